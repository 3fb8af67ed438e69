//! The console's connections: the gRPC port's own accept loop (TLS, its handshake bounds) on the
//! console's address, handed to axum with who is on the other end (a client certificate signs a
//! person in where the server takes certificates as credentials).

use std::net::SocketAddr;

use axum::extract::connect_info::Connected;
use axum::serve::IncomingStream;
use futures::StreamExt;
use shared::tls::{Conn, Incoming, PeerInfo};
use tonic::transport::server::Connected as _;

/// The accepted connections of the console's listener.
pub(super) struct Connections {
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

/// Who is on the other end of a console connection, for the handlers.
#[derive(Debug, Clone)]
pub(super) struct Peer(pub PeerInfo);

impl Connected<IncomingStream<'_, Connections>> for Peer {
    fn connect_info(stream: IncomingStream<'_, Connections>) -> Self {
        Self(stream.io().connect_info())
    }
}
