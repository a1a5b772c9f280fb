//! [`RedisKvStore`]: the shared-store filesystem's versioned key-value store in Redis.

use std::fmt;
use std::sync::LazyLock;

use async_trait::async_trait;
use bytes::Bytes;
use redis::{Script, Value};
use sandbox_core::{Error, Result};
use sandbox_fs::{KvEntry, KvStore, Precondition, Version, Versioned};

use crate::conn::{Conn, Damage, LUA_TYPES, SHEBANG, strings};
use crate::options::RedisOptions;

/// Put ARGV[3] at the entry KEYS[1] if the precondition ARGV[1] (`any`, `absent`,
/// `version` = ARGV[2]) holds: a new version from the namespace's counter KEYS[3], the key
/// ARGV[4] added to the namespace's index KEYS[2]. Redis does not roll a failed script back,
/// so every check comes before the first write (types included: a command refused for a
/// key's type half-way would leave an entry without its index member).
static PUT: LazyLock<Script> = LazyLock::new(|| {
    Script::new(&format!(
        "{SHEBANG}{LUA_TYPES}{}",
        r#"
if not (is(KEYS[1], 'hash') and is(KEYS[2], 'zset') and is(KEYS[3], 'string')) then
  return {'damaged', 'a key of the namespace holds another type of value'}
end
local current = redis.call('HGET', KEYS[1], 'ver')
if (ARGV[1] == 'absent' and current) or (ARGV[1] == 'version' and current ~= ARGV[2]) then
  return {'conflict', current or ''}
end
redis.call('INCR', KEYS[3])
local version = redis.call('GET', KEYS[3])
redis.call('HSET', KEYS[1], 'v', ARGV[3], 'ver', version)
redis.call('ZADD', KEYS[2], 0, ARGV[4])
return {'ok', version}
"#
    ))
});

/// Remove the entry KEYS[1] and its key ARGV[3] from the index KEYS[2] if the precondition
/// ARGV[1] (`any`, `version` = ARGV[2]) holds; reply how many entries went.
static DELETE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(&format!(
        "{SHEBANG}{LUA_TYPES}{}",
        r#"
if not (is(KEYS[1], 'hash') and is(KEYS[2], 'zset')) then
  return {'damaged', 'a key of the namespace holds another type of value'}
end
if ARGV[1] == 'version' then
  local current = redis.call('HGET', KEYS[1], 'ver')
  if current ~= ARGV[2] then return {'conflict', current or ''} end
end
local removed = redis.call('DEL', KEYS[1])
redis.call('ZREM', KEYS[2], ARGV[3])
return {'ok', tostring(removed)}
"#
    ))
});

/// The shared-store mode's [`KvStore`] in Redis; see the crate docs for the key design.
pub struct RedisKvStore {
    conn: Conn,
    prefix: String,
    page_size: usize,
}

impl fmt::Debug for RedisKvStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisKvStore")
            .field("service", &self.conn.service())
            .field("prefix", &self.prefix)
            .finish_non_exhaustive()
    }
}

/// The keys of one namespace: all carry the same hash tag, so one namespace is one slot.
struct Names {
    /// `<prefix>kv:{<namespace>}:`
    tag: String,
}

impl Names {
    fn entry(&self, key: &str) -> String {
        format!("{}e:{key}", self.tag)
    }

    fn index(&self) -> String {
        format!("{}idx", self.tag)
    }

    fn counter(&self) -> String {
        format!("{}seq", self.tag)
    }
}

/// The namespace inside the hash tag: `%`, `{` and `}` percent-encoded (so the tag ends where
/// the namespace does and two namespaces never share a name); empty as `%00`.
fn encode_namespace(namespace: &str) -> String {
    if namespace.is_empty() {
        return "%00".to_owned();
    }
    let mut out = String::with_capacity(namespace.len());
    for c in namespace.chars() {
        match c {
            '%' => out.push_str("%25"),
            '{' => out.push_str("%7B"),
            '}' => out.push_str("%7D"),
            c => out.push(c),
        }
    }
    out
}

impl RedisKvStore {
    /// A store over `options` (checked here; connects on first use, inside a tokio runtime).
    /// `state_ttl` does not apply: entries live until deleted.
    pub fn new(options: RedisOptions) -> Result<RedisKvStore> {
        Ok(RedisKvStore {
            conn: Conn::new(&options, Damage::Kv)?,
            prefix: options.key_prefix,
            page_size: options.page_size,
        })
    }

