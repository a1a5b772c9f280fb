//! [`RedisStateStore`]: box state JSON per isolation key, fenced, shared by every replica.

use std::collections::BTreeSet;
use std::fmt;
use std::sync::LazyLock;
use std::time::Duration;

use async_trait::async_trait;
use redis::{Script, Value};
use sandbox_core::{Error, IsolationKey, Reach, Result, StateStore};

use crate::conn::{Conn, Damage, LUA_DECIMALS, SHEBANG, glob_escape, strings};
use crate::options::RedisOptions;

/// The server's clock in milliseconds, for the deadlines of writes.
const LUA_NOW: &str = r#"
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
"#;

/// Raise the fence (KEYS[1]) to the granted token ARGV[1], or number the holder (`''`). An
/// `ok` answer also carries the server's clock (ms), so that the store can give the holder's
/// writes a deadline in the server's time.
static FENCE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(&format!(
        "{SHEBANG}{LUA_DECIMALS}{LUA_NOW}{}",
        r#"
local current = redis.call('GET', KEYS[1])
if current and not canonical(current) then return {'damaged'} end
local granted = ARGV[1]
if granted == '' then
  if current and #current >= 19 and not below(current, '9223372036854775807') then
    return {'overflow', current}
  end
  redis.call('INCR', KEYS[1])
  return {'ok', redis.call('GET', KEYS[1]), tostring(now_ms())}
end
if current and below(granted, current) then return {'stale', current} end
redis.call('SET', KEYS[1], granted)
return {'ok', granted, tostring(now_ms())}
"#
    ))
});

/// Write (ARGV[2], with expiry ARGV[3] ms unless `''`) or remove (ARGV[2] == `''` and
/// ARGV[4] == `delete`) the state KEYS[2] if the token ARGV[1] passes the fence KEYS[1] — and,
/// unless ARGV[5] is `''`, only before the deadline ARGV[5] (server ms): a write that reaches
/// a server after its caller gave up (a stalled server, a slow network) does nothing.
static WRITE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(&format!(
        "{SHEBANG}{LUA_DECIMALS}{LUA_NOW}{}",
        r#"
if ARGV[5] ~= '' and now_ms() > tonumber(ARGV[5]) then return {'expired'} end
local current = redis.call('GET', KEYS[1])
if current then
  if not canonical(current) then return {'damaged'} end
  if ARGV[1] == '' or below(ARGV[1], current) then return {'stale', current} end
end
if ARGV[4] == 'delete' then
  redis.call('DEL', KEYS[2])
elseif ARGV[3] == '' then
  redis.call('SET', KEYS[2], ARGV[2])
else
  redis.call('SET', KEYS[2], ARGV[2], 'PX', ARGV[3])
end
return {'ok'}
"#
    ))
});

/// Box state in Redis, shared by every replica ([`Reach::Cluster`]); see the crate docs for
/// the key design, the scripts and what the server must be configured with.
pub struct RedisStateStore {
    conn: Conn,
    prefix: String,
    ttl_ms: Option<u64>,
    scan_count: usize,
    /// The server's clock minus ours (ms), as last seen by `fence`: turns a write's local
    /// deadline into the server's time. (Measured within a round trip: a deadline so
    /// computed errs early, the safe side.)
    clock_offset_ms: std::sync::Mutex<Option<i64>>,
}

impl fmt::Debug for RedisStateStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisStateStore")
            .field("service", &self.conn.service())
            .field("prefix", &self.prefix)
            .field("ttl_ms", &self.ttl_ms)
            .finish_non_exhaustive()
    }
}

impl RedisStateStore {
    /// A store over `options` (checked here; connects on first use, inside a tokio runtime).
    pub fn new(options: RedisOptions) -> Result<RedisStateStore> {
        let conn = Conn::new(&options, Damage::State)?;
        let ttl_ms = match options.state_ttl {
            Some(ttl) if ttl.is_zero() => {
                return Err(Error::invalid(
                    "redis options",
                    "state_ttl is zero (use None for states that never expire)",
                ));
            }
            // `PX` takes whole milliseconds; round a sub-millisecond rest up.
            Some(ttl) => Some(u64::try_from(ttl.as_micros().div_ceil(1000)).unwrap_or(u64::MAX)),
            None => None,
        };
        Ok(RedisStateStore {
            conn,
            prefix: options.key_prefix,
            ttl_ms,
            scan_count: options.scan_count,
            clock_offset_ms: std::sync::Mutex::new(None),
        })
    }

