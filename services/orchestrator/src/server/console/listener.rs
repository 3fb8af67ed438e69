//! The console's connections: the gRPC port's own accept loop (TLS, its handshake bounds) on the
//! console's address, each served with who is on the other end (a client certificate signs a
//! person in where the server takes certificates as credentials) and a bound on how long a
//! request's head may take to arrive (a client sending it byte by byte holds nothing for long).

use std::net::SocketAddr;
use std::time::Duration;

use axum::Router;
use axum::extract::ConnectInfo;
use axum::serve::Listener as _;
use futures::StreamExt;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto::Builder;
use hyper_util::service::TowerToHyperService;
use shared::tls::{Conn, Incoming, PeerInfo};
use tonic::transport::server::Connected as _;

/// The accepted connections of the console's listener.
pub(in crate::server) struct Connections {
    pub incoming: Incoming,
    pub local: SocketAddr,
}

impl axum::serve::Listener for Connections {
    type Io = Conn;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Conn, SocketAddr) {
        loop {
            match self.incoming.next().await {
                Some(Ok(conn)) => {
                    let remote = conn.connect_info().remote_addr.unwrap_or(self.local);
                    return (conn, remote);
                }
                Some(Err(e)) => tracing::debug!("console connection not accepted: {e}"),
                // The accept loop is gone (it ends only when dropped): accept nothing more.
                None => std::future::pending::<()>().await,
            }
        }
    }

    fn local_addr(&self) -> std::io::Result<SocketAddr> {
        Ok(self.local)
    }
}

/// A listener on `address`, the port `flag` names (an error naming it when it cannot be had),
/// and the address it has.
pub(in crate::server) async fn bind(
    flag: &str,
    address: SocketAddr,
) -> Result<(tokio::net::TcpListener, SocketAddr), crate::Error> {
    let listener = tokio::net::TcpListener::bind(address)
        .await
        .map_err(|e| crate::Error::Config(format!("cannot listen on {flag} {address}: {e}")))?;
    let local = listener
        .local_addr()
        .map_err(|e| crate::Error::Config(format!("{flag}: the listener has no address: {e}")))?;
    Ok((listener, local))
}

/// Who is on the other end of a console connection, for the handlers.
#[derive(Debug, Clone)]
pub(in crate::server) struct Peer(pub PeerInfo);

/// Serves `app` on every connection `connections` accepts, a request's head read within
/// `header_timeout` (`--console-header-timeout`), until dropped.
pub(in crate::server) async fn serve(mut connections: Connections, app: Router, header_timeout: Duration) {
    loop {
        let (conn, _) = connections.accept().await;
        let peer = Peer(conn.connect_info());
        let service = TowerToHyperService::new(app.clone().layer(axum::Extension(ConnectInfo(peer))));
        shared::tasks::spawn(async move {
            let mut builder = Builder::new(TokioExecutor::new());
            builder
                .http1()
                .timer(TokioTimer::new())
                .header_read_timeout(header_timeout);
            if let Err(e) = builder
                .serve_connection_with_upgrades(TokioIo::new(conn), service)
                .await
            {
                tracing::debug!("console connection ended: {e}");
            }
        });
    }
}
