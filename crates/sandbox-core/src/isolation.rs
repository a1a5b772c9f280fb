//! Who shares a box with whom: [`IsolationScope`], [`CallContext`] and [`IsolationKey`].

use std::fmt;

use serde::{Deserialize, Serialize};

/// The dimension along which boxes (and shared-store namespaces) are shared.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
#[serde(rename_all = "snake_case")]
pub enum IsolationScope {
    /// One box per session id (the default). Without a session id, every call gets a fresh box
    /// and nothing is looked up or persisted.
    #[default]
    Session,
    /// One box per user id, shared by that user's sessions. Without a user id it falls back to
    /// [`Session`](Self::Session), with a warning.
    User,
    /// One box per agent name, shared by all users and sessions of that agent.
    Agent,
    /// One box for everything in the store.
    Global,
}

impl IsolationScope {
    /// Lower-case name: `session`, `user`, `agent`, `global`.
    pub fn as_str(self) -> &'static str {
        match self {
            IsolationScope::Session => "session",
            IsolationScope::User => "user",
            IsolationScope::Agent => "agent",
            IsolationScope::Global => "global",
        }
    }
}

/// Who is calling: the agent's name and the optional user and session ids.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct CallContext {
    /// The agent's name (fixed when the agent is built).
    pub agent: String,
    /// The end user, if known.
    pub user_id: Option<String>,
    /// The conversation, if known.
    pub session_id: Option<String>,
}

impl CallContext {
    /// A context for `agent` with no user or session.
    pub fn new(agent: impl Into<String>) -> Self {
        CallContext {
            agent: agent.into(),
            user_id: None,
            session_id: None,
        }
    }

    /// Set the user id.
    pub fn user(mut self, user_id: impl Into<String>) -> Self {
        self.user_id = Some(user_id.into());
        self
    }

    /// Set the session id.
    pub fn session(mut self, session_id: impl Into<String>) -> Self {
        self.session_id = Some(session_id.into());
        self
    }
}

/// The slot a call's box state lives in.
///
/// Its string form ([`IsolationKey::as_str`]) is stable and used verbatim as the state-store key,
/// the guard's lock key and the seed of deterministic box names:
///
/// | scope | key |
/// | --- | --- |
/// | session | `agents/<agent>/sessions/<session_id>` |
/// | user | `agents/<agent>/users/<user_id>` |
/// | agent | `agents/<agent>/shared` |
/// | global | `global/__global__` |
///
/// Each component is percent-encoded outside `[A-Za-z0-9._@-]` (and a leading `.` is encoded;
/// see [`encode_component`]), so ids with `/` or `..` cannot address another slot.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct IsolationKey {
    scope: IsolationScope,
    key: String,
}

/// The fixed value of the global slot.
pub const GLOBAL_KEY: &str = "__global__";

impl IsolationKey {
    /// Resolve the key for `scope` and `ctx`.
    ///
    /// Returns `None` when there is no slot to look up: `Session` (directly, or as `User`'s
    /// fallback) without a session id. The caller then creates a fresh box and persists
    /// nothing.
    pub fn resolve(scope: IsolationScope, ctx: &CallContext) -> Option<IsolationKey> {
        let agent = encode_component(&ctx.agent);
        match scope {
            IsolationScope::User => match &ctx.user_id {
                Some(user) => Some(IsolationKey {
                    scope,
                    key: format!("agents/{agent}/users/{}", encode_component(user)),
                }),
                None => {
                    tracing::warn!(agent = %ctx.agent, "USER isolation without a user id: falling back to SESSION");
                    IsolationKey::resolve(IsolationScope::Session, ctx)
                }
            },
            IsolationScope::Session => ctx.session_id.as_ref().map(|session| IsolationKey {
                scope: IsolationScope::Session,
                key: format!("agents/{agent}/sessions/{}", encode_component(session)),
            }),
            IsolationScope::Agent => Some(IsolationKey {
                scope,
                key: format!("agents/{agent}/shared"),
            }),
            IsolationScope::Global => Some(IsolationKey {
                scope,
                key: format!("global/{GLOBAL_KEY}"),
            }),
        }
    }

    /// The scope actually used (after fallbacks).
    pub fn scope(&self) -> IsolationScope {
        self.scope
    }

    /// The stable key string.
    pub fn as_str(&self) -> &str {
        &self.key
    }

