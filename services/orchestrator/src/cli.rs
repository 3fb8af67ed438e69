//! Command line: `serve` (the default) with flags that all have environment equivalents,
//! `demo` (the whole loop in one command) and `call` (start a run on a running orchestrator).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use shared::config::parse_duration;
use shared::telemetry::LogFormat;

use crate::config::{Backend, limits};
use crate::llm::ToolDefinition;
use crate::run::{HARD_MAX_TURNS, Limits};
use crate::{Config, Error};

/// The orchestrator: runs LLM tool loops for other services over gRPC.
#[derive(Debug, Parser)]
#[command(name = "orchestrator", version, about, args_conflicts_with_subcommands = true)]
pub struct Cli {
    /// What to do; `serve` when omitted.
    #[command(subcommand)]
    pub command: Option<Command>,
    /// Flags of `serve`, accepted without the subcommand too.
    #[command(flatten)]
    pub serve: ServeArgs,
}

/// Subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Serve gRPC (the default).
    Serve(Box<ServeArgs>),
    /// Run the whole loop once: tool-runner + stand-in model + orchestrator, one call, printed.
    /// Set LLM_BASE_URL (and LLM_MODEL, LLM_API_KEY) to use a real OpenAI-compatible server.
    Demo,
    /// Start a run on a running orchestrator and print its events.
    Call(CallArgs),
}

