//! The core conformance kit, run against the local backend with its default isolation
//! (confined by the kernel).

use sandbox_local::testkit::LocalFixture;

sandbox_core::conformance_tests!(LocalFixture::new());
