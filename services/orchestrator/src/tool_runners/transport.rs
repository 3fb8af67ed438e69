//! How calls reach the tool-runners: plaintext, or TLS trusting `--tool-runner-ca` and, for
//! runners that require mTLS, presenting `--tool-runner-cert`; and the bearer token of
//! `--tool-runner-token-file` for runners started with `--auth-tokens`.
//!
//! `https://host:port` targets use TLS and check the certificate against `host`; `dns:///name:port`
//! targets use TLS whenever a CA is given, connect to each address and check the certificate
//! against `name` (a Kubernetes headless Service's name, which the runners' certificate carries).
//!
//! The files are read again when they change ([`files_digest`], checked by the membership task):
//! cert-manager rotates the client certificate in place, and a rotated token file takes effect
//! without a restart.

use std::hash::{DefaultHasher, Hash, Hasher};
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use tonic::metadata::{Ascii, MetadataValue};
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity};

use crate::Error;
use crate::config::ToolRunnerSettings;

/// Connect timeout per endpoint.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// The largest token file read.
const MAX_TOKEN_BYTES: u64 = 16 * 1024;
/// How much of each file the change check reads.
const MAX_DIGEST_BYTES: u64 = 4 * 1024 * 1024;

/// See the module docs.
#[derive(Clone, Default)]
pub(super) struct Transport {
    tls: Option<ClientTlsConfig>,
    token: Option<MetadataValue<Ascii>>,
}

impl std::fmt::Debug for Transport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Transport")
            .field("tls", &self.tls.is_some())
            .field("token", &self.token.as_ref().map(|_| "<redacted>"))
            .finish()
    }
}

fn config_error(flag: &str, path: &Path, reason: impl std::fmt::Display) -> Error {
    Error::Config(format!("{flag} {}: {reason}", path.display()))
}

impl Transport {
    /// The transport the settings ask for; unusable files are errors naming their flag.
    pub(super) fn from_settings(settings: &ToolRunnerSettings) -> Result<Self, Error> {
        Ok(Self {
            tls: Self::tls(settings)?,
            token: settings.token_file.as_deref().map(Self::token).transpose()?,
        })
    }

    fn tls(settings: &ToolRunnerSettings) -> Result<Option<ClientTlsConfig>, Error> {
        let Some(ca) = &settings.ca else {
            if settings.cert.is_some() || settings.key.is_some() {
                return Err(Error::Config(
                    "--tool-runner-cert and --tool-runner-key need --tool-runner-ca".into(),
                ));
            }
            return Ok(None);
        };
        let tls_error = |e: shared::tls::TlsError| Error::Config(e.to_string());
        let ca_pem = shared::tls::read_pem("--tool-runner-ca", ca).map_err(tls_error)?;
        shared::tls::root_store("--tool-runner-ca", ca, &ca_pem).map_err(tls_error)?;
        let mut config = ClientTlsConfig::new().ca_certificate(Certificate::from_pem(ca_pem));
        match (&settings.cert, &settings.key) {
            (Some(cert), Some(key)) => {
                let cert_pem = shared::tls::read_pem("--tool-runner-cert", cert).map_err(tls_error)?;
                let certs = shared::tls::certificates("--tool-runner-cert", cert, &cert_pem).map_err(tls_error)?;
                let key_pem = shared::tls::read_pem("--tool-runner-key", key).map_err(tls_error)?;
                let private = shared::tls::private_key("--tool-runner-key", key, &key_pem).map_err(tls_error)?;
                shared::tls::check_pair("--tool-runner-key", key, certs, private).map_err(tls_error)?;
                config = config.identity(Identity::from_pem(cert_pem, key_pem));
            }
            (None, None) => {}
            _ => {
                return Err(Error::Config(
                    "--tool-runner-cert and --tool-runner-key go together".into(),
                ));
            }
        }
        Ok(Some(config))
    }

