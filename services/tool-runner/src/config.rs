//! The runner's settings, in sections. Each section is a clap `Args` struct that *is* the
//! configuration: a field's flag, environment variable, default and doc are in its attribute and
//! doc comment, and its range in the section's [`Bounded::bounds`] table (the flag an error names
//! comes from the struct). Adding a setting touches one struct.
//!
//! [`Config::default`] is what the flags declare, whatever the environment holds; the binary
//! reads the flags and their environment variables into the same structs; tests build it directly.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::Args;
use shared::config::{Bound, Bounded, bound, parse_duration};
use shared::telemetry::LogFormat;

use crate::Error;

const KIB: usize = 1024;
const MIB: u64 = 1024 * 1024;
const fn secs(n: u64) -> Duration {
    Duration::from_secs(n)
}

/// Everything `run` needs; the flags of `serve`.
#[derive(Debug, Clone, Args)]
pub struct Config {
    /// TOML file of settings whose keys are these long flags (`max-concurrency = 64`, lists for
    /// repeatable ones); a flag or its environment variable wins over the file.
    #[arg(long = "config", env = "TOOL_RUNNER_CONFIG", value_name = "FILE")]
    pub config_file: Option<PathBuf>,
    #[allow(missing_docs)]
    #[command(flatten)]
    pub server: ServerSettings,
    /// TOML manifest of command tools; built-ins only without it.
    #[arg(long, env = "TOOL_RUNNER_TOOLS_MANIFEST", help_heading = "Tools")]
    pub tools_manifest: Option<PathBuf>,
    #[allow(missing_docs)]
    #[command(flatten)]
    pub builtins: BuiltinSettings,
    #[allow(missing_docs)]
    #[command(flatten)]
    pub arg_limits: ArgLimits,
    #[allow(missing_docs)]
    #[command(flatten)]
    pub fence: FenceSettings,
    #[allow(missing_docs)]
    #[command(flatten)]
    pub telemetry: TelemetrySettings,
    #[allow(missing_docs)]
    #[command(flatten)]
    pub security: SecuritySettings,
}

shared::security_settings!("TOOL_RUNNER");

/// Serving, admission and draining.
#[derive(Debug, Clone, Args)]
#[command(next_help_heading = "Serving")]
pub struct ServerSettings {
    /// gRPC listen address.
    #[arg(long, env = "TOOL_RUNNER_LISTEN", default_value = "127.0.0.1:50052")]
    pub listen: SocketAddr,
    /// Prometheus /metrics listen address, or `off`.
    #[arg(long, env = "TOOL_RUNNER_METRICS_LISTEN", default_value = "127.0.0.1:9465")]
    pub metrics_listen: shared::metrics::OptionalListen,
    /// RunTool calls in flight before new ones get RESOURCE_EXHAUSTED (cap 10000).
    #[arg(long, env = "TOOL_RUNNER_MAX_CONCURRENCY", default_value_t = 64)]
    pub max_concurrency: usize,
    /// After SIGTERM/SIGINT, how long in-flight calls may take to finish (cap 1h).
    #[arg(long, env = "TOOL_RUNNER_SHUTDOWN_GRACE", default_value = "30s", value_parser = parse_duration)]
    pub shutdown_grace: Duration,
}

impl Bounded for ServerSettings {
    fn bounds(&self) -> Vec<Bound> {
        vec![
            bound("max_concurrency", self.max_concurrency, 1usize, 10_000usize),
            bound("shutdown_grace", self.shutdown_grace, Duration::ZERO, secs(3600)),
        ]
    }
}

