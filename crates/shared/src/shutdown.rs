//! The process lifecycle both services share: wait for the stop signals, bind the listeners, serve
//! until told to stop, then drain.

use std::future::Future;
use std::net::SocketAddr;

/// Installs SIGTERM (Kubernetes stopping a pod) and SIGINT (Ctrl-C) handlers and returns a future
/// that resolves with the name of the first one received. Installing happens now, so a failure is
/// a startup error rather than a service that cannot drain.
pub fn stop_signal() -> std::io::Result<impl Future<Output = &'static str> + Send + 'static> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    Ok(async move {
        tokio::select! {
            _ = term.recv() => "SIGTERM",
            _ = int.recv() => "SIGINT",
        }
    })
}

/// Why a service process could not start serving.
#[derive(Debug, thiserror::Error)]
pub enum StartupError {
    /// SIGTERM/SIGINT handlers could not be installed (the service could not drain).
    #[error("cannot install signal handlers: {0}")]
    Signals(std::io::Error),
    /// The gRPC or metrics address cannot be bound.
    #[error("cannot listen on {address} ({flag}): {source}")]
    Listen {
        /// The address.
        address: SocketAddr,
        /// The flag that sets it, and what to do (a second process of a kind on one host takes
        /// its own ports).
        flag: &'static str,
        /// Why.
        source: std::io::Error,
    },
}

/// The `serve` command of both binaries: installs the stop-signal handlers, binds `listen` and the
/// optional `/metrics` endpoint, runs `service(listener, shutdown)` (the service's
/// `serve(listener, config, shutdown)`) until SIGTERM/SIGINT has been received and the drain is
/// over, then stops the metrics endpoint.
pub async fn serve_until_stopped<E, Fut>(
    listen: SocketAddr,
    metrics_listen: Option<SocketAddr>,
    service: impl FnOnce(tokio::net::TcpListener, std::pin::Pin<Box<dyn Future<Output = ()> + Send>>) -> Fut,
) -> Result<(), E>
where
    Fut: Future<Output = Result<(), E>>,
    E: From<StartupError>,
{
    let stop = stop_signal().map_err(StartupError::Signals)?;
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .map_err(|source| StartupError::Listen {
            address: listen,
            flag: "the gRPC address: move it with --listen",
            source,
        })?;
    let metrics = match metrics_listen {
        Some(address) => Some(
            crate::metrics::start(address)
                .await
                .map_err(|source| StartupError::Listen {
                    address,
                    flag: "the /metrics address: move it with --metrics-listen, or turn it off with --metrics-listen off",
                    source,
                })?,
        ),
        None => None,
    };
    let result = service(
        listener,
        Box::pin(async move {
            let signal = stop.await;
            tracing::info!(signal, "stop signal received");
        }),
    )
    .await;
    if let Some(metrics) = metrics {
        metrics.stop();
    }
    result
}
