//! Command line: `serve` (the default) with flags that all have environment equivalents, and the
//! client commands `list` and `call` to use a running runner from a shell, plus `check-manifest`.

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, CommandFactory, Parser, Subcommand};
use proto::toolrunner::v1 as pb;
use shared::config::parse_duration;

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
    pub serve: Config,
}

impl Cli {
    /// Parses the command line, the environment and the `--config` file (see
    /// [`shared::config_file`]); a bad file stops the runner with exit code 2.
    pub fn parse_args() -> Self {
        let argv = shared::config_file::with_settings_file(
            &Self::command(),
            std::env::args_os().collect(),
            "TOOL_RUNNER_CONFIG",
        )
        .unwrap_or_else(|e| {
            eprintln!("error: {e}");
            std::process::exit(2)
        });
        Self::try_parse_from(argv).unwrap_or_else(|error| error.exit())
    }
}

/// Subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Serve gRPC (the default).
    Serve(Box<Config>),
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
    // A tool's answer can be as large as the runner's output caps allow (64 MiB for stdout).
    Ok(pb::tool_runner_client::ToolRunnerClient::new(channel).max_decoding_message_size(256 * 1024 * 1024))
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
/// A call the server runs as a task is followed (`RunToolRequest.task`) at the server's interval
/// until it ends; past `--timeout` the task is canceled.
pub async fn call(args: &ClientArgs, tool: &str, arguments: &str) -> Result<bool, Error> {
    let mut client = connect(args).await?;
    let deadline = tokio::time::Instant::now() + args.timeout;
    let mut request = pb::RunToolRequest {
        run_id: String::new(),
        call_id: "cli".into(),
        tool_name: tool.to_owned(),
        arguments_json: arguments.to_owned(),
        ..Default::default()
    };
    loop {
        let response = client
            .run_tool(request.clone())
            .await
            .map_err(|s| status_error(&s))?
            .into_inner();
        let Some(pb::run_tool_response::Outcome::Task(task)) = &response.outcome else {
            return print_outcome(tool, response);
        };
        let said = if task.message.is_empty() {
            String::new()
        } else {
            format!(": {}", task.message)
        };
        eprintln!("{tool} runs as task {} ({}{said})", task.task_id, task.status);
        let every = Duration::from_millis(if task.poll_interval_ms == 0 {
            1000
        } else {
            task.poll_interval_ms
        });
        let wait = every.clamp(Duration::from_millis(200), Duration::from_secs(5));
        let cancel = tokio::time::Instant::now() + wait >= deadline;
        if cancel {
            eprintln!(
                "--timeout ({}) passed: canceling task {}",
                humantime::format_duration(args.timeout),
                task.task_id
            );
        } else {
            tokio::time::sleep(wait).await;
        }
        request.task = Some(pb::ToolTaskRef {
            task_id: task.task_id.clone(),
            cancel,
        });
        if cancel {
            let response = client
                .run_tool(request)
                .await
                .map_err(|s| status_error(&s))?
                .into_inner();
            return print_outcome(tool, response).map(|_| false);
        }
    }
}

/// Prints a call's outcome; `Ok(false)` for anything but a result.
fn print_outcome(tool: &str, response: pb::RunToolResponse) -> Result<bool, Error> {
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
        Some(pb::run_tool_response::Outcome::InDoubt(doubt)) => {
            eprintln!("{tool} is in doubt: {}", doubt.message);
            Ok(false)
        }
        Some(pb::run_tool_response::Outcome::InputRequired(asked)) => {
            eprintln!("{tool} asks for input before it can finish (an orchestrated run waits for a person's answers):");
            for request in &asked.requests {
                let detail = if request.mode == "url" {
                    &request.url
                } else {
                    &request.schema_json
                };
                eprintln!("  {} ({}): {} {detail}", request.key, request.mode, request.message);
            }
            Ok(false)
        }
        Some(pb::run_tool_response::Outcome::Task(task)) => {
            eprintln!("{tool} still runs as task {} ({})", task.task_id, task.status);
            Ok(false)
        }
        None => Err(Error::Config(
            "the runner answered with neither a result nor an error".into(),
        )),
    }
}

/// `check-manifest`: loads the manifest as `serve` would and lists its command tools and MCP
/// servers (without starting or connecting to them).
pub fn check_manifest(file: &std::path::Path) -> Result<(), Error> {
    let manifest = crate::tools::manifest::load(file)?;
    let tools = &manifest.commands;
    for (spec, _) in tools {
        println!(
            "{:<16} timeout {:<8} {}",
            spec.name,
            humantime::format_duration(spec.timeout).to_string(),
            spec.description
        );
    }
    for server in &manifest.mcp_servers {
        let how = match &server.transport {
            crate::tools::mcp::config::Transport::Stdio { program, .. } => format!("stdio {}", program.display()),
            crate::tools::mcp::config::Transport::Http { url, .. } => url.clone(),
        };
        println!(
            "mcp {:<12} {how}, tools as {}*{}",
            server.name,
            server.prefix,
            if server.required { ", required" } else { "" }
        );
    }
    println!(
        "{}: {} command tool(s), {} MCP server(s), OK",
        file.display(),
        tools.len(),
        manifest.mcp_servers.len()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    use super::*;

    #[test]
    fn the_command_line_is_consistent() {
        Cli::command().debug_assert();
    }
}
