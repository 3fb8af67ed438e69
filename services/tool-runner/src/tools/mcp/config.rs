//! `[[mcp_servers]]` in the tools manifest: one MCP server each, reached over stdio (the runner
//! starts it) or streamable HTTP (it runs elsewhere).
//!
//! ```toml
//! [[mcp_servers]]
//! name = "time"                       # letters, digits, '_' or '-'
//! command = "mcp-server-time"         # stdio: no shell; a path (relative to the manifest) or on PATH
//! args = ["--local-timezone", "UTC"]
//! env_allowlist = ["PATH", "HOME"]    # default: PATH, LANG, LC_ALL, TZ (as command tools)
//! env = { PYTHONUNBUFFERED = "1" }
//! cwd = "."                           # default: the manifest's directory
//! [mcp_servers.limits]                # resource limits, as command tools' [tool.limits]
//! max_memory_bytes = 1073741824
//!
//! [[mcp_servers]]
//! name = "search"
//! url = "http://search-mcp:3001/mcp"  # streamable HTTP
//! headers = { "X-Team" = "support" }  # sent as written
//! headers_from_env = { Authorization = "SEARCH_MCP_AUTHORIZATION" }  # value read from that variable
//! prefix = "search__"                 # default "<name>__"
//! allow = ["query"]                   # only these of its tools (MCP names; default: all)
//! deny = ["delete_index"]             # never these
//! timeout = "30s"                     # per call (cap 1h)
//! required = true                     # health is NOT_SERVING while it is down (default false)
//! needs_approval = ["query"]          # a person approves each call of these first (MCP names;
//!                                     # `true`: every tool of the server; default none)
//! protocol = "auto"                   # "auto" (default): `server/discover` (2026-07-28), else
//!                                     # the `initialize` handshake; or one version to speak
//! ```
//!
//! Each server also takes `connect_timeout` (connecting, the handshake and listing its tools;
//! default 30 s, cap 10 min), `restart_backoff_max` (the longest wait between reconnects; default
//! 30 s, 1 s ..= 10 min), `ping_interval` (how often the live session is checked with an MCP
//! `ping`, which must be answered within that time or the session is ended and reconnected;
//! default 15 s, 1 s ..= 10 min), `max_message_bytes` (largest message accepted from it; default
//! 4 MiB, 1 KiB ..= 64 MiB) and `max_tools` (most tools taken from it; default 256, cap 10,000).

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::time::Duration;

use reqwest::header::{HeaderName, HeaderValue};
use serde::Deserialize;

use super::super::fields::{self, DEFAULT_ENV_ALLOWLIST};
use super::super::limits::{RawLimits, ResourceLimits};

/// Default per-call timeout.
pub(crate) const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30);
/// Default time to connect, shake hands and list the tools.
pub(crate) const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(30);
/// Longest `connect_timeout`.
pub(crate) const MAX_CONNECT_TIMEOUT: Duration = Duration::from_secs(600);
/// Default longest wait between reconnects.
pub(crate) const DEFAULT_BACKOFF_MAX: Duration = Duration::from_secs(30);
/// Default time between two pings of a live session.
pub(crate) const DEFAULT_PING_INTERVAL: Duration = Duration::from_secs(15);
/// Default largest message from a server.
pub(crate) const DEFAULT_MAX_MESSAGE_BYTES: u64 = 4 * 1024 * 1024;
/// Default most tools of one server.
pub(crate) const DEFAULT_MAX_TOOLS: u64 = 256;

/// One `[[mcp_servers]]` table as written.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(in crate::tools) struct RawMcpServer {
    pub(in crate::tools) name: String,
    command: Option<String>,
    #[serde(default)]
    args: Vec<String>,
    env_allowlist: Option<Vec<String>>,
    #[serde(default)]
    env: BTreeMap<String, String>,
    cwd: Option<PathBuf>,
    limits: Option<RawLimits>,
    url: Option<String>,
    #[serde(default)]
    headers: BTreeMap<String, String>,
    #[serde(default)]
    headers_from_env: BTreeMap<String, String>,
    prefix: Option<String>,
    allow: Option<Vec<String>>,
    #[serde(default)]
    deny: Vec<String>,
    timeout: Option<String>,
    connect_timeout: Option<String>,
    restart_backoff_max: Option<String>,
    ping_interval: Option<String>,
    max_message_bytes: Option<u64>,
    max_tools: Option<u64>,
    #[serde(default)]
    required: bool,
    #[serde(default, deserialize_with = "needs_approval")]
    needs_approval: NeedsApproval,
    protocol: Option<String>,
}

/// The protocol versions a server may be asked to speak, newest first (`protocol`).
pub(crate) const PROTOCOLS: [&str; 5] = ["2026-07-28", "2025-11-25", "2025-06-18", "2025-03-26", "2024-11-05"];

/// Which protocol the runner speaks with a server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Protocol {
    /// `server/discover` first (stateless 2026-07-28); a server that does not know it gets the
    /// `initialize` handshake.
    Auto,
    /// This version only (one of [`PROTOCOLS`]).
    Only(String),
}

