//! NATS: which backend a signal topic or result store uses, and how to reach NATS.

use std::path::PathBuf;

use clap::Args;

/// Where signals or results go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Backend {
    /// In this process (the default).
    Memory,
    /// A NATS server with JetStream, `nats://host:4222` (or `tls://…`); credentials in the URL
    /// (`nats://user:password@…`, `nats://token@…`) are held apart from the address.
    Nats(shared::secrets::NatsUrl),
}

impl std::str::FromStr for Backend {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim() {
            "" | "memory" => Ok(Self::Memory),
            url if url.starts_with("nats://") || url.starts_with("tls://") => {
                shared::secrets::NatsUrl::parse(url).map(Self::Nats)
            }
            other => Err(format!(
                "{:?}: use memory or nats://host:port",
                shared::secrets::without_userinfo(other)
            )),
        }
    }
}

/// How to reach NATS (the signal topic and the result store share one connection per URL).
#[derive(Debug, Clone, Args)]
#[command(next_help_heading = "NATS")]
pub struct NatsSettings {
    /// NATS credentials file (.creds).
    #[arg(long = "nats-credentials", env = "NATS_CREDENTIALS")]
    pub credentials: Option<PathBuf>,
    /// Require TLS to NATS.
    #[arg(long = "nats-tls", env = "NATS_TLS")]
    pub tls_required: bool,
    /// Extra root certificates (PEM) for TLS to NATS.
    #[arg(long = "nats-ca-file", env = "NATS_CA_FILE")]
    pub ca_file: Option<PathBuf>,
    /// Copies JetStream keeps of every stream and bucket the orchestrator uses (results,
    /// checkpoints, approvals, event logs, signals): 3 on a three-node cluster survives the loss
    /// of a node. Streams are created with it, and existing ones are brought to it at start
    /// (1..=5; more than 1 needs a JetStream cluster).
    #[arg(long = "nats-replicas", env = "NATS_REPLICAS", default_value_t = 1)]
    pub replicas: usize,
}

impl shared::config::Bounded for NatsSettings {
    fn bounds(&self) -> Vec<shared::config::Bound> {
        vec![shared::config::bound("replicas", self.replicas, 1usize, 5usize)]
    }
}
