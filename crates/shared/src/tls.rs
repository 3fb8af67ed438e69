//! TLS for both gRPC servers (rustls): the certificate and key come from PEM files, checked for
//! changes every `--tls-reload-interval` and swapped in without touching open connections (new
//! handshakes use the new files; cert-manager rotates them in place). With a client CA every
//! caller must present a certificate that CA signed (mTLS), and the certificate's subject is
//! available to authentication as [`PeerInfo::client_subject`].
//!
//! [`incoming`] accepts the connections of a listener, plain or TLS, handshakes each in its own
//! task under a timeout and a bound on pending handshakes, and hands tonic the connected ones.

use std::io;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::{Arc, RwLock};
use std::task::{Context, Poll};
use std::time::Duration;

use rustls::RootCertStore;
use rustls::ServerConfig;
use rustls::crypto::CryptoProvider;
use rustls::server::WebPkiClientVerifier;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Semaphore, mpsc};
use tokio_rustls::TlsAcceptor;
use tonic::transport::server::Connected;

use crate::runtime::AbortOnDrop;

/// Bounds on the TLS handshakes of a listener (`--tls-handshake-timeout`,
/// `--tls-max-pending-handshakes`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Handshakes {
    /// Longest handshake; the connection is closed after it.
    pub timeout: Duration,
    /// Handshakes in progress at once; connections beyond it are closed at once.
    pub max_pending: usize,
}

impl Default for Handshakes {
    fn default() -> Self {
        Self {
            timeout: Duration::from_secs(10),
            max_pending: 1024,
        }
    }
}
/// Accepted connections waiting for the server to take them.
const ACCEPTED_QUEUE: usize = 64;

/// A TLS file that cannot be used.
#[derive(Debug, thiserror::Error)]
#[error("{flag} {}: {reason}", path.display())]
pub struct TlsError {
    /// The flag that named the file.
    pub flag: &'static str,
    /// The file.
    pub path: PathBuf,
    /// What is wrong with it.
    pub reason: String,
}

fn tls_error(flag: &'static str, path: &Path, reason: impl ToString) -> TlsError {
    TlsError {
        flag,
        path: path.to_owned(),
        reason: reason.to_string(),
    }
}

/// The one crypto provider both services use (aws-lc-rs, as reqwest does), named explicitly so
/// no process-wide default has to be installed.
pub fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::aws_lc_rs::default_provider())
}

/// Reads a PEM file named by `flag`.
pub fn read_pem(flag: &'static str, path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|e| tls_error(flag, path, e))
}

/// Checks that the private key of `key_path` belongs to the first certificate of `certs` (a
/// half-rotated pair would fail every handshake instead).
pub fn check_pair(
    key_flag: &'static str,
    key_path: &Path,
    certs: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
) -> Result<(), TlsError> {
    rustls::sign::CertifiedKey::from_der(certs, key, &provider())
        .map(|_| ())
        .map_err(|e| tls_error(key_flag, key_path, format!("does not fit the certificate: {e}")))
}

/// Every certificate of a PEM file (at least one).
pub fn certificates(flag: &'static str, path: &Path, pem: &[u8]) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let certs = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| tls_error(flag, path, format!("not a PEM certificate file: {e}")))?;
    if certs.is_empty() {
        return Err(tls_error(flag, path, "holds no PEM certificate"));
    }
    Ok(certs)
}

/// The private key of a PEM file (PKCS#8, PKCS#1 or SEC1).
pub fn private_key(flag: &'static str, path: &Path, pem: &[u8]) -> Result<PrivateKeyDer<'static>, TlsError> {
    PrivateKeyDer::from_pem_slice(pem).map_err(|e| tls_error(flag, path, format!("no usable PEM private key: {e}")))
}

/// The CA certificates of a PEM file, as trust roots.
pub fn root_store(flag: &'static str, path: &Path, pem: &[u8]) -> Result<RootCertStore, TlsError> {
    let mut roots = RootCertStore::empty();
    for cert in certificates(flag, path, pem)? {
        roots
            .add(cert)
            .map_err(|e| tls_error(flag, path, format!("not a usable CA certificate: {e}")))?;
    }
    Ok(roots)
}

/// The files a TLS server is built from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerTlsFiles {
    /// PEM certificate chain the server presents.
    pub cert: PathBuf,
    /// PEM private key of that certificate.
    pub key: PathBuf,
    /// PEM CA bundle that signs the callers' certificates; `None`: no client certificate asked.
    pub client_ca: Option<PathBuf>,
}

/// The bytes of the files at one moment, compared to notice a change.
#[derive(PartialEq, Eq)]
struct Sources {
    cert: Vec<u8>,
    key: Vec<u8>,
    client_ca: Option<Vec<u8>>,
}

impl ServerTlsFiles {
    fn read(&self) -> Result<Sources, TlsError> {
        Ok(Sources {
            cert: read_pem("--tls-cert", &self.cert)?,
            key: read_pem("--tls-key", &self.key)?,
            client_ca: self
                .client_ca
                .as_deref()
                .map(|ca| read_pem("--tls-client-ca", ca))
                .transpose()?,
        })
    }

