//! Who is signed in to the console: a person signs in with a token of the tokens file (or a
//! verified client certificate, or nothing on a server without authentication) and gets a
//! session cookie. The cookie carries the session itself, signed (HMAC-SHA256) with a secret
//! every replica may share (`--console-session-key-file`), so any replica behind the Service
//! takes it: who signed in and how (the token's SHA-256, never the token), when it expires, and
//! the CSRF token its forms must send back, its id and when it was issued. Each request checks the
//! credentials again, so a token taken out of the tokens file ends its sessions at once; a
//! session lasts `--console-session-ttl` from its issue as the setting is now (lowering it
//! shortens sessions signed in before); signing out ends the session on every replica (its id
//! goes to the [`SignOuts`] store the replicas share).

use std::sync::Arc;
use std::time::Duration;

use aws_lc_rs::hmac;
use axum::http::HeaderMap;
use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD as B64;
use serde::{Deserialize, Serialize};
use shared::auth::{AuthError, Authenticator, Principal};
use shared::tls::PeerInfo;

use crate::Error;
use crate::config::ConsoleSettings;
use crate::domain::ports::{SignOuts, within};

/// The shortest session secret taken from a file.
const MIN_KEY_BYTES: usize = 32;
/// The longest cookie header read.
const MAX_COOKIE_BYTES: usize = 8 * 1024;

/// What a session cookie says, signed.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Claims {
    /// The principal's name.
    sub: String,
    /// How it signed in: the SHA-256 of its token, or the subject of its certificate (neither:
    /// a server without authentication).
    tok: Option<String>,
    cert: Option<String>,
    /// The session's id: what signing out ends.
    sid: String,
    /// Issued at, Unix seconds: the session ends `--console-session-ttl` after it, as the
    /// setting is when the session is used.
    iat: u64,
    /// Expiry, Unix seconds (as the setting was at sign-in).
    exp: u64,
    /// The CSRF token its state-changing requests carry in `x-csrf-token`.
    csrf: String,
}

impl Claims {
    /// When the session ends under `ttl`: at its expiry, or sooner when `ttl` was lowered since.
    fn ends_at(&self, ttl: Duration) -> u64 {
        self.exp.min(self.iat.saturating_add(ttl.as_secs()))
    }
}

/// A signed-in person: who, and the CSRF token of the session.
#[derive(Debug, Clone)]
pub(super) struct Session {
    pub id: String,
    pub principal: Arc<Principal>,
    pub csrf: String,
    pub expires_at: u64,
}

/// Signs sessions in and checks them.
pub(super) struct Sessions {
    key: hmac::Key,
    ttl: Duration,
    auth: Option<Arc<Authenticator>>,
    /// The console is reached over HTTPS (its own TLS, or `--console-public-url https://…`): the
    /// cookie is `Secure` and `__Host-` prefixed.
    secure: bool,
    /// The sessions people ended.
    sign_outs: Arc<dyn SignOuts>,
    /// How long reading or writing `sign_outs` may take.
    store_timeout: Duration,
}

impl Sessions {
    /// Sessions lasting `--console-session-ttl`, signed with the file's secret or one of this
    /// process.
    pub(super) fn new(
        settings: &ConsoleSettings,
        auth: Option<Arc<Authenticator>>,
        secure: bool,
        (sign_outs, store_timeout): (Arc<dyn SignOuts>, Duration),
    ) -> Result<Self, Error> {
        let secret = match &settings.console_session_key_file {
            Some(path) => read_secret(path)?,
            None => {
                let mut secret = vec![0u8; MIN_KEY_BYTES];
                aws_lc_rs::rand::fill(&mut secret)
                    .map_err(|_| Error::Config("no randomness for the console's session secret".into()))?;
                secret
            }
        };
        Ok(Self {
            key: hmac::Key::new(hmac::HMAC_SHA256, &secret),
            ttl: settings.console_session_ttl,
            auth,
            secure,
            sign_outs,
            store_timeout,
        })
    }

    /// Whether signing in needs credentials.
    pub(super) fn authenticates(&self) -> bool {
        self.auth.is_some()
    }

    /// Signs in with `token` (or the connection's client certificate, or as the anonymous
    /// caller of a server without authentication): the session and its `Set-Cookie` value.
    pub(super) fn sign_in(&self, token: Option<&str>, peer: Option<&PeerInfo>) -> Result<(Session, String), AuthError> {
        let (principal, tok, cert) = self.credentials(token, peer)?;
        let now = shared::sync::unix_ms() / 1000;
        let claims = Claims {
            sub: principal.name.clone(),
            tok,
            cert,
            sid: random_token()?,
            iat: now,
            exp: now + self.ttl.as_secs(),
            csrf: random_token()?,
        };
        let cookie = self.cookie(&self.seal(&claims), self.ttl.as_secs());
        let session = Session {
            id: claims.sid,
            principal,
            csrf: claims.csrf,
            expires_at: claims.exp,
        };
        Ok((session, cookie))
    }