    /// Whether the server answers (a readiness probe).
    pub async fn ping(&self) -> Result<()> {
        self.conn.ping().await
    }

    fn names(&self, namespace: &str) -> Names {
        Names {
            tag: format!("{}kv:{{{}}}:", self.prefix, encode_namespace(namespace)),
        }
    }

    fn conflict(namespace: &str, key: &str, expected: Precondition, current: &str) -> Error {
        let found = if current.is_empty() {
            "no value".to_owned()
        } else {
            format!("version {current}")
        };
        Error::Conflict {
            key: format!("{namespace}/{key}"),
            reason: format!("expected {expected:?}, found {found}"),
        }
    }

    fn version(&self, operation: &'static str, text: &str) -> Result<Version> {
        text.parse::<Version>()
            .ok()
            .filter(|v| *v > 0)
            .ok_or_else(|| {
                self.conn
                    .damaged(operation, format!("`{text}` is not a version"))
            })
    }
}

fn precondition(expected: Precondition) -> Result<(&'static str, String)> {
    match expected {
        Precondition::Any => Ok(("any", String::new())),
        Precondition::Absent => Ok(("absent", String::new())),
        Precondition::Version(v) => Ok(("version", v.to_string())),
        other => Err(Error::invalid(
            "precondition",
            format!("{other:?} is not supported by the Redis store"),
        )),
    }
}

#[async_trait]
impl KvStore for RedisKvStore {
    #[tracing::instrument(level = "debug", name = "redis_kv_get", skip_all, fields(namespace = %namespace, key = %key))]
    async fn get(&self, namespace: &str, key: &str) -> Result<Option<Versioned>> {
        let entry = self.names(namespace).entry(key);
        let entry = &entry;
        let (value, version): (Option<Vec<u8>>, Option<String>) = self
            .conn
            .run("kv get", |mut c| async move {
                redis::cmd("HMGET")
                    .arg(entry)
                    .arg("v")
                    .arg("ver")
                    .query_async(&mut c)
                    .await
            })
            .await?;
        match (value, version) {
            (None, None) => Ok(None),
            (Some(value), Some(version)) => Ok(Some(Versioned::new(
                Bytes::from(value),
                self.version("kv get", &version)?,
            ))),
            _ => Err(self.conn.damaged(
                "kv get",
                format!("the entry of `{namespace}/{key}` lacks its value or its version"),
            )),
        }
    }

    #[tracing::instrument(level = "debug", name = "redis_kv_put", skip_all, fields(namespace = %namespace, key = %key, bytes = value.len(), expected = ?expected))]
    async fn put(
        &self,
        namespace: &str,
        key: &str,
        value: Bytes,
        expected: Precondition,
    ) -> Result<Version> {
        let (mode, want) = precondition(expected)?;
        let names = self.names(namespace);
        let (entry, index, counter) = (names.entry(key), names.index(), names.counter());
        let (entry, index, counter, value, want) = (&entry, &index, &counter, &value, &want);
        let reply: Value = self
            .conn
            .run("kv put", |mut c| async move {
                PUT.key(entry)
                    .key(index)
                    .key(counter)
                    .arg(mode)
                    .arg(want)
                    .arg(&value[..])
                    .arg(key)
                    .invoke_async(&mut c)
                    .await
            })
            .await?;
        match strings(&reply).as_deref() {
            Some([ok, version]) if ok == "ok" => self.version("kv put", version),
            Some([conflict, current]) if conflict == "conflict" => {
                Err(Self::conflict(namespace, key, expected, current))
            }
            Some([damaged, what]) if damaged == "damaged" => Err(self.conn.damaged("kv put", what)),
            _ => Err(self.conn.unexpected("kv put", &reply)),
        }
    }

    #[tracing::instrument(level = "debug", name = "redis_kv_delete", skip_all, fields(namespace = %namespace, key = %key, expected = ?expected))]
    async fn delete(&self, namespace: &str, key: &str, expected: Precondition) -> Result<bool> {
        if expected == Precondition::Absent {
            return Err(Error::invalid(
                "precondition",
                "delete cannot expect an absent key",
            ));
        }
        let (mode, want) = precondition(expected)?;
        let names = self.names(namespace);
        let (entry, index) = (names.entry(key), names.index());
        let (entry, index, want) = (&entry, &index, &want);
        let reply: Value = self
            .conn
            .run("kv delete", |mut c| async move {
                DELETE
                    .key(entry)
                    .key(index)
                    .arg(mode)
                    .arg(want)
                    .arg(key)
                    .invoke_async(&mut c)
                    .await
            })
            .await?;
        match strings(&reply).as_deref() {
            Some([ok, removed]) if ok == "ok" => Ok(removed != "0"),
            Some([conflict, current]) if conflict == "conflict" => {
                Err(Self::conflict(namespace, key, expected, current))
            }
            Some([damaged, what]) if damaged == "damaged" => {
                Err(self.conn.damaged("kv delete", what))
            }
            _ => Err(self.conn.unexpected("kv delete", &reply)),
        }
    }