/// `protocol` as written.
fn protocol(raw: &RawMcpServer) -> Result<Protocol, String> {
    match raw.protocol.as_deref() {
        None | Some("auto") => Ok(Protocol::Auto),
        Some(version) if PROTOCOLS.contains(&version) => Ok(Protocol::Only(version.to_owned())),
        Some(other) => Err(format!(
            "protocol {other:?} must be \"auto\" or one of {}",
            PROTOCOLS.join(", ")
        )),
    }
}

/// `needs_approval` as written, with an error that says what it may be.
fn needs_approval<'de, D: serde::Deserializer<'de>>(d: D) -> Result<NeedsApproval, D::Error> {
    NeedsApproval::deserialize(d).map_err(|_| {
        serde::de::Error::custom("needs_approval must be true, false or a list of the server's tool names")
    })
}

/// `needs_approval` of a server: all its tools (`true`), none (`false`, the default) or a list.
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(untagged)]
pub(crate) enum NeedsApproval {
    /// Every tool of the server, or none.
    All(bool),
    /// These tools (MCP names).
    Tools(Vec<String>),
}

impl Default for NeedsApproval {
    fn default() -> Self {
        Self::All(false)
    }
}

/// How the runner reaches a server.
#[derive(Debug, Clone)]
pub(crate) enum Transport {
    /// A child process speaking MCP on stdin/stdout.
    Stdio {
        /// `prlimit`, which sets the limits and then executes the program.
        prlimit: PathBuf,
        program: PathBuf,
        args: Vec<String>,
        /// Its whole environment.
        env: Vec<(String, String)>,
        cwd: PathBuf,
        limits: ResourceLimits,
    },
    /// A streamable-HTTP endpoint.
    Http {
        url: String,
        /// Parsed at load time, values marked sensitive (some come from the environment and are
        /// secrets: `Debug` does not show them).
        headers: HashMap<HeaderName, HeaderValue>,
    },
}

/// One MCP server, checked.
#[derive(Debug, Clone)]
pub(crate) struct McpServerConfig {
    pub(crate) name: String,
    pub(crate) transport: Transport,
    /// Put before each of its tool names, so two servers' tools never collide.
    pub(crate) prefix: String,
    /// Its tools to offer (MCP names); `None`: all.
    pub(crate) allow: Option<Vec<String>>,
    pub(crate) deny: Vec<String>,
    pub(crate) timeout: Duration,
    pub(crate) connect_timeout: Duration,
    pub(crate) restart_backoff_max: Duration,
    /// A session can look alive and not be: an HTTP server that went away (its client keeps
    /// the session), a stdio server stuck in a loop. A missed ping ends it.
    pub(crate) ping_interval: Duration,
    pub(crate) max_message_bytes: usize,
    pub(crate) max_tools: usize,
    /// Whether the runner is unready while this server is down.
    pub(crate) required: bool,
    /// Its tools whose calls a person approves first.
    pub(crate) needs_approval: NeedsApproval,
    /// Which protocol version to speak: a server known to be old need not be probed.
    pub(crate) protocol: Protocol,
}

impl McpServerConfig {
    /// Whether the server's tool `name` is offered (allow list, then deny list).
    pub(crate) fn offers(&self, name: &str) -> bool {
        self.allow.as_ref().is_none_or(|allow| allow.iter().any(|a| a == name)) && !self.deny.iter().any(|d| d == name)
    }

    /// Whether calls of the server's tool `name` (its MCP name) need approval.
    pub(crate) fn needs_approval(&self, name: &str) -> bool {
        match &self.needs_approval {
            NeedsApproval::All(all) => *all,
            NeedsApproval::Tools(tools) => tools.iter().any(|t| t == name),
        }
    }
}

/// Checks one table; `base_dir` is the manifest's directory, `prlimit` found when the manifest
/// has a stdio server. The error says what is wrong (the caller names the file and server).
pub(in crate::tools) fn build(
    raw: RawMcpServer,
    base_dir: &Path,
    prlimit: impl Fn() -> Result<PathBuf, String>,
) -> Result<McpServerConfig, String> {
    let prefix = prefix(&raw)?;
    let protocol = protocol(&raw)?;
    let transport = transport(&raw, base_dir, prlimit)?;
    let duration = |name: &str, value: &Option<String>, default: Duration, min: Duration, cap: Duration| {
        value
            .as_deref()
            .map(|text| fields::parse_bounded_duration(name, text, min, cap))
            .transpose()
            .map(|d| d.unwrap_or(default))
    };
    let second = Duration::from_secs(1);
    Ok(McpServerConfig {
        timeout: duration(
            "timeout",
            &raw.timeout,
            DEFAULT_TIMEOUT,
            Duration::from_millis(1),
            fields::MAX_TIMEOUT,
        )?,
        connect_timeout: duration(
            "connect_timeout",
            &raw.connect_timeout,
            DEFAULT_CONNECT_TIMEOUT,
            Duration::from_millis(100),
            MAX_CONNECT_TIMEOUT,
        )?,
        restart_backoff_max: duration(
            "restart_backoff_max",
            &raw.restart_backoff_max,
            DEFAULT_BACKOFF_MAX,
            second,
            MAX_CONNECT_TIMEOUT,
        )?,
        ping_interval: duration(
            "ping_interval",
            &raw.ping_interval,
            DEFAULT_PING_INTERVAL,
            second,
            MAX_CONNECT_TIMEOUT,
        )?,
        max_message_bytes: usize::try_from(fields::check_range(
            "max_message_bytes",
            raw.max_message_bytes,
            DEFAULT_MAX_MESSAGE_BYTES,
            1024,
            64 * 1024 * 1024,
        )?)
        .unwrap_or(usize::MAX),
        max_tools: usize::try_from(fields::check_range(
            "max_tools",
            raw.max_tools,
            DEFAULT_MAX_TOOLS,
            1,
            10_000,
        )?)
        .unwrap_or(usize::MAX),
        name: raw.name,
        transport,
        prefix,
        allow: raw.allow,
        deny: raw.deny,
        required: raw.required,
        needs_approval: raw.needs_approval,
        protocol,
    })
}

