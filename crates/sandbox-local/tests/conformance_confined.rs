//! The core conformance kit, run against the local backend confined by the kernel
//! (`Isolation::Confined`): every scenario, faults, races and snapshots included.

use sandbox_local::Isolation;
use sandbox_local::testkit::LocalFixture;

sandbox_core::conformance_tests!(LocalFixture::with_isolation(Isolation::confined()));
