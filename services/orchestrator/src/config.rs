//! The orchestrator's configuration: defaults, the caps every limit is checked against, and the
//! per-run limits (a default used when a request sets none, and a ceiling a request may not pass).

use std::time::Duration;

use shared::config::{check_duration, check_range};

use crate::Error;
use crate::llm::ToolDefinition;
use crate::llm::client::LlmConfig;
use crate::run::loop_detector::DetectorConfig;
use crate::run::{HARD_MAX_TURNS, Limits};
use crate::runs::RunsConfig;

/// Defaults and caps of every limit.
pub mod limits {
    use std::time::Duration;

    /// Default per-run `max_turns`.
    pub const MAX_TURNS: u32 = 16;
    /// Default per-run tool-call budget.
    pub const TOOL_CALL_BUDGET: u32 = 64;
    /// Cap of the budget ceiling.
    pub const TOOL_CALL_BUDGET_CAP: u32 = 100_000;
    /// Default failing turns tolerated.
    pub const MAX_TOOL_FAILURES: u32 = 3;
    /// Cap of the failure ceiling.
    pub const MAX_TOOL_FAILURES_CAP: u32 = 10_000;
    /// Default tool-call timeout.
    pub const TOOL_TIMEOUT: Duration = Duration::from_secs(60);
    /// Cap of the tool timeout ceiling.
    pub const TOOL_TIMEOUT_CAP: Duration = Duration::from_secs(3600);
    /// Default run deadline.
    pub const RUN_TIMEOUT: Duration = Duration::from_secs(600);
    /// Cap of the run deadline ceiling (24 h).
    pub const RUN_TIMEOUT_CAP: Duration = Duration::from_secs(86_400);
    /// Default run slots.
    pub const MAX_RUNS: usize = 256;
    /// Cap on run slots.
    pub const MAX_RUNS_CAP: usize = 100_000;
    /// Default finished results kept.
    pub const KEEP_RESULTS: usize = 10_000;
    /// Cap on finished results kept.
    pub const KEEP_RESULTS_CAP: usize = 1_000_000;
    /// Default age of kept results.
    pub const KEEP_RESULTS_FOR: Duration = Duration::from_secs(3600);
    /// Cap on the age of kept results (7 days).
    pub const KEEP_RESULTS_FOR_CAP: Duration = Duration::from_secs(7 * 86_400);
    /// Default LLM idle timeout.
    pub const LLM_IDLE_TIMEOUT: Duration = Duration::from_secs(60);
    /// Cap on the LLM idle timeout.
    pub const LLM_IDLE_TIMEOUT_CAP: Duration = Duration::from_secs(3600);
    /// Default LLM connect timeout.
    pub const LLM_CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
    /// Cap on the LLM connect timeout.
    pub const LLM_CONNECT_TIMEOUT_CAP: Duration = Duration::from_secs(300);
    /// Default LLM retries before the first byte.
    pub const LLM_MAX_RETRIES: u32 = 3;
    /// Cap on LLM retries.
    pub const LLM_MAX_RETRIES_CAP: u32 = 10;
    /// Default first retry delay.
    pub const LLM_RETRY_BACKOFF: Duration = Duration::from_millis(500);
    /// Cap on the first retry delay.
    pub const LLM_RETRY_BACKOFF_CAP: Duration = Duration::from_secs(60);
    /// Default longest SSE line.
    pub const LLM_MAX_LINE_BYTES: usize = 1024 * 1024;
    /// Cap on the longest SSE line.
    pub const LLM_MAX_LINE_BYTES_CAP: usize = 64 * 1024 * 1024;
    /// Default events buffered per run stream.
    pub const EVENT_BUFFER: usize = 64;
    /// Cap on the event buffer.
    pub const EVENT_BUFFER_CAP: usize = 65_536;
    /// Default signals buffered per subscriber.
    pub const SIGNAL_BUFFER: usize = 1024;
    /// Cap on the signal buffer.
    pub const SIGNAL_BUFFER_CAP: usize = 1_000_000;
    /// Default loop-detector window (lines).
    pub const LOOP_WINDOW: usize = 128;
    /// Cap on the loop-detector window.
    pub const LOOP_WINDOW_CAP: usize = 100_000;
    /// Default loop-detector threshold.
    pub const LOOP_THRESHOLD: usize = 12;
    /// Default tool catalog refresh interval.
    pub const TOOL_REFRESH: Duration = Duration::from_secs(30);
    /// Cap on the refresh interval.
    pub const TOOL_REFRESH_CAP: Duration = Duration::from_secs(3600);
    /// Default DNS re-resolution interval of `dns:///` tool-runner targets.
    pub const RESOLVE_INTERVAL: Duration = Duration::from_secs(10);
    /// Cap on the re-resolution interval.
    pub const RESOLVE_INTERVAL_CAP: Duration = Duration::from_secs(600);
    /// Default retries of a tool call no runner ran.
    pub const TOOL_CALL_RETRIES: u32 = 3;
    /// Cap on those retries.
    pub const TOOL_CALL_RETRIES_CAP: u32 = 10;
    /// Default first delay between those retries.
    pub const TOOL_CALL_RETRY_BACKOFF: Duration = Duration::from_millis(25);
    /// Cap on that delay.
    pub const TOOL_CALL_RETRY_BACKOFF_CAP: Duration = Duration::from_secs(5);
    /// Default drain grace period.
    pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(30);
    /// Cap on the grace period.
    pub const SHUTDOWN_GRACE_CAP: Duration = Duration::from_secs(3600);
    /// Default largest Orchestrate request.
    pub const MAX_REQUEST_BYTES: usize = 4 * 1024 * 1024;
    /// Cap on the largest request.
    pub const MAX_REQUEST_BYTES_CAP: usize = 64 * 1024 * 1024;
    /// Default age of signals kept by the NATS stream (7 days).
    pub const SIGNAL_STREAM_MAX_AGE: Duration = Duration::from_secs(7 * 86_400);
    /// Cap on that age (365 days).
    pub const SIGNAL_STREAM_MAX_AGE_CAP: Duration = Duration::from_secs(365 * 86_400);
    /// Default size of the NATS signal stream (1 GiB).
    pub const SIGNAL_STREAM_MAX_BYTES: i64 = 1 << 30;
    /// Default publish retries of a signal.
    pub const SIGNAL_PUBLISH_RETRIES: u32 = 6;
    /// Cap on those retries.
    pub const SIGNAL_PUBLISH_RETRIES_CAP: u32 = 30;
    /// Default first delay between publish attempts.
    pub const SIGNAL_PUBLISH_BACKOFF: Duration = Duration::from_millis(250);
    /// Cap on that delay.
    pub const SIGNAL_PUBLISH_BACKOFF_CAP: Duration = Duration::from_secs(60);
    /// Default wait for a JetStream acknowledgement.
    pub const SIGNAL_ACK_TIMEOUT: Duration = Duration::from_secs(5);
    /// Cap on that wait.
    pub const SIGNAL_ACK_TIMEOUT_CAP: Duration = Duration::from_secs(60);
    /// Default age of results kept by the NATS result store (24 h).
    pub const RUN_STORE_TTL: Duration = Duration::from_secs(86_400);
    /// Cap on that age (365 days).
    pub const RUN_STORE_TTL_CAP: Duration = Duration::from_secs(365 * 86_400);
    /// Default wait for one read or write of the result store.
    pub const STORE_TIMEOUT: Duration = Duration::from_secs(5);
    /// Cap on that wait.
    pub const STORE_TIMEOUT_CAP: Duration = Duration::from_secs(60);
    /// Default size of tool payloads recorded on spans (when turned on).
    pub const TRACE_PAYLOAD: usize = 1024;
    /// Cap on recorded tool payloads.
    pub const TRACE_PAYLOAD_CAP: usize = 64 * 1024;
}

