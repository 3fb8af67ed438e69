//! A2A: the agent-to-agent protocol (A2A 1.0, JSON-RPC with server-sent events) served on a port
//! of its own, for agents and frameworks that call remote agents.

use std::net::SocketAddr;
use std::time::Duration;

use clap::Args;
use shared::config::{Bound, Bounded, bound, parse_duration};

use super::{KIB, MIB, secs};

/// A2A (off unless `--a2a-listen` is set).
#[derive(Debug, Clone, PartialEq, Eq, Args)]
#[command(next_help_heading = "A2A")]
pub struct A2aSettings {
    /// Serve A2A 1.0 (JSON-RPC, with server-sent events for streams) on this address, with the
    /// TLS and credentials of the gRPC port: an agent card at /.well-known/agent-card.json, and
    /// one per named agent at /agents/NAME/.well-known/agent-card.json (unset: off).
    #[arg(long, env = "ORCHESTRATOR_A2A_LISTEN")]
    pub a2a_listen: Option<SocketAddr>,
    /// The URL callers reach A2A at when it is not its listen address (behind an Ingress:
    /// `https://agents.example.com`); the agent cards name it (unset: the listen address).
    #[arg(long, env = "ORCHESTRATOR_A2A_PUBLIC_URL", value_name = "URL")]
    pub a2a_public_url: Option<String>,
    /// Largest A2A request body, in bytes (cap 64 MiB).
    #[arg(long, env = "ORCHESTRATOR_A2A_MAX_BODY_BYTES", default_value_t = 4 * MIB)]
    pub a2a_max_body_bytes: usize,
    /// How long A2A waits for a request's head (a client that sends it slower holds a connection
    /// for nothing) (cap 5m).
    #[arg(long, env = "ORCHESTRATOR_A2A_HEADER_TIMEOUT", default_value = "10s", value_parser = parse_duration)]
    pub a2a_header_timeout: Duration,
}

impl Bounded for A2aSettings {
    fn bounds(&self) -> Vec<Bound> {
        vec![
            bound("a2a_max_body_bytes", self.a2a_max_body_bytes, KIB, 64 * MIB),
            bound("a2a_header_timeout", self.a2a_header_timeout, secs(1), secs(300)),
        ]
    }
}
