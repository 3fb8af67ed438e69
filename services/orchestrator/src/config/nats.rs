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
    Nats(crate::secrets::NatsUrl),
}

impl std::str::FromStr for Backend {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim() {
            "" | "memory" => Ok(Self::Memory),
            url if url.starts_with("nats://") || url.starts_with("tls://") => {
                crate::secrets::NatsUrl::parse(url).map(Self::Nats)
            }
            other => Err(format!(
                "{:?}: use memory or nats://host:port",
                crate::secrets::without_userinfo(other)
            )),
        }
    }
}

/// How to reach NATS (the signal topic and the result store share one connection per URL).
#[derive(Debug, Clone, Default, Args)]
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
}
