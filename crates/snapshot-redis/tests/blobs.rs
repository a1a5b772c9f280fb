//! The blob-store suite of `sandbox_core::testkit::blobs` on a real Redis
//! (`SANDBOX_TEST_REDIS_URL`), with the default 1 MiB parts and with 64 KiB ones (many parts per
//! blob: ranges across part boundaries, a 24 MiB blob of 385 parts).

mod common;

sandbox_core::blob_store_tests!(
    common::store_with(common::options().part_size(1024 * 1024).page_size(100)),
    listing_blobs = 257,
    #[cfg_attr(not(redis_tests), ignore = "needs Redis; run by cargo xtask test")]
);

mod small_parts {
    use super::common;

    sandbox_core::blob_store_tests!(
        common::store_with(
            common::options()
                .part_size(64 * 1024)
                .parts_in_flight(8)
                .page_size(7)
        ),
        listing_blobs = 40,
        #[cfg_attr(not(redis_tests), ignore = "needs Redis; run by cargo xtask test")]
    );
}