    /// How `token` (or the connection's client certificate) signs in: the token's SHA-256 or
    /// the certificate's subject (neither on a server without authentication), and who that is.
    #[allow(clippy::type_complexity)]
    fn credentials(
        &self,
        token: Option<&str>,
        peer: Option<&PeerInfo>,
    ) -> Result<(Arc<Principal>, Option<String>, Option<String>), AuthError> {
        if self.auth.is_none() {
            return Ok((Arc::new(Principal::anonymous()), None, None));
        }
        let tok = token
            .map(str::trim)
            .filter(|t| !t.is_empty())
            .map(shared::auth::token_sha256);
        let cert = match tok {
            Some(_) => None,
            None => peer.and_then(|p| p.client_subject.clone()),
        };
        let principal = self.principal(tok.as_deref(), cert.as_deref()).map_err(|e| match tok {
            Some(_) => AuthError::Unauthenticated("the token is not valid for this server".into()),
            None => e,
        })?;
        Ok((principal, tok, cert))
    }

    /// Who signed in with the token whose SHA-256 is `tok`, or the certificate naming `cert`: the
    /// one rule of a sign-in and of every request after it.
    fn principal(&self, tok: Option<&str>, cert: Option<&str>) -> Result<Arc<Principal>, AuthError> {
        let Some(auth) = &self.auth else {
            return Ok(Arc::new(Principal::anonymous()));
        };
        match (tok, cert) {
            (Some(sha), _) => auth.by_token_sha256(sha),
            (None, Some(subject)) => auth.by_subject(subject),
            (None, None) => Err(AuthError::Unauthenticated("sign in with a token".into())),
        }
    }

    /// The session a request's cookie carries: not expired, not signed out, its credentials
    /// still good. A store of sign-outs that cannot be read refuses it (the console fails
    /// closed).
    pub(super) async fn session(&self, headers: &HeaderMap) -> Result<Session, AuthError> {
        let sealed = self
            .cookie_value(headers)
            .ok_or_else(|| AuthError::Unauthenticated("not signed in".into()))?;
        let claims = self
            .open(&sealed)
            .ok_or_else(|| AuthError::Unauthenticated("the session is not valid here: sign in again".into()))?;
        let ends_at = claims.ends_at(self.ttl);
        if ends_at <= shared::sync::unix_ms() / 1000 {
            return Err(AuthError::Unauthenticated(
                "the session has expired: sign in again".into(),
            ));
        }
        let principal = self.principal(claims.tok.as_deref(), claims.cert.as_deref())?;
        if principal.name != claims.sub {
            return Err(AuthError::Unauthenticated(
                "the session's credentials changed hands: sign in again".into(),
            ));
        }
        match within(self.store_timeout, self.sign_outs.ended(&claims.sid)).await {
            Ok(false) => {}
            Ok(true) => return Err(AuthError::Unauthenticated("signed out: sign in again".into())),
            Err(e) => {
                tracing::warn!("console sessions cannot be checked against sign-outs: {e}");
                return Err(AuthError::Unauthenticated(
                    "the session cannot be checked now: try again shortly".into(),
                ));
            }
        }
        Ok(Session {
            id: claims.sid,
            principal,
            csrf: claims.csrf,
            expires_at: ends_at,
        })
    }

    /// Ends `session` on every replica; the `Set-Cookie` value that ends it in the browser.
    pub(super) async fn sign_out(&self, session: &Session) -> Result<String, AuthError> {
        within(self.store_timeout, self.sign_outs.end(&session.id, session.expires_at))
            .await
            .map_err(|e| AuthError::Unauthenticated(format!("signing out failed, try again: {e}")))?;
        Ok(self.cookie("", 0))
    }