    /// The rustls server configuration from `sources` (HTTP/2 only, as gRPC needs).
    fn build(&self, sources: &Sources) -> Result<ServerConfig, TlsError> {
        let certs = certificates("--tls-cert", &self.cert, &sources.cert)?;
        let key = private_key("--tls-key", &self.key, &sources.key)?;
        let builder = ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| tls_error("--tls-cert", &self.cert, e))?;
        let builder = match (&self.client_ca, &sources.client_ca) {
            (Some(path), Some(pem)) => {
                let roots = root_store("--tls-client-ca", path, pem)?;
                let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider())
                    .build()
                    .map_err(|e| tls_error("--tls-client-ca", path, e))?;
                builder.with_client_cert_verifier(verifier)
            }
            _ => builder.with_no_client_auth(),
        };
        let mut config = builder
            .with_single_cert(certs, key)
            .map_err(|e| tls_error("--tls-key", &self.key, format!("does not fit the certificate: {e}")))?;
        config.alpn_protocols = vec![b"h2".to_vec()];
        Ok(config)
    }
}

/// What a listener speaks over TLS, as its ALPN offers it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protocols {
    /// HTTP/2 only, as gRPC needs (a client that offers only HTTP/1.1 is refused in the handshake).
    Grpc,
    /// HTTP/2 or HTTP/1.1: pages and JSON over HTTP (the console, A2A).
    Http,
}

/// The configurations of the server's TLS files: gRPC's and HTTP's (see [`Protocols`]).
struct Configs {
    grpc: Arc<ServerConfig>,
    http: Arc<ServerConfig>,
}

impl Configs {
    fn of(grpc: ServerConfig) -> Self {
        let mut http = grpc.clone();
        http.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        Self {
            grpc: Arc::new(grpc),
            http: Arc::new(http),
        }
    }
}

/// The server's TLS configuration, swapped when its files change.
pub struct ReloadingTls {
    files: ServerTlsFiles,
    current: RwLock<(Configs, Sources)>,
}

impl ReloadingTls {
    /// Loads the files now; an unusable file is an error naming its flag.
    pub fn load(files: ServerTlsFiles) -> Result<Arc<Self>, TlsError> {
        let sources = files.read()?;
        let configs = Configs::of(files.build(&sources)?);
        Ok(Arc::new(Self {
            files,
            current: RwLock::new((configs, sources)),
        }))
    }

    /// Whether callers must present a certificate.
    pub fn requires_client_certificates(&self) -> bool {
        self.files.client_ca.is_some()
    }

    fn acceptor(&self, protocols: Protocols) -> TlsAcceptor {
        let current = crate::sync::read(&self.current);
        TlsAcceptor::from(Arc::clone(match protocols {
            Protocols::Grpc => &current.0.grpc,
            Protocols::Http => &current.0.http,
        }))
    }

    /// Reads the files again and swaps the configuration in when they changed (`Ok(true)`); on
    /// an error the previous configuration stays.
    pub fn reload_if_changed(&self) -> Result<bool, TlsError> {
        let sources = self.files.read()?;
        if sources == crate::sync::read(&self.current).1 {
            return Ok(false);
        }
        let configs = Configs::of(self.files.build(&sources)?);
        *crate::sync::write(&self.current) = (configs, sources);
        Ok(true)
    }

    /// Checks the files every `interval` until the handle is dropped.
    pub fn watch(self: &Arc<Self>, interval: Duration) -> AbortOnDrop {
        let tls = Arc::clone(self);
        AbortOnDrop(tokio::spawn(async move {
            let mut ticker = tokio::time::interval(interval);
            ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            ticker.tick().await;
            loop {
                ticker.tick().await;
                match tls.reload_if_changed() {
                    Ok(true) => {
                        tracing::info!(cert = %tls.files.cert.display(), "TLS files changed; new connections use them")
                    }
                    Ok(false) => {}
                    Err(e) => tracing::warn!("TLS files changed but cannot be used; keeping the previous ones: {e}"),
                }
            }
        }))
    }
}

/// Who is on the other end of a connection, as tonic puts it into every request's extensions.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PeerInfo {
    /// The caller's address.
    pub remote_addr: Option<SocketAddr>,
    /// The subject of the verified client certificate (its common name, else the whole
    /// distinguished name); `None` without mTLS.
    pub client_subject: Option<String>,
}

/// The subject a client certificate names: its common name, else the whole distinguished name.
pub fn certificate_subject(der: &[u8]) -> Option<String> {
    let (_, cert) = x509_parser::parse_x509_certificate(der).ok()?;
    let subject = cert.subject();
    let common_name = subject.iter_common_name().next().and_then(|cn| cn.as_str().ok());
    Some(common_name.map_or_else(|| subject.to_string(), str::to_owned))
}

/// An accepted connection, plain or TLS.
pub enum Conn {
    /// Plaintext.
    Plain(TcpStream, PeerInfo),
    /// After a completed TLS handshake.
    Tls(Box<tokio_rustls::server::TlsStream<TcpStream>>, PeerInfo),
}

