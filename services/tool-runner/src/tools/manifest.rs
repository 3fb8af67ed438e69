//! The TOML manifest of command tools (`--tools-manifest FILE`).
//!
//! ```toml
//! [defaults]                      # optional; applies to every [[tool]]
//! timeout = "30s"
//! env_allowlist = ["PATH", "LANG"]
//!
//! [[tool]]
//! name = "system_info"
//! description = "Kernel and machine of the runner host."
//! argv = ["uname", "-a"]          # no shell: argv[0] is looked up on PATH at load time
//! output = "text"                 # "auto" (JSON if it parses, else text), "json" or "text"
//! stderr_to_model = false         # default: stderr goes to the runner's log, not to the model
//! needs_approval = false          # true: a person approves each call first (the orchestrator asks)
//! [tool.parameters]               # JSON Schema of the arguments, written as TOML
//! type = "object"
//! [tool.limits]                   # optional; see super::limits for every field and default
//! max_memory_bytes = 268435456
//! max_cpu_seconds = 10
//! ```
//!
//! The same file lists MCP servers as `[[mcp_servers]]` tables (see [`super::mcp::config`]).
//!
//! Everything is checked when the runner starts; a manifest with an error stops the runner with a
//! message naming the file, the tool (or server) and what is wrong.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;
use serde_json::Value;

use super::ToolSpec;
use super::command::{CommandConfig, CommandTool, OutputMode};
use super::limits::{RawLimits, ResourceLimits};
use super::mcp::config::{McpServerConfig, RawMcpServer};
use crate::Error;

pub use super::fields::{DEFAULT_ENV_ALLOWLIST, MAX_TIMEOUT};
use super::fields::{check_range, parse_bounded_duration, resolve_dir, resolve_program};

/// Default per-call timeout of a command tool.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30);
/// Default cap on a command's stdout; more output fails the call.
pub const DEFAULT_MAX_STDOUT: u64 = 1024 * 1024;
/// Largest stdout cap a tool may declare.
pub const MAX_STDOUT_CAP: u64 = 64 * 1024 * 1024;
/// Default amount of stderr kept (the tail) for error messages.
pub const DEFAULT_MAX_STDERR: u64 = 64 * 1024;
/// Largest stderr cap a tool may declare.
pub const MAX_STDERR_CAP: u64 = 4 * 1024 * 1024;

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawManifest {
    #[serde(default)]
    defaults: RawDefaults,
    #[serde(default, rename = "tool")]
    tools: Vec<RawTool>,
    #[serde(default)]
    mcp_servers: Vec<RawMcpServer>,
}

/// What a manifest declares.
#[derive(Default)]
pub struct Manifest {
    /// Its command tools.
    pub commands: Vec<(ToolSpec, CommandTool)>,
    /// Its MCP servers.
    pub(crate) mcp_servers: Vec<McpServerConfig>,
}

