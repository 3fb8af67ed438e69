//! Command line: `serve` (the default) with flags that all have environment equivalents, and the
//! client commands `list` and `call` to use a running runner from a shell, plus `check-manifest`.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use shared::config::parse_duration;
use shared::proto::toolrunner::v1 as pb;
use shared::telemetry::LogFormat;

use crate::config::limits;
use crate::registry::ArgLimits;
use crate::tools::builtin::BuiltinConfig;
use crate::{Config, Error};

/// The tool-runner: serves `ListTools` / `RunTool` over gRPC.
#[derive(Debug, Parser)]
#[command(name = "tool-runner", version, about, args_conflicts_with_subcommands = true)]
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
    Serve(ServeArgs),
    /// List the tools of a running tool-runner.
    List(ClientArgs),
    /// Call one tool on a running tool-runner and print its JSON result.
    Call {
        /// Connection settings.
        #[command(flatten)]
        client: ClientArgs,
        /// Tool name, e.g. `calculate`.
        tool: String,
        /// Arguments as a JSON object, e.g. '{"expression": "2 + 2"}'.
        #[arg(default_value = "{}")]
        arguments: String,
    },
    /// Check a tools manifest and list its tools, without serving.
    CheckManifest {
        /// The manifest file.
        file: PathBuf,
    },
}

/// Flags of `serve`.
#[derive(Debug, Clone, Args)]
pub struct ServeArgs {
    /// gRPC listen address.
    #[arg(long, env = "TOOL_RUNNER_LISTEN", default_value = "127.0.0.1:50052")]
    pub listen: SocketAddr,
    /// TOML manifest of command tools.
    #[arg(long, env = "TOOL_RUNNER_TOOLS_MANIFEST")]
    pub tools_manifest: Option<PathBuf>,
    /// Root directory of read_file / list_dir; both are off without it.
    #[arg(long, env = "TOOL_RUNNER_SANDBOX_ROOT")]
    pub sandbox_root: Option<PathBuf>,
    /// Host http_get may fetch from (repeatable; `*.example.com` for subdomains); off when none.
    #[arg(
        long = "http-allow-host",
        env = "TOOL_RUNNER_HTTP_ALLOW_HOSTS",
        value_delimiter = ','
    )]
    pub http_allow_hosts: Vec<String>,
    /// RunTool calls in flight before new ones get RESOURCE_EXHAUSTED (cap 10000).
    #[arg(long, env = "TOOL_RUNNER_MAX_CONCURRENCY", default_value_t = limits::MAX_CONCURRENCY)]
    pub max_concurrency: usize,
    /// Largest arguments_json in bytes (cap 16 MiB).
    #[arg(long, env = "TOOL_RUNNER_MAX_ARGUMENT_BYTES", default_value_t = limits::MAX_ARGUMENT_BYTES)]
    pub max_argument_bytes: usize,
    /// Deepest JSON nesting of arguments (cap 128).
    #[arg(long, env = "TOOL_RUNNER_MAX_JSON_DEPTH", default_value_t = limits::MAX_JSON_DEPTH)]
    pub max_json_depth: usize,
    /// Longest sleep the `sleep` tool allows (cap 1h).
    #[arg(long, env = "TOOL_RUNNER_SLEEP_MAX", default_value = "60s", value_parser = parse_duration)]
    pub sleep_max: Duration,
    /// Largest file read_file returns, in bytes (cap 16 MiB).
    #[arg(long, env = "TOOL_RUNNER_READ_MAX_BYTES", default_value_t = limits::MAX_READ_BYTES)]
    pub read_max_bytes: u64,
    /// Most entries list_dir returns (cap 100000).
    #[arg(long, env = "TOOL_RUNNER_LIST_MAX_ENTRIES", default_value_t = limits::LIST_MAX_ENTRIES)]
    pub list_max_entries: usize,
    /// Largest body http_get returns, in bytes (cap 16 MiB).
    #[arg(long, env = "TOOL_RUNNER_HTTP_MAX_BYTES", default_value_t = limits::MAX_READ_BYTES)]
    pub http_max_bytes: u64,
    /// Timeout of built-ins that do I/O: read_file, list_dir, http_get (cap 10m).
    #[arg(long, env = "TOOL_RUNNER_IO_TIMEOUT", default_value = "30s", value_parser = parse_duration)]
    pub io_timeout: Duration,
    /// After SIGTERM/SIGINT, how long in-flight calls may take to finish (cap 1h).
    #[arg(long, env = "TOOL_RUNNER_SHUTDOWN_GRACE", default_value = "30s", value_parser = parse_duration)]
    pub shutdown_grace: Duration,
    /// Log format: text or json.
    #[arg(long, env = "TOOL_RUNNER_LOG_FORMAT", default_value = "text")]
    pub log_format: LogFormat,
    /// Prometheus /metrics listen address, or `off`.
    #[arg(long, env = "TOOL_RUNNER_METRICS_LISTEN", default_value = "127.0.0.1:9465")]
    pub metrics_listen: shared::metrics::OptionalListen,
    /// Record tool arguments and results on spans (off by default: they may hold secrets).
    #[arg(long, env = "TOOL_RUNNER_TRACE_TOOL_PAYLOADS")]
    pub trace_tool_payloads: bool,
    /// Size cap of each recorded payload, in bytes (cap 64 KiB).
    #[arg(long, env = "TOOL_RUNNER_TRACE_PAYLOAD_MAX_BYTES", default_value_t = limits::TRACE_PAYLOAD)]
    pub trace_payload_max_bytes: usize,
}