    fn cookie_name(&self) -> &'static str {
        match self.secure {
            true => "__Host-orchestrator-console",
            false => "orchestrator-console",
        }
    }

    fn cookie(&self, value: &str, max_age: u64) -> String {
        let secure = if self.secure { "; Secure" } else { "" };
        format!(
            "{}={value}; Path=/; HttpOnly; SameSite=Strict; Max-Age={max_age}{secure}",
            self.cookie_name()
        )
    }

    /// The value of this console's cookie among a request's cookies.
    fn cookie_value(&self, headers: &HeaderMap) -> Option<String> {
        let name = self.cookie_name();
        headers
            .get_all(axum::http::header::COOKIE)
            .iter()
            .filter(|v| v.len() <= MAX_COOKIE_BYTES)
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(';'))
            .filter_map(|pair| pair.trim().split_once('='))
            .find(|(n, _)| *n == name)
            .map(|(_, value)| value.to_owned())
    }

    /// `claims` as `payload.signature`.
    fn seal(&self, claims: &Claims) -> String {
        let payload = B64.encode(serde_json::to_vec(claims).unwrap_or_default());
        let tag = hmac::sign(&self.key, payload.as_bytes());
        format!("{payload}.{}", B64.encode(tag.as_ref()))
    }

    /// The claims of a sealed value whose signature holds.
    fn open(&self, sealed: &str) -> Option<Claims> {
        let (payload, tag) = sealed.split_once('.')?;
        let tag = B64.decode(tag).ok()?;
        hmac::verify(&self.key, payload.as_bytes(), &tag).ok()?;
        serde_json::from_slice(&B64.decode(payload).ok()?).ok()
    }
}

/// 16 random bytes, URL-safe base64.
fn random_token() -> Result<String, AuthError> {
    let mut bytes = [0u8; 16];
    aws_lc_rs::rand::fill(&mut bytes).map_err(|_| AuthError::Unauthenticated("no randomness".into()))?;
    Ok(B64.encode(bytes))
}

