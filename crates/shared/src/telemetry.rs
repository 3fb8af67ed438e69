//! Logging setup shared by both binaries: `tracing` with an env filter (`RUST_LOG`, default
//! `info`) and either human-readable text or one JSON object per line for log shippers.

use std::str::FromStr;

use tracing_subscriber::EnvFilter;

/// How log lines are written to stderr.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LogFormat {
    /// Human-readable, for terminals.
    #[default]
    Text,
    /// One JSON object per line, for machines.
    Json,
}

impl FromStr for LogFormat {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "text" => Ok(Self::Text),
            "json" => Ok(Self::Json),
            other => Err(format!("unknown log format {other:?} (expected text or json)")),
        }
    }
}

/// Installs the global subscriber. `RUST_LOG` overrides `default_filter`. Calling it twice is
/// harmless (the second call does nothing), so tests that start services in-process may call it.
pub fn init_logging(format: LogFormat, default_filter: &str) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_filter));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let _already_set = match format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder.json().flatten_event(true).with_current_span(true).try_init(),
    };
}
