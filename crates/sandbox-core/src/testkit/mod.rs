//! The conformance kit: scenarios every backend runs.

pub mod raw_tar;
