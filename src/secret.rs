//! Connection strings that carry passwords: shown as what was parsed out of
//! them, or redacted, everywhere; exposed only to the client library that
//! connects with them.
//!
//! Generated passwords hold `/`, `#` or `@` unencoded more often than not, a
//! string may miss the colon of its scheme, a key/value string may quote its
//! password or space its `=`: redaction assumes the worst of each.

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

    /// The connection string with anything that may be a password replaced
    /// by `***`. Prefer what was parsed out of it, where it parses.
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

/// Masks the password of `scheme://user:password@host/…` and of every
/// `password=value` pair (query strings, key/value strings).
#[doc(hidden)]
pub fn redact(text: &str) -> String {
    redact_password_pairs(&redact_userinfo(text))
}

/// Masks what lies between the user and the host (see [`userinfo_password`]).
fn redact_userinfo(text: &str) -> String {
    match password_span(text) {
        Some((from, to)) => format!("{}***{}", &text[..from], &text[to..]),
        None => text.to_owned(),
    }
}

/// Where the password of a URL's userinfo may stand: after the first `:`
/// of the userinfo, which starts after the first `//` (`scheme://`, or a
/// scheme whose colon was lost) or at the start, up to the last `@` (a
/// password may hold `/`, `#` or `@` unencoded, and clients split in
/// different places). Over-reaches when an `@` stands further on, in a
/// query say: better a host hidden than a password shown.
fn password_span(text: &str) -> Option<(usize, usize)> {
    let at = text.rfind('@')?;
    let start = text[..at].find("//").map_or(0, |slashes| slashes + 2);
    let colon = text[start..at].find(':')?;
    Some((start + colon + 1, at))
}

/// What may be the password of `url`'s userinfo, as written (see
/// `password_span`); `None` when there is no `user:…@`.
#[doc(hidden)]
pub fn userinfo_password(url: &str) -> Option<&str> {
    password_span(url).map(|(from, to)| &url[from..to])
}

/// True unless `url` holds a password candidate that is not the password
/// its client parsed out of it (`parsed`, percent-decoded): the password
/// then went somewhere else (into the host, the vhost, the path), from
/// where the client or the server would echo it. Such a URL must be
/// refused, and never described from its parts.
#[doc(hidden)]
pub fn parsed_as_written(url: &str, parsed: &[u8]) -> bool {
    userinfo_password(url).is_none_or(|written| {
        percent_encoding::percent_decode_str(written).collect::<Vec<u8>>() == parsed
    })
}

/// Masks the value of every `password` key: `password=x`, `password = x`,
/// `password='a b'` (with `\'` inside), up to the next `&` or white space
/// when unquoted.
fn redact_password_pairs(text: &str) -> String {
    const KEY: &str = "password";
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find(KEY) {
        let after_key = &rest[at + KEY.len()..];
        let trimmed = after_key.trim_start();
        let Some(value) = trimmed.strip_prefix('=') else {
            out.push_str(&rest[..at + KEY.len()]);
            rest = after_key;
            continue;
        };
        let value = value.trim_start();
        out.push_str(&rest[..at + KEY.len()]);
        out.push('=');
        let end = value_end(value);
        if end > 0 {
            out.push_str("***");
        }
        rest = &value[end..];
    }
    out.push_str(rest);
    out
}

/// Where the value at the start of `value` ends: after its closing quote if
/// it is quoted (a missing one runs to the end), else at `&` or white space.
fn value_end(value: &str) -> usize {
    let Some(quoted) = value.strip_prefix('\'') else {
        return value
            .find(|c: char| c == '&' || c.is_whitespace())
            .unwrap_or(value.len());
    };
    let mut escaped = false;
    for (index, c) in quoted.char_indices() {
        match c {
            _ if escaped => escaped = false,
            '\\' => escaped = true,
            '\'' => return 1 + index + 1,
            _ => {}
        }
    }
    value.len()
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

    /// Each found by trying, in the output of a command.
    #[test]
    fn passwords_that_break_the_url_syntax_are_redacted_too() {
        let cases = [
            ("postgres://u:pa/ss@host/db", "postgres://u:***@host/db"),
            ("amqp://u:pa/ss@host/v", "amqp://u:***@host/v"),
            ("postgres://u:pa#ss@host/db", "postgres://u:***@host/db"),
            ("amqp://u:pa#ss@host/v", "amqp://u:***@host/v"),
            ("amqp://u:p@ss@host/v", "amqp://u:***@host/v"),
            ("amqp//guest:pw@host", "amqp//guest:***@host"),
            ("guest:pw@host", "guest:***@host"),
            (
                "host=db password = pw user=u",
                "host=db password=*** user=u",
            ),
            (
                "host=db password='a pw' user=u",
                "host=db password=*** user=u",
            ),
            (
                r"host=db password='it\'s a pw' user=u",
                "host=db password=*** user=u",
            ),
            ("host=db password='never closed", "host=db password=***"),
        ];
        for (url, expected) in cases {
            assert_eq!(SecretUrl::new(url).to_string(), expected, "{url}");
        }
    }

    #[test]
    fn a_password_that_went_elsewhere_is_told_from_one_parsed_as_written() {
        assert!(parsed_as_written("amqp://guest:guest@h/v", b"guest"));
        assert!(parsed_as_written("amqp://u:p%2Fw@h/v", b"p/w"));
        assert!(parsed_as_written("postgres://u@h/db", b""));
        assert!(parsed_as_written("host=h password=p@ss", b"p@ss"));
        // The client read the host, or the vhost, out of the password.
        assert!(!parsed_as_written("postgres://u:p@ss@h/db", b"p"));
        assert!(!parsed_as_written("amqp:/guest:pw@h/%2f", b"guest"));
    }

    #[test]
    fn debug_output_hides_the_password_too() {
        let url = SecretUrl::new("amqp://u:topsecret@h/v");
        assert!(!format!("{url:?}").contains("topsecret"));
        assert_eq!(url.expose(), "amqp://u:topsecret@h/v");
    }
}