/// Flags of `serve`.
#[derive(Debug, Clone, Args)]
pub struct ServeArgs {
    /// gRPC listen address.
    #[arg(long, env = "ORCHESTRATOR_LISTEN", default_value = "127.0.0.1:50051")]
    pub listen: SocketAddr,
    /// OpenAI-compatible base URL, ending in /v1 (vLLM, Ollama, llama.cpp, OpenAI …). The API key
    /// is read from LLM_API_KEY only (never a flag, never logged).
    #[arg(long, env = "LLM_BASE_URL", default_value = "http://127.0.0.1:11434/v1")]
    pub llm_base_url: String,
    /// Model used when a request names none.
    #[arg(long, env = "LLM_MODEL", default_value = "llama3.1")]
    pub llm_model: String,
    /// Extra header for the LLM server, `Name: value` (repeatable; `;`-separated in the environment).
    #[arg(long = "llm-header", env = "LLM_HEADERS", value_delimiter = ';')]
    pub llm_headers: Vec<String>,
    /// No byte from the LLM for this long ends the run LLM_STREAM_STALLED (cap 1h).
    #[arg(long, env = "LLM_IDLE_TIMEOUT", default_value = "60s", value_parser = parse_duration)]
    pub llm_idle_timeout: Duration,
    /// Connect timeout to the LLM server (cap 5m).
    #[arg(long, env = "LLM_CONNECT_TIMEOUT", default_value = "10s", value_parser = parse_duration)]
    pub llm_connect_timeout: Duration,
    /// Retries before the first byte on connect errors, 429 and 5xx (cap 10).
    #[arg(long, env = "LLM_MAX_RETRIES", default_value_t = limits::LLM_MAX_RETRIES)]
    pub llm_max_retries: u32,
    /// First retry delay, doubled each attempt (cap 1m).
    #[arg(long, env = "LLM_RETRY_BACKOFF", default_value = "500ms", value_parser = parse_duration)]
    pub llm_retry_backoff: Duration,
    /// Longest SSE line accepted from the LLM, in bytes (cap 64 MiB).
    #[arg(long, env = "LLM_MAX_LINE_BYTES", default_value_t = limits::LLM_MAX_LINE_BYTES)]
    pub llm_max_line_bytes: usize,
    /// Tool-runner endpoint: http://host:port, or dns:///name:port for every address of a name
    /// (a Kubernetes headless Service), re-resolved on an interval. Repeatable; comma-separated in
    /// the environment.
    #[arg(
        long = "tool-runner",
        env = "TOOL_RUNNER_ENDPOINTS",
        value_delimiter = ',',
        default_value = "http://127.0.0.1:50052"
    )]
    pub tool_runners: Vec<String>,
    /// How often the tool catalog is refreshed with ListTools (cap 1h).
    #[arg(long, env = "ORCHESTRATOR_TOOL_REFRESH_INTERVAL", default_value = "30s", value_parser = parse_duration)]
    pub tool_refresh_interval: Duration,
    /// How often dns:/// tool-runner targets are resolved again (cap 10m).
    #[arg(long, env = "ORCHESTRATOR_TOOL_RUNNER_RESOLVE_INTERVAL", default_value = "10s", value_parser = parse_duration)]
    pub tool_runner_resolve_interval: Duration,
    /// Retries of a tool call no runner ran (refused over its limit or draining; cap 10).
    #[arg(long, env = "ORCHESTRATOR_TOOL_CALL_RETRIES", default_value_t = limits::TOOL_CALL_RETRIES)]
    pub tool_call_retries: u32,
    /// First delay between those retries, doubled each time (cap 5s).
    #[arg(long, env = "ORCHESTRATOR_TOOL_CALL_RETRY_BACKOFF", default_value = "25ms", value_parser = parse_duration)]
    pub tool_call_retry_backoff: Duration,
    /// Exit tool offered to every run: NAME or NAME=SCHEMA_FILE (a JSON Schema; its
    /// "description" describes the tool). Repeatable; comma-separated in the environment.
    #[arg(long = "exit-tool", env = "ORCHESTRATOR_EXIT_TOOLS", value_delimiter = ',')]
    pub exit_tools: Vec<String>,
    /// Default max turns per run.
    #[arg(long, env = "ORCHESTRATOR_MAX_TURNS", default_value_t = limits::MAX_TURNS)]
    pub max_turns: u32,
    /// Most turns a request may ask for (cap 128).
    #[arg(long, env = "ORCHESTRATOR_MAX_TURNS_CEILING", default_value_t = HARD_MAX_TURNS)]
    pub max_turns_ceiling: u32,
    /// Default tool-call budget per run.
    #[arg(long, env = "ORCHESTRATOR_TOOL_CALL_BUDGET", default_value_t = limits::TOOL_CALL_BUDGET)]
    pub tool_call_budget: u32,
    /// Largest budget a request may ask for (cap 100000).
    #[arg(long, env = "ORCHESTRATOR_TOOL_CALL_BUDGET_CEILING", default_value_t = 1000)]
    pub tool_call_budget_ceiling: u32,
    /// Default failing turns tolerated per run.
    #[arg(long, env = "ORCHESTRATOR_MAX_TOOL_FAILURES", default_value_t = limits::MAX_TOOL_FAILURES)]
    pub max_tool_failures: u32,
    /// Most failing turns a request may allow (cap 10000).
    #[arg(long, env = "ORCHESTRATOR_MAX_TOOL_FAILURES_CEILING", default_value_t = 100)]
    pub max_tool_failures_ceiling: u32,
    /// Default timeout of one tool call.
    #[arg(long, env = "ORCHESTRATOR_TOOL_TIMEOUT", default_value = "60s", value_parser = parse_duration)]
    pub tool_timeout: Duration,
    /// Longest tool timeout a request may ask for (cap 1h).
    #[arg(long, env = "ORCHESTRATOR_TOOL_TIMEOUT_CEILING", default_value = "10m", value_parser = parse_duration)]
    pub tool_timeout_ceiling: Duration,
    /// Default deadline of a run.
    #[arg(long, env = "ORCHESTRATOR_RUN_TIMEOUT", default_value = "10m", value_parser = parse_duration)]
    pub run_timeout: Duration,
    /// Longest run deadline a request may ask for (cap 24h).
    #[arg(long, env = "ORCHESTRATOR_RUN_TIMEOUT_CEILING", default_value = "1h", value_parser = parse_duration)]
    pub run_timeout_ceiling: Duration,
    /// Runs live at once; more get RESOURCE_EXHAUSTED (cap 100000).
    #[arg(long, env = "ORCHESTRATOR_MAX_RUNS", default_value_t = limits::MAX_RUNS)]
    pub max_runs: usize,
    /// Finished results kept for GetRun (cap 1000000).
    #[arg(long, env = "ORCHESTRATOR_KEEP_RESULTS", default_value_t = limits::KEEP_RESULTS)]
    pub keep_results: usize,
    /// How long finished results are kept (cap 7 days).
    #[arg(long, env = "ORCHESTRATOR_KEEP_RESULTS_FOR", default_value = "1h", value_parser = parse_duration)]
    pub keep_results_for: Duration,
    /// Repeated-line detector: complete lines remembered (cap 100000).
    #[arg(long, env = "ORCHESTRATOR_LOOP_WINDOW", default_value_t = limits::LOOP_WINDOW)]
    pub loop_window: usize,
    /// Repeated-line detector: occurrences of one line in the window that end the run (2..=window).
    #[arg(long, env = "ORCHESTRATOR_LOOP_THRESHOLD", default_value_t = limits::LOOP_THRESHOLD)]
    pub loop_threshold: usize,
    /// Event batches (events the loop produces together) buffered per run stream before the run
    /// waits for a slow reader (cap 65536).
    #[arg(long, env = "ORCHESTRATOR_EVENT_BUFFER", default_value_t = limits::EVENT_BUFFER)]
    pub event_buffer: usize,
    /// Signals buffered per SubscribeSignals subscriber (cap 1000000).
    #[arg(long, env = "ORCHESTRATOR_SIGNAL_BUFFER", default_value_t = limits::SIGNAL_BUFFER)]
    pub signal_buffer: usize,
    /// Largest Orchestrate request in bytes (cap 64 MiB).
    #[arg(long, env = "ORCHESTRATOR_MAX_REQUEST_BYTES", default_value_t = limits::MAX_REQUEST_BYTES)]
    pub max_request_bytes: usize,
    /// After SIGTERM/SIGINT, how long runs may take to finish before they are canceled (cap 1h).
    #[arg(long, env = "ORCHESTRATOR_SHUTDOWN_GRACE", default_value = "30s", value_parser = parse_duration)]
    pub shutdown_grace: Duration,
    /// Log format: text or json.
    #[arg(long, env = "ORCHESTRATOR_LOG_FORMAT", default_value = "text")]
    pub log_format: LogFormat,
    /// Prometheus /metrics listen address, or `off`.
    #[arg(long, env = "ORCHESTRATOR_METRICS_LISTEN", default_value = "127.0.0.1:9464")]
    pub metrics_listen: shared::metrics::OptionalListen,
    /// Record tool arguments and results on spans (off by default: they may hold secrets).
    #[arg(long, env = "ORCHESTRATOR_TRACE_TOOL_PAYLOADS")]
    pub trace_tool_payloads: bool,
    /// Signal topic: memory, or nats://host:4222 (JetStream).
    #[arg(long, env = "ORCHESTRATOR_SIGNAL_TOPIC", default_value = "memory")]
    pub signal_topic: Backend,
    /// NATS subject prefix: signals go to <prefix>.<tool_name>.
    #[arg(long, env = "ORCHESTRATOR_SIGNAL_SUBJECT_PREFIX", default_value = "signals")]
    pub signal_subject_prefix: String,
    /// JetStream stream holding <prefix>.> (created when missing).
    #[arg(long, env = "ORCHESTRATOR_SIGNAL_STREAM", default_value = "SIGNALS")]
    pub signal_stream: String,
    /// How long the stream keeps signals (cap 365d).
    #[arg(long, env = "ORCHESTRATOR_SIGNAL_STREAM_MAX_AGE", default_value = "7d", value_parser = parse_duration)]
    pub signal_stream_max_age: Duration,
    /// Most bytes the stream keeps; -1 for no limit.
    #[arg(long, env = "ORCHESTRATOR_SIGNAL_STREAM_MAX_BYTES", default_value_t = limits::SIGNAL_STREAM_MAX_BYTES, allow_negative_numbers = true)]
    pub signal_stream_max_bytes: i64,
    /// Publish attempts after the first, before a signal is marked undelivered (cap 30).
    #[arg(long, env = "ORCHESTRATOR_SIGNAL_PUBLISH_RETRIES", default_value_t = limits::SIGNAL_PUBLISH_RETRIES)]
    pub signal_publish_retries: u32,
    /// First delay between publish attempts, doubled each time (cap 1m).
    #[arg(long, env = "ORCHESTRATOR_SIGNAL_PUBLISH_BACKOFF", default_value = "250ms", value_parser = parse_duration)]
    pub signal_publish_backoff: Duration,
    /// How long one publish waits for JetStream's acknowledgement (cap 1m).
    #[arg(long, env = "ORCHESTRATOR_SIGNAL_ACK_TIMEOUT", default_value = "5s", value_parser = parse_duration)]
    pub signal_ack_timeout: Duration,
    /// Result store: memory (bounded by --keep-results / --keep-results-for), or nats://host:4222
    /// (a JetStream key-value bucket shared by replicas, kept across restarts).
    #[arg(long, env = "ORCHESTRATOR_RUN_STORE", default_value = "memory")]
    pub run_store: Backend,
    /// Key-value bucket of the NATS result store (created when missing).
    #[arg(long, env = "ORCHESTRATOR_RUN_STORE_BUCKET", default_value = "orchestrator-runs")]
    pub run_store_bucket: String,
    /// How long the NATS result store keeps a result (cap 365d).
    #[arg(long, env = "ORCHESTRATOR_RUN_STORE_TTL", default_value = "24h", value_parser = parse_duration)]
    pub run_store_ttl: Duration,
    /// How long one read or write of the result store may take (cap 1m).
    #[arg(long, env = "ORCHESTRATOR_STORE_TIMEOUT", default_value = "5s", value_parser = parse_duration)]
    pub store_timeout: Duration,
    /// NATS credentials file (.creds).
    #[arg(long, env = "NATS_CREDENTIALS")]
    pub nats_credentials: Option<PathBuf>,
    /// Require TLS to NATS.
    #[arg(long, env = "NATS_TLS")]
    pub nats_tls: bool,
    /// Extra root certificates (PEM) for TLS to NATS.
    #[arg(long, env = "NATS_CA_FILE")]
    pub nats_ca_file: Option<PathBuf>,
    /// Size cap of each recorded payload, in bytes (cap 64 KiB).
    #[arg(long, env = "ORCHESTRATOR_TRACE_PAYLOAD_MAX_BYTES", default_value_t = limits::TRACE_PAYLOAD)]
    pub trace_payload_max_bytes: usize,
}

