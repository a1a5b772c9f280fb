//! URLs as the project shows them: without their user info.
//!
//! Every URL an option takes (a Redis server, an API base, an S3 endpoint) may carry
//! credentials as `scheme://user:password@host`. A password may hold raw `/`, `#`, `?` or `@`
//! (users paste them unencoded), which makes the authority ambiguous to a URL parser: cutting
//! it at the first `/` (as a parser does) shows the rest of the password. The rule here is
//! conservative: the user info is **everything between `://` and the last `@`** of the URL.
//! [`redact_url`] replaces it with `***`; [`split_userinfo`] takes it out (for a client that
//! then sends it as basic auth, so no library below ever sees it in a URL). An `@` that
//! belongs to a path or query must therefore be percent-encoded (`%40`): otherwise more than
//! the user info is hidden, never less.

use std::fmt;

/// The user info removed: `scheme://user:pass@host/…` → `scheme://***@host/…`, and the values
/// of `pass`/`password`/`token` query parameters → `***`. Text that is no URL is handled the
/// same way (everything before its last `@` hidden).
pub fn redact_url(url: &str) -> String {
    let mut out = match userinfo_span(url) {
        Some((start, end)) => format!("{}***@{}", &url[..start], &url[end..]),
        None => url.to_owned(),
    };
    if let Some(q) = out.find('?') {
        let (head, query) = out.split_at(q + 1);
        let query: Vec<String> = query
            .split('&')
            .map(|pair| match pair.split_once('=') {
                Some((k, _)) if SECRET_PARAMS.iter().any(|s| k.eq_ignore_ascii_case(s)) => {
                    format!("{k}=***")
                }
                _ => pair.to_owned(),
            })
            .collect();
        out = format!("{head}{}", query.join("&"));
    }
    out
}

/// Query parameters whose values are credentials (`redis+unix:///s?pass=…`).
const SECRET_PARAMS: [&str; 5] = ["pass", "password", "token", "access_token", "secret"];

/// A URL shown through [`redact_url`] (for `Display` and `tracing` fields).
#[derive(Clone, Copy)]
pub struct RedactedUrl<'a>(pub &'a str);

impl fmt::Display for RedactedUrl<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&redact_url(self.0))
    }
}

impl fmt::Debug for RedactedUrl<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&redact_url(self.0), f)
    }
}

/// User info taken out of a URL, percent-decoded.
#[derive(Clone, PartialEq, Eq)]
pub struct UserInfo {
    /// The user name (may be empty: `scheme://:password@host`).
    pub user: String,
    /// The password, when the user info has a `:`.
    pub password: Option<String>,
}

impl fmt::Debug for UserInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("UserInfo(***)")
    }
}

/// `url` without its user info (the same span [`redact_url`] hides), and that user info.
/// `scheme://u:p/w#x@host/path` → (`scheme://host/path`, `u` / `p/w#x`).
pub fn split_userinfo(url: &str) -> (String, Option<UserInfo>) {
    let Some((start, end)) = userinfo_span(url) else {
        return (url.to_owned(), None);
    };
    let info = &url[start..end - 1];
    let (user, password) = match info.split_once(':') {
        Some((u, p)) => (u, Some(percent_decode(p))),
        None => (info, None),
    };
    let stripped = format!("{}{}", &url[..start], &url[end..]);
    (
        stripped,
        Some(UserInfo {
            user: percent_decode(user),
            password,
        }),
    )
}

/// The user info of `url` as written (not decoded): the text [`redact_url`] hides, without
/// its `@`. For scrubbing a password out of a library's messages.
pub fn raw_userinfo(url: &str) -> Option<&str> {
    userinfo_span(url).map(|(start, end)| &url[start..end - 1])
}

/// The byte range `[start, end)` of `user[:password]@` in `url`: from after `://` (or the
/// start, for text without a scheme) through the last `@`.
fn userinfo_span(url: &str) -> Option<(usize, usize)> {
    let start = url.find("://").map_or(0, |i| i + 3);
    let at = url[start..].rfind('@')?;
    Some((start, start + at + 1))
}

fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let hex = |c: u8| (c as char).to_digit(16);
        if b[i] == b'%'
            && i + 2 < b.len()
            && let (Some(h), Some(l)) = (hex(b[i + 1]), hex(b[i + 2]))
        {
            out.push((h * 16 + l) as u8);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A password with every character that confuses a URL parser.
    const HARD: &str = "p/ss#w?rd@x%40y:z";

    #[test]
    fn user_info_is_hidden_whatever_the_password_holds() {
        for (url, want) in [
            ("redis://127.0.0.1:6379", "redis://127.0.0.1:6379"),
            ("redis://:pw@h:1/0", "redis://***@h:1/0"),
            ("redis://u:pw@h", "redis://***@h"),
            ("redis://u:p@w:x@h/2", "redis://***@h/2"),
            ("redis://pw@h", "redis://***@h"),
            ("redis://u:p/w@h:6379/0", "redis://***@h:6379/0"),
            ("redis://u:p#w@h", "redis://***@h"),
            ("redis://u:p?w@h", "redis://***@h"),
            ("http://u:p%2Fw%40x@h/api", "http://***@h/api"),
            ("http://u:a/b?c#d@e@h:1/p?q=1", "http://***@h:1/p?q=1"),
            ("u:pw@h:6379", "***@h:6379"),
            (
                "redis+unix:///run/r.sock?db=1&pass=pw",
                "redis+unix:///run/r.sock?db=1&pass=***",
            ),
            ("https://api.e2b.app", "https://api.e2b.app"),
            ("", ""),
        ] {
            assert_eq!(redact_url(url), want, "{url}");
            assert_eq!(RedactedUrl(url).to_string(), want, "{url}");
        }
        let marker = "s3cr3t-MARKER";
        for shape in [
            format!("redis://admin:{marker}{HARD}@h:6379/0"),
            format!("http://{marker}:{HARD}@h/x"),
            format!("http://user:{HARD}{marker}@[::1]:80"),
            format!("https://user:{marker}%2F%23%3F%40@h"),
        ] {
            let shown = redact_url(&shape);
            assert!(!shown.contains(marker), "{shape} -> {shown}");
            assert!(
                !shown.contains("p/ss") && !shown.contains("rd@x"),
                "{shown}"
            );
        }
    }

    #[test]
    fn split_takes_out_exactly_what_is_hidden() {
        let url = format!("http://us%65r:{HARD}@h:8080/base");
        let (bare, info) = split_userinfo(&url);
        assert_eq!(bare, "http://h:8080/base");
        let info = info.expect("user info");
        assert_eq!(info.user, "user");
        assert_eq!(info.password.as_deref(), Some("p/ss#w?rd@x@y:z"));
        assert_eq!(format!("{info:?}"), "UserInfo(***)");
        assert_eq!(
            split_userinfo("http://h/x"),
            ("http://h/x".to_owned(), None)
        );
        let (bare, info) = split_userinfo("http://token@h");
        assert_eq!(bare, "http://h");
        assert_eq!(
            info,
            Some(UserInfo {
                user: "token".into(),
                password: None
            })
        );
        assert_eq!(percent_decode("%zz%4"), "%zz%4");
    }
}
