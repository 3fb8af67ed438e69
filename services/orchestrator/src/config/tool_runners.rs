//! Where the tool-runners are ([`Target`]) and how calls reach them (retries, TLS, the token).

use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

use clap::Args;
use shared::config::{Bound, Bounded, bound, parse_duration};
use tonic::transport::Endpoint;

use super::{KIB, MIB, ms, secs};

/// Where the tool-runners are and how calls reach them.
#[derive(Debug, Clone, Args)]
#[command(next_help_heading = "Tool-runners")]
pub struct ToolRunnerSettings {
    /// Tool-runner endpoint: http://host:port, or dns:///name:port for every address of a name
    /// (a Kubernetes headless Service), re-resolved on an interval. Repeatable; comma-separated in
    /// the environment.
    #[arg(
        long = "tool-runner",
        env = "TOOL_RUNNER_ENDPOINTS",
        value_delimiter = ',',
        default_value = "http://127.0.0.1:50052"
    )]
    pub endpoints: Vec<String>,
    /// How often the tool catalog is refreshed with ListTools (cap 1h).
    #[arg(long = "tool-refresh-interval", env = "ORCHESTRATOR_TOOL_REFRESH_INTERVAL", default_value = "30s", value_parser = parse_duration)]
    pub refresh_interval: Duration,
    /// How often dns:/// tool-runner targets are resolved again (cap 10m).
    #[arg(long = "tool-runner-resolve-interval", env = "ORCHESTRATOR_TOOL_RUNNER_RESOLVE_INTERVAL", default_value = "10s", value_parser = parse_duration)]
    pub resolve_interval: Duration,
    /// Retries of a tool call no runner ran (refused over its limit or draining; cap 10).
    #[arg(
        long = "tool-call-retries",
        env = "ORCHESTRATOR_TOOL_CALL_RETRIES",
        default_value_t = 3
    )]
    pub call_retries: u32,
    /// First delay between those retries, doubled each time (cap 5s).
    #[arg(long = "tool-call-retry-backoff", env = "ORCHESTRATOR_TOOL_CALL_RETRY_BACKOFF", default_value = "25ms", value_parser = parse_duration)]
    pub call_retry_backoff: Duration,
    /// Largest RunTool or ListTools answer taken from a tool-runner (64 KiB-256 MiB); a larger call
    /// answer fails the call (fed back to the model), a larger tool list the catalog fetch. What
    /// reaches the model is then cut to --max-tool-result-bytes.
    #[arg(long = "tool-runner-max-response-bytes", env = "ORCHESTRATOR_TOOL_RUNNER_MAX_RESPONSE_BYTES", default_value_t = 64 * MIB)]
    pub max_response_bytes: usize,
    /// Most questions one tool call may ask a person at once (an MCP server's input_required);
    /// more fail the call (cap 256).
    #[arg(
        long = "max-tool-questions",
        env = "ORCHESTRATOR_MAX_TOOL_QUESTIONS",
        default_value_t = 16
    )]
    pub max_questions: usize,
    /// PEM CA bundle that signs the tool-runners' certificates: https:// targets, and dns:///
    /// targets over TLS (their certificates must name the DNS name).
    #[arg(long = "tool-runner-ca", env = "ORCHESTRATOR_TOOL_RUNNER_CA")]
    pub ca: Option<PathBuf>,
    /// PEM client certificate presented to tool-runners that require mTLS (needs --tool-runner-key).
    #[arg(long = "tool-runner-cert", env = "ORCHESTRATOR_TOOL_RUNNER_CERT")]
    pub cert: Option<PathBuf>,
    /// PEM private key of --tool-runner-cert.
    #[arg(long = "tool-runner-key", env = "ORCHESTRATOR_TOOL_RUNNER_KEY")]
    pub key: Option<PathBuf>,
    /// File holding the bearer token sent to tool-runners started with --auth-tokens.
    #[arg(long = "tool-runner-token-file", env = "ORCHESTRATOR_TOOL_RUNNER_TOKEN_FILE")]
    pub token_file: Option<PathBuf>,
}

impl Bounded for ToolRunnerSettings {
    fn bounds(&self) -> Vec<Bound> {
        vec![
            bound("refresh_interval", self.refresh_interval, secs(1), secs(3600)),
            bound("resolve_interval", self.resolve_interval, ms(100), secs(600)),
            bound("call_retries", self.call_retries, 0u32, 10u32),
            bound("call_retry_backoff", self.call_retry_backoff, Duration::ZERO, secs(5)),
            bound("max_response_bytes", self.max_response_bytes, 64 * KIB, 256 * MIB),
            bound(
                "max_questions",
                self.max_questions,
                1usize,
                crate::domain::input::MAX_QUESTIONS,
            ),
        ]
    }
}

/// Where tool-runners are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    /// One endpoint, `http://host:port`.
    Static(String),
    /// Every address a DNS name resolves to, on `port`.
    Dns {
        /// The name, e.g. `tool-runner.tools.svc.cluster.local`.
        host: String,
        /// The port of every address.
        port: u16,
    },
}

impl FromStr for Target {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let s = s.trim();
        if let Some(rest) = s.strip_prefix("dns://") {
            // dns:///name:port (the authority, a DNS server, is not supported: the system resolver is used).
            let Some(name_port) = rest.strip_prefix('/') else {
                return Err(format!(
                    "{s:?}: use dns:///name:port (a DNS server in the authority is not supported)"
                ));
            };
            let (host, port) = name_port
                .rsplit_once(':')
                .ok_or_else(|| format!("{s:?}: the port is missing (dns:///name:port)"))?;
            let port = port.parse().map_err(|_| format!("{s:?}: {port:?} is not a port"))?;
            if host.is_empty() {
                return Err(format!("{s:?}: the name is empty"));
            }
            return Ok(Self::Dns {
                host: host.to_owned(),
                port,
            });
        }
        if s.starts_with("http://") || s.starts_with("https://") {
            Endpoint::from_shared(s.to_owned()).map_err(|e| format!("{s:?}: {e}"))?;
            return Ok(Self::Static(s.trim_end_matches('/').to_owned()));
        }
        Err(format!("{s:?}: use http://host:port or dns:///name:port"))
    }
}