/// Flags of `call`.
#[derive(Debug, Clone, Args)]
pub struct CallArgs {
    /// The orchestrator's address.
    #[arg(long, env = "ORCHESTRATOR_ENDPOINT", default_value = "http://127.0.0.1:50051")]
    pub endpoint: String,
    /// The user message.
    #[arg(long)]
    pub prompt: String,
    /// A system message for the run.
    #[arg(long, default_value = "")]
    pub system: String,
    /// Model override.
    #[arg(long, default_value = "")]
    pub model: String,
    /// Normal tool the model may use (repeatable; default all).
    #[arg(long = "tool")]
    pub tools: Vec<String>,
    /// Exit tool for this run: NAME or NAME=DESCRIPTION (repeatable).
    #[arg(long = "exit-tool")]
    pub exit_tools: Vec<String>,
    /// Run id (default: generated).
    #[arg(long, default_value = "")]
    pub run_id: String,
    /// Deadline of the call.
    #[arg(long, default_value = "10m", value_parser = parse_duration)]
    pub timeout: Duration,
}

fn exit_tool(spec: &str) -> Result<ToolDefinition, Error> {
    let (name, file) = match spec.split_once('=') {
        Some((name, file)) => (name.trim(), Some(PathBuf::from(file.trim()))),
        None => (spec.trim(), None),
    };
    let (description, parameters) = match file {
        None => (
            format!("Signal {name} (one-way; nothing comes back)."),
            serde_json::json!({"type": "object"}),
        ),
        Some(path) => {
            let text = std::fs::read_to_string(&path)
                .map_err(|e| Error::Config(format!("--exit-tool {name}: cannot read {}: {e}", path.display())))?;
            let schema: serde_json::Value = serde_json::from_str(&text)
                .map_err(|e| Error::Config(format!("--exit-tool {name}: {} is not JSON: {e}", path.display())))?;
            let description = schema.get("description").and_then(|d| d.as_str()).map_or_else(
                || format!("Signal {name} (one-way; nothing comes back)."),
                str::to_owned,
            );
            (description, schema)
        }
    };
    Ok(ToolDefinition {
        name: name.to_owned(),
        description,
        parameters,
    })
}

