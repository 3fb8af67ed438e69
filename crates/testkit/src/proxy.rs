//! A TCP proxy whose traffic can be cut and healed: the process behind it stays alive and keeps
//! serving its own callers, but cannot reach what is on the other side (a network partition).
//! While cut, nothing passes either way and new connections wait; what was sent meanwhile is held
//! and delivered once healed, as a partition shorter than TCP's timeouts does. Its upstream can
//! change, as a Kubernetes Service's endpoints do when a pod goes: new connections go to the new
//! one, open ones stay where they are.

use std::net::SocketAddr;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// See the module docs. Dropping it closes the listener (open connections end with the test).
pub struct CutProxy {
    addr: SocketAddr,
    cut: watch::Sender<bool>,
    upstream: watch::Sender<SocketAddr>,
    accept: tokio::task::JoinHandle<()>,
}

impl Drop for CutProxy {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

impl CutProxy {
    /// A proxy on a free loopback port forwarding to `upstream`.
    pub async fn start(upstream: SocketAddr) -> anyhow::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let (cut, open) = watch::channel(false);
        let (upstream, target) = watch::channel(upstream);
        let accept = tokio::spawn(async move {
            while let Ok((inbound, _)) = listener.accept().await {
                let upstream = *target.borrow();
                tokio::spawn(forward(inbound, upstream, open.clone()));
            }
        });
        Ok(Self {
            addr,
            cut,
            upstream,
            accept,
        })
    }

    /// Sends the connections opened from now on to `upstream`.
    pub fn redirect(&self, upstream: SocketAddr) {
        self.upstream.send_replace(upstream);
    }

    /// Where callers connect.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Holds all traffic, both ways, until [`CutProxy::heal`].
    pub fn cut(&self) {
        self.cut.send_replace(true);
    }

    /// Lets traffic pass again, what was held first.
    pub fn heal(&self) {
        self.cut.send_replace(false);
    }
}

async fn forward(inbound: TcpStream, upstream: SocketAddr, mut open: watch::Receiver<bool>) {
    if open.wait_for(|cut| !cut).await.is_err() {
        return;
    }
    let Ok(outbound) = TcpStream::connect(upstream).await else {
        return;
    };
    let (in_read, in_write) = inbound.into_split();
    let (out_read, out_write) = outbound.into_split();
    tokio::select! {
        () = pump(in_read, out_write, open.clone()) => {}
        () = pump(out_read, in_write, open) => {}
    }
}

/// Copies `from` to `to`, holding what it read while the proxy is cut.
async fn pump(
    mut from: impl AsyncReadExt + Unpin,
    mut to: impl AsyncWriteExt + Unpin,
    mut open: watch::Receiver<bool>,
) {
    let mut buffer = vec![0u8; 16 * 1024];
    loop {
        if open.wait_for(|cut| !cut).await.is_err() {
            return;
        }
        let n = match from.read(&mut buffer).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        if open.wait_for(|cut| !cut).await.is_err() {
            return;
        }
        if to.write_all(&buffer[..n]).await.is_err() {
            return;
        }
    }
}
