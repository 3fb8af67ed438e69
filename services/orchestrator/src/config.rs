//! The orchestrator's settings, in sections. Each section is a clap `Args` struct that *is* the
//! configuration: a field's flag, environment variable, default and doc are in its attribute and
//! doc comment, and its range in the section's [`Bounded::bounds`] table, which names the field
//! (the flag an error names comes from the struct). Adding a setting touches one struct.
//!
//! [`Config::default`] is what the flags declare, whatever the environment holds; the binary
//! reads the flags and their environment variables into the same structs.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::Args;
use shared::config::{Bound, Bounded, bound, flag, parse_duration};
use shared::telemetry::LogFormat;

use crate::Error;
use crate::llm::params::parse_extra_body;
use crate::llm::{SamplingParams, ToolChoice, ToolDefinition};
use crate::run::{HARD_MAX_TURNS, Limits};
use crate::secrets::Secret;

const KIB: usize = 1024;
const MIB: usize = 1024 * 1024;
const fn secs(n: u64) -> Duration {
    Duration::from_secs(n)
}
const fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}
const DAY: Duration = secs(86_400);

/// Everything [`crate::run`] (the server) needs; the flags of `serve`.
#[derive(Debug, Clone, Args)]
pub struct Config {
    /// TOML file of settings whose keys are these long flags (`max-concurrency = 64`, lists for
    /// repeatable ones); a flag or its environment variable wins over the file.
    #[arg(long = "config", env = "ORCHESTRATOR_CONFIG", value_name = "FILE")]
    pub config_file: Option<PathBuf>,
    #[allow(missing_docs)]
    #[command(flatten)]
    pub server: ServerSettings,
    #[allow(missing_docs)]
    #[command(flatten)]
    pub llm: LlmSettings,
    #[allow(missing_docs)]
    #[command(flatten)]
    pub tool_runners: ToolRunnerSettings,
    #[allow(missing_docs)]
    #[command(flatten)]
    pub limits: LimitSettings,
    #[allow(missing_docs)]
    #[command(flatten)]
    pub runs: RunSettings,
    #[allow(missing_docs)]
    #[command(flatten)]
    pub signals: SignalSettings,
    #[allow(missing_docs)]
    #[command(flatten)]
    pub store: StoreSettings,
    #[allow(missing_docs)]
    #[command(flatten)]
    pub nats: NatsSettings,
    #[allow(missing_docs)]
    #[command(flatten)]
    pub telemetry: TelemetrySettings,
    #[allow(missing_docs)]
    #[command(flatten)]
    pub security: SecuritySettings,
}

shared::security_settings!("ORCHESTRATOR");

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
}

impl Bounded for ServerSettings {
    fn bounds(&self) -> Vec<Bound> {
        vec![
            bound("max_request_bytes", self.max_request_bytes, KIB, 64 * MIB),
            bound("shutdown_grace", self.shutdown_grace, Duration::ZERO, secs(3600)),
        ]
    }
}

/// An extra HTTP header for the LLM server (`Name: value`); its value may be a credential. A
/// blank entry (`LLM_HEADERS=""`, or a trailing `;`) parses to a header without a name, which is
/// not sent. Parsing never fails, so a malformed entry is never echoed by the flag parser: it
/// keeps no name and its text as value, and [`Config::validate`] refuses it without showing it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Header {
    /// Header name.
    pub name: String,
    /// Header value.
    pub value: Secret,
}

impl Header {
    /// Neither name nor value: nothing to send.
    fn is_blank(&self) -> bool {
        self.name.is_empty() && self.value.expose().is_empty()
    }

    /// Not `Name: value`.
    fn is_malformed(&self) -> bool {
        self.name.is_empty() && !self.value.expose().is_empty()
    }
}

impl std::str::FromStr for Header {
    type Err = std::convert::Infallible;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (name, value) = s.split_once(':').unwrap_or(("", s));
        Ok(Self {
            name: name.trim().to_owned(),
            value: Secret::from(value.trim()),
        })
    }
}

