//! One lazily connected `ConnectionManager` per store, the time limits around every call, and
//! the conversion of `redis` errors into [`sandbox_core::Error`] (with secrets scrubbed).
//!
//! Public as the connection layer of every Redis store of the workspace (this crate's, and
//! `snapshot-redis`'s blob store): one place decides URL handling, deadlines, the resend after a
//! dropped connection and how outages are reported (`Unavailable`, `Timeout`: retryable).

use std::fmt;
use std::future::Future;
use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{RedisError, ServerErrorKind, Value};
use sandbox_core::{Error, Result};
use std::sync::Mutex;

use crate::options::RedisOptions;

/// The backend tag used in [`Error::Backend`].
pub const BACKEND: &str = "redis";

/// How damaged data in a store's keys is reported.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Damage {
    /// As [`Error::MalformedState`].
    State,
    /// As [`Error::Backend`] naming the damage (key-value entries, snapshot blobs).
    Kv,
}

/// A store's connection: created on first use, reconnected by `redis`'s manager after an I/O
/// failure (the failed call is reported, the next one waits for the new connection), and
/// replaced after failures the manager would keep returning (see [`Conn::run`]).
pub struct Conn {
    client: redis::Client,
    manager: Mutex<Option<ConnectionManager>>,
    /// `redis at host:port`: names the service in errors, never with credentials.
    service: String,
    /// Texts scrubbed from every message taken from `redis` (the password, decoded and as
    /// written in the URL).
    secrets: Vec<String>,
    connect_timeout: Duration,
    response_timeout: Duration,
    damage: Damage,
}

impl fmt::Debug for Conn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Conn")
            .field("service", &self.service)
            .field("started", &self.lock().is_some())
            .finish_non_exhaustive()
    }
}

impl Conn {
    /// Check `options` and prepare the client (no I/O).
    pub fn new(options: &RedisOptions, damage: Damage) -> Result<Conn> {
        let scheme = options.url.split_once("://").map(|(s, _)| s);
        if matches!(scheme, Some("rediss" | "valkeys")) {
            return Err(Error::invalid(
                "redis url",
                "TLS (`rediss://`) is not built into store-redis; reach the server through a \
                 TLS-terminating proxy or a private network",
            ));
        }
        let client = redis::Client::open(options.url.as_str()).map_err(|_| {
            // The message could quote the URL, and with it the password: say only what is wrong.
            Error::invalid(
                "redis url",
                "not a Redis URL (redis://[user][:password@]host[:port][/db] or \
                 redis+unix:///path)",
            )
        })?;
        if options.key_prefix.contains(['{', '}']) {
            return Err(Error::invalid(
                "redis key prefix",
                format!(
                    "`{}` contains `{{` or `}}`, which would change the keys' hash slots",
                    options.key_prefix
                ),
            ));
        }
        for (name, value) in [
            ("connect timeout", options.connect_timeout),
            ("response timeout", options.response_timeout),
        ] {
            if value.is_zero() {
                return Err(Error::invalid(
                    "redis options",
                    format!("the {name} is zero"),
                ));
            }
        }
        if options.scan_count == 0 || options.page_size == 0 {
            return Err(Error::invalid(
                "redis options",
                "scan_count and page_size must be at least 1",
            ));
        }
        let info = client.get_connection_info();
        let mut secrets = Vec::new();
        if let Some(pw) = info.redis_settings().password() {
            secrets.push(pw.to_owned());
        }
        if let Some(raw) = raw_password(&options.url) {
            secrets.push(raw);
        }
        secrets.retain(|s| !s.is_empty());
        // Longest first, so a password containing another secret is scrubbed whole.
        secrets.sort_by_key(|s| std::cmp::Reverse(s.len()));
        Ok(Conn {
            service: format!("redis at {}", info.addr()),
            client,
            manager: Mutex::new(None),
            secrets,
            connect_timeout: options.connect_timeout,
            response_timeout: options.response_timeout,
            damage,
        })
    }

