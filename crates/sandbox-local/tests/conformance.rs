//! The core conformance kit, run against the local backend.

use sandbox_local::testkit::LocalFixture;

sandbox_core::conformance_tests!(LocalFixture::new());