/// Settings of the built-in tools.
#[derive(Debug, Clone, Args)]
#[command(next_help_heading = "Built-in tools")]
pub struct BuiltinSettings {
    /// Longest sleep the `sleep` tool allows (cap 1h); the schema's `maximum` for `ms`.
    #[arg(long, env = "TOOL_RUNNER_SLEEP_MAX", default_value = "60s", value_parser = parse_duration)]
    pub sleep_max: Duration,
    /// Root directory of read_file / list_dir; both are off without it.
    #[arg(long, env = "TOOL_RUNNER_SANDBOX_ROOT")]
    pub sandbox_root: Option<PathBuf>,
    /// Largest file read_file returns, in bytes (cap 16 MiB); longer files are cut and say so.
    #[arg(long, env = "TOOL_RUNNER_READ_MAX_BYTES", default_value_t = MIB)]
    pub read_max_bytes: u64,
    /// Most entries list_dir returns (cap 100000).
    #[arg(long, env = "TOOL_RUNNER_LIST_MAX_ENTRIES", default_value_t = 1000)]
    pub list_max_entries: usize,
    /// Host http_get may fetch from (repeatable; `*.example.com` for subdomains); off when none.
    #[arg(
        long = "http-allow-host",
        env = "TOOL_RUNNER_HTTP_ALLOW_HOSTS",
        value_delimiter = ','
    )]
    pub http_allow_hosts: Vec<String>,
    /// Addresses http_get may reach although they are loopback, link-local, private, CGNAT,
    /// multicast or unspecified, as CIDRs (repeatable; e.g. 10.20.0.0/16, fd00::/8).
    #[arg(
        long = "http-allow-cidr",
        env = "TOOL_RUNNER_HTTP_ALLOW_CIDRS",
        value_delimiter = ','
    )]
    pub http_allow_cidrs: Vec<ipnet::IpNet>,
    /// Ports http_get may reach (repeatable).
    #[arg(
        long = "http-allow-port",
        env = "TOOL_RUNNER_HTTP_ALLOW_PORTS",
        value_delimiter = ',',
        default_value = "80,443"
    )]
    pub http_allow_ports: Vec<u16>,
    /// Largest body http_get returns, in bytes (cap 16 MiB); longer bodies are cut and say so.
    #[arg(long, env = "TOOL_RUNNER_HTTP_MAX_BYTES", default_value_t = MIB)]
    pub http_max_bytes: u64,
    /// Timeout of built-ins that do I/O: read_file, list_dir, http_get (cap 10m).
    #[arg(long, env = "TOOL_RUNNER_IO_TIMEOUT", default_value = "30s", value_parser = parse_duration)]
    pub io_timeout: Duration,
}

impl Bounded for BuiltinSettings {
    fn bounds(&self) -> Vec<Bound> {
        vec![
            bound("sleep_max", self.sleep_max, Duration::ZERO, secs(3600)),
            bound("read_max_bytes", self.read_max_bytes, 1u64, 16 * MIB),
            bound("list_max_entries", self.list_max_entries, 1usize, 100_000usize),
            bound("http_max_bytes", self.http_max_bytes, 1u64, 16 * MIB),
            bound("io_timeout", self.io_timeout, Duration::from_millis(1), secs(600)),
        ]
    }
}

/// Limits on the arguments of any call, checked before its schema.
#[derive(Debug, Clone, Copy, Args)]
#[command(next_help_heading = "Arguments")]
pub struct ArgLimits {
    /// Largest arguments_json in bytes (cap 16 MiB).
    #[arg(long = "max-argument-bytes", env = "TOOL_RUNNER_MAX_ARGUMENT_BYTES", default_value_t = 1024 * KIB)]
    pub max_bytes: usize,
    /// Deepest JSON nesting of arguments (cap 128, serde_json's own recursion limit).
    #[arg(long = "max-json-depth", env = "TOOL_RUNNER_MAX_JSON_DEPTH", default_value_t = 64)]
    pub max_depth: usize,
}

impl Bounded for ArgLimits {
    fn bounds(&self) -> Vec<Bound> {
        vec![
            bound("max_bytes", self.max_bytes, 2usize, 16 * 1024 * KIB),
            bound("max_depth", self.max_depth, 1usize, 128usize),
        ]
    }
}