impl ServeArgs {
    /// The runner configuration these flags describe (not yet validated).
    pub fn to_config(&self) -> Config {
        Config {
            tools_manifest: self.tools_manifest.clone(),
            builtins: BuiltinConfig {
                sleep_max: self.sleep_max,
                sandbox_root: self.sandbox_root.clone(),
                read_max_bytes: self.read_max_bytes,
                list_max_entries: self.list_max_entries,
                http_allow_hosts: self.http_allow_hosts.clone(),
                http_max_bytes: self.http_max_bytes,
                io_timeout: self.io_timeout,
            },
            max_concurrency: self.max_concurrency,
            arg_limits: ArgLimits {
                max_bytes: self.max_argument_bytes,
                max_depth: self.max_json_depth,
            },
            shutdown_grace: self.shutdown_grace,
            trace_payloads: self.trace_tool_payloads.then_some(self.trace_payload_max_bytes),
        }
    }
}

/// How the client commands reach a runner.
#[derive(Debug, Clone, Args)]
pub struct ClientArgs {
    /// The runner's address.
    #[arg(long, env = "TOOL_RUNNER_ENDPOINT", default_value = "http://127.0.0.1:50052")]
    pub endpoint: String,
    /// Deadline of the call.
    #[arg(long, default_value = "60s", value_parser = parse_duration)]
    pub timeout: Duration,
}

async fn connect(
    args: &ClientArgs,
) -> Result<pb::tool_runner_client::ToolRunnerClient<tonic::transport::Channel>, Error> {
    let endpoint = tonic::transport::Endpoint::from_shared(args.endpoint.clone())
        .map_err(|e| Error::Config(format!("--endpoint {:?}: {e}", args.endpoint)))?
        .timeout(args.timeout)
        .connect_timeout(Duration::from_secs(5));
    let channel = endpoint
        .connect()
        .await
        .map_err(|e| Error::Config(format!("cannot connect to {}: {e}", args.endpoint)))?;
    Ok(pb::tool_runner_client::ToolRunnerClient::new(channel))
}

fn status_error(status: &tonic::Status) -> Error {
    Error::Config(format!(
        "the runner refused the call: {:?}: {}",
        status.code(),
        status.message()
    ))
}

/// `list`: prints one line per tool (name, source, timeout, description).
pub async fn list(args: &ClientArgs) -> Result<(), Error> {
    let tools = connect(args)
        .await?
        .list_tools(pb::ListToolsRequest {})
        .await
        .map_err(|s| status_error(&s))?;
    for tool in tools.into_inner().tools {
        println!(
            "{:<16} {:<8} {:>7}ms  {}",
            tool.name, tool.source, tool.timeout_ms, tool.description
        );
    }
    Ok(())
}

/// `call`: runs one tool and prints its result. `Ok(false)` when the tool answered with an error.
pub async fn call(args: &ClientArgs, tool: &str, arguments: &str) -> Result<bool, Error> {
    let request = pb::RunToolRequest {
        run_id: String::new(),
        call_id: "cli".into(),
        tool_name: tool.to_owned(),
        arguments_json: arguments.to_owned(),
        metadata: Default::default(),
    };
    let response = connect(args)
        .await?
        .run_tool(request)
        .await
        .map_err(|s| status_error(&s))?
        .into_inner();
    match response.outcome {
        Some(pb::run_tool_response::Outcome::ContentJson(json)) => {
            let pretty = serde_json::from_str::<serde_json::Value>(&json)
                .and_then(|v| serde_json::to_string_pretty(&v))
                .unwrap_or(json);
            println!("{pretty}");
            eprintln!("({tool} took {} ms)", response.duration_ms);
            Ok(true)
        }
        Some(pb::run_tool_response::Outcome::Error(e)) => {
            let code =
                pb::ToolErrorCode::try_from(e.code).map_or_else(|_| e.code.to_string(), |c| c.as_str_name().to_owned());
            eprintln!(
                "{tool} failed: {code}: {}{}",
                e.message,
                if e.retryable { " (retryable)" } else { "" }
            );
            Ok(false)
        }
        None => Err(Error::Config(
            "the runner answered with neither a result nor an error".into(),
        )),
    }
}

/// `check-manifest`: loads the manifest as `serve` would and lists its tools.
pub fn check_manifest(file: &std::path::Path) -> Result<(), Error> {
    let tools = crate::tools::manifest::load(file)?;
    for (spec, _) in &tools {
        println!(
            "{:<16} timeout {:<8} {}",
            spec.name,
            humantime::format_duration(spec.timeout).to_string(),
            spec.description
        );
    }
    println!("{}: {} command tool(s), OK", file.display(), tools.len());
    Ok(())
}