    #[tracing::instrument(level = "debug", name = "redis_kv_list", skip_all, fields(namespace = %namespace, prefix = %prefix))]
    async fn list(&self, namespace: &str, prefix: &str) -> Result<Vec<KvEntry>> {
        let names = self.names(namespace);
        // The index is a sorted set whose members all score 0: ordered by their bytes, so the
        // keys starting with `prefix` are the range [prefix, prefix + 0xFF] (no UTF-8 text
        // contains the byte 0xFF). Read page by page; never the whole namespace at once.
        let (mut min, max) = if prefix.is_empty() {
            (b"-".to_vec(), b"+".to_vec())
        } else {
            (
                [b"[", prefix.as_bytes()].concat(),
                [b"[", prefix.as_bytes(), b"\xff"].concat(),
            )
        };
        let mut out = Vec::new();
        loop {
            let (index, lo, hi, page) = (names.index(), min.clone(), max.clone(), self.page_size);
            let (index, lo, hi) = (&index, &lo, &hi);
            let members: Vec<Vec<u8>> = self
                .conn
                .run("kv list", |mut c| async move {
                    redis::cmd("ZRANGEBYLEX")
                        .arg(index)
                        .arg(lo)
                        .arg(hi)
                        .arg("LIMIT")
                        .arg(0)
                        .arg(page)
                        .query_async(&mut c)
                        .await
                })
                .await?;
            let Some(last) = members.last() else {
                break;
            };
            min = [b"(".as_slice(), last].concat();
            let full = members.len() == self.page_size;
            let keys = members
                .into_iter()
                .map(|m| {
                    String::from_utf8(m).map_err(|_| {
                        self.conn
                            .damaged("kv list", format!("a key of `{namespace}` is not UTF-8"))
                    })
                })
                .collect::<Result<Vec<String>>>()?;
            // Versions and sizes of the page in one round trip. An entry deleted since the
            // range was read is skipped: a listing is not a snapshot.
            let mut pipe = redis::pipe();
            for key in &keys {
                let entry = names.entry(key);
                pipe.cmd("HGET").arg(&entry).arg("ver");
                pipe.cmd("HSTRLEN").arg(&entry).arg("v");
            }
            let pipe = &pipe;
            let details: Vec<(Option<String>, u64)> = self
                .conn
                .run("kv list", |mut c| async move {
                    let flat: Vec<Value> = pipe.query_async(&mut c).await?;
                    let mut pairs = Vec::with_capacity(flat.len() / 2);
                    let mut it = flat.into_iter();
                    while let (Some(ver), Some(len)) = (it.next(), it.next()) {
                        pairs.push((redis::from_redis_value(ver)?, redis::from_redis_value(len)?));
                    }
                    Ok(pairs)
                })
                .await?;
            for (key, (version, size)) in keys.into_iter().zip(details) {
                if let Some(version) = version {
                    let version = self.version("kv list", &version)?;
                    out.push(KvEntry::new(key, version, size));
                }
            }
            if !full {
                break;
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn namespaces_are_unambiguous_in_a_hash_tag() {
        assert_eq!(
            encode_namespace("agents/a/users/b/memory"),
            "agents/a/users/b/memory"
        );
        assert_eq!(encode_namespace("a}:e:x"), "a%7D:e:x");
        assert_eq!(encode_namespace("{%}"), "%7B%25%7D");
        assert_eq!(encode_namespace(""), "%00");
        assert_ne!(encode_namespace("%00"), encode_namespace(""));
        let store = RedisKvStore::new(RedisOptions::default().key_prefix("p:")).unwrap();
        let names = store.names("a}:e:x");
        assert_eq!(names.entry("k"), "p:kv:{a%7D:e:x}:e:k");
        assert_eq!(store.names("a").entry("x}:e:k"), "p:kv:{a}:e:x}:e:k");
        assert_ne!(names.entry("k"), store.names("a").entry("x}:e:k"));
    }
}
