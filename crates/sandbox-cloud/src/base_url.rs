//! [`BaseUrl`]: an API's base URL with its user info taken out and sent as basic auth.

use std::fmt;

use sandbox_core::UserInfo;

/// An API base URL as the clients use it. The user info a configured URL may carry
/// (`https://user:password@proxy/…`, the password perhaps with raw `/`, `#`, `?` or `@`) is
/// taken out here ([`sandbox_core::split_userinfo`]) and sent as basic auth on every request
/// ([`apply`](Self::apply)): the URL that reaches reqwest, hyper and every error message and
/// log line has none. `Debug` and `Display` show the bare URL.
#[derive(Clone)]
pub struct BaseUrl {
    url: String,
    auth: Option<UserInfo>,
}

impl BaseUrl {
    /// `url` without a trailing `/`, its user info kept apart.
    pub fn new(url: &str) -> BaseUrl {
        let (bare, auth) = sandbox_core::split_userinfo(url);
        BaseUrl {
            url: bare.trim_end_matches('/').to_owned(),
            auth,
        }
    }

    /// The URL without user info.
    pub fn as_str(&self) -> &str {
        &self.url
    }

    /// Whether the configured URL carried user info.
    pub fn has_credentials(&self) -> bool {
        self.auth.is_some()
    }

    /// `path` (starting with `/`) under the base.
    pub fn join(&self, path: &str) -> String {
        format!("{}{path}", self.url)
    }

    /// `rb` with the URL's user info as basic auth, when it had some (what reqwest does with
    /// user info it finds in a URL, without the URL ever holding it).
    pub fn apply(&self, rb: reqwest::RequestBuilder) -> reqwest::RequestBuilder {
        match &self.auth {
            Some(a) => rb.basic_auth(&a.user, a.password.as_ref()),
            None => rb,
        }
    }
}

impl fmt::Debug for BaseUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BaseUrl")
            .field("url", &self.url)
            .field("auth", &self.auth.as_ref().map(|_| "***"))
            .finish()
    }
}

impl fmt::Display for BaseUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.url)
    }
}
