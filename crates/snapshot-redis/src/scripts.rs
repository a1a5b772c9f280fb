//! The Lua scripts of the store: each is one atomic step on the server.
//!
//! Part keys are `<base><gen>:<n>` with `<base>` = `<prefix>blob:{<blob key>}:` and `<gen>` a
//! fresh 32-hex-digit id per put; the scripts name them from `<base>` and the generation in the
//! metadata (so they run on one endpoint: a standalone server or a proxy; see the README).

use std::sync::LazyLock;

use redis::Script;
use store_redis::conn::SHEBANG;

/// Shared helpers: the server's clock and the retirement of a generation's parts.
const LUA_COMMON: &str = r#"
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
-- Schedule the removal of the parts of generation `gen` (`parts` of them): after `grace` ms,
-- so that readers that already read the metadata still find them; at once when `grace` is 0.
-- A generation that does not look like ours (damaged metadata) names no keys: nothing is done.
local function retire(base, gen, parts, keep, grace)
  if not gen or gen == keep or not parts then return 0 end
  if string.match(gen, '^[0-9a-f]+$') == nil or parts < 0 or parts > 16777216 then return 0 end
  local g = tonumber(grace)
  for i = 0, parts - 1 do
    local k = base .. gen .. ':' .. i
    if g == 0 then
      redis.call('UNLINK', k)
    else
      local left = redis.call('PTTL', k)
      if left == -1 or left > g then redis.call('PEXPIRE', k, g) end
    end
  end
  return parts
end
"#;

/// Publish a generation whose parts are written.
///
/// KEYS: meta, index. ARGV: blob key (index member), part base, gen, size, parts, part size,
/// ttl ms (`''`: none), grace ms, a deadline in the server's clock (ms; `''`: none) past which
/// it does nothing (a publish that reaches the server after its writer gave up, and reported
/// the put as failed, never lands), and, for a blob of one part, optionally that part (written
/// here: a small blob is one round trip). Answers `{'expired'}` past the deadline. Checks
/// every part exists (unpublished parts expire after the
/// upload TTL), replaces the metadata (a damaged one too), gives the parts and the metadata the
/// blob's TTL (or removes the upload TTL), indexes the key and retires the previous generation.
/// Answers `{'ok', modified_ms}` or `{'missing', n}`.
pub(crate) static PUBLISH: LazyLock<Script> = LazyLock::new(|| {
    Script::new(&format!(
        "{SHEBANG}{LUA_COMMON}{}",
        r#"
local base, gen, parts, ttl = ARGV[2], ARGV[3], tonumber(ARGV[5]), ARGV[7]
if ARGV[9] ~= '' and now_ms() > tonumber(ARGV[9]) then return {'expired'} end
if ARGV[10] then redis.call('SET', base .. gen .. ':0', ARGV[10]) end
for i = 0, parts - 1 do
  if redis.call('EXISTS', base .. gen .. ':' .. i) == 0 then return {'missing', tostring(i)} end
end
local kind = redis.call('TYPE', KEYS[1])['ok']
local old_gen, old_parts = nil, nil
if kind == 'hash' then
  local old = redis.call('HMGET', KEYS[1], 'gen', 'parts')
  old_gen, old_parts = old[1], tonumber(old[2])
end
if kind ~= 'none' then redis.call('DEL', KEYS[1]) end
local ms = now_ms()
redis.call('HSET', KEYS[1], 'gen', gen, 'size', ARGV[4], 'parts', ARGV[5],
  'part_size', ARGV[6], 'modified_ms', tostring(ms))
for i = 0, parts - 1 do
  local k = base .. gen .. ':' .. i
  if ttl == '' then redis.call('PERSIST', k) else redis.call('PEXPIRE', k, ttl) end
end
if ttl ~= '' then redis.call('PEXPIRE', KEYS[1], ttl) end
redis.call('ZADD', KEYS[2], 0, ARGV[1])
retire(base, old_gen, old_parts, gen, ARGV[8])
return {'ok', tostring(ms)}
"#
    ))
});

/// Remove a blob: its metadata and index entry at once, its parts after the grace period.
///
/// KEYS: meta, index. ARGV: blob key, part base, grace ms. Answers `{'ok'}`.
pub(crate) static DELETE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(&format!(
        "{SHEBANG}{LUA_COMMON}{}",
        r#"
local kind = redis.call('TYPE', KEYS[1])['ok']
if kind == 'hash' then
  local old = redis.call('HMGET', KEYS[1], 'gen', 'parts')
  retire(ARGV[2], old[1], tonumber(old[2]), '', ARGV[3])
end
if kind ~= 'none' then redis.call('DEL', KEYS[1]) end
redis.call('ZREM', KEYS[2], ARGV[1])
return {'ok'}
"#
    ))
});

/// Remove the parts of a put that did not publish — unless it did (the publish reached the
/// server but its answer did not reach the writer): then they are the blob.
///
/// KEYS: meta. ARGV: part base, gen, parts started. Answers the number of keys removed.
pub(crate) static ABANDON: LazyLock<Script> = LazyLock::new(|| {
    Script::new(&format!(
        "{SHEBANG}{}",
        r#"
if redis.call('TYPE', KEYS[1])['ok'] == 'hash' and redis.call('HGET', KEYS[1], 'gen') == ARGV[2] then
  return 0
end
local n = 0
for i = 0, tonumber(ARGV[3]) - 1 do
  n = n + redis.call('UNLINK', ARGV[1] .. ARGV[2] .. ':' .. i)
end
return n
"#
    ))
});

/// Drop index entries whose metadata is gone (expired under a TTL). Checked here, not by the
/// lister: a blob published again since the lister looked keeps its entry.
///
/// KEYS: index. ARGV: metadata key head (`<prefix>blob:{`), then blob keys. Answers how many
/// entries went.
pub(crate) static PRUNE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(&format!(
        "{SHEBANG}{}",
        r#"
local n = 0
for i = 2, #ARGV do
  if redis.call('EXISTS', ARGV[1] .. ARGV[i] .. '}') == 0 then
    n = n + redis.call('ZREM', KEYS[1], ARGV[i])
  end
end
return n
"#
    ))
});

/// Open a blob for reading in one round trip: its metadata and the first bytes a read needs.
///
/// KEYS: meta. ARGV: part base, offset, length, most bytes to return. Answers the metadata
/// fields (as `HMGET` of `gen`, `size`, `parts`, `part_size`, `modified_ms`) and the range's
/// bytes within its first part when they are at most that many (else `''`, as when there are
/// none or the metadata is not numbers: the caller checks it). Large values are read with
/// plain commands: passing them through Lua costs several times a `GETRANGE`.
pub(crate) static OPEN: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r#"#!lua flags=no-writes
local f = redis.call('HMGET', KEYS[1], 'gen', 'size', 'parts', 'part_size', 'modified_ms')
local data = ''
local size, ps = tonumber(f[2]), tonumber(f[4])
if f[1] and size and ps and ps > 0 then
  local off = tonumber(ARGV[2])
  local stop = math.min(off + tonumber(ARGV[3]), size)
  if off < stop then
    local n = math.floor(off / ps)
    local last = math.min(stop, (n + 1) * ps) - 1
    if last - off + 1 <= tonumber(ARGV[4]) then
      data = redis.call('GETRANGE', ARGV[1] .. f[1] .. ':' .. string.format('%d', n),
        string.format('%d', off - n * ps), string.format('%d', last - n * ps))
    end
  end
end
return {f[1], f[2], f[3], f[4], f[5], data}
"#,
    )
});
