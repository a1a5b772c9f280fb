//! The owner tags every remote box carries (E2B metadata, Daytona labels), with the same key
//! names as the Docker backend's labels, and reading them back for `gc`.

use std::collections::BTreeMap;
use std::time::{SystemTime, UNIX_EPOCH};

use sandbox_core::{IsolationKey, OwnedBox};

/// Owner: the deployment prefix. `gc` only removes boxes with its own owner.
pub const OWNER: &str = "io.sandbox-harness.owner";
/// The isolation key string (absent for boxes without a key).
pub const KEY: &str = "io.sandbox-harness.key";
/// The isolation scope of the key.
pub const SCOPE: &str = "io.sandbox-harness.scope";
/// Creation time, seconds since the epoch.
pub const CREATED_AT: &str = "io.sandbox-harness.created-at";
/// Expiry time, seconds since the epoch.
pub const EXPIRES_AT: &str = "io.sandbox-harness.expires-at";

fn secs(t: SystemTime) -> i64 {
    t.duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64)
}

/// The tags of a box created now for `key` by deployment `owner`.
pub fn tags(
    owner: &str,
    key: Option<&IsolationKey>,
    created: SystemTime,
    expires: Option<SystemTime>,
) -> BTreeMap<String, String> {
    let mut tags = BTreeMap::from([
        (OWNER.to_owned(), owner.to_owned()),
        (CREATED_AT.to_owned(), secs(created).to_string()),
    ]);
    if let Some(key) = key {
        tags.insert(KEY.to_owned(), key.as_str().to_owned());
        tags.insert(SCOPE.to_owned(), key.scope().as_str().to_owned());
    }
    if let Some(expires) = expires {
        tags.insert(EXPIRES_AT.to_owned(), secs(expires).to_string());
    }
    tags
}

/// The box `id` as `gc` sees it, if its `tags` carry owner `owner`; `None` for anyone else's.
pub fn owned_box(id: &str, owner: &str, tags: &BTreeMap<String, String>) -> Option<OwnedBox> {
    if tags.get(OWNER).map(String::as_str) != Some(owner) {
        return None;
    }
    let ms = |k: &str| {
        tags.get(k)
            .and_then(|v| v.parse::<i64>().ok())
            .map(|s| s.saturating_mul(1000))
    };
    Some(OwnedBox::new(id, tags.get(KEY).cloned(), ms(CREATED_AT)).expires(ms(EXPIRES_AT)))
}