    /// Whether the server answers (a readiness probe).
    pub async fn ping(&self) -> Result<()> {
        self.conn.ping().await
    }

    /// How long a saved state lives after its last save (`None`: forever).
    pub fn state_ttl(&self) -> Option<Duration> {
        self.ttl_ms.map(Duration::from_millis)
    }

    fn fence_key(&self, key: &IsolationKey) -> String {
        // Isolation keys are percent-encoded: never a brace, so the tag is the whole key.
        format!("{}{{{}}}:fence", self.prefix, key.as_str())
    }

    fn state_key(&self, key: &IsolationKey) -> String {
        format!("{}{{{}}}:state", self.prefix, key.as_str())
    }

    async fn write(
        &self,
        operation: &'static str,
        key: &IsolationKey,
        state_json: Option<&str>,
        fence: Option<u64>,
    ) -> Result<()> {
        let token = fence.map(|t| t.to_string()).unwrap_or_default();
        let ttl = self.ttl_ms.map(|t| t.to_string()).unwrap_or_default();
        // When the caller will have given up, in the server's time (when that is known).
        let offset = *self.clock_offset_ms.lock().expect("clock");
        let deadline = offset
            .map(|o| (local_ms() + self.conn.budget().as_millis() as i64 + o).to_string())
            .unwrap_or_default();
        let (fence_key, state_key) = (self.fence_key(key), self.state_key(key));
        let (fence_key, state_key, token, ttl, deadline) =
            (&fence_key, &state_key, &token, &ttl, &deadline);
        let reply: Value = self
            .conn
            .run(operation, |mut c| async move {
                WRITE
                    .key(fence_key)
                    .key(state_key)
                    .arg(token)
                    .arg(state_json.unwrap_or(""))
                    .arg(ttl)
                    .arg(if state_json.is_some() {
                        "save"
                    } else {
                        "delete"
                    })
                    .arg(deadline)
                    .invoke_async(&mut c)
                    .await
            })
            .await?;
        match strings(&reply).as_deref() {
            Some([ok]) if ok == "ok" => Ok(()),
            // It arrived after its caller gave up (who therefore saw a timeout): nothing was
            // written. Said as the timeout it is.
            Some([expired]) if expired == "expired" => Err(Error::Timeout {
                operation: format!("redis {operation} (reached the server after its deadline)"),
                after: self.conn.budget(),
            }),
            Some([stale, current]) if stale == "stale" => Err(self.stale(key, fence, current)?),
            Some([damaged]) if damaged == "damaged" => Err(self.damaged_fence(operation, key)),
            _ => Err(self.conn.unexpected(operation, &reply)),
        }
    }

    fn stale(&self, key: &IsolationKey, token: Option<u64>, current: &str) -> Result<Error> {
        Ok(Error::StaleLease {
            key: key.to_string(),
            token: token.unwrap_or(0),
            current: self.token(key, current)?,
        })
    }

    fn token(&self, key: &IsolationKey, text: &str) -> Result<u64> {
        text.parse().map_err(|_| self.damaged_fence("fence", key))
    }

    fn damaged_fence(&self, operation: &'static str, key: &IsolationKey) -> Error {
        self.conn.damaged(
            operation,
            format!("the fence of `{key}` is not a fencing token"),
        )
    }
}

/// This host's clock, ms since the epoch.
fn local_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