/// Where signals or results go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Backend {
    /// In this process (the default).
    Memory,
    /// A NATS server with JetStream, `nats://host:4222` (or `tls://…`).
    Nats(String),
}

impl std::str::FromStr for Backend {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim() {
            "" | "memory" => Ok(Self::Memory),
            url if url.starts_with("nats://") || url.starts_with("tls://") => Ok(Self::Nats(url.to_owned())),
            other => Err(format!("{other:?}: use memory or nats://host:port")),
        }
    }
}

/// How to reach NATS.
#[derive(Debug, Clone, Default)]
pub struct NatsOptions {
    /// A `.creds` file (JWT + NKey seed).
    pub credentials: Option<std::path::PathBuf>,
    /// Require TLS.
    pub tls_required: bool,
    /// Extra root certificates (PEM) for TLS.
    pub ca_file: Option<std::path::PathBuf>,
}

/// Everything [`crate::run`] (the server) needs.
#[derive(Debug, Clone)]
pub struct Config {
    /// The LLM server.
    pub llm: LlmConfig,
    /// Model used when a request names none.
    pub model: String,
    /// Tool-runner endpoints (`http://host:port`).
    pub tool_runners: Vec<String>,
    /// How often the tool catalog is refreshed.
    pub tool_refresh_interval: Duration,
    /// How often `dns:///` tool-runner targets are resolved again.
    pub tool_runner_resolve_interval: Duration,
    /// Retries of a tool call no runner ran (refused over its limit or draining, or never delivered).
    pub tool_call_retries: u32,
    /// First delay between those retries (doubles per attempt).
    pub tool_call_retry_backoff: Duration,
    /// Exit tools every run offers.
    pub exit_tools: Vec<ToolDefinition>,
    /// Limits used when a request sets none.
    pub default_limits: Limits,
    /// The most a request may ask for.
    pub ceiling_limits: Limits,
    /// Run slots and kept results.
    pub runs: RunsConfig,
    /// Repeated-line detector.
    pub detector: DetectorConfig,
    /// Event batches buffered per run stream before the run waits for its reader.
    pub event_buffer: usize,
    /// Signals buffered per `SubscribeSignals` subscriber.
    pub signal_buffer: usize,
    /// Largest `Orchestrate` request, in bytes.
    pub max_request_bytes: usize,
    /// How long in-flight runs may take to finish after a stop signal.
    pub shutdown_grace: Duration,
    /// Record tool arguments and results on spans, truncated to this many bytes; `None` = off
    /// (the default: they may hold secrets).
    pub trace_payloads: Option<usize>,
    /// The signal topic's backend.
    pub signal_topic: Backend,
    /// Settings of the NATS signal topic.
    pub signals: crate::signals::nats::NatsTopicSettings,
    /// The result store's backend.
    pub run_store: Backend,
    /// Key-value bucket of the NATS result store.
    pub run_store_bucket: String,
    /// How long the NATS result store keeps a result.
    pub run_store_ttl: Duration,
    /// How long one read or write of the result store may take.
    pub store_timeout: Duration,
    /// How to reach NATS.
    pub nats: NatsOptions,
}

