//! Connection strings that carry passwords: shown redacted everywhere, exposed
//! only to the client library that connects with them.

use std::fmt;

/// A URL or DSN that may hold a password. `Display` and `Debug` redact it.
#[derive(Clone, PartialEq, Eq)]
pub struct SecretUrl(String);

impl SecretUrl {
    /// Wraps a connection string.
    pub fn new(url: impl Into<String>) -> Self {
        Self(url.into())
    }

    /// The connection string with its password, for the client library only.
    pub fn expose(&self) -> &str {
        &self.0
    }

    /// The connection string with any password replaced by `***`.
    pub fn redacted(&self) -> String {
        redact(&self.0)
    }
}

impl fmt::Display for SecretUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.redacted())
    }
}

impl fmt::Debug for SecretUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "SecretUrl({})", self.redacted())
    }
}

impl From<String> for SecretUrl {
    fn from(url: String) -> Self {
        Self(url)
    }
}

/// Replaces the password in `scheme://user:password@host/…` and in any
/// `password=value` pair (query strings, libpq key/value DSNs).
fn redact(url: &str) -> String {
    let url = match url.split_once("://") {
        Some((scheme, rest)) => {
            let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
            let (authority, tail) = rest.split_at(authority_end);
            match authority.rsplit_once('@') {
                Some((userinfo, host)) => {
                    let user = userinfo.split_once(':').map_or(userinfo, |(user, _)| user);
                    let masked = if userinfo.contains(':') { ":***" } else { "" };
                    format!("{scheme}://{user}{masked}@{host}{tail}")
                }
                None => url.to_owned(),
            }
        }
        None => url.to_owned(),
    };
    redact_password_pairs(&url)
}

fn redact_password_pairs(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find("password=") {
        let (before, after) = rest.split_at(at + "password=".len());
        out.push_str(before);
        let value_end = after
            .find(|c: char| c == '&' || c.is_whitespace())
            .unwrap_or(after.len());
        if value_end > 0 {
            out.push_str("***");
        }
        rest = &after[value_end..];
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_in_urls_are_redacted() {
        let cases = [
            (
                "amqp://guest:guest@127.0.0.1:5672/%2f",
                "amqp://guest:***@127.0.0.1:5672/%2f",
            ),
            (
                "postgres://app:s3cr%40t@db:5432/points?sslmode=disable",
                "postgres://app:***@db:5432/points?sslmode=disable",
            ),
            (
                "postgres://postgres@127.0.0.1:5432/postgres",
                "postgres://postgres@127.0.0.1:5432/postgres",
            ),
            (
                "postgres://db/points?user=app&password=hunter2&sslmode=require",
                "postgres://db/points?user=app&password=***&sslmode=require",
            ),
            (
                "host=db user=app password=hunter2 dbname=points",
                "host=db user=app password=*** dbname=points",
            ),
            ("amqp://127.0.0.1", "amqp://127.0.0.1"),
        ];
        for (url, expected) in cases {
            assert_eq!(SecretUrl::new(url).to_string(), expected);
        }
    }

    #[test]
    fn debug_output_hides_the_password_too() {
        let url = SecretUrl::new("amqp://u:topsecret@h/v");
        assert!(!format!("{url:?}").contains("topsecret"));
        assert_eq!(url.expose(), "amqp://u:topsecret@h/v");
    }
}
