//! What stands between the orchestrator and a model server in hosted deployments, for the tests of
//! that path: a TLS front ([`TlsFront`], a server certificate from a test CA, forwarding the
//! plain bytes to a server behind it) and a forward HTTP proxy ([`HttpProxy`]: `CONNECT` tunnels
//! and absolute-form requests, as `HTTPS_PROXY` / `HTTP_PROXY` send them), which counts what it
//! carried.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// Longest request head the proxy reads.
const MAX_HEAD: usize = 16 * 1024;

/// A TLS server on a free loopback port that forwards the decrypted bytes to `upstream`.
pub struct TlsFront {
    addr: SocketAddr,
    accept: tokio::task::JoinHandle<()>,
}

impl Drop for TlsFront {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

impl TlsFront {
    /// Serves TLS with the certificate chain `cert_pem` and key `key_pem` in front of `upstream`.
    pub async fn start(upstream: SocketAddr, cert_pem: &Path, key_pem: &Path) -> anyhow::Result<Self> {
        let chain = CertificateDer::pem_file_iter(cert_pem)?.collect::<Result<Vec<_>, _>>()?;
        let key = PrivateKeyDer::from_pem_file(key_pem)?;
        let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
        let config = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()?
            .with_no_client_auth()
            .with_single_cert(chain, key)?;
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let accept = tokio::spawn(async move {
            while let Ok((inbound, _)) = listener.accept().await {
                let acceptor = acceptor.clone();
                tokio::spawn(async move {
                    let Ok(Ok(mut tls)) = tokio::time::timeout(Duration::from_secs(10), acceptor.accept(inbound)).await
                    else {
                        return;
                    };
                    if let Ok(mut outbound) = TcpStream::connect(upstream).await {
                        let _ = tokio::io::copy_bidirectional(&mut tls, &mut outbound).await;
                    }
                });
            }
        });
        Ok(Self { addr, accept })
    }

    /// Where clients connect (`https://127.0.0.1:PORT`; the test certificates name 127.0.0.1).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

/// A forward HTTP proxy on a free loopback port: `CONNECT host:port` opens a tunnel, any other
/// request (absolute-form, `POST http://host:port/path`) is passed on to its host whole.
pub struct HttpProxy {
    addr: SocketAddr,
    tunnels: Arc<AtomicUsize>,
    forwarded: Arc<AtomicUsize>,
    accept: tokio::task::JoinHandle<()>,
}

impl Drop for HttpProxy {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

impl HttpProxy {
    /// A proxy on a free loopback port.
    pub async fn start() -> anyhow::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let (tunnels, forwarded) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let counts = (Arc::clone(&tunnels), Arc::clone(&forwarded));
        let accept = tokio::spawn(async move {
            while let Ok((inbound, _)) = listener.accept().await {
                tokio::spawn(proxy(inbound, counts.0.clone(), counts.1.clone()));
            }
        });
        Ok(Self {
            addr,
            tunnels,
            forwarded,
            accept,
        })
    }

    /// The proxy's URL, for `HTTP_PROXY` / `HTTPS_PROXY`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// `CONNECT` tunnels opened so far.
    pub fn tunnels(&self) -> usize {
        self.tunnels.load(Ordering::Relaxed)
    }

    /// Connections whose requests were passed on (absolute-form) so far.
    pub fn forwarded(&self) -> usize {
        self.forwarded.load(Ordering::Relaxed)
    }
}

/// One client connection: its first request's head says where it goes.
async fn proxy(mut inbound: TcpStream, tunnels: Arc<AtomicUsize>, forwarded: Arc<AtomicUsize>) {
    let Some((head, rest)) = read_head(&mut inbound).await else {
        return;
    };
    let first = head.lines().next().unwrap_or_default().to_owned();
    let mut words = first.split_whitespace();
    let (method, target) = (words.next().unwrap_or_default(), words.next().unwrap_or_default());
    if method == "CONNECT" {
        let Ok(mut outbound) = TcpStream::connect(target).await else {
            return;
        };
        if inbound
            .write_all(b"HTTP/1.1 200 Connection established\r\n\r\n")
            .await
            .is_err()
        {
            return;
        }
        tunnels.fetch_add(1, Ordering::Relaxed);
        let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
        return;
    }
    let Some(authority) = target.strip_prefix("http://").and_then(|t| t.split('/').next()) else {
        let _ = inbound
            .write_all(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n")
            .await;
        return;
    };
    let Ok(mut outbound) = TcpStream::connect(authority).await else {
        return;
    };
    forwarded.fetch_add(1, Ordering::Relaxed);
    if outbound.write_all(head.as_bytes()).await.is_err() || outbound.write_all(&rest).await.is_err() {
        return;
    }
    let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
}

/// The request head (through its blank line) and the bytes read after it.
async fn read_head(inbound: &mut TcpStream) -> Option<(String, Vec<u8>)> {
    let mut read = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        if let Some(end) = read.windows(4).position(|w| w == b"\r\n\r\n") {
            let rest = read.split_off(end + 4);
            return Some((String::from_utf8(read).ok()?, rest));
        }
        if read.len() > MAX_HEAD {
            return None;
        }
        let n = tokio::time::timeout(Duration::from_secs(10), inbound.read(&mut chunk))
            .await
            .ok()?
            .ok()?;
        if n == 0 {
            return None;
        }
        read.extend_from_slice(&chunk[..n]);
    }
}
