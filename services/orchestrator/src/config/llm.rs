//! The LLM server: where it is, how it is reached (credentials, headers, retries, timeouts), and
//! the model parameters of runs that set none.

use std::time::Duration;

use clap::Args;
use shared::config::{Bound, Bounded, bound, parse_duration};

use super::{KIB, MIB, ms, secs};
use crate::domain::params::parse_extra_body;
use crate::domain::params::{SamplingParams, ToolChoice};
use shared::secrets::Secret;

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
    pub(super) fn is_blank(&self) -> bool {
        self.name.is_empty() && self.value.expose().is_empty()
    }

    /// Not `Name: value`.
    pub(super) fn is_malformed(&self) -> bool {
        self.name.is_empty() && !self.value.expose().is_empty()
    }

    /// A header that frames the request or its connection, which only the HTTP client sets: one
    /// set by hand could make the model server read the body's end, or the next request, where
    /// the client did not put it.
    pub(super) fn is_framing(&self) -> bool {
        FRAMING_HEADERS.iter().any(|h| self.name.eq_ignore_ascii_case(h))
    }
}

/// Headers `--llm-header` may not set (see [`Header::is_framing`]).
const FRAMING_HEADERS: &[&str] = &[
    "host",
    "content-length",
    "transfer-encoding",
    "connection",
    "keep-alive",
    "proxy-connection",
    "upgrade",
    "te",
    "trailer",
    "expect",
];

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

/// Who reads a completion's bytes from the LLM server's socket.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Reader {
    /// The run, in its own task: no hand-over between tasks per chunk.
    Run,
    /// The shared HTTP client's connection tasks.
    Pooled,
}