/// The LLM server.
#[derive(Debug, Clone, Args)]
#[command(next_help_heading = "LLM server")]
pub struct LlmSettings {
    /// OpenAI-compatible base URL, ending in /v1 (vLLM, Ollama, llama.cpp, OpenAI …). The API key
    /// is read from LLM_API_KEY only (never a flag, never logged).
    #[arg(
        long = "llm-base-url",
        env = "LLM_BASE_URL",
        default_value = "http://127.0.0.1:11434/v1"
    )]
    pub base_url: String,
    /// Model used when a request names none.
    #[arg(long = "llm-model", env = "LLM_MODEL", default_value = "llama3.1")]
    pub model: String,
    /// Bearer token, from the environment variable LLM_API_KEY.
    #[arg(skip = Secret::from_env("LLM_API_KEY"))]
    pub api_key: Option<Secret>,
    /// Extra header for the LLM server, `Name: value` (repeatable; `;`-separated in the environment).
    #[arg(long = "llm-header", env = "LLM_HEADERS", value_delimiter = ';')]
    pub headers: Vec<Header>,
    /// No byte from the LLM for this long ends the run LLM_STREAM_STALLED (cap 1h).
    #[arg(long = "llm-idle-timeout", env = "LLM_IDLE_TIMEOUT", default_value = "60s", value_parser = parse_duration)]
    pub idle_timeout: Duration,
    /// Connect timeout to the LLM server (cap 5m).
    #[arg(long = "llm-connect-timeout", env = "LLM_CONNECT_TIMEOUT", default_value = "10s", value_parser = parse_duration)]
    pub connect_timeout: Duration,
    /// Retries before the first byte on connect errors, 429 and 5xx (cap 10).
    #[arg(long = "llm-max-retries", env = "LLM_MAX_RETRIES", default_value_t = 3)]
    pub max_retries: u32,
    /// First retry delay, doubled each attempt (cap 1m).
    #[arg(long = "llm-retry-backoff", env = "LLM_RETRY_BACKOFF", default_value = "500ms", value_parser = parse_duration)]
    pub retry_backoff: Duration,
    /// Longest SSE line accepted from the LLM, in bytes (cap 64 MiB).
    #[arg(long = "llm-max-line-bytes", env = "LLM_MAX_LINE_BYTES", default_value_t = MIB)]
    pub max_line_bytes: usize,
    /// Largest SSE event accepted from the LLM (all its lines), in bytes (max-line-bytes..=64 MiB).
    #[arg(long = "llm-max-event-bytes", env = "LLM_MAX_EVENT_BYTES", default_value_t = 4 * MIB)]
    pub max_event_bytes: usize,
    /// Temperature of runs that set none (0..=2; unset: the model server's default).
    #[arg(long = "llm-temperature", env = "LLM_TEMPERATURE")]
    pub temperature: Option<f32>,
    /// max_tokens per turn of runs that set none (unset: the model server's default).
    #[arg(long = "llm-max-tokens", env = "LLM_MAX_TOKENS")]
    pub max_tokens: Option<u32>,
    /// tool_choice of runs that set none: auto, none, required or a tool name (first turn only).
    #[arg(long = "llm-tool-choice", env = "LLM_TOOL_CHOICE")]
    pub tool_choice: Option<ToolChoice>,
    /// parallel_tool_calls of runs that set none (unset: not sent).
    #[arg(long = "llm-parallel-tool-calls", env = "LLM_PARALLEL_TOOL_CALLS")]
    pub parallel_tool_calls: Option<bool>,
    /// reasoning_effort of runs that set none (e.g. low, medium, high; unset: not sent).
    #[arg(long = "llm-reasoning-effort", env = "LLM_REASONING_EFFORT")]
    pub reasoning_effort: Option<String>,
    /// A JSON object merged into every chat request (a run's extra_body_json keys win), e.g.
    /// '{"chat_template_kwargs": {"enable_thinking": false}}' for vLLM.
    #[arg(long = "llm-extra-body", env = "LLM_EXTRA_BODY", value_parser = parse_extra_body)]
    pub extra_body: Option<serde_json::Map<String, serde_json::Value>>,
    /// Send each turn's reasoning back to the model as `reasoning_content` in its assistant
    /// message, for servers whose chat templates need it between tool calls (off: reasoning is
    /// never sent back).
    #[arg(long = "llm-send-reasoning", env = "LLM_SEND_REASONING")]
    pub send_reasoning: bool,
}

impl LlmSettings {
    /// The model parameters of runs that set none, from the `--llm-*` flags (checked once, at
    /// start, by [`LlmSettings::defaults`]).
    pub fn run_defaults(&self) -> SamplingParams {
        SamplingParams {
            temperature: self.temperature,
            max_tokens: self.max_tokens,
            tool_choice: self.tool_choice.clone(),
            parallel_tool_calls: self.parallel_tool_calls,
            reasoning_effort: self.reasoning_effort.clone().filter(|e| !e.is_empty()),
            extra_body: self.extra_body.clone().unwrap_or_default(),
            ..SamplingParams::default()
        }
    }

    /// [`LlmSettings::run_defaults`], checked like a request's parameters.
    pub fn defaults(&self) -> Result<SamplingParams, String> {
        let params = self.run_defaults();
        params.check().map_err(|e| format!("the --llm-* run defaults: {e}"))?;
        Ok(params)
    }
}

impl Bounded for LlmSettings {
    fn bounds(&self) -> Vec<Bound> {
        vec![
            bound("idle_timeout", self.idle_timeout, ms(1), secs(3600)),
            bound("connect_timeout", self.connect_timeout, ms(1), secs(300)),
            bound("max_retries", self.max_retries, 0u32, 10u32),
            bound("retry_backoff", self.retry_backoff, Duration::ZERO, secs(60)),
            bound("max_line_bytes", self.max_line_bytes, KIB, 64 * MIB),
            bound("max_event_bytes", self.max_event_bytes, self.max_line_bytes, 64 * MIB),
        ]
    }
}

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
        ]
    }
}

