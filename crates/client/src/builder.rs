//! Building a [`Client`]: where, how securely, with which token, how patiently.

use std::time::Duration;

use proto::orchestrator::v1 as pb;
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity};

use crate::{Client, Error, Retry};

/// Settings of a [`Client`]; [`connect`](Self::connect) or [`connect_lazy`](Self::connect_lazy)
/// makes it.
///
/// ```no_run
/// use std::time::Duration;
/// use orchestrator_client::{ClientBuilder, Retry};
///
/// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
/// let client = ClientBuilder::new("https://orchestrator.example:50051")
///     .tls_ca_pem(std::fs::read("ca.pem")?)
///     .tls_identity_pem(std::fs::read("client.pem")?, std::fs::read("client.key")?)
///     .token(std::env::var("ORCHESTRATOR_TOKEN")?)
///     .timeout(Duration::from_secs(300))
///     .retry(Retry { attempts: 8, ..Retry::default() })
///     .connect()
///     .await?;
/// # let _ = client;
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct ClientBuilder {
    endpoint: String,
    token: Option<String>,
    ca_pem: Option<Vec<u8>>,
    identity_pem: Option<(Vec<u8>, Vec<u8>)>,
    domain: Option<String>,
    connect_timeout: Duration,
    timeout: Duration,
    retry: Retry,
    max_message_bytes: usize,
}

/// The default of [`ClientBuilder::max_message_bytes`].
pub const DEFAULT_MAX_MESSAGE_BYTES: usize = 64 * 1024 * 1024;

impl std::fmt::Debug for ClientBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClientBuilder")
            .field("endpoint", &self.endpoint)
            .field("token", &self.token.as_ref().map(|_| "<redacted>"))
            .field("tls", &self.ca_pem.is_some())
            .field("mtls", &self.identity_pem.is_some())
            .field("timeout", &self.timeout)
            .field("retry", &self.retry)
            .field("max_message_bytes", &self.max_message_bytes)
            .finish_non_exhaustive()
    }
}

impl ClientBuilder {
    /// A client of the orchestrator at `endpoint` (`http://host:port`, or `https://host:port`
    /// with [`tls_ca_pem`](Self::tls_ca_pem)); defaults: no token, 5 s to connect, 10 min per
    /// call, [`Retry::default`], messages up to [`DEFAULT_MAX_MESSAGE_BYTES`].
    pub fn new(endpoint: impl Into<String>) -> Self {
        Self {
            endpoint: endpoint.into(),
            token: None,
            ca_pem: None,
            identity_pem: None,
            domain: None,
            connect_timeout: Duration::from_secs(5),
            timeout: Duration::from_secs(600),
            retry: Retry::default(),
            max_message_bytes: DEFAULT_MAX_MESSAGE_BYTES,
        }
    }

    /// Sends `authorization: Bearer <token>` with every call.
    pub fn token(mut self, token: impl Into<String>) -> Self {
        self.token = Some(token.into());
        self
    }

    /// Trusts the server certificates this PEM CA signed (needs an `https://` endpoint).
    pub fn tls_ca_pem(mut self, pem: impl Into<Vec<u8>>) -> Self {
        self.ca_pem = Some(pem.into());
        self
    }

    /// Presents this PEM certificate and key (mTLS).
    pub fn tls_identity_pem(mut self, cert: impl Into<Vec<u8>>, key: impl Into<Vec<u8>>) -> Self {
        self.identity_pem = Some((cert.into(), key.into()));
        self
    }

    /// Checks the server's certificate against `name` instead of the endpoint's host.
    pub fn tls_domain(mut self, name: impl Into<String>) -> Self {
        self.domain = Some(name.into());
        self
    }

    /// How long connecting may take.
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// Deadline of each call; for [`Client::orchestrate`] that is the whole run.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// The largest message taken from the server (64 MiB by default; gRPC's usual 4 MiB is too
    /// small). A run's result (`run_finished`, `GetRun`) holds its whole text, reasoning and
    /// tool-call records, so it grows with the server's `--max-output-bytes` and
    /// `--max-reasoning-bytes`; a larger message fails the call `OUT_OF_RANGE`, naming the limit.
    pub fn max_message_bytes(mut self, bytes: usize) -> Self {
        self.max_message_bytes = bytes;
        self
    }

    /// When to try a refused call again.
    pub fn retry(mut self, retry: Retry) -> Self {
        self.retry = retry;
        self
    }

    /// Connects now; fails if the orchestrator cannot be reached.
    pub async fn connect(self) -> Result<Client, Error> {
        let endpoint = self.endpoint()?;
        let channel = endpoint.connect().await?;
        self.client(channel)
    }

    /// Connects on the first call (and again after a connection is lost); until then calls fail
    /// `UNAVAILABLE`, which the [`Retry`] policy retries. Call it within a Tokio runtime.
    pub fn connect_lazy(self) -> Result<Client, Error> {
        let channel = self.endpoint()?.connect_lazy();
        self.client(channel)
    }

    fn endpoint(&self) -> Result<Endpoint, Error> {
        let endpoint = Endpoint::from_shared(self.endpoint.clone())
            .map_err(|e| Error::Config(format!("endpoint {:?}: {e}", self.endpoint)))?
            .connect_timeout(self.connect_timeout);
        let https = self.endpoint.starts_with("https://");
        match (&self.ca_pem, https) {
            (None, false) if self.identity_pem.is_none() => Ok(endpoint),
            (None, _) => Err(Error::Config(
                "an https:// endpoint needs the CA that signed the server's certificate (tls_ca_pem)".into(),
            )),
            (Some(_), false) => Err(Error::Config(format!(
                "TLS needs an https:// endpoint, not {:?}",
                self.endpoint
            ))),
            (Some(ca), true) => {
                let mut tls = ClientTlsConfig::new().ca_certificate(Certificate::from_pem(ca));
                if let Some((cert, key)) = &self.identity_pem {
                    tls = tls.identity(Identity::from_pem(cert, key));
                }
                if let Some(domain) = &self.domain {
                    tls = tls.domain_name(domain.clone());
                }
                Ok(endpoint.tls_config(tls)?)
            }
        }
    }

    fn client(self, channel: tonic::transport::Channel) -> Result<Client, Error> {
        let authorization = self
            .token
            .as_deref()
            .map(|token| {
                format!("Bearer {token}")
                    .parse()
                    .map_err(|_| Error::Config("the token must be printable ASCII".into()))
            })
            .transpose()?;
        Ok(Client {
            inner: pb::orchestrator_client::OrchestratorClient::new(channel)
                .max_decoding_message_size(self.max_message_bytes),
            authorization,
            retry: self.retry,
            timeout: self.timeout,
        })
    }
}