/// The LLM server.
#[derive(Debug, Clone, Args)]
#[command(next_help_heading = "LLM server")]
pub struct LlmSettings {
    /// OpenAI-compatible base URL, ending in /v1 (vLLM, Ollama, llama.cpp, OpenAI …), or
    /// dns:///name:port/v1 for every address of a name (re-resolved every
    /// --llm-resolve-interval). Repeatable (comma-separated in the environment): every endpoint
    /// serves the same model, and each run's turns go to one of them (see --llm-affinity-field).
    /// The API key is read from LLM_API_KEY only (never a flag, never logged).
    #[arg(
        long = "llm-base-url",
        env = "LLM_BASE_URL",
        value_delimiter = ',',
        default_value = "http://127.0.0.1:11434/v1"
    )]
    pub base_urls: Vec<String>,
    /// How often dns:/// model endpoints are resolved again (100ms..=10m).
    #[arg(long = "llm-resolve-interval", env = "LLM_RESOLVE_INTERVAL", default_value = "30s", value_parser = parse_duration)]
    pub endpoint_resolve_interval: Duration,
    /// Completions in flight on one model endpoint before a run whose turns go there moves to
    /// the next endpoint in its order (1..=100000).
    #[arg(
        long = "llm-max-inflight-per-endpoint",
        env = "LLM_MAX_INFLIGHT_PER_ENDPOINT",
        default_value_t = 256
    )]
    pub max_inflight_per_endpoint: usize,
    /// Failures in a row (no connection, 5xx or 429 before the first byte, a stream cut) after
    /// which a model endpoint is ejected: runs go to the next one until it is let back in
    /// (1..=100).
    #[arg(long = "llm-eject-after", env = "LLM_EJECT_AFTER", default_value_t = 3)]
    pub eject_after: u32,
    /// How long an endpoint stays ejected the first time; each ejection in a row doubles it, up
    /// to 5 minutes. Then it is let back in on probation: one more failure ejects it again
    /// (100ms..=5m).
    #[arg(long = "llm-eject-for", env = "LLM_EJECT_FOR", default_value = "5s", value_parser = parse_duration)]
    pub eject_for: Duration,
    /// Most model endpoints ejected at once, in percent of the fleet (0..=100): an endpoint past
    /// it stays in, so a fleet-wide fault never ejects every endpoint.
    #[arg(
        long = "llm-max-ejected-percent",
        env = "LLM_MAX_EJECTED_PERCENT",
        default_value_t = 50
    )]
    pub max_ejected_percent: u32,
    /// A body field that carries each run's affinity key to the server, for hosted providers
    /// that route by one (OpenAI: prompt_cache_key). Unset: not sent.
    #[arg(long = "llm-affinity-field", env = "LLM_AFFINITY_FIELD")]
    pub affinity_field: Option<String>,
    /// A header that carries each run's affinity key, for providers and gateways that route by
    /// one (xAI: x-grok-conv-id). Unset: not sent.
    #[arg(long = "llm-affinity-header", env = "LLM_AFFINITY_HEADER")]
    pub affinity_header: Option<String>,
    /// Model used when a request names none.
    #[arg(long = "llm-model", env = "LLM_MODEL", default_value = "llama3.1")]
    pub model: String,
    /// Bearer token, from the environment variable LLM_API_KEY.
    #[arg(skip = Secret::from_env("LLM_API_KEY"))]
    pub api_key: Option<Secret>,
    /// Extra header for the LLM server, `Name: value` (repeatable; `;`-separated in the
    /// environment). Headers that frame the request (Host, Content-Length, Transfer-Encoding,
    /// Connection, Upgrade, TE, Trailer, Expect …) are refused: the HTTP client sets those.
    #[arg(long = "llm-header", env = "LLM_HEADERS", value_delimiter = ';')]
    pub headers: Vec<Header>,
    /// PEM file of CA certificates trusted for an `https://` LLM server, besides the system's
    /// (a self-hosted server behind a private CA). Read once at start.
    #[arg(long = "llm-ca-file", env = "LLM_CA_FILE")]
    pub server_ca_file: Option<std::path::PathBuf>,
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
    /// Longest SSE line, and longest HTTP response head, accepted from the LLM, in bytes (cap 64 MiB).
    #[arg(long = "llm-max-line-bytes", env = "LLM_MAX_LINE_BYTES", default_value_t = MIB)]
    pub max_line_bytes: usize,
    /// Largest SSE event accepted from the LLM (all its lines), in bytes (max-line-bytes..=64 MiB).
    #[arg(long = "llm-max-event-bytes", env = "LLM_MAX_EVENT_BYTES", default_value_t = 4 * MIB)]
    pub max_event_bytes: usize,
    /// How completions are read from a plain-http LLM server: `run` (each run reads its own
    /// HTTP/1.1 connection in its own task, connections kept alive between turns) or `pooled` (a
    /// shared client whose connection tasks hand the bytes over). https URLs and a configured
    /// proxy (HTTP_PROXY, ALL_PROXY …) always use `pooled`.
    #[arg(long = "llm-reader", env = "LLM_READER", default_value = "run")]
    pub reader: Reader,
    /// Idle keep-alive connections to the LLM server kept for the next turn by the `run` reader
    /// (0..=4096; 0: a connection per completion).
    #[arg(
        long = "llm-max-idle-connections",
        env = "LLM_MAX_IDLE_CONNECTIONS",
        default_value_t = 256
    )]
    pub max_idle_connections: usize,
    /// An idle connection older than this is closed rather than reused (1s..=1h): a NAT or load
    /// balancer between here and the model server may have dropped it without a word.
    #[arg(long = "llm-idle-connection-timeout", env = "LLM_IDLE_CONNECTION_TIMEOUT", default_value = "90s", value_parser = parse_duration)]
    pub idle_connection_timeout: Duration,
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

/// A model endpoint as configured.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LlmTarget {
    /// One base URL.
    Static(String),
    /// `http://ADDRESS:port/path` for every address a name resolves to.
    Dns {
        /// The name, e.g. `vllm.models.svc.cluster.local`.
        host: String,
        /// The port of every address.
        port: u16,
        /// The path of every base URL, e.g. `/v1`.
        path: String,
    },
}