impl ServeArgs {
    /// The configuration these flags describe (validated by `run`).
    pub fn to_config(&self) -> Result<Config, Error> {
        let mut config = Config::new(&self.llm_base_url, &self.llm_model, self.tool_runners.clone());
        config.llm.api_key = std::env::var("LLM_API_KEY").ok().filter(|k| !k.is_empty());
        config.llm.extra_headers = self
            .llm_headers
            .iter()
            .filter(|h| !h.trim().is_empty())
            .map(|h| {
                h.split_once(':')
                    .map(|(k, v)| (k.trim().to_owned(), v.trim().to_owned()))
                    .ok_or_else(|| Error::Config(format!("--llm-header {h:?} must look like 'Name: value'")))
            })
            .collect::<Result<_, _>>()?;
        config.llm.idle_timeout = self.llm_idle_timeout;
        config.llm.connect_timeout = self.llm_connect_timeout;
        config.llm.max_retries = self.llm_max_retries;
        config.llm.retry_backoff = self.llm_retry_backoff;
        config.llm.max_line_bytes = self.llm_max_line_bytes;
        config.tool_refresh_interval = self.tool_refresh_interval;
        config.tool_runner_resolve_interval = self.tool_runner_resolve_interval;
        config.tool_call_retries = self.tool_call_retries;
        config.tool_call_retry_backoff = self.tool_call_retry_backoff;
        config.exit_tools = self
            .exit_tools
            .iter()
            .filter(|s| !s.trim().is_empty())
            .map(|s| exit_tool(s))
            .collect::<Result<_, _>>()?;
        config.default_limits = Limits {
            max_turns: self.max_turns,
            tool_call_budget: self.tool_call_budget,
            max_tool_failures: self.max_tool_failures,
            tool_timeout: self.tool_timeout,
            run_timeout: self.run_timeout,
        };
        config.ceiling_limits = Limits {
            max_turns: self.max_turns_ceiling,
            tool_call_budget: self.tool_call_budget_ceiling,
            max_tool_failures: self.max_tool_failures_ceiling,
            tool_timeout: self.tool_timeout_ceiling,
            run_timeout: self.run_timeout_ceiling,
        };
        config.runs.max_runs = self.max_runs;
        config.runs.keep_results = self.keep_results;
        config.runs.keep_results_for = self.keep_results_for;
        config.detector.window = self.loop_window;
        config.detector.threshold = self.loop_threshold;
        config.event_buffer = self.event_buffer;
        config.signal_buffer = self.signal_buffer;
        config.max_request_bytes = self.max_request_bytes;
        config.shutdown_grace = self.shutdown_grace;
        config.trace_payloads = self.trace_tool_payloads.then_some(self.trace_payload_max_bytes);
        config.signal_topic = self.signal_topic.clone();
        config.signals = crate::signals::nats::NatsTopicSettings {
            subject_prefix: self.signal_subject_prefix.clone(),
            stream: self.signal_stream.clone(),
            max_age: self.signal_stream_max_age,
            max_bytes: self.signal_stream_max_bytes,
            retries: self.signal_publish_retries,
            backoff: self.signal_publish_backoff,
            ack_timeout: self.signal_ack_timeout,
        };
        config.run_store = self.run_store.clone();
        config.run_store_bucket = self.run_store_bucket.clone();
        config.run_store_ttl = self.run_store_ttl;
        config.store_timeout = self.store_timeout;
        config.nats = crate::config::NatsOptions {
            credentials: self.nats_credentials.clone(),
            tls_required: self.nats_tls,
            ca_file: self.nats_ca_file.clone(),
        };
        Ok(config)
    }
}

impl CallArgs {
    /// The client options these flags describe.
    pub fn to_options(&self) -> crate::client::CallOptions {
        crate::client::CallOptions {
            endpoint: self.endpoint.clone(),
            prompt: self.prompt.clone(),
            system: self.system.clone(),
            model: self.model.clone(),
            tools: self.tools.clone(),
            exit_tools: self
                .exit_tools
                .iter()
                .map(|s| match s.split_once('=') {
                    Some((name, description)) => (name.trim().to_owned(), description.trim().to_owned()),
                    None => (s.trim().to_owned(), String::new()),
                })
                .collect(),
            run_id: self.run_id.clone(),
            timeout: self.timeout,
        }
    }
}
