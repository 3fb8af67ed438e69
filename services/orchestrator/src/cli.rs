//! Command line: `serve` (the default) with flags that all have environment equivalents, and
//! `call` (start a run on a running orchestrator). The one-command demo is its own binary
//! (`cargo run -p demo`), so this one carries no stand-in model.

use std::time::Duration;

use clap::{Args, CommandFactory, Parser, Subcommand};
use shared::config::parse_duration;

use crate::Config;

/// The orchestrator: runs LLM tool loops for other services over gRPC.
#[derive(Debug, Parser)]
#[command(name = "orchestrator", version, about, args_conflicts_with_subcommands = true)]
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
    /// [`shared::config_file`]; a bad file is exit code 2). A refused value is echoed by the error
    /// message, so the userinfo of any URL in it is removed first (`nats://user:password@…`);
    /// `--help` and `--version` print as usual.
    pub fn parse_args() -> Self {
        let argv = shared::config_file::with_settings_file(
            &Self::command(),
            std::env::args_os().collect(),
            "ORCHESTRATOR_CONFIG",
        )
        .unwrap_or_else(|e| {
            eprintln!("error: {}", crate::secrets::without_userinfo(&e));
            std::process::exit(2)
        });
        Self::try_parse_from(argv).unwrap_or_else(|error| {
            if !error.use_stderr() {
                error.exit()
            }
            eprint!("{}", crate::secrets::without_userinfo(&error.render().to_string()));
            std::process::exit(error.exit_code())
        })
    }
}

/// Subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Serve gRPC (the default).
    Serve(Box<Config>),
    /// Start a run on a running orchestrator and print its events, or attach to one (--attach).
    Call(Box<CallArgs>),
}

/// Flags of `call`.
#[derive(Debug, Clone, Args)]
pub struct CallArgs {
    /// The orchestrator's address.
    #[arg(long, env = "ORCHESTRATOR_ENDPOINT", default_value = "http://127.0.0.1:50051")]
    pub endpoint: String,
    /// The user message (required unless --attach).
    #[arg(long, required_unless_present = "attach", conflicts_with = "attach")]
    pub prompt: Option<String>,
    /// Attach to this run (live or finished, on any replica) instead of starting one, and print
    /// its events from --after on.
    #[arg(long, value_name = "RUN_ID")]
    pub attach: Option<String>,
    /// With --attach: the last seq already seen (0: from the start).
    #[arg(long, value_name = "SEQ", default_value_t = 0, requires = "attach")]
    pub after: u64,
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
    /// tool_choice: auto, none, required or a tool name (required and a name: first turn only).
    #[arg(long, default_value = "")]
    pub tool_choice: String,
    /// Sampling temperature (default: the server's).
    #[arg(long)]
    pub temperature: Option<f32>,
    /// Most tokens the model may generate per turn (default: the server's).
    #[arg(long)]
    pub max_tokens: Option<u32>,
}

impl CallArgs {
    /// The client options these flags describe.
    pub fn to_options(&self) -> crate::client::CallOptions {
        crate::client::CallOptions {
            endpoint: self.endpoint.clone(),
            prompt: self.prompt.clone().unwrap_or_default(),
            attach: self.attach.clone().map(|run_id| (run_id, self.after)),
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
            params: proto::orchestrator::v1::ModelParams {
                tool_choice: self.tool_choice.clone(),
                temperature: self.temperature,
                max_tokens: self.max_tokens,
                ..Default::default()
            },
        }
    }
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