/// Per-run limits: the default used when a request sets none, and the ceiling a request may not
/// pass.
#[derive(Debug, Clone, Copy, Args)]
#[command(next_help_heading = "Run limits")]
pub struct LimitSettings {
    /// Default max turns per run.
    #[arg(long, env = "ORCHESTRATOR_MAX_TURNS", default_value_t = 16)]
    pub max_turns: u32,
    /// Most turns a request may ask for (cap 128).
    #[arg(long, env = "ORCHESTRATOR_MAX_TURNS_CEILING", default_value_t = HARD_MAX_TURNS)]
    pub max_turns_ceiling: u32,
    /// Default tool-call budget per run.
    #[arg(long, env = "ORCHESTRATOR_TOOL_CALL_BUDGET", default_value_t = 64)]
    pub tool_call_budget: u32,
    /// Largest budget a request may ask for (cap 100000).
    #[arg(long, env = "ORCHESTRATOR_TOOL_CALL_BUDGET_CEILING", default_value_t = 1000)]
    pub tool_call_budget_ceiling: u32,
    /// Default failing turns tolerated per run.
    #[arg(long, env = "ORCHESTRATOR_MAX_TOOL_FAILURES", default_value_t = 3)]
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
}

impl LimitSettings {
    /// The limits of a run whose request sets none.
    pub fn defaults(&self) -> Limits {
        Limits {
            max_turns: self.max_turns,
            tool_call_budget: self.tool_call_budget,
            max_tool_failures: self.max_tool_failures,
            tool_timeout: self.tool_timeout,
            run_timeout: self.run_timeout,
        }
    }

    /// The most a request may ask for.
    pub fn ceilings(&self) -> Limits {
        Limits {
            max_turns: self.max_turns_ceiling,
            tool_call_budget: self.tool_call_budget_ceiling,
            max_tool_failures: self.max_tool_failures_ceiling,
            tool_timeout: self.tool_timeout_ceiling,
            run_timeout: self.run_timeout_ceiling,
        }
    }
}

impl Bounded for LimitSettings {
    /// Each ceiling has a cap; each default lies below its ceiling.
    fn bounds(&self) -> Vec<Bound> {
        vec![
            bound("max_turns_ceiling", self.max_turns_ceiling, 1u32, HARD_MAX_TURNS),
            bound("max_turns", self.max_turns, 1u32, self.max_turns_ceiling),
            bound(
                "tool_call_budget_ceiling",
                self.tool_call_budget_ceiling,
                0u32,
                100_000u32,
            ),
            bound(
                "tool_call_budget",
                self.tool_call_budget,
                0u32,
                self.tool_call_budget_ceiling,
            ),
            bound(
                "max_tool_failures_ceiling",
                self.max_tool_failures_ceiling,
                0u32,
                10_000u32,
            ),
            bound(
                "max_tool_failures",
                self.max_tool_failures,
                0u32,
                self.max_tool_failures_ceiling,
            ),
            bound("tool_timeout_ceiling", self.tool_timeout_ceiling, ms(1), secs(3600)),
            bound("tool_timeout", self.tool_timeout, ms(1), self.tool_timeout_ceiling),
            bound("run_timeout_ceiling", self.run_timeout_ceiling, ms(1), DAY),
            bound("run_timeout", self.run_timeout, ms(1), self.run_timeout_ceiling),
        ]
    }
}

/// Runs: how many at once, what every run offers, how its stream and output are watched.
#[derive(Debug, Clone, Args)]
#[command(next_help_heading = "Runs")]
pub struct RunSettings {
    /// Runs live at once; more get RESOURCE_EXHAUSTED (cap 100000).
    #[arg(long, env = "ORCHESTRATOR_MAX_RUNS", default_value_t = 256)]
    pub max_runs: usize,
    /// Exit tool offered to every run: NAME or NAME=SCHEMA_FILE (a JSON Schema; its
    /// "description" describes the tool). Repeatable; comma-separated in the environment. Blank
    /// entries are ignored.
    #[arg(long = "exit-tool", env = "ORCHESTRATOR_EXIT_TOOLS", value_delimiter = ',', value_parser = exit_tool)]
    pub exit_tools: Vec<ToolDefinition>,
    /// Event batches (events the loop produces together) buffered per run stream before the run
    /// waits for a slow reader (cap 65536).
    #[arg(long, env = "ORCHESTRATOR_EVENT_BUFFER", default_value_t = 64)]
    pub event_buffer: usize,
    /// Longest wait for a caller to take an event: a caller that reads nothing for this long has
    /// its stream dropped (its run is canceled unless detached), so it cannot hold a run slot
    /// (cap 10m).
    #[arg(long, env = "ORCHESTRATOR_EVENT_SEND_TIMEOUT", default_value = "30s", value_parser = parse_duration)]
    pub event_send_timeout: Duration,
    /// Largest text or tool result in one event sent to a caller, in bytes: longer text is split,
    /// a longer result is cut in its event and flagged (cap 3 MiB, under gRPC's usual 4 MiB
    /// receive limit).
    #[arg(long = "max-event-bytes", env = "ORCHESTRATOR_MAX_EVENT_BYTES", default_value_t = MIB)]
    pub max_caller_event_bytes: usize,
    /// Largest tool result fed back to the model, in bytes; a longer one is cut and says how much
    /// was cut (cap 16 MiB).
    #[arg(long, env = "ORCHESTRATOR_MAX_TOOL_RESULT_BYTES", default_value_t = 64 * KIB)]
    pub max_tool_result_bytes: usize,
    /// How long before the caller's gRPC deadline a run ends DEADLINE_EXCEEDED, so the caller
    /// still receives its result (cap 10s).
    #[arg(long, env = "ORCHESTRATOR_DEADLINE_HEADROOM", default_value = "200ms", value_parser = parse_duration)]
    pub deadline_headroom: Duration,
    #[allow(missing_docs)]
    #[command(flatten)]
    pub output: OutputBounds,
    #[allow(missing_docs)]
    #[command(flatten)]
    pub request: RequestBounds,
    #[allow(missing_docs)]
    #[command(flatten)]
    pub loop_detector: LoopDetectorSettings,
}

