//! Who is calling: callers authenticate with `authorization: Bearer <token>`, checked against the
//! `--auth-tokens` file (the SHA-256 of each token, never the token itself), or with a verified
//! client certificate whose subject is the principal (`--auth-principal-from-cert`).
//!
//! [`AuthGate`] runs before every gRPC method but health (probes carry no credentials): a
//! caller without valid credentials gets `UNAUTHENTICATED`, a certificate subject the file does
//! not list `PERMISSION_DENIED`; an admitted request carries its [`Principal`] in its extensions
//! for the service to scope what it may do.
//!
//! The tokens file (TOML) is read again every `--tls-reload-interval` when it changed, so tokens
//! rotate without a restart:
//!
//! ```toml
//! [[token]]
//! principal = "billing"                 # who the caller is: owner of its runs, in logs and spans
//! sha256 = "9f86d081884c7d65…"          # hex SHA-256 of the token (`printf %s "$TOKEN" | sha256sum`)
//! tools = ["calculate", "time_*"]       # optional: the tools it may use (`*` globs); default all
//! max_runs = 8                          # optional: its runs in flight at once, on all replicas
//! max_queued = 100                      # optional: its runs waiting for a slot (default
//!                                       # --max-queued-runs)
//! weight = 2                            # optional: its share of the slots when runs wait (1-1000)
//! tokens_per_hour = 2000000             # optional: tokens its runs may spend per hour, together
//! roles = ["approver"]                  # optional: "approver" decides any run's tool calls,
//!                                       # "operator" lists every principal's runs
//! [token.limits]                        # optional: ceilings on what its requests may ask
//! max_turns = 8
//! tool_call_budget = 32
//! max_tool_failures = 2
//! tool_timeout = "30s"
//! run_timeout = "2m"
//! max_total_tokens = 200000
//! ```

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use serde::Deserialize;
use sha2::{Digest, Sha256};
use tonic::codegen::http;

use crate::grpc::Gate;
use crate::runtime::AbortOnDrop;
use crate::tls::PeerInfo;

/// The longest principal name accepted (it becomes a label and a log field).
pub const MAX_PRINCIPAL_LEN: usize = 128;
/// The largest share weight a principal may have.
pub const MAX_WEIGHT: u32 = 1000;
/// The most entries a tokens file may hold.
pub const MAX_TOKENS: usize = 10_000;
/// The largest tokens file read.
const MAX_FILE_BYTES: u64 = 4 * 1024 * 1024;

/// Ceilings on what one principal's requests may ask, below the server's own.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LimitCeilings {
    /// Turns per run.
    pub max_turns: Option<u32>,
    /// Normal tool calls per run.
    pub tool_call_budget: Option<u32>,
    /// Turns with a failed call per run.
    pub max_tool_failures: Option<u32>,
    /// Time per tool call.
    #[serde(default, with = "humantime_option")]
    pub tool_timeout: Option<Duration>,
    /// Time per run.
    #[serde(default, with = "humantime_option")]
    pub run_timeout: Option<Duration>,
    /// Tokens per run.
    pub max_total_tokens: Option<u64>,
}

mod humantime_option {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer};

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
        Option::<String>::deserialize(d)?
            .map(|s| humantime::parse_duration(&s).map_err(serde::de::Error::custom))
            .transpose()
    }
}

/// One `[[token]]` entry.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct Entry {
    principal: String,
    /// `None`: the principal authenticates by client certificate only.
    sha256: Option<String>,
    tools: Option<Vec<String>>,
    max_runs: Option<usize>,
    max_queued: Option<usize>,
    weight: Option<u32>,
    tokens_per_hour: Option<u64>,
    #[serde(default)]
    limits: LimitCeilings,
    #[serde(default)]
    roles: Vec<String>,
}

/// The roles a tokens file may give.
pub const ROLES: &[&str] = &[APPROVER, OPERATOR];
/// Decides tool calls waiting for approval in any caller's run (not only its own).
pub const APPROVER: &str = "approver";
/// Finds every caller's runs (`ListRuns`), not only its own: the people who run the service.
pub const OPERATOR: &str = "operator";

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct TokensFile {
    #[serde(default)]
    token: Vec<Entry>,
}