/// The server's tool-name prefix (default `<name>__`), checked with its name: prefixed names
/// must still be valid tool names.
fn prefix(raw: &RawMcpServer) -> Result<String, String> {
    if !shared::tools::valid_tool_name(&raw.name) {
        return Err("the name must be 1-64 characters of letters, digits, '_' or '-'".into());
    }
    let prefix = raw.prefix.clone().unwrap_or_else(|| format!("{}__", raw.name));
    if !prefix.is_empty() && !shared::tools::valid_tool_name(&prefix) {
        return Err(format!(
            "prefix {prefix:?} must be letters, digits, '_' or '-' (at most 63, so names fit in 64)"
        ));
    }
    Ok(prefix)
}

/// How the server is reached: exactly one of `command` (stdio) and `url` (streamable HTTP).
fn transport(
    raw: &RawMcpServer,
    base_dir: &Path,
    prlimit: impl Fn() -> Result<PathBuf, String>,
) -> Result<Transport, String> {
    match (&raw.command, &raw.url) {
        (Some(_), Some(_)) => Err("give either command (stdio) or url (streamable HTTP), not both".into()),
        (None, None) => Err("give command (a stdio server) or url (a streamable-HTTP server)".into()),
        (Some(command), None) => stdio(raw, command, base_dir, prlimit()?),
        (None, Some(url)) => http(raw, url),
    }
}

fn stdio(raw: &RawMcpServer, command: &str, base_dir: &Path, prlimit: PathBuf) -> Result<Transport, String> {
    if !raw.headers.is_empty() || !raw.headers_from_env.is_empty() {
        return Err("headers and headers_from_env are for url servers; a stdio server takes env".into());
    }
    let allowlist = raw
        .env_allowlist
        .clone()
        .unwrap_or_else(|| DEFAULT_ENV_ALLOWLIST.iter().map(|s| (*s).to_owned()).collect());
    let mut env: BTreeMap<String, String> = allowlist
        .iter()
        .filter_map(|k| std::env::var(k).ok().map(|v| (k.clone(), v)))
        .collect();
    env.extend(raw.env.clone());
    Ok(Transport::Stdio {
        prlimit,
        program: fields::resolve_program(command, base_dir)?,
        args: raw.args.clone(),
        env: env.into_iter().collect(),
        cwd: match &raw.cwd {
            Some(dir) => fields::resolve_dir(dir, base_dir)?,
            None => base_dir.to_owned(),
        },
        limits: ResourceLimits::resolve(raw.limits.as_ref(), &ResourceLimits::default())?,
    })
}

fn http(raw: &RawMcpServer, url: &str) -> Result<Transport, String> {
    if raw.env_allowlist.is_some()
        || !raw.env.is_empty()
        || raw.cwd.is_some()
        || raw.limits.is_some()
        || !raw.args.is_empty()
    {
        return Err(
            "args, env, env_allowlist, cwd and limits are for command servers; a url server runs elsewhere".into(),
        );
    }
    let parsed = reqwest::Url::parse(url).map_err(|e| format!("url {url:?} is not a valid URL: {e}"))?;
    if !matches!(parsed.scheme(), "http" | "https") {
        return Err(format!("url {url:?} must be http or https"));
    }
    let mut written: Vec<(String, String)> = raw.headers.clone().into_iter().collect();
    for (header, variable) in &raw.headers_from_env {
        let value = std::env::var(variable)
            .map_err(|_| format!("headers_from_env: {header} comes from ${variable}, which is not set"))?;
        written.push((header.clone(), value));
    }
    let mut headers = HashMap::new();
    for (name, value) in written {
        let parsed_name = HeaderName::from_bytes(name.as_bytes())
            .map_err(|_| format!("header name {name:?} is not a valid HTTP header name"))?;
        // The value is not quoted: it may be a secret.
        let mut value = HeaderValue::from_str(&value)
            .map_err(|_| format!("the value of header {name} is not a valid HTTP header value"))?;
        value.set_sensitive(true);
        headers.insert(parsed_name, value);
    }
    Ok(Transport::Http {
        url: url.to_owned(),
        headers,
    })
}
