//! Webhooks: where the orchestrator may deliver them (the egress rules `http_get` keeps), how
//! long one attempt may take, how often and how long a delivery is tried, and how much may wait.

use std::time::Duration;

use clap::Args;
use shared::config::{Bound, Bounded, bound, parse_duration};

use super::secs;

/// Webhook deliveries (registered with `CreateWebhook`).
#[derive(Debug, Clone, PartialEq, Eq, Args)]
#[command(next_help_heading = "Webhooks")]
pub struct WebhookSettings {
    /// Address ranges webhooks may be delivered to although they are loopback, link-local,
    /// private, CGNAT, multicast or unspecified, as CIDRs (repeatable; e.g. 10.20.0.0/16). A
    /// registration or delivery to any other such address is refused.
    #[arg(
        long = "webhook-allow-cidr",
        env = "ORCHESTRATOR_WEBHOOK_ALLOW_CIDRS",
        value_delimiter = ','
    )]
    pub webhook_allow_cidrs: Vec<ipnet::IpNet>,
    /// Ports webhooks may be delivered to (repeatable).
    #[arg(
        long = "webhook-allow-port",
        env = "ORCHESTRATOR_WEBHOOK_ALLOW_PORTS",
        value_delimiter = ',',
        default_value = "80,443"
    )]
    pub webhook_allow_ports: Vec<u16>,
    /// Longest wait for a receiver's answer to one delivery attempt (cap 1m).
    #[arg(long, env = "ORCHESTRATOR_WEBHOOK_TIMEOUT", default_value = "10s", value_parser = parse_duration)]
    pub webhook_timeout: Duration,
    /// Attempts of one delivery before it is given up as failed (cap 50).
    #[arg(long, env = "ORCHESTRATOR_WEBHOOK_MAX_ATTEMPTS", default_value_t = 10)]
    pub webhook_max_attempts: u32,
    /// Longest wait between two attempts (the wait doubles from 1s up to it) (cap 1h).
    #[arg(long, env = "ORCHESTRATOR_WEBHOOK_MAX_BACKOFF", default_value = "5m", value_parser = parse_duration)]
    pub webhook_max_backoff: Duration,
    /// Deliveries one webhook may have waiting; past them a new one is dropped, and its record
    /// says so (cap 100000).
    #[arg(long, env = "ORCHESTRATOR_WEBHOOK_MAX_PENDING", default_value_t = 1000)]
    pub webhook_max_pending: usize,
    /// Webhooks one principal may register (cap 10000).
    #[arg(long, env = "ORCHESTRATOR_MAX_WEBHOOKS", default_value_t = 100)]
    pub max_webhooks: usize,
    /// Deliveries attempted at once by this replica (cap 1024).
    #[arg(long, env = "ORCHESTRATOR_WEBHOOK_MAX_IN_FLIGHT", default_value_t = 64)]
    pub webhook_max_in_flight: usize,
    /// How often this replica looks for deliveries due again (a retry, or one a stopped replica
    /// left) (cap 1m).
    #[arg(long, env = "ORCHESTRATOR_WEBHOOK_SWEEP_INTERVAL", default_value = "2s", value_parser = parse_duration)]
    pub webhook_sweep_interval: Duration,
    /// Delivery records one listing reads (narrow it by webhook or run to see past them)
    /// (cap 10000).
    #[arg(long, env = "ORCHESTRATOR_WEBHOOK_MAX_LISTED", default_value_t = 1000)]
    pub webhook_max_listed: usize,
    /// How long a delivery's record is kept after its last change (cap 30d).
    #[arg(long, env = "ORCHESTRATOR_WEBHOOK_KEEP", default_value = "24h", value_parser = parse_duration)]
    pub webhook_keep: Duration,
}

impl Bounded for WebhookSettings {
    fn bounds(&self) -> Vec<Bound> {
        vec![
            bound("webhook_timeout", self.webhook_timeout, secs(1), secs(60)),
            bound("webhook_max_attempts", self.webhook_max_attempts, 1u32, 50u32),
            bound("webhook_max_backoff", self.webhook_max_backoff, secs(1), secs(3600)),
            bound("webhook_max_pending", self.webhook_max_pending, 1usize, 100_000usize),
            bound("max_webhooks", self.max_webhooks, 1usize, 10_000usize),
            bound("webhook_max_in_flight", self.webhook_max_in_flight, 1usize, 1024usize),
            bound(
                "webhook_sweep_interval",
                self.webhook_sweep_interval,
                Duration::from_millis(100),
                secs(60),
            ),
            bound("webhook_max_listed", self.webhook_max_listed, 1usize, 10_000usize),
            bound("webhook_keep", self.webhook_keep, secs(60), secs(30 * 86_400)),
        ]
    }
}
