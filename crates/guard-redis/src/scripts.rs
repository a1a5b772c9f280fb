//! The three Lua scripts of a lease. Each touches only the keys it is given, and those two
//! keys share one hash tag, so each runs on one node of a cluster, atomically.

use std::sync::LazyLock;

use redis::Script;

/// Grant: `SET lease owner NX PX ttl` and, only if that took, `INCR` the key's fence counter
/// (raised to the clock floor if below) and return it — the token is issued atomically with the
/// grant, so grant order is token order. Returns nil when someone else holds the key.
///
/// A grant retried after its reply was lost finds the lease already holding its owner id and
/// returns the counter, which no one else can have moved while the lease is held.
///
/// `KEYS[1]` lease, `KEYS[2]` fence counter; `ARGV[1]` owner id, `ARGV[2]` TTL in ms,
/// `ARGV[3]` the lowest token to issue (the caller's clock in µs).
pub(crate) static GRANT: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  local token = redis.call('INCR', KEYS[2])
  local floor = tonumber(ARGV[3])
  if token < floor then
    redis.call('SET', KEYS[2], ARGV[3])
    token = floor
  end
  return token
end
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return tonumber(redis.call('GET', KEYS[2]))
end
return false
",
    )
});

/// Renew: `PEXPIRE lease ttl` only if the lease still holds our owner id. Returns 1 when
/// renewed, 0 when the lease is gone or someone else's.
///
/// `KEYS[1]` lease; `ARGV[1]` owner id, `ARGV[2]` TTL in ms.
pub(crate) static RENEW: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
",
    )
});

/// Release: `DEL lease` only if it still holds our owner id (compare-and-delete): a holder
/// whose lease expired never frees its successor's. Returns 1 when deleted, else 0.
///
/// `KEYS[1]` lease; `ARGV[1]` owner id.
pub(crate) static RELEASE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
",
    )
});
