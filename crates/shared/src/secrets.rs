//! Credentials kept out of everything the services show: logs at any level (their
//! dependencies' included), spans, metrics and error messages.
//!
//! * [`shown_url`] / [`without_userinfo`]: a URL, or any text holding URLs, as it may be shown:
//!   no `user:password@`, no query values.
//! * [`Redactor`]: scrubs the configured secret values from text that came from outside, since an
//!   LLM server's error body may echo the request's own headers back.
//! * [`NatsUrl`]: a NATS address with its `user:password@` or `token@` held apart, so the NATS
//!   client (which logs its server addresses at debug level) is never given them.
//! * [`Secret`]: a configured credential, redacted in `Debug` output.

use std::fmt;
use std::sync::Arc;

/// A value kept out of logs and `Debug` output (an API key, a header value).
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct Secret(String);

impl Secret {
    /// The secret itself, for the one place that sends it.
    pub fn expose(&self) -> &str {
        &self.0
    }

    /// The value of the environment variable `name`, when set and not empty.
    pub fn from_env(name: &str) -> Option<Self> {
        std::env::var(name).ok().filter(|v| !v.is_empty()).map(Self)
    }
}

impl From<&str> for Secret {
    fn from(value: &str) -> Self {
        Self(value.to_owned())
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("<redacted>")
    }
}

/// What stands in for a removed credential.
pub const REDACTED: &str = "***";

/// Secrets shorter than this are not scrubbed from text: a one- or two-letter header value would
/// mangle every message, and is no credential.
pub const MIN_SCRUBBED_LEN: usize = 4;

/// `raw` with the userinfo of every `scheme://user:password@host` in it replaced by `***` (text
/// that is not a URL is returned as it is).
pub fn without_userinfo(raw: &str) -> String {
    replace_userinfo(raw, REDACTED)
}

/// `raw` with the userinfo of every URL in it replaced by `with` (the `@` goes too when `with` is
/// empty).
fn replace_userinfo(raw: &str, with: &str) -> String {
    let mut shown = String::with_capacity(raw.len());
    let mut rest = raw;
    while let Some(start) = rest.find("://") {
        let (head, tail) = rest.split_at(start + 3);
        shown.push_str(head);
        let authority_end = tail
            .find(|c: char| matches!(c, '/' | '?' | '#' | '\'' | '"' | ',') || c.is_whitespace())
            .unwrap_or(tail.len());
        match tail[..authority_end].rfind('@') {
            Some(at) if with.is_empty() => shown.push_str(&tail[at + 1..authority_end]),
            Some(at) => {
                shown.push_str(with);
                shown.push_str(&tail[at..authority_end]);
            }
            None => shown.push_str(&tail[..authority_end]),
        }
        rest = &tail[authority_end..];
    }
    shown.push_str(rest);
    shown
}

/// A URL as it may be logged: without userinfo, each query value replaced by `***` (gateways take
/// keys as `?key=…`), without a fragment.
pub fn shown_url(raw: &str) -> String {
    let base = raw.split(['?', '#']).next().unwrap_or_default();
    let mut shown = without_userinfo(base);
    let keys: Vec<String> = query_pairs(raw).map(|(key, _)| format!("{key}={REDACTED}")).collect();
    if !keys.is_empty() {
        shown.push('?');
        shown.push_str(&keys.join("&"));
    }
    shown
}

/// What [`shown_url`] hides of `raw`: its userinfo, whole and each part, and its query values.
pub fn url_secrets(raw: &str) -> Vec<&str> {
    let mut secrets = Vec::new();
    if let Some(info) = userinfo(raw) {
        secrets.push(info);
        secrets.extend(info.split(':'));
    }
    secrets.extend(query_pairs(raw).filter_map(|(_, value)| value));
    secrets
}

/// The `key=value` pairs of a URL's query (the fragment left out); a pair without `=` has no value.
fn query_pairs(raw: &str) -> impl Iterator<Item = (&str, Option<&str>)> {
    let without_fragment = raw.split_once('#').map_or(raw, |(url, _)| url);
    without_fragment
        .split_once('?')
        .map(|(_, query)| query)
        .into_iter()
        .flat_map(|query| query.split('&'))
        .filter(|pair| !pair.is_empty())
        .map(|pair| match pair.split_once('=') {
            Some((key, value)) => (key, Some(value)),
            None => (pair, None),
        })
}

/// The `user:password` (or `token`) of a URL, percent-encoded as written, when it has one.
pub fn userinfo(raw: &str) -> Option<&str> {
    let (_, tail) = raw.split_once("://")?;
    let authority = &tail[..tail.find(['/', '?', '#']).unwrap_or(tail.len())];
    authority
        .rfind('@')
        .map(|at| &authority[..at])
        .filter(|u| !u.is_empty())
}

/// Scrubs known secret values out of text.
#[derive(Clone, Default)]
pub struct Redactor {
    /// Longest first, so a secret that contains another is replaced whole.
    secrets: Arc<[String]>,
}

