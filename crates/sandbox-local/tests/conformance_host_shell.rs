//! The core conformance kit, run against the local backend's explicit opt-out,
//! `Isolation::HostShell` (`conformance.rs` runs it with the default, confined isolation).

use sandbox_local::Isolation;
use sandbox_local::testkit::LocalFixture;

sandbox_core::conformance_tests!(LocalFixture::with_isolation(Isolation::HostShell));