/// The run fence and the call records: where a durable call's epoch is checked before its tool
/// runs, and where it is recorded so that it runs once.
#[derive(Debug, Clone, Args)]
#[command(next_help_heading = "Run fence and call records")]
pub struct FenceSettings {
    /// The orchestrators' run store (`nats://host:4222`, `tls://…`, or a comma-separated seed
    /// list; `user:password@` or `token@` are held apart from the address): a durable call whose
    /// epoch is older than its run's is refused FAILED_PRECONDITION before its tool runs, and each
    /// durable call is recorded there (--call-records). Unset: calls are not checked.
    #[arg(long = "run-store", env = "TOOL_RUNNER_RUN_STORE", value_name = "URL")]
    pub run_store: Option<String>,
    /// The orchestrators' --run-store-bucket.
    #[arg(
        long = "run-store-bucket",
        env = "TOOL_RUNNER_RUN_STORE_BUCKET",
        default_value = "orchestrator-runs"
    )]
    pub bucket: String,
    /// Longest wait for a run's fence (cap 60s); past it the call is refused UNAVAILABLE, unrun,
    /// and the orchestrator sends it to another runner. Must be shorter than the orchestrators'
    /// --run-fence-grace (2s by default): checked when the store is first read, and durable calls
    /// are refused, naming both, while it is not.
    #[arg(long = "run-store-timeout", env = "TOOL_RUNNER_RUN_STORE_TIMEOUT", default_value = "1s", value_parser = parse_duration)]
    pub timeout: Duration,
    /// Record each durable call in the run store where it runs (started, then its outcome), so
    /// that a call sent again (after its run moved, or its answer was lost) is answered from the
    /// record instead of running twice: one write before the tool starts and one after.
    /// `false`: a call in flight when its run moves may run again.
    #[arg(long = "call-records", env = "TOOL_RUNNER_CALL_RECORDS", default_value_t = true, action = clap::ArgAction::Set)]
    pub records: bool,
    /// How long this runner's liveness in the run store may go unrenewed (renewed every third of
    /// it; 3s–5m) before other runners count a durable call it started and never answered as in
    /// doubt. A runner that has not renewed it within two thirds of it starts no durable call.
    #[arg(long = "runner-lease", env = "TOOL_RUNNER_RUNNER_LEASE", default_value = "15s", value_parser = parse_duration)]
    pub runner_lease: Duration,
    /// Largest outcome kept in a durable call's record (cap 900 KiB, under NATS's default
    /// payload limit); a larger one is answered to its caller, and an error naming this bound is
    /// kept in its place, so the call sent again is answered with that error, not run again.
    #[arg(long = "call-record-max-bytes", env = "TOOL_RUNNER_CALL_RECORD_MAX_BYTES", default_value_t = 256 * KIB)]
    pub record_max_bytes: usize,
    /// NATS credentials file (.creds) for the run store.
    #[arg(long = "nats-credentials", env = "TOOL_RUNNER_NATS_CREDENTIALS", value_name = "FILE")]
    pub credentials: Option<PathBuf>,
    /// Require TLS to NATS.
    #[arg(long = "nats-tls", env = "TOOL_RUNNER_NATS_TLS")]
    pub tls_required: bool,
    /// Extra root certificates (PEM) for TLS to NATS.
    #[arg(long = "nats-ca-file", env = "TOOL_RUNNER_NATS_CA_FILE", value_name = "FILE")]
    pub ca_file: Option<PathBuf>,
}

impl Bounded for FenceSettings {
    fn bounds(&self) -> Vec<Bound> {
        vec![
            bound("timeout", self.timeout, Duration::from_millis(1), secs(60)),
            bound("runner_lease", self.runner_lease, secs(3), secs(300)),
            bound("record_max_bytes", self.record_max_bytes, KIB, 900 * KIB),
        ]
    }
}

impl FenceSettings {
    /// The run store's address, when one is set: `nats://` or `tls://` servers, their
    /// credentials held apart (the NATS client logs its addresses; it never sees them).
    pub fn store(&self) -> Result<Option<shared::secrets::NatsUrl>, Error> {
        let Some(raw) = self.run_store.as_deref().map(str::trim).filter(|s| !s.is_empty()) else {
            return Ok(None);
        };
        for seed in raw.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            if !seed.starts_with("nats://") && !seed.starts_with("tls://") {
                return Err(Error::Config(format!(
                    "--run-store {:?}: use nats://host:port or tls://host:port",
                    shared::secrets::without_userinfo(seed)
                )));
            }
        }
        shared::secrets::NatsUrl::parse(raw)
            .map(Some)
            .map_err(|e| Error::Config(format!("--run-store: {e}")))
    }
}