impl Config {
    /// A configuration talking to `llm_base_url` and `tool_runners`, everything else default.
    pub fn new(llm_base_url: &str, model: &str, tool_runners: Vec<String>) -> Self {
        let default_limits = Limits {
            max_turns: limits::MAX_TURNS,
            tool_call_budget: limits::TOOL_CALL_BUDGET,
            max_tool_failures: limits::MAX_TOOL_FAILURES,
            tool_timeout: limits::TOOL_TIMEOUT,
            run_timeout: limits::RUN_TIMEOUT,
        };
        Self {
            llm: LlmConfig {
                base_url: llm_base_url.to_owned(),
                api_key: None,
                extra_headers: Vec::new(),
                connect_timeout: limits::LLM_CONNECT_TIMEOUT,
                idle_timeout: limits::LLM_IDLE_TIMEOUT,
                max_retries: limits::LLM_MAX_RETRIES,
                retry_backoff: limits::LLM_RETRY_BACKOFF,
                max_line_bytes: limits::LLM_MAX_LINE_BYTES,
            },
            model: model.to_owned(),
            tool_runners,
            tool_refresh_interval: limits::TOOL_REFRESH,
            tool_runner_resolve_interval: limits::RESOLVE_INTERVAL,
            tool_call_retries: limits::TOOL_CALL_RETRIES,
            tool_call_retry_backoff: limits::TOOL_CALL_RETRY_BACKOFF,
            exit_tools: Vec::new(),
            default_limits,
            ceiling_limits: Limits {
                max_turns: HARD_MAX_TURNS,
                tool_call_budget: 1000,
                max_tool_failures: 100,
                tool_timeout: Duration::from_secs(600),
                run_timeout: Duration::from_secs(3600),
            },
            runs: RunsConfig {
                max_runs: limits::MAX_RUNS,
                keep_results: limits::KEEP_RESULTS,
                keep_results_for: limits::KEEP_RESULTS_FOR,
            },
            detector: DetectorConfig {
                window: limits::LOOP_WINDOW,
                threshold: limits::LOOP_THRESHOLD,
            },
            event_buffer: limits::EVENT_BUFFER,
            signal_buffer: limits::SIGNAL_BUFFER,
            max_request_bytes: limits::MAX_REQUEST_BYTES,
            shutdown_grace: limits::SHUTDOWN_GRACE,
            trace_payloads: None,
            signal_topic: Backend::Memory,
            signals: crate::signals::nats::NatsTopicSettings {
                subject_prefix: "signals".to_owned(),
                stream: "SIGNALS".to_owned(),
                max_age: limits::SIGNAL_STREAM_MAX_AGE,
                max_bytes: limits::SIGNAL_STREAM_MAX_BYTES,
                retries: limits::SIGNAL_PUBLISH_RETRIES,
                backoff: limits::SIGNAL_PUBLISH_BACKOFF,
                ack_timeout: limits::SIGNAL_ACK_TIMEOUT,
            },
            run_store: Backend::Memory,
            run_store_bucket: "orchestrator-runs".to_owned(),
            run_store_ttl: limits::RUN_STORE_TTL,
            store_timeout: limits::STORE_TIMEOUT,
            nats: NatsOptions::default(),
        }
    }