/// An authenticated caller and what it may do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Principal {
    /// Its name; empty for the anonymous caller of a server without authentication.
    pub name: String,
    /// The caller of a server that authenticates nobody, or the service acting for itself: it
    /// sees and may do everything. Only [`Principal::anonymous`] makes one, so no credential can
    /// name its way into it.
    pub anonymous: Anonymous,
    /// The tools it may use (`*` globs); `None`: every tool.
    pub tools: Option<Vec<String>>,
    /// Its runs in flight at once; `None`: only the server's limit.
    pub max_runs: Option<usize>,
    /// Its runs waiting for a slot at once; `None`: the server's limit.
    pub max_queued: Option<usize>,
    /// Its share of the slots when runs wait for them (`None`: 1).
    pub weight: Option<u32>,
    /// Tokens its runs may spend per hour, all together (`None`: no such budget).
    pub tokens_per_hour: Option<u64>,
    /// Its ceilings on request limits.
    pub limits: LimitCeilings,
    /// Its roles (see [`ROLES`]).
    pub roles: Vec<String>,
}

/// Whether a principal is [`Principal::anonymous`]: a value no name or credential produces (its
/// field is private: only this module sets it).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Anonymous(bool);

impl Principal {
    /// A caller known only by name, with no restriction of its own.
    pub fn unrestricted(name: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            anonymous: Anonymous(false),
            tools: None,
            max_runs: None,
            max_queued: None,
            weight: None,
            tokens_per_hour: None,
            limits: LimitCeilings::default(),
            roles: Vec::new(),
        }
    }

    /// The caller of a server without authentication (or the service acting for itself): no
    /// name, and it sees and may do everything.
    pub fn anonymous() -> Self {
        Self {
            anonymous: Anonymous(true),
            ..Self::unrestricted("")
        }
    }

    /// Whether it is [`Principal::anonymous`]: no authentication, not a name.
    pub fn is_anonymous(&self) -> bool {
        self.anonymous.0
    }

    /// Whether it holds `role`.
    pub fn has_role(&self, role: &str) -> bool {
        self.roles.iter().any(|r| r == role)
    }

    /// Whether it may use the tool `name`.
    pub fn may_use(&self, name: &str) -> bool {
        self.tools
            .as_ref()
            .is_none_or(|patterns| patterns.iter().any(|p| glob_match(p, name)))
    }
}

/// Whether `name` matches `pattern`, where `*` stands for any run of characters.
pub fn glob_match(pattern: &str, name: &str) -> bool {
    let mut parts = pattern.split('*');
    let first = parts.next().unwrap_or_default();
    let Some(mut rest) = name.strip_prefix(first) else {
        return false;
    };
    let parts: Vec<&str> = parts.collect();
    let Some((last, middle)) = parts.split_last() else {
        return rest.is_empty();
    };
    for part in middle {
        match rest.find(part) {
            Some(at) => rest = &rest[at + part.len()..],
            None => return false,
        }
    }
    rest.ends_with(last)
}