    /// `redis at host:port`.
    pub fn service(&self) -> &str {
        &self.service
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<ConnectionManager>> {
        // Nothing panics while holding it; a poisoned lock still holds a valid manager.
        self.manager.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn manager(&self) -> std::result::Result<ConnectionManager, RedisError> {
        let mut slot = self.lock();
        if let Some(manager) = &*slot {
            return Ok(manager.clone());
        }
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(self.connect_timeout))
            .set_response_timeout(Some(self.response_timeout))
            // One attempt per call: callers retry retryable errors at their level.
            .set_number_of_retries(0);
        // Lazy: no I/O here; the first command connects.
        let manager = ConnectionManager::new_lazy_with_config(self.client.clone(), config)?;
        *slot = Some(manager.clone());
        Ok(manager)
    }

    /// Drop the manager, so the next call starts a new one. `redis`'s manager reconnects by
    /// itself only after I/O errors: a connection attempt refused for another reason (the
    /// server still loading its data after a restart, credentials changed and changed back)
    /// would otherwise be returned to every later call.
    fn reset(&self) {
        self.lock().take();
    }

    /// Run `call` on the connection within the time limits; convert its error. A call that
    /// failed because the connection had dropped (a server restarted since the last call) is
    /// sent once more on the reconnected connection: every call of the stores is idempotent
    /// (fenced writes, compare-and-set scripts; a repeated `INCR` of a fence only skips a
    /// number).
    pub async fn run<T, F, Fut>(&self, operation: &'static str, call: F) -> Result<T>
    where
        F: Fn(ConnectionManager) -> Fut,
        Fut: Future<Output = std::result::Result<T, RedisError>>,
    {
        // Waiting for a connection and the command each have their limit inside `redis`;
        // this one only guarantees the call ends.
        let budget = self.connect_timeout.saturating_add(self.response_timeout);
        let work = async {
            let conn = self.manager()?;
            match call(conn.clone()).await {
                Err(e) if e.is_connection_dropped() || e.is_io_error() => {
                    tracing::debug!(operation, error = %self.scrub(&e.to_string()), "connection dropped: sending once more");
                    call(conn).await
                }
                r => r,
            }
        };
        let result = match tokio::time::timeout(budget, work).await {
            Ok(Ok(value)) => return Ok(value),
            Ok(Err(e)) => {
                if needs_new_manager(&e) {
                    self.reset();
                }
                self.error(operation, &e)
            }
            Err(_) => {
                self.reset();
                self.timeout(operation, budget)
            }
        };
        tracing::debug!(operation, error = %result, "redis call failed");
        Err(result)
    }

    /// The longest a call may take before its caller gives up (see [`run`](Self::run)).
    pub fn budget(&self) -> Duration {
        self.connect_timeout.saturating_add(self.response_timeout)
    }

    /// Whether the server answers.
    pub async fn ping(&self) -> Result<()> {
        self.run("ping", |mut c| async move {
            redis::cmd("PING").query_async::<String>(&mut c).await
        })
        .await
        .map(drop)
    }

    fn timeout(&self, operation: &'static str, after: Duration) -> Error {
        Error::Timeout {
            operation: format!("redis {operation} on {}", self.service),
            after,
        }
    }

    /// Stored data that is not what the store writes.
    pub fn damaged(&self, operation: &'static str, reason: impl fmt::Display) -> Error {
        match self.damage {
            Damage::State => Error::MalformedState {
                reason: format!("{} ({operation}): {reason}", self.service),
            },
            Damage::Kv => Error::Backend {
                backend: BACKEND,
                operation,
                message: format!("damaged data in {}: {reason}", self.service),
                source: None,
            },
        }
    }

    /// A reply of a shape the store's own scripts never produce.
    pub fn unexpected(&self, operation: &'static str, reply: &Value) -> Error {
        Error::Backend {
            backend: BACKEND,
            operation,
            message: format!(
                "unexpected reply from {}: {}",
                self.service,
                describe(reply)
            ),
            source: None,
        }
    }

    fn scrub(&self, text: &str) -> String {
        self.secrets
            .iter()
            .fold(text.to_owned(), |t, s| t.replace(s.as_str(), "***"))
    }

    /// Convert a `redis` error. The dependency's error never leaves the crate: its message,
    /// scrubbed, is kept as text.
    fn error(&self, operation: &'static str, e: &RedisError) -> Error {
        let message = self.scrub(&e.to_string());
        if e.is_timeout() {
            return self.timeout(operation, self.response_timeout);
        }
        let unavailable = || Error::Unavailable {
            service: self.service.clone(),
            reason: format!("{operation}: {message}"),
            source: None,
        };
        let backend = |what: &str| Error::Backend {
            backend: BACKEND,
            operation,
            message: format!("{what} ({}): {message}", self.service),
            source: None,
        };
        match e.kind() {
            redis::ErrorKind::Io => unavailable(),
            redis::ErrorKind::Server(
                ServerErrorKind::BusyLoading
                | ServerErrorKind::TryAgain
                | ServerErrorKind::ClusterDown
                | ServerErrorKind::MasterDown
                | ServerErrorKind::ReadOnly,
            ) => unavailable(),
            redis::ErrorKind::AuthenticationFailed
            | redis::ErrorKind::Server(ServerErrorKind::NoPerm) => {
                backend("authentication or permission refused")
            }
            _ => match e.code() {
                // A script busy past `lua-time-limit`: the server answers again when it ends.
                Some("BUSY") => unavailable(),
                Some("WRONGTYPE") => self.damaged(operation, "a key holds another type of value"),
                Some("NOAUTH" | "WRONGPASS") => backend("authentication refused"),
                _ if message.contains("WRONGTYPE") => {
                    // Inside a script the code may arrive wrapped in the script's error.
                    self.damaged(operation, "a key holds another type of value")
                }
                _ => backend("the server refused the call"),
            },
        }
    }
}

/// Errors after which the manager is replaced (it would not reconnect by itself).
fn needs_new_manager(e: &RedisError) -> bool {
    matches!(
        e.kind(),
        redis::ErrorKind::AuthenticationFailed
            | redis::ErrorKind::Parse
            | redis::ErrorKind::Server(ServerErrorKind::BusyLoading | ServerErrorKind::NoPerm)
    ) || matches!(e.code(), Some("NOAUTH" | "WRONGPASS"))
}

/// The password as written in the URL (still percent-encoded), if any.
fn raw_password(url: &str) -> Option<String> {
    // The user info is everything up to the URL's last `@` (a password may hold raw `/`, `#`,
    // `?` or `@`); `redis://secret@host` is read as a user name by some: scrub it all the same.
    if let Some(userinfo) = sandbox_core::raw_userinfo(url) {
        let pw = userinfo.split_once(':').map_or(userinfo, |(_, pw)| pw);
        return Some(pw.to_owned());
    }
    url.split_once('?')?
        .1
        .split('&')
        .find_map(|p| p.strip_prefix("pass=").map(str::to_owned))
}

/// A short description of a reply, for errors (shapes, never contents).
fn describe(v: &Value) -> String {
    match v {
        Value::Nil => "nil".to_owned(),
        Value::Int(_) => "an integer".to_owned(),
        Value::BulkString(b) => format!("a string of {} bytes", b.len()),
        Value::Array(items) => format!("an array of {}", items.len()),
        Value::SimpleString(_) | Value::Okay => "a status".to_owned(),
        _ => "another kind of value".to_owned(),
    }
}

/// The bulk strings of a script's reply (`{'ok', …}` tables), or `None` for another shape.
pub fn strings(reply: &Value) -> Option<Vec<String>> {
    let Value::Array(items) = reply else {
        return None;
    };
    items
        .iter()
        .map(|item| match item {
            Value::BulkString(b) => String::from_utf8(b.clone()).ok(),
            Value::SimpleString(s) => Some(s.clone()),
            Value::Int(i) => Some(i.to_string()),
            _ => None,
        })
        .collect()
}

/// Escape the glob metacharacters of `SCAN … MATCH` patterns (`*`, `?`, `[`, `]`, `\`).
pub fn glob_escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        if matches!(c, '*' | '?' | '[' | ']' | '\\') {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

/// The first line of every script: Redis 7 script flags (none given), so the server refuses
/// the whole script, before it runs, while it is out of memory (scripts are not rolled back).
pub const SHEBANG: &str = "#!lua\n";

/// `is(key, type)`: the key holds `type` or nothing.
pub const LUA_TYPES: &str = r#"
local function is(key, kind)
  local t = redis.call('TYPE', key)['ok']
  return t == kind or t == 'none'
end
"#;

/// Lua helpers shared by the scripts: fences and versions are canonical decimal strings
/// (compared exactly, never as Lua numbers, which are doubles).
pub const LUA_DECIMALS: &str = r#"
local function canonical(s)
  return s == '0' or (#s <= 20 and string.match(s, '^[1-9]%d*$') ~= nil)
end
local function below(a, b)
  if #a ~= #b then return #a < #b end
  return a < b
end
"#;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn glob_metacharacters_are_escaped() {
        assert_eq!(glob_escape("a*b?c[d]e\\f"), "a\\*b\\?c\\[d\\]e\\\\f");
        assert_eq!(glob_escape("agents/x-y_%2A"), "agents/x-y_%2A");
    }

    #[test]
    fn raw_passwords_are_found() {
        assert_eq!(raw_password("redis://:p%40w@h").as_deref(), Some("p%40w"));
        assert_eq!(raw_password("redis://u:pw@h/1").as_deref(), Some("pw"));
        assert_eq!(
            raw_password("redis://u:p/w#x?y@z@h/1").as_deref(),
            Some("p/w#x?y@z")
        );
        assert_eq!(raw_password("redis://h:6379"), None);
        assert_eq!(
            raw_password("redis+unix:///s.sock?pass=pw").as_deref(),
            Some("pw")
        );
    }

    #[test]
    fn bad_options_are_refused_without_echoing_the_url() {
        let secret = "s3cr3t-MARKER";
        for (options, what) in [
            (
                RedisOptions::new(format!("http://:{secret}@h")),
                "redis url",
            ),
            (
                RedisOptions::new(format!("rediss://:{secret}@h")),
                "redis url",
            ),
            (
                RedisOptions::new(format!("redis://:{secret}@h")).key_prefix("a{b}:"),
                "redis key prefix",
            ),
            (
                RedisOptions::new(format!("redis://:{secret}@h")).scan_count(0),
                "redis options",
            ),
            (
                RedisOptions::new(format!("redis://:{secret}@h")).response_timeout(Duration::ZERO),
                "redis options",
            ),
        ] {
            let err = Conn::new(&options, Damage::State).unwrap_err();
            assert!(
                matches!(err, Error::InvalidInput { what: w, .. } if w == what),
                "{err}"
            );
            assert!(!err.to_string().contains(secret), "{err}");
            assert!(!format!("{err:?}").contains(secret), "{err:?}");
        }
        let conn = Conn::new(
            &RedisOptions::new(format!("redis://user:{secret}@127.0.0.1:1/2")),
            Damage::State,
        )
        .unwrap();
        assert_eq!(conn.service(), "redis at 127.0.0.1:1");
        assert!(!format!("{conn:?}").contains(secret));
        assert_eq!(conn.scrub(&format!("x {secret} y")), "x *** y");
    }
}