    fn token(path: &Path) -> Result<MetadataValue<Ascii>, Error> {
        let flag = "--tool-runner-token-file";
        let meta = std::fs::metadata(path).map_err(|e| config_error(flag, path, e))?;
        if meta.len() > MAX_TOKEN_BYTES {
            return Err(config_error(flag, path, format!("larger than {MAX_TOKEN_BYTES} bytes")));
        }
        let text = std::fs::read_to_string(path).map_err(|e| config_error(flag, path, e))?;
        let token = text.trim();
        if token.is_empty() {
            return Err(config_error(flag, path, "is empty"));
        }
        // The error says what is wrong, never the token.
        format!("Bearer {token}")
            .parse()
            .map_err(|_| config_error(flag, path, "the token must be printable ASCII"))
    }

    /// The scheme of endpoints found through DNS.
    pub(super) fn dns_scheme(&self) -> &'static str {
        if self.tls.is_some() { "https" } else { "http" }
    }

    /// The endpoint for `uri`; `server_name` is the name its TLS certificate must carry when it
    /// is not the URI's host (addresses found through DNS).
    pub(super) fn endpoint(&self, uri: &str, server_name: Option<&str>) -> Result<Endpoint, Error> {
        let mut endpoint = Endpoint::from_shared(uri.to_owned())
            .map_err(|e| Error::Config(format!("--tool-runner {uri:?}: {e}")))?
            .connect_timeout(CONNECT_TIMEOUT)
            .tcp_nodelay(true)
            .http2_keep_alive_interval(Duration::from_secs(30))
            .keep_alive_while_idle(true);
        if uri.starts_with("https://") {
            let Some(tls) = &self.tls else {
                return Err(Error::Config(format!(
                    "--tool-runner {uri:?} is https:// but no --tool-runner-ca says which CA signs its certificate"
                )));
            };
            let tls = match server_name {
                Some(name) => tls.clone().domain_name(name),
                None => tls.clone(),
            };
            endpoint = endpoint
                .tls_config(tls)
                .map_err(|e| Error::Config(format!("--tool-runner {uri:?}: TLS: {e}")))?;
        }
        Ok(endpoint)
    }

    /// Adds the bearer token to a request, when there is one.
    pub(super) fn authorize<T>(&self, request: &mut tonic::Request<T>) {
        if let Some(token) = &self.token {
            request.metadata_mut().insert("authorization", token.clone());
        }
    }
}

/// The transport in use, replaced whole when its files change (calls take the current one).
#[derive(Clone, Debug)]
pub(super) struct SharedTransport(Arc<RwLock<Arc<Transport>>>);

impl SharedTransport {
    /// Shares `transport`.
    pub(super) fn new(transport: Transport) -> Self {
        Self(Arc::new(RwLock::new(Arc::new(transport))))
    }

    /// The transport now.
    pub(super) fn current(&self) -> Arc<Transport> {
        Arc::clone(&shared::sync::read(&self.0))
    }

    /// Puts `transport` in place for the calls that start from now on.
    pub(super) fn replace(&self, transport: Transport) {
        *shared::sync::write(&self.0) = Arc::new(transport);
    }
}

/// The files the transport is built from (CA, certificate, key, token file), those that are set.
pub(super) fn files(settings: &ToolRunnerSettings) -> Vec<PathBuf> {
    [&settings.ca, &settings.cert, &settings.key, &settings.token_file]
        .into_iter()
        .flatten()
        .cloned()
        .collect()
}

/// A digest of `files` (see [`files`]), to
/// notice that one changed; `None` when there are none. A file that cannot be read counts by its
/// error, so it changes again once it is back.
pub(super) fn files_digest(files: &[PathBuf]) -> Option<u64> {
    if files.is_empty() {
        return None;
    }
    let mut hasher = DefaultHasher::new();
    for path in files {
        path.hash(&mut hasher);
        match read_prefix(path) {
            Ok(bytes) => bytes.hash(&mut hasher),
            Err(e) => e.kind().hash(&mut hasher),
        }
    }
    Some(hasher.finish())
}

/// The first [`MAX_DIGEST_BYTES`] of a file and its length (no PEM bundle or token is larger;
/// the bound keeps a file that grew wild from being read whole every interval).
fn read_prefix(path: &Path) -> std::io::Result<(Vec<u8>, u64)> {
    use std::io::Read;
    let file = std::fs::File::open(path)?;
    let len = file.metadata()?.len();
    let mut bytes = Vec::new();
    file.take(MAX_DIGEST_BYTES).read_to_end(&mut bytes)?;
    Ok((bytes, len))
}