/// The SHA-256 of a token, as the tokens file writes it (lowercase hex).
pub fn token_sha256(token: &str) -> String {
    Sha256::digest(token.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// The principals of a tokens file, by token hash and by name.
#[derive(Debug, Default)]
struct Table {
    by_hash: HashMap<String, Arc<Principal>>,
    by_name: HashMap<String, Arc<Principal>>,
    source: Vec<u8>,
}

/// A tokens file that cannot be used.
#[derive(Debug, thiserror::Error)]
#[error("--auth-tokens {}: {reason}", path.display())]
pub struct TokensError {
    /// The file.
    pub path: PathBuf,
    /// What is wrong.
    pub reason: String,
}

/// Whether `name` may name a principal: 1 to [`MAX_PRINCIPAL_LEN`] printable characters, not
/// all of them blank (an empty name is no one, never everyone).
pub fn is_principal_name(name: &str) -> bool {
    !name.trim().is_empty() && name.len() <= MAX_PRINCIPAL_LEN && !name.chars().any(char::is_control)
}

fn check_entry(entry: &Entry) -> Result<(), String> {
    let name = &entry.principal;
    if !is_principal_name(name) {
        return Err(format!(
            "principal {name:?} must be 1 to {MAX_PRINCIPAL_LEN} printable characters, not all blank"
        ));
    }
    if let Some(hash) = &entry.sha256
        && (hash.len() != 64 || !hash.bytes().all(|b| b.is_ascii_hexdigit()))
    {
        return Err(format!(
            "principal {name:?}: sha256 must be 64 hex digits (printf %s \"$TOKEN\" | sha256sum)"
        ));
    }
    if entry.max_runs == Some(0) {
        return Err(format!("principal {name:?}: max_runs must be at least 1"));
    }
    if entry.weight.is_some_and(|w| !(1..=MAX_WEIGHT).contains(&w)) {
        return Err(format!("principal {name:?}: weight must be from 1 to {MAX_WEIGHT}"));
    }
    if let Some(role) = entry.roles.iter().find(|r| !ROLES.contains(&r.as_str())) {
        return Err(format!(
            "principal {name:?}: unknown role {role:?} (known: {})",
            ROLES.join(", ")
        ));
    }
    Ok(())
}

impl Table {
    fn parse(path: &Path, source: Vec<u8>) -> Result<Self, TokensError> {
        let error = |reason: String| TokensError {
            path: path.to_owned(),
            reason,
        };
        let text = std::str::from_utf8(&source).map_err(|e| error(format!("not UTF-8: {e}")))?;
        let file: TokensFile = toml::from_str(text).map_err(|e| error(e.to_string()))?;
        if file.token.len() > MAX_TOKENS {
            return Err(error(format!("more than {MAX_TOKENS} [[token]] entries")));
        }
        let mut table = Self::default();
        for entry in file.token {
            check_entry(&entry).map_err(error)?;
            let principal = Arc::new(Principal {
                name: entry.principal.clone(),
                anonymous: Anonymous(false),
                tools: entry.tools,
                max_runs: entry.max_runs,
                max_queued: entry.max_queued,
                weight: entry.weight,
                tokens_per_hour: entry.tokens_per_hour,
                limits: entry.limits,
                roles: entry.roles,
            });
            if let Some(hash) = entry.sha256 {
                let hash = hash.to_ascii_lowercase();
                if table.by_hash.insert(hash, Arc::clone(&principal)).is_some() {
                    return Err(error(format!(
                        "principal {:?}: the same sha256 appears twice",
                        entry.principal
                    )));
                }
            }
            table.by_name.entry(entry.principal).or_insert(principal);
        }
        table.source = source;
        Ok(table)
    }
}

fn read_file(path: &Path) -> Result<Vec<u8>, TokensError> {
    let error = |reason: String| TokensError {
        path: path.to_owned(),
        reason,
    };
    let meta = std::fs::metadata(path).map_err(|e| error(e.to_string()))?;
    if meta.len() > MAX_FILE_BYTES {
        return Err(error(format!("larger than {MAX_FILE_BYTES} bytes")));
    }
    std::fs::read(path).map_err(|e| error(e.to_string()))
}

/// Why a request was not admitted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AuthError {
    /// No credentials, or unknown ones.
    #[error("{0}")]
    Unauthenticated(String),
    /// Known credentials that this server does not admit.
    #[error("{0}")]
    PermissionDenied(String),
}

impl From<AuthError> for tonic::Status {
    fn from(e: AuthError) -> Self {
        match e {
            AuthError::Unauthenticated(m) => Self::unauthenticated(m),
            AuthError::PermissionDenied(m) => Self::permission_denied(m),
        }
    }
}

/// Checks the credentials of requests.
pub struct Authenticator {
    tokens: Option<PathBuf>,
    table: RwLock<Arc<Table>>,
    from_cert: bool,
}

impl Authenticator {
    /// Checks bearer tokens against the file `tokens` and/or takes the principal from a
    /// verified client certificate (`from_cert`); `None` when neither is asked (no auth).
    pub fn new(tokens: Option<&Path>, from_cert: bool) -> Result<Option<Arc<Self>>, TokensError> {
        if tokens.is_none() && !from_cert {
            return Ok(None);
        }
        let table = match tokens {
            Some(path) => Table::parse(path, read_file(path)?)?,
            None => Table::default(),
        };
        Ok(Some(Arc::new(Self {
            tokens: tokens.map(Path::to_owned),
            table: RwLock::new(Arc::new(table)),
            from_cert,
        })))
    }

    fn table(&self) -> Arc<Table> {
        Arc::clone(&crate::sync::read(&self.table))
    }

    /// Reads the tokens file again and uses it when it changed (`Ok(true)`); on an error the
    /// previous tokens stay.
    pub fn reload_if_changed(&self) -> Result<bool, TokensError> {
        let Some(path) = &self.tokens else { return Ok(false) };
        let source = read_file(path)?;
        if source == self.table().source {
            return Ok(false);
        }
        let table = Table::parse(path, source)?;
        *crate::sync::write(&self.table) = Arc::new(table);
        Ok(true)
    }

    /// Checks the tokens file every `interval` until the handle is dropped.
    pub fn watch(self: &Arc<Self>, interval: Duration) -> Option<AbortOnDrop> {
        self.tokens.as_ref()?;
        let auth = Arc::clone(self);
        Some(AbortOnDrop(tokio::spawn(async move {
            let mut ticker = tokio::time::interval(interval);
            ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            ticker.tick().await;
            loop {
                ticker.tick().await;
                match auth.reload_if_changed() {
                    Ok(true) => tracing::info!("--auth-tokens changed; new requests use the new tokens"),
                    Ok(false) => {}
                    Err(e) => tracing::warn!("keeping the previous tokens: {e}"),
                }
            }
        })))
    }

    /// The principal of a request with `headers`, over a connection from `peer`.
    pub fn authenticate(
        &self,
        headers: &http::HeaderMap,
        peer: Option<&PeerInfo>,
    ) -> Result<Arc<Principal>, AuthError> {
        if let Some(value) = headers.get(http::header::AUTHORIZATION) {
            return self.by_token(value);
        }
        let subject = peer.and_then(|p| p.client_subject.as_deref());
        match subject {
            Some(subject) if self.from_cert => self.by_certificate(subject),
            _ => Err(AuthError::Unauthenticated(if self.from_cert {
                "credentials required: `authorization: Bearer <token>` metadata or a client certificate".into()
            } else {
                "credentials required: `authorization: Bearer <token>` metadata".into()
            })),
        }
    }

    fn by_token(&self, value: &http::HeaderValue) -> Result<Arc<Principal>, AuthError> {
        let token = value
            .to_str()
            .ok()
            .and_then(|v| v.strip_prefix("Bearer ").or_else(|| v.strip_prefix("bearer ")))
            .map(str::trim)
            .filter(|t| !t.is_empty())
            .ok_or_else(|| AuthError::Unauthenticated("authorization metadata must be `Bearer <token>`".into()))?;
        self.table()
            .by_hash
            .get(&token_sha256(token))
            .cloned()
            .ok_or_else(|| AuthError::Unauthenticated("the bearer token is not valid for this server".into()))
    }

    /// The principal of the token whose SHA-256 is `sha256` (a session that signed in with that
    /// token, checked again on each request: a token taken out of the file ends its sessions).
    pub fn by_token_sha256(&self, sha256: &str) -> Result<Arc<Principal>, AuthError> {
        self.table().by_hash.get(sha256).cloned().ok_or_else(|| {
            AuthError::Unauthenticated("the token signed in with is no longer valid for this server".into())
        })
    }

    /// The principal a verified client certificate's `subject` names, when certificates sign in
    /// (`--auth-principal-from-cert`).
    pub fn by_subject(&self, subject: &str) -> Result<Arc<Principal>, AuthError> {
        match self.from_cert {
            true => self.by_certificate(subject),
            false => Err(AuthError::Unauthenticated(
                "this server does not take client certificates as credentials".into(),
            )),
        }
    }

    fn by_certificate(&self, subject: &str) -> Result<Arc<Principal>, AuthError> {
        if !is_principal_name(subject) {
            return Err(AuthError::Unauthenticated(format!(
                "the client certificate's subject {:?} names no principal: give it a common name of 1 to {MAX_PRINCIPAL_LEN} printable characters, or use a bearer token",
                crate::text::excerpt(subject)
            )));
        }
        if self.tokens.is_none() {
            return Ok(Arc::new(Principal::unrestricted(subject)));
        }
        self.table().by_name.get(subject).cloned().ok_or_else(|| {
            AuthError::PermissionDenied(format!(
                "the client certificate's subject {subject:?} is not a principal of this server"
            ))
        })
    }
}

/// The gRPC path prefix left open to unauthenticated callers (probes).
const HEALTH_PREFIX: &str = "/grpc.health.v1.Health/";

/// The gate applying an [`Authenticator`] to every method but health (as a tower layer:
/// `GateLayer(AuthGate::new(..))`).
#[derive(Clone)]
pub struct AuthGate {
    auth: Option<Arc<Authenticator>>,
    refused_metric: &'static str,
}

impl AuthGate {
    /// `auth` (`None`: every caller is admitted as the anonymous principal); refusals are
    /// counted in the counter `refused_metric` by code.
    pub fn new(auth: Option<Arc<Authenticator>>, refused_metric: &'static str) -> Self {
        Self { auth, refused_metric }
    }
}

impl Gate for AuthGate {
    type Pass = ();

    fn admit<B>(&self, request: &mut http::Request<B>) -> Result<(), tonic::Status> {
        let principal = match &self.auth {
            None => Ok(Arc::new(Principal::anonymous())),
            Some(_) if request.uri().path().starts_with(HEALTH_PREFIX) => Ok(Arc::new(Principal::anonymous())),
            Some(auth) => auth.authenticate(request.headers(), request.extensions().get::<PeerInfo>()),
        };
        match principal {
            Ok(principal) => {
                request.extensions_mut().insert(principal);
                Ok(())
            }
            Err(refusal) => {
                let code = match refusal {
                    AuthError::Unauthenticated(_) => "unauthenticated",
                    AuthError::PermissionDenied(_) => "permission_denied",
                };
                metrics::counter!(self.refused_metric, "code" => code).increment(1);
                tracing::info!(path = request.uri().path(), code, "request refused: {refusal}");
                Err(refusal.into())
            }
        }
    }
}

/// The caller of a request, as [`AuthGate`] admitted it (the anonymous caller when the server
/// does not authenticate).
pub fn caller<T>(request: &tonic::Request<T>) -> Arc<Principal> {
    request
        .extensions()
        .get::<Arc<Principal>>()
        .cloned()
        .unwrap_or_else(|| Arc::new(Principal::anonymous()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn globs() {
        for (pattern, name, expected) in [
            ("calculate", "calculate", true),
            ("calculate", "calculate2", false),
            ("time_*", "time_now", true),
            ("time_*", "time_", true),
            ("time_*", "timer", false),
            ("*", "anything", true),
            ("*_now", "time_now", true),
            ("a*b*c", "axxbyyc", true),
            ("a*b*c", "axxcyyb", false),
            ("a*a", "a", false),
        ] {
            assert_eq!(glob_match(pattern, name), expected, "{pattern} ~ {name}");
        }
    }

    fn file(text: &str) -> (tempfile::NamedTempFile, Result<Option<Arc<Authenticator>>, TokensError>) {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        std::io::Write::write_all(&mut f, text.as_bytes()).unwrap();
        let auth = Authenticator::new(Some(f.path()), false);
        (f, auth)
    }

    fn bearer(token: &str) -> http::HeaderMap {
        let mut headers = http::HeaderMap::new();
        headers.insert(http::header::AUTHORIZATION, format!("Bearer {token}").parse().unwrap());
        headers
    }

    #[test]
    fn tokens_are_checked_by_their_hash() {
        let text = format!(
            "[[token]]\nprincipal = \"billing\"\nsha256 = \"{}\"\ntools = [\"time_*\"]\nmax_runs = 2\n[token.limits]\nrun_timeout = \"2m\"\n",
            token_sha256("s3cret")
        );
        let (_f, auth) = file(&text);
        let auth = auth.unwrap().unwrap();
        let p = auth.authenticate(&bearer("s3cret"), None).unwrap();
        assert_eq!(p.name, "billing");
        assert_eq!(p.max_runs, Some(2));
        assert_eq!(p.limits.run_timeout, Some(Duration::from_secs(120)));
        assert!(p.may_use("time_now") && !p.may_use("calculate"));
        let wrong = auth.authenticate(&bearer("other"), None).unwrap_err();
        assert!(matches!(wrong, AuthError::Unauthenticated(_)));
        let none = auth.authenticate(&http::HeaderMap::new(), None).unwrap_err();
        assert!(matches!(none, AuthError::Unauthenticated(m) if m.contains("Bearer")));
        let mut basic = http::HeaderMap::new();
        basic.insert(http::header::AUTHORIZATION, "Basic eA==".parse().unwrap());
        assert!(auth.authenticate(&basic, None).is_err());
    }

    #[test]
    fn bad_files_are_refused_with_the_reason() {
        for (text, expected) in [
            ("[[token]]\nprincipal = \"a\"\nsha256 = \"abc\"\n", "64 hex digits"),
            ("[[token]]\nprincipal = \"\"\n", "printable"),
            ("[[token]]\nprincipal = \"a\"\ntool = [\"x\"]\n", "unknown field"),
            ("[[token]]\nprincipal = \"a\"\nmax_runs = 0\n", "at least 1"),
            (
                "[[token]]\nprincipal = \"a\"\nweight = 0\n",
                "weight must be from 1 to 1000",
            ),
            (
                "[[token]]\nprincipal = \"a\"\nweight = 1001\n",
                "weight must be from 1 to 1000",
            ),
        ] {
            let (_f, auth) = file(text);
            let e = auth.err().unwrap().to_string();
            assert!(e.contains(expected), "{text}: {e}");
        }
    }

    #[test]
    fn an_empty_or_blank_certificate_subject_is_no_one() {
        let auth = Authenticator::new(None, true).unwrap().unwrap();
        for subject in ["", "   ", "\t"] {
            let refused = auth.by_subject(subject).unwrap_err();
            assert!(
                matches!(&refused, AuthError::Unauthenticated(m) if m.contains("names no principal")),
                "{subject:?}: {refused:?}"
            );
        }
        let carol = auth.by_subject("carol").unwrap();
        assert_eq!(carol.name, "carol");
        assert!(!carol.is_anonymous() && Principal::anonymous().is_anonymous());
        assert!(
            !Principal::unrestricted("").is_anonymous(),
            "no name makes the anonymous caller"
        );
    }

    #[test]
    fn certificate_subjects_need_an_entry_when_there_is_a_file() {
        let peer = PeerInfo {
            remote_addr: None,
            client_subject: Some("orchestrator".into()),
        };
        let open = Authenticator::new(None, true).unwrap().unwrap();
        assert_eq!(
            open.authenticate(&http::HeaderMap::new(), Some(&peer)).unwrap().name,
            "orchestrator"
        );
        let mut f = tempfile::NamedTempFile::new().unwrap();
        std::io::Write::write_all(&mut f, b"[[token]]\nprincipal = \"someone-else\"\n").unwrap();
        let listed = Authenticator::new(Some(f.path()), true).unwrap().unwrap();
        let refused = listed.authenticate(&http::HeaderMap::new(), Some(&peer)).unwrap_err();
        assert!(matches!(refused, AuthError::PermissionDenied(_)));
    }
}
