//! Serving and draining: the listen addresses, the request size, the drain's grace periods.

use std::net::SocketAddr;
use std::time::Duration;

use clap::Args;
use shared::config::{Bound, Bounded, bound, parse_duration};

use super::{KIB, MIB, secs};

/// Serving and draining.
#[derive(Debug, Clone, Args)]
#[command(next_help_heading = "Serving")]
pub struct ServerSettings {
    /// gRPC listen address.
    #[arg(long, env = "ORCHESTRATOR_LISTEN", default_value = "127.0.0.1:50051")]
    pub listen: SocketAddr,
    /// Prometheus /metrics listen address, or `off`.
    #[arg(long, env = "ORCHESTRATOR_METRICS_LISTEN", default_value = "127.0.0.1:9464")]
    pub metrics_listen: shared::metrics::OptionalListen,
    /// Largest Orchestrate request in bytes (cap 64 MiB).
    #[arg(long, env = "ORCHESTRATOR_MAX_REQUEST_BYTES", default_value_t = 4 * MIB)]
    pub max_request_bytes: usize,
    /// After SIGTERM/SIGINT, how long runs may take to finish before they are canceled (cap 1h).
    #[arg(long, env = "ORCHESTRATOR_SHUTDOWN_GRACE", default_value = "30s", value_parser = parse_duration)]
    pub shutdown_grace: Duration,
    /// With the NATS store: after SIGTERM/SIGINT, how long each run has to reach its next safe
    /// point (a turn's calls assembled, or its end) before it is handed over from its last
    /// checkpoint anyway; another replica resumes it at once (cap 10m, and within
    /// --shutdown-grace).
    #[arg(long, env = "ORCHESTRATOR_HAND_OVER_GRACE", default_value = "10s", value_parser = parse_duration)]
    pub hand_over_grace: Duration,
}

impl Bounded for ServerSettings {
    fn bounds(&self) -> Vec<Bound> {
        vec![
            bound("max_request_bytes", self.max_request_bytes, KIB, 64 * MIB),
            bound("shutdown_grace", self.shutdown_grace, Duration::ZERO, secs(3600)),
            bound("hand_over_grace", self.hand_over_grace, Duration::ZERO, secs(600)),
        ]
    }
}