    /// Checks every limit against its range; the error names the flag.
    pub fn validate(&self) -> Result<(), Error> {
        use limits::*;
        let ms = Duration::from_millis;
        let (d, c) = (&self.default_limits, &self.ceiling_limits);
        check_range("--max-turns-ceiling", c.max_turns, 1, HARD_MAX_TURNS)?;
        check_range("--max-turns", d.max_turns, 1, c.max_turns)?;
        check_range(
            "--tool-call-budget-ceiling",
            c.tool_call_budget,
            0,
            TOOL_CALL_BUDGET_CAP,
        )?;
        check_range("--tool-call-budget", d.tool_call_budget, 0, c.tool_call_budget)?;
        check_range(
            "--max-tool-failures-ceiling",
            c.max_tool_failures,
            0,
            MAX_TOOL_FAILURES_CAP,
        )?;
        check_range("--max-tool-failures", d.max_tool_failures, 0, c.max_tool_failures)?;
        check_duration("--tool-timeout-ceiling", c.tool_timeout, ms(1), TOOL_TIMEOUT_CAP)?;
        check_duration("--tool-timeout", d.tool_timeout, ms(1), c.tool_timeout)?;
        check_duration("--run-timeout-ceiling", c.run_timeout, ms(1), RUN_TIMEOUT_CAP)?;
        check_duration("--run-timeout", d.run_timeout, ms(1), c.run_timeout)?;
        check_range("--max-runs", self.runs.max_runs, 1, MAX_RUNS_CAP)?;
        check_range("--keep-results", self.runs.keep_results, 0, KEEP_RESULTS_CAP)?;
        check_duration(
            "--keep-results-for",
            self.runs.keep_results_for,
            Duration::ZERO,
            KEEP_RESULTS_FOR_CAP,
        )?;
        check_duration("--llm-idle-timeout", self.llm.idle_timeout, ms(1), LLM_IDLE_TIMEOUT_CAP)?;
        check_duration(
            "--llm-connect-timeout",
            self.llm.connect_timeout,
            ms(1),
            LLM_CONNECT_TIMEOUT_CAP,
        )?;
        check_range("--llm-max-retries", self.llm.max_retries, 0, LLM_MAX_RETRIES_CAP)?;
        check_duration(
            "--llm-retry-backoff",
            self.llm.retry_backoff,
            Duration::ZERO,
            LLM_RETRY_BACKOFF_CAP,
        )?;
        check_range(
            "--llm-max-line-bytes",
            self.llm.max_line_bytes,
            1024,
            LLM_MAX_LINE_BYTES_CAP,
        )?;
        check_range("--event-buffer", self.event_buffer, 1, EVENT_BUFFER_CAP)?;
        check_range("--signal-buffer", self.signal_buffer, 1, SIGNAL_BUFFER_CAP)?;
        check_range("--loop-window", self.detector.window, 1, LOOP_WINDOW_CAP)?;
        check_range(
            "--loop-threshold",
            self.detector.threshold,
            2,
            self.detector.window.max(2),
        )?;
        check_duration(
            "--tool-refresh-interval",
            self.tool_refresh_interval,
            Duration::from_secs(1),
            TOOL_REFRESH_CAP,
        )?;
        check_range(
            "--max-request-bytes",
            self.max_request_bytes,
            1024,
            MAX_REQUEST_BYTES_CAP,
        )?;
        check_duration(
            "--shutdown-grace",
            self.shutdown_grace,
            Duration::ZERO,
            SHUTDOWN_GRACE_CAP,
        )?;
        check_duration(
            "--tool-runner-resolve-interval",
            self.tool_runner_resolve_interval,
            Duration::from_millis(100),
            RESOLVE_INTERVAL_CAP,
        )?;
        check_range("--tool-call-retries", self.tool_call_retries, 0, TOOL_CALL_RETRIES_CAP)?;
        check_duration(
            "--tool-call-retry-backoff",
            self.tool_call_retry_backoff,
            Duration::ZERO,
            TOOL_CALL_RETRY_BACKOFF_CAP,
        )?;
        for target in &self.tool_runners {
            target
                .parse::<crate::tool_runners::Target>()
                .map_err(|e| Error::Config(format!("--tool-runner {e}")))?;
        }
        let s = &self.signals;
        check_range("--signal-publish-retries", s.retries, 0, SIGNAL_PUBLISH_RETRIES_CAP)?;
        check_duration(
            "--signal-publish-backoff",
            s.backoff,
            Duration::ZERO,
            SIGNAL_PUBLISH_BACKOFF_CAP,
        )?;
        check_duration(
            "--signal-ack-timeout",
            s.ack_timeout,
            Duration::from_millis(10),
            SIGNAL_ACK_TIMEOUT_CAP,
        )?;
        check_duration(
            "--signal-stream-max-age",
            s.max_age,
            Duration::from_secs(1),
            SIGNAL_STREAM_MAX_AGE_CAP,
        )?;
        check_range("--signal-stream-max-bytes", s.max_bytes, -1, i64::MAX)?;
        check_duration(
            "--run-store-ttl",
            self.run_store_ttl,
            Duration::from_secs(1),
            RUN_STORE_TTL_CAP,
        )?;
        check_duration(
            "--store-timeout",
            self.store_timeout,
            Duration::from_millis(10),
            STORE_TIMEOUT_CAP,
        )?;
        let token = |t: &str| !t.is_empty() && t.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
        if !s.subject_prefix.split('.').all(token) {
            return Err(Error::Config(format!(
                "--signal-subject-prefix {:?}: dot-separated tokens of letters, digits, '_' or '-'",
                s.subject_prefix
            )));
        }
        for (flag, name) in [
            ("--signal-stream", &s.stream),
            ("--run-store-bucket", &self.run_store_bucket),
        ] {
            if !token(name) {
                return Err(Error::Config(format!("{flag} {name:?}: letters, digits, '_' or '-'")));
            }
        }
        if let Some(max) = self.trace_payloads {
            check_range("--trace-payload-max-bytes", max, 1, TRACE_PAYLOAD_CAP)?;
        }
        let mut seen = std::collections::HashSet::new();
        for tool in &self.exit_tools {
            if !shared::tools::valid_tool_name(&tool.name) {
                return Err(Error::Config(format!(
                    "--exit-tool {:?}: names are 1-64 of letters, digits, '_' or '-'",
                    tool.name
                )));
            }
            if !seen.insert(&tool.name) {
                return Err(Error::Config(format!("--exit-tool {:?} is given twice", tool.name)));
            }
            shared::tools::check_schema(&tool.parameters)
                .map_err(|e| Error::Config(format!("--exit-tool {}: {e}", tool.name)))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid_and_caps_hold_on_both_sides() {
        let base = Config::new("http://127.0.0.1:1/v1", "m", vec!["http://127.0.0.1:2".into()]);
        assert!(base.validate().is_ok());
        type Change = Box<dyn Fn(&mut Config, bool)>;
        // Each change sets a value at its cap (ok) or one past it (refused).
        let cases: Vec<(&str, Change)> = vec![
            (
                "--max-turns-ceiling",
                Box::new(|c, over| c.ceiling_limits.max_turns = HARD_MAX_TURNS + u32::from(over)),
            ),
            (
                "--max-runs",
                Box::new(|c, over| c.runs.max_runs = limits::MAX_RUNS_CAP + usize::from(over)),
            ),
            (
                "--keep-results",
                Box::new(|c, over| c.runs.keep_results = limits::KEEP_RESULTS_CAP + usize::from(over)),
            ),
            (
                "--llm-max-retries",
                Box::new(|c, over| c.llm.max_retries = limits::LLM_MAX_RETRIES_CAP + u32::from(over)),
            ),
            (
                "--event-buffer",
                Box::new(|c, over| c.event_buffer = limits::EVENT_BUFFER_CAP + usize::from(over)),
            ),
            (
                "--loop-window",
                Box::new(|c, over| c.detector.window = limits::LOOP_WINDOW_CAP + usize::from(over)),
            ),
            (
                "--shutdown-grace",
                Box::new(|c, over| {
                    c.shutdown_grace = limits::SHUTDOWN_GRACE_CAP + Duration::from_secs(u64::from(over))
                }),
            ),
            (
                "--max-turns",
                Box::new(|c, over| c.default_limits.max_turns = c.ceiling_limits.max_turns + u32::from(over)),
            ),
            (
                "--llm-idle-timeout",
                Box::new(|c, over| {
                    c.llm.idle_timeout = limits::LLM_IDLE_TIMEOUT_CAP + Duration::from_millis(u64::from(over))
                }),
            ),
        ];
        for (flag, change) in cases {
            let mut at = base.clone();
            change(&mut at, false);
            assert!(
                at.validate().is_ok(),
                "{flag} at its cap must be accepted: {:?}",
                at.validate()
            );
            let mut over = base.clone();
            change(&mut over, true);
            let err = over.validate().unwrap_err().to_string();
            assert!(err.contains(flag), "{err} should name {flag}");
        }
    }
}