impl Bounded for RunSettings {
    fn bounds(&self) -> Vec<Bound> {
        let mut rows = vec![
            bound("max_runs", self.max_runs, 1usize, 100_000usize),
            bound("event_buffer", self.event_buffer, 1usize, 65_536usize),
            bound("event_send_timeout", self.event_send_timeout, ms(10), secs(600)),
            bound("max_caller_event_bytes", self.max_caller_event_bytes, KIB, 3 * MIB),
            bound("max_tool_result_bytes", self.max_tool_result_bytes, 256usize, 16 * MIB),
            bound("deadline_headroom", self.deadline_headroom, Duration::ZERO, secs(10)),
        ];
        rows.extend(self.output.bounds());
        rows.extend(self.request.bounds());
        rows.extend(self.loop_detector.bounds());
        rows
    }
}

/// What the model may produce in one run: past these, a run ends `OUTPUT_LIMIT` (or the call
/// fails) instead of growing the orchestrator's memory and its callers' messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Args)]
pub struct OutputBounds {
    /// Tool calls the model may make in one turn; more end the run OUTPUT_LIMIT, none of them
    /// run (1..=1024).
    #[arg(long, env = "ORCHESTRATOR_MAX_CALLS_PER_TURN", default_value_t = 128)]
    pub max_calls_per_turn: usize,
    /// Largest arguments of one tool call, in bytes; a longer call fails INVALID_ARGUMENTS (fed
    /// back to the model) and only this much of it is kept (64..=16 MiB).
    #[arg(long = "max-argument-bytes", env = "ORCHESTRATOR_MAX_ARGUMENT_BYTES", default_value_t = MIB)]
    pub max_argument_bytes: usize,
    /// Largest output of one run, in bytes: its text and the arguments and errors of its calls
    /// and signals; a run going over ends OUTPUT_LIMIT with the output up to it. Keeps every
    /// result (run_finished, GetRun) under gRPC's usual 4 MiB receive limit (1 KiB..=64 MiB).
    #[arg(long, env = "ORCHESTRATOR_MAX_OUTPUT_BYTES", default_value_t = 2 * MIB)]
    pub max_output_bytes: usize,
    /// Reasoning kept of one run, in bytes (reasoning_delta events and the result's reasoning;
    /// with --llm-send-reasoning, also what is sent back per turn). Past it the model's reasoning
    /// is still watched for repeated lines but no longer kept, and the result says so; the run
    /// goes on (0..=64 MiB).
    #[arg(long, env = "ORCHESTRATOR_MAX_REASONING_BYTES", default_value_t = 512 * KIB)]
    pub max_reasoning_bytes: usize,
}

impl Bounded for OutputBounds {
    fn bounds(&self) -> Vec<Bound> {
        vec![
            bound("max_calls_per_turn", self.max_calls_per_turn, 1usize, 1024usize),
            bound("max_argument_bytes", self.max_argument_bytes, 64usize, 16 * MIB),
            bound("max_output_bytes", self.max_output_bytes, KIB, 64 * MIB),
            bound("max_reasoning_bytes", self.max_reasoning_bytes, 0usize, 64 * MIB),
        ]
    }
}

/// How much one `Orchestrate` request may carry besides its byte size (`--max-request-bytes`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Args)]
pub struct RequestBounds {
    /// Messages in one request (1..=100000).
    #[arg(long, env = "ORCHESTRATOR_MAX_MESSAGES", default_value_t = 1000)]
    pub max_messages: usize,
    /// Exit tools one request may define (0..=1024).
    #[arg(long, env = "ORCHESTRATOR_MAX_REQUEST_EXIT_TOOLS", default_value_t = 64)]
    pub max_request_exit_tools: usize,
    /// Metadata entries in one request; they travel with every tool call and signal (0..=1024).
    #[arg(long, env = "ORCHESTRATOR_MAX_METADATA_ENTRIES", default_value_t = 64)]
    pub max_metadata_entries: usize,
    /// Bytes of metadata keys and values in one request (0..=1 MiB).
    #[arg(long, env = "ORCHESTRATOR_MAX_METADATA_BYTES", default_value_t = 16 * KIB)]
    pub max_metadata_bytes: usize,
}

