//! Resolving a DNS name to every address it has: how `dns:///name:port` targets (tool-runners,
//! model servers behind a headless Service) become endpoints. A trait, so tests script answers.

use std::net::SocketAddr;

use futures::FutureExt;
use futures::future::BoxFuture;

/// Resolves DNS names (the system resolver in production; scripted answers in tests).
pub trait Resolve: Send + Sync + 'static {
    /// Every address `host` resolves to, with `port`.
    fn resolve(&self, host: &str, port: u16) -> BoxFuture<'static, std::io::Result<Vec<SocketAddr>>>;
}

/// The system resolver (`getaddrinfo`: `/etc/hosts`, then DNS).
pub struct SystemResolver;

impl Resolve for SystemResolver {
    fn resolve(&self, host: &str, port: u16) -> BoxFuture<'static, std::io::Result<Vec<SocketAddr>>> {
        let host = host.to_owned();
        async move { Ok(tokio::net::lookup_host((host.as_str(), port)).await?.collect()) }.boxed()
    }
}