impl Redactor {
    /// A redactor for `secrets` (blank and very short values are ignored, see [`MIN_SCRUBBED_LEN`]).
    pub fn new<'a>(secrets: impl IntoIterator<Item = &'a str>) -> Self {
        let mut secrets: Vec<String> = secrets
            .into_iter()
            .map(str::trim)
            .filter(|s| s.len() >= MIN_SCRUBBED_LEN)
            .map(str::to_owned)
            .collect();
        secrets.sort_by_key(|s| std::cmp::Reverse(s.len()));
        secrets.dedup();
        Self {
            secrets: secrets.into(),
        }
    }

    /// `text` with every secret replaced by `***`, and with the userinfo of any URL in it removed.
    pub fn scrub(&self, text: &str) -> String {
        let mut text = without_userinfo(text);
        for secret in self.secrets.iter() {
            if text.contains(secret.as_str()) {
                text = text.replace(secret.as_str(), REDACTED);
            }
        }
        text
    }
}

impl fmt::Debug for Redactor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Redactor({} secrets)", self.secrets.len())
    }
}

/// How the NATS client authenticates, taken out of the URL.
#[derive(Clone, PartialEq, Eq, Hash)]
pub enum NatsAuth {
    /// `nats://user:password@host`.
    UserPassword(String, Secret),
    /// `nats://token@host`.
    Token(Secret),
}

/// A NATS address (`nats://host:4222`, `tls://…`, or several, comma-separated) whose credentials
/// are kept apart: `Display` and `Debug` show the address alone.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct NatsUrl {
    /// The address(es) without userinfo: what the NATS client is given, and what logs show.
    servers: String,
    auth: Option<NatsAuth>,
}

impl NatsUrl {
    /// Splits `raw` into its servers and credentials. Every server of a list must carry the same
    /// credentials or none (the client presents one set).
    pub fn parse(raw: &str) -> Result<Self, String> {
        let mut auth = None;
        for server in raw.split(',').map(str::trim) {
            let Some(info) = userinfo(server) else { continue };
            let this = match info.split_once(':') {
                Some((user, password)) => NatsAuth::UserPassword(user.to_owned(), Secret::from(password)),
                None => NatsAuth::Token(Secret::from(info)),
            };
            match &auth {
                Some(seen) if *seen != this => {
                    return Err("the NATS URLs of one list carry different credentials".to_owned());
                }
                _ => auth = Some(this),
            }
        }
        Ok(Self {
            servers: replace_userinfo(raw, ""),
            auth,
        })
    }

    /// The servers, without credentials.
    pub fn servers(&self) -> &str {
        &self.servers
    }

    /// Each server of the list, without credentials: the NATS client's seeds.
    pub fn seeds(&self) -> Vec<&str> {
        self.servers
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .collect()
    }

    /// The credentials given in the URL, if any.
    pub fn auth(&self) -> Option<&NatsAuth> {
        self.auth.as_ref()
    }
}

impl fmt::Display for NatsUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.servers)
    }
}

impl fmt::Debug for NatsUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "NatsUrl({:?}, credentials: {})", self.servers, self.auth.is_some())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn userinfo_is_removed_from_every_url_in_a_text() {
        assert_eq!(
            without_userinfo("cannot reach http://u:p%40ss@host:8080/v1 or nats://tok@n:4222, sorry"),
            "cannot reach http://***@host:8080/v1 or nats://***@n:4222, sorry"
        );
        assert_eq!(without_userinfo("http://host/a@b"), "http://host/a@b");
        assert_eq!(without_userinfo("no url here: a@b"), "no url here: a@b");
        assert_eq!(without_userinfo("x://"), "x://");
    }

    #[test]
    fn shown_urls_keep_query_keys_but_not_values() {
        assert_eq!(
            shown_url("https://k:s@gw.example/v1?api-key=abc&v=2#frag"),
            "https://***@gw.example/v1?api-key=***&v=***"
        );
        assert_eq!(shown_url("http://127.0.0.1:11434/v1"), "http://127.0.0.1:11434/v1");
    }

    #[test]
    fn the_redactor_replaces_secrets_longest_first_and_ignores_short_ones() {
        let redactor = Redactor::new(["sk-abc", "sk-abcdef", "ab", " "]);
        assert_eq!(redactor.scrub("key sk-abcdef and sk-abc, ab"), "key *** and ***, ab");
        assert_eq!(redactor.scrub("at https://u:pw@h/"), "at https://***@h/");
    }

    #[test]
    fn nats_credentials_are_held_apart_from_the_address() {
        let url = NatsUrl::parse("nats://alice:s3cret@n1:4222,nats://alice:s3cret@n2:4222").unwrap();
        assert_eq!(url.servers(), "nats://n1:4222,nats://n2:4222");
        assert_eq!(url.seeds(), ["nats://n1:4222", "nats://n2:4222"]);
        assert!(matches!(url.auth(), Some(NatsAuth::UserPassword(u, p)) if u == "alice" && p.expose() == "s3cret"));
        assert!(!format!("{url} {url:?}").contains("s3cret"));
        let token = NatsUrl::parse("tls://t0ken@n:4222").unwrap();
        assert!(matches!(token.auth(), Some(NatsAuth::Token(t)) if t.expose() == "t0ken"));
        assert!(NatsUrl::parse("nats://a:1@n1,nats://b:2@n2").is_err());
        assert!(NatsUrl::parse("nats://n1").unwrap().auth().is_none());
    }
}
