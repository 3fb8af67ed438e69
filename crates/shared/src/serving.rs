//! What both gRPC servers set up the same way before serving: TLS from PEM files and the tokens
//! file (both watched for changes), authentication, the plaintext health address for probes, and
//! the stream of accepted connections.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tonic_health::pb::health_server::{Health, HealthServer};

use crate::auth::{AuthGate, Authenticator, TokensError};
use crate::grpc::GateLayer;
use crate::runtime::AbortOnDrop;
use crate::tls::{Handshakes, Incoming, ReloadingTls, ServerTlsFiles, TlsError};

/// The security settings a service was started with (built by its `SecuritySettings`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SecurityOptions {
    /// TLS files; `None`: plaintext.
    pub tls: Option<ServerTlsFiles>,
    /// The tokens file.
    pub auth_tokens: Option<PathBuf>,
    /// Principal from the client certificate's subject.
    pub principal_from_cert: bool,
    /// How often the files are checked for changes.
    pub reload_interval: Duration,
    /// Bounds on TLS handshakes.
    pub handshakes: Handshakes,
    /// Plaintext health address.
    pub health_listen: Option<SocketAddr>,
}

/// The TLS files, when the flags turn TLS on; an error when they do not go together.
pub fn tls_files(
    cert: Option<&Path>,
    key: Option<&Path>,
    client_ca: Option<&Path>,
    principal_from_cert: bool,
) -> Result<Option<ServerTlsFiles>, String> {
    match (cert, key) {
        (Some(cert), Some(key)) => Ok(Some(ServerTlsFiles {
            cert: cert.to_owned(),
            key: key.to_owned(),
            client_ca: client_ca.map(Path::to_owned),
        })),
        (Some(_), None) => Err("--tls-cert needs --tls-key".into()),
        (None, Some(_)) => Err("--tls-key needs --tls-cert".into()),
        (None, None) if client_ca.is_some() => Err("--tls-client-ca needs --tls-cert and --tls-key".into()),
        (None, None) if principal_from_cert => {
            Err("--auth-principal-from-cert needs --tls-cert, --tls-key and --tls-client-ca".into())
        }
        (None, None) => Ok(None),
    }
}

/// Why security could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum SecurityError {
    /// A TLS file.
    #[error(transparent)]
    Tls(#[from] TlsError),
    /// The tokens file.
    #[error(transparent)]
    Tokens(#[from] TokensError),
    /// The health address.
    #[error("cannot listen on --health-listen {address}: {source}")]
    HealthListen {
        /// The address.
        address: SocketAddr,
        /// Why.
        source: std::io::Error,
    },
}

/// A server's TLS, authentication and health listener, set up and watched.
pub struct Security {
    tls: Option<Arc<ReloadingTls>>,
    auth: Option<Arc<Authenticator>>,
    handshakes: Handshakes,
    health_listener: Option<TcpListener>,
    _watchers: Vec<AbortOnDrop>,
}

impl Security {
    /// Loads the files (an unusable one is an error naming its flag), starts watching them, binds
    /// the health address, and warns when `service` admits every caller.
    pub async fn start(options: &SecurityOptions, service: &str) -> Result<Self, SecurityError> {
        let tls = options.tls.clone().map(ReloadingTls::load).transpose()?;
        let auth = Authenticator::new(options.auth_tokens.as_deref(), options.principal_from_cert)?;
        let mut watchers = Vec::new();
        if let Some(tls) = &tls {
            watchers.push(tls.watch(options.reload_interval));
        }
        if let Some(watcher) = auth.as_ref().and_then(|a| a.watch(options.reload_interval)) {
            watchers.push(watcher);
        }
        let health_listener = match options.health_listen {
            Some(address) => Some(
                TcpListener::bind(address)
                    .await
                    .map_err(|source| SecurityError::HealthListen { address, source })?,
            ),
            None => None,
        };
        let mutual = tls.as_ref().is_some_and(|t| t.requires_client_certificates());
        if auth.is_none() && !mutual {
            tracing::warn!(
                "{service} is unauthenticated: anyone who can reach its port may call it (set --auth-tokens or --tls-client-ca)"
            );
        }
        tracing::info!(
            tls = tls.is_some(),
            mtls = mutual,
            tokens = options.auth_tokens.is_some(),
            principal_from_cert = options.principal_from_cert,
            "security"
        );
        Ok(Self {
            tls,
            auth,
            handshakes: options.handshakes,
            health_listener,
            _watchers: watchers,
        })
    }

    /// Whether callers are authenticated (requests carry a named principal).
    pub fn authenticates(&self) -> bool {
        self.auth.is_some()
    }

    /// The authenticator (`None`: every caller is the anonymous principal), for a second face of
    /// the server that checks the same credentials (the orchestrator's console).
    pub fn authenticator(&self) -> Option<Arc<Authenticator>> {
        self.auth.clone()
    }

    /// Whether connections are served over TLS.
    pub fn tls(&self) -> bool {
        self.tls.is_some()
    }

    /// The connections of `listener`, over TLS when it is on.
    pub fn incoming(&self, listener: TcpListener) -> Incoming {
        crate::tls::incoming(listener, self.tls.clone(), self.handshakes)
    }

    /// [`Self::incoming`] for HTTP beside gRPC's port (the console, A2A): TLS offers HTTP/1.1
    /// too.
    pub fn incoming_http(&self, listener: TcpListener) -> Incoming {
        let tls = self.tls.clone().map(|tls| (tls, crate::tls::Protocols::Http));
        crate::tls::incoming_speaking(listener, tls, self.handshakes)
    }

    /// The authentication layer for the server (admits everyone when auth is off).
    pub fn auth_layer(&self, refused_metric: &'static str) -> GateLayer<AuthGate> {
        GateLayer(AuthGate::new(self.auth.clone(), refused_metric))
    }

    /// Serves `health` alone, plaintext, on the health address (when set) until the handle is
    /// dropped.
    pub fn serve_health<H: Health>(&mut self, health: HealthServer<H>) -> Option<AbortOnDrop> {
        let listener = self.health_listener.take()?;
        if let Ok(address) = listener.local_addr() {
            tracing::info!(%address, "health serving (plaintext)");
        }
        let incoming = crate::tls::incoming(listener, None, self.handshakes);
        Some(AbortOnDrop(tokio::spawn(async move {
            if let Err(e) = tonic::transport::Server::builder()
                .add_service(health)
                .serve_with_incoming(incoming)
                .await
            {
                tracing::error!("the health server stopped: {e}");
            }
        })))
    }
}