impl std::str::FromStr for LlmTarget {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let s = s.trim();
        let Some(rest) = s.strip_prefix("dns://") else {
            return Ok(Self::Static(s.to_owned()));
        };
        // dns:///name:port/path (the authority, a DNS server, is not supported).
        let shown = shared::secrets::shown_url(s);
        let Some(rest) = rest.strip_prefix('/') else {
            return Err(format!(
                "{shown:?}: use dns:///name:port/path (a DNS server in the authority is not supported)"
            ));
        };
        let (name_port, path) = rest.split_once('/').map_or((rest, ""), |(n, p)| (n, p));
        let (host, port) = name_port
            .rsplit_once(':')
            .ok_or_else(|| format!("{shown:?}: the port is missing (dns:///name:port/path)"))?;
        let port = port.parse().map_err(|_| format!("{shown:?}: {port:?} is not a port"))?;
        if host.is_empty() {
            return Err(format!("{shown:?}: the name is empty"));
        }
        Ok(Self::Dns {
            host: host.to_owned(),
            port,
            path: format!("/{path}"),
        })
    }
}

impl LlmSettings {
    /// The certificates of `--llm-ca-file`, each checked; an error names the flag and the file.
    pub fn ca_certificates(&self) -> Result<Vec<reqwest::Certificate>, String> {
        let Some(path) = &self.server_ca_file else {
            return Ok(Vec::new());
        };
        let shown = || format!("--llm-ca-file {}", path.display());
        let pem = std::fs::read(path).map_err(|e| format!("{}: {e}", shown()))?;
        let certificates = reqwest::Certificate::from_pem_bundle(&pem)
            .map_err(|e| format!("{}: not PEM certificates: {e}", shown()))?;
        if certificates.is_empty() {
            return Err(format!("{}: holds no certificate", shown()));
        }
        Ok(certificates)
    }

    /// The header that carries each run's affinity key, checked.
    pub fn affinity_header(&self) -> Result<Option<reqwest::header::HeaderName>, String> {
        self.affinity_header
            .as_deref()
            .filter(|name| !name.trim().is_empty())
            .map(|name| {
                reqwest::header::HeaderName::from_bytes(name.trim().as_bytes())
                    .map_err(|_| format!("--llm-affinity-header {name:?} is not a header name"))
            })
            .transpose()
    }

    /// The model endpoints (at least one), each checked.
    pub fn targets(&self) -> Result<Vec<LlmTarget>, String> {
        if self.base_urls.is_empty() {
            return Err("--llm-base-url: give at least one model endpoint".to_owned());
        }
        let targets = self
            .base_urls
            .iter()
            .map(|url| url.parse::<LlmTarget>().map_err(|e| format!("--llm-base-url {e}")))
            .collect::<Result<Vec<_>, _>>()?;
        for target in &targets {
            if let LlmTarget::Static(url) = target
                && !(url.starts_with("http://") || url.starts_with("https://"))
            {
                return Err(format!(
                    "--llm-base-url {:?} must be an http or https URL, or dns:///name:port/path",
                    shared::secrets::shown_url(url)
                ));
            }
        }
        Ok(targets)
    }

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
            bound(
                "endpoint_resolve_interval",
                self.endpoint_resolve_interval,
                ms(100),
                secs(600),
            ),
            bound(
                "max_inflight_per_endpoint",
                self.max_inflight_per_endpoint,
                1usize,
                100_000usize,
            ),
            bound("eject_after", self.eject_after, 1u32, 100u32),
            bound("eject_for", self.eject_for, ms(100), secs(300)),
            bound("max_ejected_percent", self.max_ejected_percent, 0u32, 100u32),
            bound("retry_backoff", self.retry_backoff, Duration::ZERO, secs(60)),
            bound("max_line_bytes", self.max_line_bytes, KIB, 64 * MIB),
            bound("max_event_bytes", self.max_event_bytes, self.max_line_bytes, 64 * MIB),
            bound("max_idle_connections", self.max_idle_connections, 0usize, 4096usize),
            bound(
                "idle_connection_timeout",
                self.idle_connection_timeout,
                secs(1),
                secs(3600),
            ),
        ]
    }
}