/// The session secret in `path`: its bytes, surrounding whitespace left out.
fn read_secret(path: &std::path::Path) -> Result<Vec<u8>, Error> {
    let flag = shared::config::flag::<ConsoleSettings>("console_session_key_file");
    let bytes = std::fs::read(path).map_err(|e| Error::Config(format!("{flag} {}: {e}", path.display())))?;
    let secret = bytes.trim_ascii().to_vec();
    if secret.len() < MIN_KEY_BYTES {
        return Err(Error::Config(format!(
            "{flag} {} holds {} bytes: a session secret needs at least {MIN_KEY_BYTES} (e.g. `head -c 48 /dev/urandom | base64`)",
            path.display(),
            secret.len()
        )));
    }
    Ok(secret)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::memory::MemorySignOuts;

    fn settings(ttl: Duration) -> ConsoleSettings {
        ConsoleSettings {
            console_session_ttl: ttl,
            ..crate::Config::default().console
        }
    }

    fn store() -> (Arc<dyn SignOuts>, Duration) {
        (Arc::new(MemorySignOuts::default()), Duration::from_secs(5))
    }

    fn sessions(ttl: Duration, auth: Option<Arc<Authenticator>>, secure: bool) -> Sessions {
        Sessions::new(&settings(ttl), auth, secure, store()).unwrap()
    }

    fn tokens(dir: &std::path::Path) -> Arc<Authenticator> {
        let path = dir.join("tokens.toml");
        let text = format!(
            "[[token]]\nprincipal = \"ann\"\nsha256 = \"{}\"\n",
            shared::auth::token_sha256("ann-token")
        );
        std::fs::write(&path, text).unwrap();
        Authenticator::new(Some(&path), false).unwrap().unwrap()
    }

    fn with_cookie(set_cookie: &str) -> HeaderMap {
        let pair = set_cookie.split(';').next().unwrap();
        let mut headers = HeaderMap::new();
        headers.insert(axum::http::header::COOKIE, format!("other=1; {pair}").parse().unwrap());
        headers
    }

    #[tokio::test]
    async fn a_token_signs_in_and_the_cookie_brings_the_same_person_back() {
        let dir = tempfile::tempdir().unwrap();
        let sessions = sessions(Duration::from_secs(3600), Some(tokens(dir.path())), false);
        assert!(sessions.sign_in(Some("wrong"), None).is_err());
        assert!(sessions.sign_in(None, None).is_err());
        let (session, cookie) = sessions.sign_in(Some("ann-token"), None).unwrap();
        assert_eq!(session.principal.name, "ann");
        assert!(cookie.contains("HttpOnly") && cookie.contains("SameSite=Strict") && !cookie.contains("Secure"));
        assert!(!cookie.contains("ann-token"), "the token never goes into the cookie");
        let back = sessions.session(&with_cookie(&cookie)).await.unwrap();
        assert_eq!(
            (back.principal.name.as_str(), back.csrf, back.id),
            ("ann", session.csrf, session.id)
        );
    }

    #[tokio::test]
    async fn a_cookie_changed_or_signed_elsewhere_or_expired_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let auth = tokens(dir.path());
        let here = sessions(Duration::from_secs(3600), Some(Arc::clone(&auth)), true);
        let (_, cookie) = here.sign_in(Some("ann-token"), None).unwrap();
        assert!(cookie.starts_with("__Host-") && cookie.contains("; Secure"));
        let tampered = cookie.replacen('.', "x.", 1);
        assert!(here.session(&with_cookie(&tampered)).await.is_err());
        let elsewhere = sessions(Duration::from_secs(3600), Some(auth), true);
        assert!(
            elsewhere.session(&with_cookie(&cookie)).await.is_err(),
            "another secret"
        );
        let now = shared::sync::unix_ms() / 1000;
        let claims = |iat: u64, exp: u64| Claims {
            sub: "ann".into(),
            tok: Some(shared::auth::token_sha256("ann-token")),
            cert: None,
            sid: "s1".into(),
            iat,
            exp,
            csrf: "c".into(),
        };
        let sealed = here.cookie(&here.seal(&claims(0, 1)), 60);
        let refused = here.session(&with_cookie(&sealed)).await.unwrap_err();
        assert!(refused.to_string().contains("expired"), "{refused}");
        // Issued two hours ago for a day: a TTL lowered to one hour ends it; two hours and more do not.
        let sealed = here.cookie(&here.seal(&claims(now - 7200, now + 86_400)), 60);
        assert!(here.session(&with_cookie(&sealed)).await.is_err(), "a lowered TTL");
        let longer = sessions(Duration::from_secs(7300), Some(tokens(dir.path())), true);
        let sealed = longer.cookie(&longer.seal(&claims(now - 7200, now + 86_400)), 60);
        assert!(
            longer.session(&with_cookie(&sealed)).await.is_ok(),
            "within the TTL as it is now"
        );
    }

    #[tokio::test]
    async fn signing_out_ends_the_session_everywhere_the_store_is_shared() {
        let dir = tempfile::tempdir().unwrap();
        let auth = tokens(dir.path());
        let key = dir.path().join("key");
        std::fs::write(&key, "a-secret-of-more-than-thirty-two-bytes\n").unwrap();
        let mut shared_key = settings(Duration::from_secs(3600));
        shared_key.console_session_key_file = Some(key);
        let sign_outs = store();
        let one = Sessions::new(&shared_key, Some(Arc::clone(&auth)), false, sign_outs.clone()).unwrap();
        let two = Sessions::new(&shared_key, Some(auth), false, sign_outs).unwrap();
        let (_, cookie) = one.sign_in(Some("ann-token"), None).unwrap();
        let (_, other) = one.sign_in(Some("ann-token"), None).unwrap();
        let session = two.session(&with_cookie(&cookie)).await.unwrap();
        two.sign_out(&session).await.unwrap();
        let refused = one.session(&with_cookie(&cookie)).await.unwrap_err();
        assert!(refused.to_string().contains("signed out"), "{refused}");
        assert!(
            one.session(&with_cookie(&other)).await.is_ok(),
            "another session goes on"
        );
    }

    #[tokio::test]
    async fn a_token_taken_out_of_the_file_ends_its_sessions() {
        let dir = tempfile::tempdir().unwrap();
        let auth = tokens(dir.path());
        let sessions = sessions(Duration::from_secs(3600), Some(Arc::clone(&auth)), false);
        let (_, cookie) = sessions.sign_in(Some("ann-token"), None).unwrap();
        std::fs::write(dir.path().join("tokens.toml"), "").unwrap();
        auth.reload_if_changed().unwrap();
        assert!(sessions.session(&with_cookie(&cookie)).await.is_err());
    }

    #[tokio::test]
    async fn a_shared_secret_lets_every_replica_take_the_session_and_a_short_one_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let key = dir.path().join("key");
        std::fs::write(&key, "short").unwrap();
        let mut shared_key = settings(Duration::from_secs(60));
        shared_key.console_session_key_file = Some(key.clone());
        let refused = Sessions::new(&shared_key, None, false, store())
            .err()
            .map(|e| e.to_string());
        assert!(refused.is_some_and(|e| e.contains("at least 32")));
        std::fs::write(&key, "a-secret-of-more-than-thirty-two-bytes\n").unwrap();
        let (one, two) = (
            Sessions::new(&shared_key, None, false, store()).unwrap(),
            Sessions::new(&shared_key, None, false, store()).unwrap(),
        );
        let (_, cookie) = one.sign_in(None, None).unwrap();
        assert!(
            two.session(&with_cookie(&cookie))
                .await
                .unwrap()
                .principal
                .is_anonymous()
        );
    }
}