/// Logs and traces.
#[derive(Debug, Clone, Args)]
#[command(next_help_heading = "Telemetry")]
pub struct TelemetrySettings {
    /// Log format: text or json.
    #[arg(long, env = "TOOL_RUNNER_LOG_FORMAT", default_value = "text")]
    pub log_format: LogFormat,
    /// Record tool arguments and results on spans (off by default: they may hold secrets).
    #[arg(long, env = "TOOL_RUNNER_TRACE_TOOL_PAYLOADS")]
    pub trace_tool_payloads: bool,
    /// Size cap of each recorded payload, in bytes (cap 64 KiB).
    #[arg(long, env = "TOOL_RUNNER_TRACE_PAYLOAD_MAX_BYTES", default_value_t = KIB)]
    pub trace_payload_max_bytes: usize,
}

impl TelemetrySettings {
    /// How many bytes of tool payloads spans record; `None`: none.
    pub fn trace_payloads(&self) -> Option<usize> {
        self.trace_tool_payloads.then_some(self.trace_payload_max_bytes)
    }
}

impl Bounded for TelemetrySettings {
    fn bounds(&self) -> Vec<Bound> {
        let size = bound(
            "trace_payload_max_bytes",
            self.trace_payload_max_bytes,
            1usize,
            64 * KIB,
        );
        self.trace_tool_payloads.then_some(size).into_iter().collect()
    }
}

impl Bounded for Config {
    fn bounds(&self) -> Vec<Bound> {
        let sections = [
            self.server.bounds(),
            self.builtins.bounds(),
            self.arg_limits.bounds(),
            self.fence.bounds(),
            self.telemetry.bounds(),
            self.security.bounds(),
        ];
        sections.into_iter().flatten().collect()
    }
}

impl Default for Config {
    fn default() -> Self {
        shared::config::defaults()
    }
}

impl Config {
    /// Checks every limit against its range; the error names the flag.
    pub fn validate(&self) -> Result<(), Error> {
        self.check_bounds()?;
        self.fence.store()?;
        self.security.options().map_err(Error::Config)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_defaults_are_valid() {
        assert!(Config::default().validate().is_ok());
    }

    /// The fence read ends within the orchestrators' default grace as the runner ships.
    #[test]
    fn the_default_fence_read_is_the_shared_one() {
        assert_eq!(Config::default().fence.timeout, shared::fence::DEFAULT_READ_TIMEOUT);
    }

    /// Every row of the table, through the real flags, on both sides of both edges.
    #[test]
    fn every_bound_holds_on_both_sides() {
        let validate = |c: &Config| c.validate().map_err(|e| e.to_string());
        let companions = |flag: &str| match flag {
            "--trace-payload-max-bytes" => vec!["--trace-tool-payloads".to_owned()],
            _ => Vec::new(),
        };
        assert_eq!(shared::config::check_every_bound(validate, companions), Ok(()));
    }

    /// The run store is a NATS address (or a seed list) whose credentials are held apart; any
    /// other scheme is refused naming the flag, without the credentials.
    #[test]
    fn the_run_store_is_a_nats_address_with_its_credentials_held_apart() {
        let with = |store: &str| {
            let mut config = Config::default();
            config.fence.run_store = Some(store.to_owned());
            config
                .validate()
                .and_then(|()| config.fence.store())
                .map(|url| url.map(|u| (u.seeds().join(" "), u.auth().is_some())))
                .map_err(|e| e.to_string())
        };
        assert_eq!(with(""), Ok(None));
        assert_eq!(
            with("nats://a:4222, tls://b:4222"),
            Ok(Some(("nats://a:4222 tls://b:4222".to_owned(), false)))
        );
        assert_eq!(
            with("nats://runner:s3cret@a:4222"),
            Ok(Some(("nats://a:4222".to_owned(), true)))
        );
        let refused = with("http://runner:s3cret@a:4222").unwrap_err();
        assert!(
            refused.contains("use nats://host:port") && !refused.contains("s3cret"),
            "{refused}"
        );
    }
}