impl Bounded for RequestBounds {
    fn bounds(&self) -> Vec<Bound> {
        vec![
            bound("max_messages", self.max_messages, 1usize, 100_000usize),
            bound("max_request_exit_tools", self.max_request_exit_tools, 0usize, 1024usize),
            bound("max_metadata_entries", self.max_metadata_entries, 0usize, 1024usize),
            bound("max_metadata_bytes", self.max_metadata_bytes, 0usize, MIB),
        ]
    }
}

/// The repeated-line detector: a line seen `threshold` times among the last `window` complete
/// lines of a run's output ends it `REPEATED_LINE_LOOP`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Args)]
pub struct LoopDetectorSettings {
    /// Repeated-line detector: complete lines remembered (cap 100000).
    #[arg(long = "loop-window", env = "ORCHESTRATOR_LOOP_WINDOW", default_value_t = 128)]
    pub window: usize,
    /// Repeated-line detector: occurrences of one line in the window that end the run (2..=window).
    #[arg(long = "loop-threshold", env = "ORCHESTRATOR_LOOP_THRESHOLD", default_value_t = 12)]
    pub threshold: usize,
}

impl Bounded for LoopDetectorSettings {
    fn bounds(&self) -> Vec<Bound> {
        vec![
            bound("window", self.window, 1usize, 100_000usize),
            bound("threshold", self.threshold, 2usize, self.window.max(2)),
        ]
    }
}

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

/// What a full signal stream gives up (see `--signal-stream-discard`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum StreamDiscard {
    /// Refuse new signals.
    New,
    /// Drop the oldest signals.
    Old,
}

/// The signal topic.
#[derive(Debug, Clone, Args)]
#[command(next_help_heading = "Signal topic")]
pub struct SignalSettings {
    /// Signal topic: memory, or nats://host:4222 (JetStream).
    #[arg(long = "signal-topic", env = "ORCHESTRATOR_SIGNAL_TOPIC", default_value = "memory")]
    pub topic: Backend,
    /// Signals buffered per SubscribeSignals subscriber (cap 1000000).
    #[arg(long = "signal-buffer", env = "ORCHESTRATOR_SIGNAL_BUFFER", default_value_t = 1024)]
    pub buffer: usize,
    /// NATS subject prefix: signals go to <prefix>.<tool_name>.
    #[arg(
        long = "signal-subject-prefix",
        env = "ORCHESTRATOR_SIGNAL_SUBJECT_PREFIX",
        default_value = "signals"
    )]
    pub subject_prefix: String,
    /// JetStream stream holding <prefix>.> (created when missing).
    #[arg(
        long = "signal-stream",
        env = "ORCHESTRATOR_SIGNAL_STREAM",
        default_value = "SIGNALS"
    )]
    pub stream: String,
    /// How long the stream keeps signals (cap 365d).
    #[arg(long = "signal-stream-max-age", env = "ORCHESTRATOR_SIGNAL_STREAM_MAX_AGE", default_value = "7d", value_parser = parse_duration)]
    pub stream_max_age: Duration,
    /// Most bytes the stream keeps; -1 for no limit.
    #[arg(long = "signal-stream-max-bytes", env = "ORCHESTRATOR_SIGNAL_STREAM_MAX_BYTES", default_value_t = 1 << 30, allow_negative_numbers = true)]
    pub stream_max_bytes: i64,
    /// What the stream does when full: `new` refuses new signals (they are marked undelivered in
    /// the run's result and counted, so nothing is lost unseen); `old` drops the oldest signals
    /// silently, consumed or not.
    #[arg(
        long = "signal-stream-discard",
        env = "ORCHESTRATOR_SIGNAL_STREAM_DISCARD",
        default_value = "new",
        value_enum
    )]
    pub stream_discard: StreamDiscard,
    /// Publish attempts after the first, before a signal is marked undelivered (cap 30).
    #[arg(
        long = "signal-publish-retries",
        env = "ORCHESTRATOR_SIGNAL_PUBLISH_RETRIES",
        default_value_t = 6
    )]
    pub publish_retries: u32,
    /// First delay between publish attempts, doubled each time (cap 1m).
    #[arg(long = "signal-publish-backoff", env = "ORCHESTRATOR_SIGNAL_PUBLISH_BACKOFF", default_value = "250ms", value_parser = parse_duration)]
    pub publish_backoff: Duration,
    /// How long one publish waits for JetStream's acknowledgement (cap 1m).
    #[arg(long = "signal-ack-timeout", env = "ORCHESTRATOR_SIGNAL_ACK_TIMEOUT", default_value = "5s", value_parser = parse_duration)]
    pub ack_timeout: Duration,
}