impl Manifest {
    /// The names of its MCP servers, in order.
    pub fn mcp_server_names(&self) -> Vec<&str> {
        self.mcp_servers.iter().map(|s| s.name.as_str()).collect()
    }
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawDefaults {
    timeout: Option<String>,
    max_stdout_bytes: Option<u64>,
    max_stderr_bytes: Option<u64>,
    env_allowlist: Option<Vec<String>>,
    working_dir: Option<PathBuf>,
    limits: Option<RawLimits>,
    stderr_to_model: Option<bool>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTool {
    name: String,
    description: String,
    argv: Vec<String>,
    parameters: Option<Value>,
    timeout: Option<String>,
    max_stdout_bytes: Option<u64>,
    max_stderr_bytes: Option<u64>,
    env_allowlist: Option<Vec<String>>,
    #[serde(default)]
    env: BTreeMap<String, String>,
    working_dir: Option<PathBuf>,
    #[serde(default)]
    output: OutputMode,
    limits: Option<RawLimits>,
    stderr_to_model: Option<bool>,
    #[serde(default)]
    needs_approval: bool,
    #[serde(default)]
    idempotent: bool,
}

pub use shared::tools::{check_schema, valid_tool_name};

/// Loads and checks the manifest at `path`: its command tools and MCP servers.
pub fn load(path: &Path) -> Result<Manifest, Error> {
    let file_error = |message: String| Error::Manifest {
        file: path.to_owned(),
        tool: None,
        message,
    };
    let text = std::fs::read_to_string(path).map_err(|e| file_error(format!("cannot read it: {e}")))?;
    let raw: RawManifest = toml::from_str(&text).map_err(|e| file_error(e.to_string().trim_end().to_owned()))?;
    // Absolute, so argv[0] and working_dir mean the same whatever the child's working directory.
    let base_dir = std::fs::canonicalize(path)
        .map_err(|e| file_error(format!("cannot resolve its directory: {e}")))?
        .parent()
        .map_or_else(|| PathBuf::from("/"), Path::to_path_buf);
    let defaults = Defaults::from_raw(raw.defaults, &base_dir).map_err(file_error)?;
    // Command tools and stdio MCP servers run under prlimit; looked up once, when one needs it.
    let prlimit = std::cell::OnceCell::new();
    let find_prlimit = || {
        prlimit
            .get_or_init(|| {
                if nix::unistd::Uid::effective().is_root() {
                    tracing::warn!(
                        "the runner runs as root: the kernel does not enforce max_processes for root; run it as another user"
                    );
                }
                resolve_program("prlimit", &base_dir).map_err(|e| {
                    format!("command tools and stdio MCP servers run under prlimit (util-linux) for their resource limits: {e}")
                })
            })
            .clone()
    };

    let mut manifest = Manifest::default();
    let mut seen = BTreeMap::new();
    for (i, raw_tool) in raw.tools.into_iter().enumerate() {
        let name = raw_tool.name.clone();
        let tool_error = |message: String| Error::Manifest {
            file: path.to_owned(),
            tool: Some(name.clone()),
            message,
        };
        if let Some(first) = seen.insert(name.clone(), i) {
            return Err(tool_error(format!("the name is used by tool #{} already", first + 1)));
        }
        let prlimit = find_prlimit().map_err(file_error)?;
        manifest
            .commands
            .push(build_tool(raw_tool, &defaults, &base_dir, &prlimit).map_err(tool_error)?);
    }
    let mut servers = BTreeMap::new();
    for (i, raw_server) in raw.mcp_servers.into_iter().enumerate() {
        let name = raw_server.name.clone();
        let server_error = |message: String| Error::Manifest {
            file: path.to_owned(),
            tool: Some(format!("mcp_servers {name}")),
            message,
        };
        if let Some(first) = servers.insert(name.clone(), i) {
            return Err(server_error(format!(
                "the name is used by mcp_servers #{} already",
                first + 1
            )));
        }
        let server = super::mcp::config::build(raw_server, &base_dir, find_prlimit).map_err(server_error)?;
        manifest.mcp_servers.push(server);
    }
    Ok(manifest)
}

struct Defaults {
    timeout: Duration,
    max_stdout: u64,
    max_stderr: u64,
    env_allowlist: Vec<String>,
    working_dir: PathBuf,
    limits: ResourceLimits,
    stderr_to_model: bool,
}

impl Defaults {
    fn from_raw(raw: RawDefaults, base_dir: &Path) -> Result<Self, String> {
        Ok(Self {
            timeout: raw
                .timeout
                .as_deref()
                .map(parse_timeout)
                .transpose()?
                .unwrap_or(DEFAULT_TIMEOUT),
            max_stdout: check_cap(
                "max_stdout_bytes",
                raw.max_stdout_bytes,
                DEFAULT_MAX_STDOUT,
                MAX_STDOUT_CAP,
            )?,
            max_stderr: check_cap(
                "max_stderr_bytes",
                raw.max_stderr_bytes,
                DEFAULT_MAX_STDERR,
                MAX_STDERR_CAP,
            )?,
            env_allowlist: raw
                .env_allowlist
                .unwrap_or_else(|| DEFAULT_ENV_ALLOWLIST.iter().map(|s| (*s).to_owned()).collect()),
            working_dir: raw
                .working_dir
                .map_or_else(|| Ok(base_dir.to_owned()), |d| resolve_dir(&d, base_dir))?,
            limits: ResourceLimits::resolve(raw.limits.as_ref(), &ResourceLimits::default())?,
            stderr_to_model: raw.stderr_to_model.unwrap_or(false),
        })
    }
}

fn parse_timeout(text: &str) -> Result<Duration, String> {
    parse_bounded_duration("timeout", text, Duration::from_millis(1), MAX_TIMEOUT)
}

fn check_cap(name: &'static str, value: Option<u64>, default: u64, cap: u64) -> Result<u64, String> {
    check_range(name, value, default, 1, cap)
}

fn build_tool(
    raw: RawTool,
    defaults: &Defaults,
    base_dir: &Path,
    prlimit: &Path,
) -> Result<(ToolSpec, CommandTool), String> {
    if !valid_tool_name(&raw.name) {
        return Err("the name must be 1-64 characters of letters, digits, '_' or '-'".into());
    }
    if raw.description.trim().is_empty() {
        return Err("description is empty; the model needs it to know when to call the tool".into());
    }
    let (program, args) = raw
        .argv
        .split_first()
        .ok_or("argv is empty; give the program and its arguments")?;
    let program = resolve_program(program, base_dir)?;
    let parameters = raw.parameters.unwrap_or_else(|| serde_json::json!({"type": "object"}));
    check_schema(&parameters)?;
    let timeout = raw
        .timeout
        .as_deref()
        .map(parse_timeout)
        .transpose()?
        .unwrap_or(defaults.timeout);
    let allowlist = raw.env_allowlist.as_ref().unwrap_or(&defaults.env_allowlist);
    let mut env: BTreeMap<String, String> = allowlist
        .iter()
        .filter_map(|k| std::env::var(k).ok().map(|v| (k.clone(), v)))
        .collect();
    env.extend(raw.env);
    let working_dir = match &raw.working_dir {
        Some(dir) => resolve_dir(dir, base_dir)?,
        None => defaults.working_dir.clone(),
    };
    let spec = ToolSpec {
        name: raw.name,
        description: raw.description,
        parameters,
        timeout,
        source: "command",
        needs_approval: raw.needs_approval,
        mcp_protocol: String::new(),
        idempotent: raw.idempotent,
    };
    let tool = CommandTool::new(CommandConfig {
        prlimit: prlimit.to_owned(),
        program,
        args: args.to_vec(),
        env: env.into_iter().collect(),
        working_dir,
        max_stdout: check_cap(
            "max_stdout_bytes",
            raw.max_stdout_bytes,
            defaults.max_stdout,
            MAX_STDOUT_CAP,
        )?,
        max_stderr: check_cap(
            "max_stderr_bytes",
            raw.max_stderr_bytes,
            defaults.max_stderr,
            MAX_STDERR_CAP,
        )?,
        output: raw.output,
        limits: ResourceLimits::resolve(raw.limits.as_ref(), &defaults.limits)?,
        stderr_to_model: raw.stderr_to_model.unwrap_or(defaults.stderr_to_model),
    });
    Ok((spec, tool))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load_str(text: &str) -> Result<Vec<(ToolSpec, CommandTool)>, String> {
        load_manifest(text).map(|m| m.commands)
    }

    fn load_manifest(text: &str) -> Result<Manifest, String> {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tools.toml");
        std::fs::write(&path, text).unwrap();
        load(&path).map_err(|e| e.to_string().replace(&path.display().to_string(), "FILE"))
    }

    const OK: &str = r#"
        [[tool]]
        name = "hello"
        description = "says hello"
        argv = ["echo", "hello"]
    "#;

    #[test]
    fn loads_a_minimal_tool_with_defaults() {
        let tools = load_str(OK).unwrap();
        assert_eq!(tools.len(), 1);
        assert_eq!(tools[0].0.name, "hello");
        assert_eq!(tools[0].0.timeout, DEFAULT_TIMEOUT);
        assert_eq!(tools[0].0.parameters, serde_json::json!({"type": "object"}));
    }

    #[test]
    fn every_error_names_file_tool_and_problem() {
        let cases = [
            ("[[tool]]\nname = \"a\"\n", "tools manifest FILE: TOML parse error"),
            (
                &OK.replace("argv = [\"echo\", \"hello\"]", "argv = []"),
                "tool \"hello\": argv is empty",
            ),
            (
                &OK.replace("\"echo\"", "\"no-such-program-xyz\""),
                "tool \"hello\": argv[0] \"no-such-program-xyz\" was not found on PATH",
            ),
            (
                &OK.replace("name = \"hello\"", "name = \"he llo\""),
                "tool \"he llo\": the name must be",
            ),
            (
                &format!("{OK}{OK}"),
                "tool \"hello\": the name is used by tool #1 already",
            ),
            (
                &format!("{OK}timeout = \"2h\""),
                "tool \"hello\": timeout = 2h is above its cap of 1h",
            ),
            (
                &format!("{OK}timeout = \"soon\""),
                "tool \"hello\": timeout: invalid duration",
            ),
            (
                &format!("{OK}max_stdout_bytes = 0"),
                "max_stdout_bytes = 0 is below its minimum of 1",
            ),
            (
                &format!("{OK}max_stdout_bytes = 67108865"),
                "max_stdout_bytes = 67108865 is above its cap of 67108864",
            ),
            (&format!("{OK}tmeout = \"1s\""), "unknown field `tmeout`"),
            (&format!("{OK}working_dir = \"nope\""), "working_dir"),
            (
                &format!("{OK}[tool.parameters]\ntype = \"array\""),
                "must describe an object",
            ),
            (
                &format!("{OK}[tool.parameters]\ntype = \"object\"\nrequired = \"x\""),
                "not a valid JSON Schema",
            ),
            (&OK.replace("says hello", " "), "description is empty"),
        ];
        for (text, expected) in cases {
            let err = load_str(text).err().unwrap_or_else(|| panic!("accepted: {text}"));
            assert!(err.contains(expected), "{err:?} should contain {expected:?}");
        }
    }

    /// A command tool runs again when its call is in doubt only when the manifest says so.
    #[test]
    fn a_tool_is_idempotent_only_when_declared() {
        assert!(load_str(&format!("{OK}idempotent = true")).unwrap()[0].0.idempotent);
        assert!(!load_str(OK).unwrap()[0].0.idempotent, "not idempotent unless declared");
        let bad = load_str(&format!("{OK}idempotent = \"yes\"")).err().unwrap();
        assert!(bad.contains("idempotent"), "{bad}");
    }

    #[test]
    fn tools_and_mcp_servers_may_require_approval() {
        let tools = load_str(&format!("{OK}needs_approval = true")).unwrap();
        assert!(tools[0].0.needs_approval);
        assert!(!load_str(OK).unwrap()[0].0.needs_approval, "no approval unless asked");
        let server =
            |needs: &str| format!("[[mcp_servers]]\nname = \"pay\"\nurl = \"http://127.0.0.1:1/mcp\"\n{needs}");
        let every = load_manifest(&server("needs_approval = true")).unwrap();
        assert!(every.mcp_servers[0].needs_approval("refund") && every.mcp_servers[0].needs_approval("lookup"));
        let some = load_manifest(&server("needs_approval = [\"refund\"]")).unwrap();
        assert!(some.mcp_servers[0].needs_approval("refund") && !some.mcp_servers[0].needs_approval("lookup"));
        let none = load_manifest(&server("")).unwrap();
        assert!(!none.mcp_servers[0].needs_approval("refund"));
        let bad = load_manifest(&server("needs_approval = \"yes\""))
            .err()
            .unwrap_or_default();
        assert!(bad.contains("needs_approval must be true, false or a list"), "{bad}");
    }

    #[test]
    fn caps_accept_their_edge() {
        let text = format!("{OK}timeout = \"1h\"\nmax_stdout_bytes = 67108864\nmax_stderr_bytes = 4194304");
        assert!(load_str(&text).is_ok());
    }
}
