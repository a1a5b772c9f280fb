//! [`Secret`]: a credential that never prints.

use std::fmt;

/// An API key or access token. `Debug` and `Display` print `***`; it has no `Serialize`, so it
/// cannot end up in state JSON. [`expose`](Self::expose) is the one way to the value (to put
/// it in a header).
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    /// Wrap a credential.
    pub fn new(value: impl Into<String>) -> Self {
        Secret(value.into())
    }

    /// The credential, for a request header.
    pub fn expose(&self) -> &str {
        &self.0
    }

    /// The value of environment variable `var`, if set and not empty.
    pub fn from_env(var: &str) -> Option<Secret> {
        std::env::var(var)
            .ok()
            .filter(|v| !v.trim().is_empty())
            .map(Secret)
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(***)")
    }
}

impl fmt::Display for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("***")
    }
}