    /// Read back a key string produced by [`as_str`](Self::as_str) (e.g. a name a store
    /// listed). Anything else is [`Error::InvalidInput`](crate::Error::InvalidInput).
    pub fn parse(key: &str) -> crate::Result<IsolationKey> {
        let encoded = |c: &str| {
            !c.is_empty()
                && !c.starts_with('.')
                && c.bytes().all(|b| {
                    b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'@' | b'-' | b'%')
                })
        };
        let parts: Vec<&str> = key.split('/').collect();
        let scope = match parts.as_slice() {
            ["global", GLOBAL_KEY] => Some(IsolationScope::Global),
            ["agents", a, "shared"] if encoded(a) => Some(IsolationScope::Agent),
            ["agents", a, "users", u] if encoded(a) && encoded(u) => Some(IsolationScope::User),
            ["agents", a, "sessions", s] if encoded(a) && encoded(s) => {
                Some(IsolationScope::Session)
            }
            _ => None,
        };
        match scope {
            Some(scope) => Ok(IsolationKey {
                scope,
                key: key.to_owned(),
            }),
            None => Err(crate::Error::invalid(
                "isolation key",
                format!("`{key}` is not a key this library produces"),
            )),
        }
    }

    /// A key no call resolves to (and [`parse`](Self::parse) refuses), for the library's own
    /// exclusion through the guard: `reserved/<name>`.
    pub(crate) fn reserved(name: &str) -> IsolationKey {
        IsolationKey {
            scope: IsolationScope::Global,
            key: format!("reserved/{}", encode_component(name)),
        }
    }

    /// A short, name-safe digest of the key (16 hex chars of SHA-256), for box names.
    pub fn digest(&self) -> String {
        use sha2::Digest as _;
        let hash = sha2::Sha256::digest(self.key.as_bytes());
        hex::encode(&hash[..8])
    }
}

impl fmt::Display for IsolationKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.key)
    }
}

impl fmt::Debug for IsolationKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "IsolationKey({})", self.key)
    }
}

/// Percent-encode one component of a key or directory name, so that no id can address
/// another slot: every byte outside `[A-Za-z0-9._@-]` becomes `%XX` (upper-case hex), and so
/// does a leading `.` (no `.`, `..` or hidden names). `%` itself is encoded, so an encoded id
/// never reads as the encoding of another. The empty string becomes `%00`, which it shares with
/// a lone NUL byte.
///
/// ```
/// use sandbox_core::encode_component;
/// assert_eq!(encode_component("alice@example.com"), "alice@example.com");
/// assert_eq!(encode_component("../bob/x"), "%2E.%2Fbob%2Fx");
/// assert_eq!(encode_component(""), "%00");
/// ```
pub fn encode_component(component: &str) -> String {
    let mut out = String::with_capacity(component.len());
    for (i, b) in component.bytes().enumerate() {
        let plain =
            b.is_ascii_alphanumeric() || matches!(b, b'_' | b'@' | b'-') || (b == b'.' && i > 0);
        if plain {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    if out.is_empty() {
        out.push_str("%00");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ctx() -> CallContext {
        CallContext::new("coder").user("alice").session("s1")
    }

    #[test]
    fn keys_are_stable() {
        let k = |s| IsolationKey::resolve(s, &ctx()).unwrap().to_string();
        assert_eq!(k(IsolationScope::Session), "agents/coder/sessions/s1");
        assert_eq!(k(IsolationScope::User), "agents/coder/users/alice");
        assert_eq!(k(IsolationScope::Agent), "agents/coder/shared");
        assert_eq!(k(IsolationScope::Global), "global/__global__");
    }

    #[test]
    fn fallbacks() {
        let no_user = CallContext::new("a").session("s");
        let key = IsolationKey::resolve(IsolationScope::User, &no_user).unwrap();
        assert_eq!(key.scope(), IsolationScope::Session);
        assert_eq!(key.as_str(), "agents/a/sessions/s");
        assert!(IsolationKey::resolve(IsolationScope::Session, &CallContext::new("a")).is_none());
        assert!(IsolationKey::resolve(IsolationScope::User, &CallContext::new("a")).is_none());
        assert!(IsolationKey::resolve(IsolationScope::Agent, &CallContext::new("a")).is_some());
    }

    #[test]
    fn hostile_ids_cannot_address_other_slots() {
        let k = IsolationKey::resolve(
            IsolationScope::User,
            &CallContext::new("a").user("../bob/x"),
        )
        .unwrap();
        assert_eq!(k.as_str(), "agents/a/users/%2E.%2Fbob%2Fx");
        let k1 =
            IsolationKey::resolve(IsolationScope::User, &CallContext::new("a").user("u1")).unwrap();
        let k10 = IsolationKey::resolve(IsolationScope::User, &CallContext::new("a").user("u1%30"))
            .unwrap();
        assert_ne!(k1, k10);
        assert_eq!(k1.digest().len(), 16);
    }
}