impl Bounded for SignalSettings {
    fn bounds(&self) -> Vec<Bound> {
        vec![
            bound("buffer", self.buffer, 1usize, 1_000_000usize),
            bound("stream_max_age", self.stream_max_age, secs(1), DAY * 365),
            bound("stream_max_bytes", self.stream_max_bytes, -1i64, i64::MAX),
            bound("publish_retries", self.publish_retries, 0u32, 30u32),
            bound("publish_backoff", self.publish_backoff, Duration::ZERO, secs(60)),
            bound("ack_timeout", self.ack_timeout, ms(10), secs(60)),
        ]
    }
}

/// Where run results are kept for `GetRun`.
#[derive(Debug, Clone, Args)]
#[command(next_help_heading = "Result store")]
pub struct StoreSettings {
    /// Result store: memory (bounded by --keep-results / --keep-results-for), or nats://host:4222
    /// (a JetStream key-value bucket shared by replicas, kept across restarts).
    #[arg(long = "run-store", env = "ORCHESTRATOR_RUN_STORE", default_value = "memory")]
    pub backend: Backend,
    /// Finished results kept for GetRun (cap 1000000).
    #[arg(long, env = "ORCHESTRATOR_KEEP_RESULTS", default_value_t = 10_000)]
    pub keep_results: usize,
    /// How long finished results are kept (cap 7 days).
    #[arg(long, env = "ORCHESTRATOR_KEEP_RESULTS_FOR", default_value = "1h", value_parser = parse_duration)]
    pub keep_results_for: Duration,
    /// Key-value bucket of the NATS result store (created when missing).
    #[arg(
        long = "run-store-bucket",
        env = "ORCHESTRATOR_RUN_STORE_BUCKET",
        default_value = "orchestrator-runs"
    )]
    pub bucket: String,
    /// Lease of a live run in the NATS result store: its replica renews it every third of this;
    /// a run whose replica stops renewing (crashed, partitioned) reads as FAILED
    /// ORCHESTRATOR_LOST once it expires (1s..=10m).
    #[arg(long = "run-store-lease", env = "ORCHESTRATOR_RUN_STORE_LEASE", default_value = "15s", value_parser = parse_duration)]
    pub lease: Duration,
    /// How long the NATS result store keeps a result (cap 365d).
    #[arg(long = "run-store-ttl", env = "ORCHESTRATOR_RUN_STORE_TTL", default_value = "24h", value_parser = parse_duration)]
    pub ttl: Duration,
    /// How long one read or write of the result store may take (cap 1m).
    #[arg(long = "store-timeout", env = "ORCHESTRATOR_STORE_TIMEOUT", default_value = "5s", value_parser = parse_duration)]
    pub timeout: Duration,
    /// Finished results kept in memory while the store cannot take them (NATS down), written
    /// again when it is back and answered by GetRun meanwhile; the oldest is dropped past this
    /// (1..=1000000).
    #[arg(
        long = "run-store-backlog",
        env = "ORCHESTRATOR_RUN_STORE_BACKLOG",
        default_value_t = 10_000
    )]
    pub backlog: usize,
}

