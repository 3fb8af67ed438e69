//! Prometheus metrics: the process-wide recorder (`metrics` + `metrics-exporter-prometheus`) and a
//! small HTTP server for `/metrics` on its own port. Histograms of seconds get buckets from 1 ms
//! to 5 min.

use std::future::Future;

use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};

/// Bucket bounds (seconds) for every histogram.
const BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
];

/// Installs the global recorder; metrics macros are no-ops until this is called.
pub fn install() -> Result<PrometheusHandle, String> {
    PrometheusBuilder::new()
        .set_buckets(BUCKETS)
        .map_err(|e| format!("metrics buckets: {e}"))?
        .install_recorder()
        .map_err(|e| format!("cannot install the metrics recorder: {e}"))
}

/// Serves `GET /metrics` (Prometheus text format) on `listener` until `shutdown` resolves.
pub async fn serve(
    listener: tokio::net::TcpListener,
    handle: PrometheusHandle,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let app = axum::Router::new().route(
        "/metrics",
        axum::routing::get(move || {
            let handle = handle.clone();
            async move {
                handle.run_upkeep();
                (
                    [(axum::http::header::CONTENT_TYPE, "text/plain; version=0.0.4")],
                    handle.render(),
                )
            }
        }),
    );
    axum::serve(listener, app).with_graceful_shutdown(shutdown).await
}

/// The running `/metrics` server; [`MetricsServer::stop`] ends it.
pub struct MetricsServer {
    stop: tokio::sync::oneshot::Sender<()>,
}

impl MetricsServer {
    /// Stops serving.
    pub fn stop(self) {
        let _ = self.stop.send(());
    }
}

/// Installs the recorder and serves `/metrics` on `address` (logging the bound address).
pub async fn start(address: std::net::SocketAddr) -> std::io::Result<MetricsServer> {
    let handle = install().map_err(std::io::Error::other)?;
    let listener = tokio::net::TcpListener::bind(address).await?;
    tracing::info!(address = %listener.local_addr()?, "metrics serving on /metrics");
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(serve(listener, handle, async move {
        let _ = stopped.await;
    }));
    Ok(MetricsServer { stop })
}

/// A listen address that can be switched off (`off`, `none` or empty), for flags.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OptionalListen(pub Option<std::net::SocketAddr>);

impl std::str::FromStr for OptionalListen {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim() {
            "" | "off" | "none" => Ok(Self(None)),
            other => other
                .parse()
                .map(|a| Self(Some(a)))
                .map_err(|e| format!("invalid listen address {other:?}: {e} (or `off`)")),
        }
    }
}

/// Keeps a gauge one higher while alive (runs, calls in flight), so every way out of the work it
/// guards, panics and cancellation included, brings the gauge back down.
pub struct InFlight(&'static str);

impl InFlight {
    /// Increments `gauge` until dropped.
    pub fn new(gauge: &'static str) -> Self {
        metrics::gauge!(gauge).increment(1.0);
        Self(gauge)
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        metrics::gauge!(self.0).decrement(1.0);
    }
}