#[async_trait]
impl StateStore for RedisStateStore {
    #[tracing::instrument(level = "debug", name = "redis_state_load", skip_all, fields(key = %key))]
    async fn load(&self, key: &IsolationKey) -> Result<Option<String>> {
        let state_key = self.state_key(key);
        let state_key = &state_key;
        let bytes: Option<Vec<u8>> = self
            .conn
            .run("load", |mut c| async move {
                redis::cmd("GET").arg(state_key).query_async(&mut c).await
            })
            .await?;
        bytes
            .map(|b| {
                String::from_utf8(b).map_err(|_| {
                    self.conn
                        .damaged("load", format!("the state of `{key}` is not UTF-8"))
                })
            })
            .transpose()
    }

    #[tracing::instrument(level = "debug", name = "redis_state_fence", skip_all, fields(key = %key, granted = ?granted))]
    async fn fence(&self, key: &IsolationKey, granted: Option<u64>) -> Result<u64> {
        let fence_key = self.fence_key(key);
        let arg = granted.map(|t| t.to_string()).unwrap_or_default();
        let (fence_key, arg) = (&fence_key, &arg);
        let reply: Value = self
            .conn
            .run("fence", |mut c| async move {
                FENCE.key(fence_key).arg(arg).invoke_async(&mut c).await
            })
            .await?;
        match strings(&reply).as_deref() {
            Some([ok, token, server_ms]) if ok == "ok" => {
                if let Ok(server_ms) = server_ms.parse::<i64>() {
                    *self.clock_offset_ms.lock().expect("clock") = Some(server_ms - local_ms());
                }
                self.token(key, token)
            }
            Some([stale, current]) if stale == "stale" => Err(self.stale(key, granted, current)?),
            Some([overflow, _]) if overflow == "overflow" => Err(Error::Backend {
                backend: crate::conn::BACKEND,
                operation: "fence",
                message: format!(
                    "the fence of `{key}` is at the largest number Redis can increment; \
                     register a granted token instead"
                ),
                source: None,
            }),
            Some([damaged]) if damaged == "damaged" => Err(self.damaged_fence("fence", key)),
            _ => Err(self.conn.unexpected("fence", &reply)),
        }
    }

    #[tracing::instrument(level = "debug", name = "redis_state_save", skip_all, fields(key = %key, fence = ?fence, bytes = state_json.len()))]
    async fn save(&self, key: &IsolationKey, state_json: &str, fence: Option<u64>) -> Result<()> {
        self.write("save", key, Some(state_json), fence).await
    }

    #[tracing::instrument(level = "debug", name = "redis_state_delete", skip_all, fields(key = %key, fence = ?fence))]
    async fn delete(&self, key: &IsolationKey, fence: Option<u64>) -> Result<()> {
        self.write("delete", key, None, fence).await
    }

    #[tracing::instrument(level = "debug", name = "redis_state_list", skip_all, fields(prefix = %prefix))]
    async fn list(&self, prefix: &str) -> Result<Vec<IsolationKey>> {
        // Only state keys match (`…}:state`); fences alone are not listed.
        let head = format!("{}{{", self.prefix);
        let pattern = format!("{}{}*}}:state", glob_escape(&head), glob_escape(prefix));
        let mut found = BTreeSet::new();
        let mut cursor = "0".to_owned();
        loop {
            let (pattern, count, at) = (&pattern, self.scan_count, &cursor);
            let (next, names): (String, Vec<Vec<u8>>) = self
                .conn
                .run("list", |mut c| async move {
                    redis::cmd("SCAN")
                        .arg(at)
                        .arg("MATCH")
                        .arg(pattern)
                        .arg("COUNT")
                        .arg(count)
                        .query_async(&mut c)
                        .await
                })
                .await?;
            for name in names {
                let key = std::str::from_utf8(&name)
                    .ok()
                    .and_then(|n| n.strip_prefix(head.as_str()))
                    .and_then(|n| n.strip_suffix("}:state"))
                    .filter(|k| k.starts_with(prefix))
                    .and_then(|k| IsolationKey::parse(k).ok());
                // Anything else under the prefix is not ours; SCAN may return a key twice.
                if let Some(key) = key {
                    found.insert(key);
                }
            }
            if next == "0" {
                break;
            }
            cursor = next;
        }
        Ok(found.into_iter().collect())
    }

    fn reach(&self) -> Reach {
        Reach::Cluster
    }
}