impl Bounded for StoreSettings {
    fn bounds(&self) -> Vec<Bound> {
        vec![
            bound("keep_results", self.keep_results, 0usize, 1_000_000usize),
            bound("keep_results_for", self.keep_results_for, Duration::ZERO, DAY * 7),
            bound("ttl", self.ttl, secs(1), DAY * 365),
            bound("lease", self.lease, secs(1), secs(600)),
            bound("timeout", self.timeout, ms(10), secs(60)),
            bound("backlog", self.backlog, 1usize, 1_000_000usize),
        ]
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

/// Logs and traces.
#[derive(Debug, Clone, Args)]
#[command(next_help_heading = "Telemetry")]
pub struct TelemetrySettings {
    /// Log format: text or json.
    #[arg(long, env = "ORCHESTRATOR_LOG_FORMAT", default_value = "text")]
    pub log_format: LogFormat,
    /// Record tool arguments and results on spans (off by default: they may hold secrets).
    #[arg(long, env = "ORCHESTRATOR_TRACE_TOOL_PAYLOADS")]
    pub trace_tool_payloads: bool,
    /// Size cap of each recorded payload, in bytes (cap 64 KiB).
    #[arg(long, env = "ORCHESTRATOR_TRACE_PAYLOAD_MAX_BYTES", default_value_t = KIB)]
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
            self.llm.bounds(),
            self.tool_runners.bounds(),
            self.limits.bounds(),
            self.runs.bounds(),
            self.signals.bounds(),
            self.store.bounds(),
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
    /// A configuration talking to `llm_base_url` and `tool_runners`, everything else default.
    pub fn new(llm_base_url: &str, model: &str, tool_runners: Vec<String>) -> Self {
        let mut config = Self::default();
        config.llm.base_url = llm_base_url.to_owned();
        config.llm.model = model.to_owned();
        config.tool_runners.endpoints = tool_runners;
        config
    }

    /// Drops the blank entries of lists read from the environment (`ORCHESTRATOR_EXIT_TOOLS=""`,
    /// `"a,,b"`), which mean nothing.
    pub fn without_blanks(mut self) -> Self {
        self.runs.exit_tools.retain(|t| !t.name.is_empty());
        self.llm.headers.retain(|h| !h.is_blank());
        self
    }

    /// Checks every limit against its range and every name against its rules; the error names
    /// the flag.
    pub fn validate(&self) -> Result<(), Error> {
        self.check_bounds()?;
        for target in &self.tool_runners.endpoints {
            target
                .parse::<crate::tool_runners::Target>()
                .map_err(|e| Error::Config(format!("{} {e}", flag::<ToolRunnerSettings>("endpoints"))))?;
        }
        self.security.options().map_err(Error::Config)?;
        self.check_llm_headers()?;
        self.llm.defaults().map_err(Error::Config)?;
        self.check_nats_names()?;
        self.check_exit_tools()
    }

    /// Every extra LLM header is `Name: value`; the error never shows the entry (it may be a
    /// credential without its name).
    fn check_llm_headers(&self) -> Result<(), Error> {
        match self.llm.headers.iter().position(Header::is_malformed) {
            Some(index) => Err(Error::Config(format!(
                "{} entry {} is not `Name: value` (not shown: it may hold a credential)",
                flag::<LlmSettings>("headers"),
                index + 1
            ))),
            None => Ok(()),
        }
    }

    /// NATS subjects, streams and buckets are dot-separated tokens of letters, digits, `_`, `-`.
    fn check_nats_names(&self) -> Result<(), Error> {
        let token = |t: &str| !t.is_empty() && t.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
        let prefix = &self.signals.subject_prefix;
        if !prefix.split('.').all(token) {
            return Err(Error::Config(format!(
                "{} {prefix:?}: dot-separated tokens of letters, digits, '_' or '-'",
                flag::<SignalSettings>("subject_prefix")
            )));
        }
        for (flag, name) in [
            (flag::<SignalSettings>("stream"), &self.signals.stream),
            (flag::<StoreSettings>("bucket"), &self.store.bucket),
        ] {
            if !token(name) {
                return Err(Error::Config(format!("{flag} {name:?}: letters, digits, '_' or '-'")));
            }
        }
        Ok(())
    }

    /// Exit tools have valid, distinct names and usable schemas.
    fn check_exit_tools(&self) -> Result<(), Error> {
        let flag = flag::<RunSettings>("exit_tools");
        let mut seen = std::collections::HashSet::new();
        for tool in self.runs.exit_tools.iter().filter(|t| !t.name.is_empty()) {
            if !shared::tools::valid_tool_name(&tool.name) {
                return Err(Error::Config(format!(
                    "{flag} {:?}: names are 1-64 of letters, digits, '_' or '-'",
                    tool.name
                )));
            }
            if !seen.insert(&tool.name) {
                return Err(Error::Config(format!("{flag} {:?} is given twice", tool.name)));
            }
            shared::tools::check_schema(&tool.parameters)
                .map_err(|e| Error::Config(format!("{flag} {}: {e}", tool.name)))?;
        }
        Ok(())
    }
}

/// Parses `--exit-tool NAME[=SCHEMA_FILE]`: the schema file's `description` describes the tool.
fn exit_tool(spec: &str) -> Result<ToolDefinition, String> {
    let (name, file) = match spec.split_once('=') {
        Some((name, file)) => (name.trim(), Some(PathBuf::from(file.trim()))),
        None => (spec.trim(), None),
    };
    let default_description = || format!("Signal {name} (one-way; nothing comes back).");
    let (description, parameters) = match file {
        None => (default_description(), serde_json::json!({"type": "object"})),
        Some(path) => {
            let text = std::fs::read_to_string(&path)
                .map_err(|e| format!("--exit-tool {name}: cannot read {}: {e}", path.display()))?;
            let schema: serde_json::Value = serde_json::from_str(&text)
                .map_err(|e| format!("--exit-tool {name}: {} is not JSON: {e}", path.display()))?;
            let description = schema
                .get("description")
                .and_then(|d| d.as_str())
                .map_or_else(default_description, str::to_owned);
            (description, schema)
        }
    };
    Ok(ToolDefinition {
        name: name.to_owned(),
        description,
        parameters,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Settings whose range depends on this one, set so that both edges of this one are valid.
    fn companions(flag: &str) -> Vec<String> {
        let others: &[&str] = match flag {
            "--loop-window" => &["--loop-threshold=2"],
            "--llm-max-line-bytes" => &["--llm-max-event-bytes=67108864"],
            "--max-turns-ceiling" => &["--max-turns=1"],
            "--tool-call-budget-ceiling" => &["--tool-call-budget=0"],
            "--max-tool-failures-ceiling" => &["--max-tool-failures=0"],
            "--tool-timeout-ceiling" => &["--tool-timeout=1ms"],
            "--run-timeout-ceiling" => &["--run-timeout=1ms"],
            "--trace-payload-max-bytes" => &["--trace-tool-payloads"],
            _ => &[],
        };
        others.iter().map(|o| (*o).to_owned()).collect()
    }

    #[test]
    fn the_defaults_are_valid() {
        assert!(Config::default().validate().is_ok());
    }

    /// Every row of the table, through the real flags, on both sides of both edges.
    #[test]
    fn every_bound_holds_on_both_sides() {
        let validate = |c: &Config| c.validate().map_err(|e| e.to_string());
        assert_eq!(shared::config::check_every_bound(validate, companions), Ok(()));
    }

    #[test]
    fn names_and_exit_tools_are_checked() {
        let mut config = Config::default();
        config.signals.subject_prefix = "a..b".into();
        assert!(
            config
                .validate()
                .unwrap_err()
                .to_string()
                .contains("--signal-subject-prefix")
        );
        let mut config = Config::default();
        config.runs.exit_tools = vec![exit_tool("done").unwrap(), exit_tool("done").unwrap()];
        assert!(
            config
                .validate()
                .unwrap_err()
                .to_string()
                .contains("--exit-tool \"done\" is given twice")
        );
        let mut config = Config::default();
        config.tool_runners.endpoints = vec!["dns://x".into()];
        assert!(config.validate().unwrap_err().to_string().contains("--tool-runner"));
    }

    #[test]
    fn blank_list_entries_mean_nothing() {
        let mut config = Config::default();
        config.runs.exit_tools = vec![exit_tool("a").unwrap(), exit_tool("").unwrap()];
        config.llm.headers = vec!["".parse().unwrap(), "X-A: 1".parse().unwrap()];
        assert!(config.validate().is_ok());
        let config = config.without_blanks();
        assert_eq!(config.runs.exit_tools.len(), 1);
        assert_eq!(config.llm.headers.len(), 1);
    }

    #[test]
    fn secrets_stay_out_of_debug_output() {
        let mut config = Config::default();
        config.llm.api_key = Some(Secret::from("sk-secret"));
        config.llm.headers = vec!["X-Gateway-Key: hunter2".parse().unwrap()];
        let debug = format!("{config:?}");
        assert!(!debug.contains("sk-secret") && !debug.contains("hunter2"), "{debug}");
        assert!(debug.contains("X-Gateway-Key"), "{debug}");
    }

    #[test]
    fn run_defaults_from_flags_are_checked_like_a_request() {
        use clap::Parser;
        #[derive(Parser)]
        struct Flags {
            #[command(flatten)]
            llm: LlmSettings,
        }
        let parse = |args: &[&str]| {
            let mut argv = vec!["orchestrator"];
            argv.extend_from_slice(args);
            Flags::try_parse_from(argv).map_err(|e| e.to_string())?.llm.defaults()
        };
        let ok = parse(&[
            "--llm-temperature",
            "2",
            "--llm-tool-choice",
            "required",
            "--llm-extra-body",
            r#"{"top_k": 5}"#,
        ])
        .unwrap();
        assert_eq!(
            (ok.temperature, ok.tool_choice),
            (Some(2.0), Some(ToolChoice::Required))
        );
        assert_eq!(ok.extra_body["top_k"], 5);
        assert!(
            parse(&["--llm-temperature", "2.1"])
                .unwrap_err()
                .contains("temperature = 2.1 is outside 0..=2")
        );
        assert!(
            parse(&["--llm-extra-body", r#"{"stream": false}"#])
                .unwrap_err()
                .contains("may not set \"stream\"")
        );
        assert!(
            parse(&["--llm-extra-body", "nope"])
                .unwrap_err()
                .contains("--llm-extra-body")
        );
        assert!(parse(&["--llm-tool-choice", "two words"]).is_err());
        assert!(parse(&["--llm-reasoning-effort", "HIGH"]).is_err());
    }

    #[test]
    fn a_malformed_header_is_refused_without_being_shown() {
        let mut config = Config::default();
        config.llm.headers = vec!["X-A: 1".parse().unwrap(), "X-Gateway-Key hunter2".parse().unwrap()];
        let error = config.without_blanks().validate().unwrap_err().to_string();
        assert!(error.contains("--llm-header entry 2 is not `Name: value`"), "{error}");
        assert!(!error.contains("hunter2"), "{error}");
    }

    #[test]
    fn nats_credentials_stay_out_of_the_backend_and_its_errors() {
        let backend: Backend = "nats://svc:pa55word@nats:4222".parse().unwrap();
        let shown = format!("{backend:?}");
        assert!(!shown.contains("pa55word") && shown.contains("nats:4222"), "{shown}");
        let error = "natz://svc:pa55word@nats:4222".parse::<Backend>().unwrap_err();
        assert!(!error.contains("pa55word"), "{error}");
    }
}