impl Connected for Conn {
    type ConnectInfo = PeerInfo;
    fn connect_info(&self) -> PeerInfo {
        match self {
            Self::Plain(_, peer) | Self::Tls(_, peer) => peer.clone(),
        }
    }
}

impl AsyncRead for Conn {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Self::Plain(s, _) => Pin::new(s).poll_read(cx, buf),
            Self::Tls(s, _) => Pin::new(s.as_mut()).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Conn {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Self::Plain(s, _) => Pin::new(s).poll_write(cx, buf),
            Self::Tls(s, _) => Pin::new(s.as_mut()).poll_write(cx, buf),
        }
    }
    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Self::Plain(s, _) => Pin::new(s).poll_flush(cx),
            Self::Tls(s, _) => Pin::new(s.as_mut()).poll_flush(cx),
        }
    }
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Self::Plain(s, _) => Pin::new(s).poll_shutdown(cx),
            Self::Tls(s, _) => Pin::new(s.as_mut()).poll_shutdown(cx),
        }
    }
    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Self::Plain(s, _) => Pin::new(s).poll_write_vectored(cx, bufs),
            Self::Tls(s, _) => Pin::new(s.as_mut()).poll_write_vectored(cx, bufs),
        }
    }
    fn is_write_vectored(&self) -> bool {
        match self {
            Self::Plain(s, _) => s.is_write_vectored(),
            Self::Tls(s, _) => s.is_write_vectored(),
        }
    }
}

/// The connections of a listener, for `serve_with_incoming_shutdown`; accepting stops when it
/// is dropped.
pub struct Incoming {
    accepted: mpsc::Receiver<Conn>,
    _accept: AbortOnDrop,
}

impl futures::Stream for Incoming {
    type Item = Result<Conn, io::Error>;
    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.accepted.poll_recv(cx).map(|conn| conn.map(Ok))
    }
}

/// Accepts `listener`'s connections, over TLS when `tls` is set (each handshake within
/// `handshakes.timeout`, at most `handshakes.max_pending` at once; a failed one is logged and
/// the connection closed).
pub fn incoming(listener: TcpListener, tls: Option<Arc<ReloadingTls>>, handshakes: Handshakes) -> Incoming {
    incoming_speaking(listener, tls.map(|tls| (tls, Protocols::Grpc)), handshakes)
}

/// [`incoming`], TLS offering `protocols` (ALPN).
pub fn incoming_speaking(
    listener: TcpListener,
    tls: Option<(Arc<ReloadingTls>, Protocols)>,
    handshakes: Handshakes,
) -> Incoming {
    let (tx, accepted) = mpsc::channel(ACCEPTED_QUEUE);
    let task = tokio::spawn(accept_loop(listener, tls, handshakes, tx));
    Incoming {
        accepted,
        _accept: AbortOnDrop(task),
    }
}

async fn accept_loop(
    listener: TcpListener,
    tls: Option<(Arc<ReloadingTls>, Protocols)>,
    handshakes: Handshakes,
    tx: mpsc::Sender<Conn>,
) {
    let pending = Arc::new(Semaphore::new(handshakes.max_pending));
    loop {
        let (stream, remote) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(e) => {
                // Out of file descriptors and the like: wait instead of spinning.
                tracing::warn!("accepting a connection failed: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let peer = PeerInfo {
            remote_addr: Some(remote),
            client_subject: None,
        };
        let Some((tls, protocols)) = &tls else {
            if tx.send(Conn::Plain(stream, peer)).await.is_err() {
                return;
            }
            continue;
        };
        let Ok(permit) = Arc::clone(&pending).try_acquire_owned() else {
            tracing::warn!(%remote, max_pending = handshakes.max_pending, "TLS handshakes pending at the bound (--tls-max-pending-handshakes); connection closed");
            continue;
        };
        let (acceptor, tx) = (tls.acceptor(*protocols), tx.clone());
        tokio::spawn(async move {
            if let Some(conn) = handshake(acceptor, stream, peer, handshakes.timeout).await {
                let _ = tx.send(conn).await;
            }
            drop(permit);
        });
    }
}

/// One TLS handshake; `None` (logged) when it fails or takes too long.
async fn handshake(acceptor: TlsAcceptor, stream: TcpStream, mut peer: PeerInfo, timeout: Duration) -> Option<Conn> {
    let remote = peer.remote_addr;
    match tokio::time::timeout(timeout, acceptor.accept(stream)).await {
        Ok(Ok(tls)) => {
            peer.client_subject = tls
                .get_ref()
                .1
                .peer_certificates()
                .and_then(|chain| chain.first())
                .and_then(|cert| certificate_subject(cert));
            Some(Conn::Tls(Box::new(tls), peer))
        }
        Ok(Err(e)) => {
            tracing::info!(remote = ?remote, "TLS handshake refused: {e}");
            None
        }
        Err(_) => {
            tracing::info!(remote = ?remote, timeout = %humantime::format_duration(timeout), "TLS handshake timed out");
            None
        }
    }
}
