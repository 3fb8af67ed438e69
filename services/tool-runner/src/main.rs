//! `tool-runner` binary: parse flags, set up telemetry, serve until SIGTERM/SIGINT, drain, flush
//! spans, exit.
//! Exit codes: 0 stopped cleanly (or the command succeeded), 1 runtime failure (cannot listen,
//! server error, a `call` that failed), 2 invalid configuration or manifest.

use std::process::ExitCode;

use tool_runner::cli::{self, Cli, Command};
use tool_runner::{Config, Error};

fn main() -> ExitCode {
    shared::runtime::block_on("tool-runner", run())
}

async fn run() -> ExitCode {
    let cli = Cli::parse_args();
    let result = match cli.command.unwrap_or_else(|| Command::Serve(Box::new(cli.serve))) {
        Command::Serve(config) => serve(*config).await.map(|()| true),
        Command::List(client) => cli::list(&client).await.map(|()| true),
        Command::Call {
            client,
            tool,
            arguments,
        } => cli::call(&client, &tool, &arguments).await,
        Command::CheckManifest { file } => cli::check_manifest(&file).map(|()| true),
    };
    shared::runtime::exit_code("tool-runner", result)
}

/// The log filter without `RUST_LOG`: the MCP client library logs every handshake at INFO with
/// the server's whole self-description; its warnings are enough.
const DEFAULT_LOG_FILTER: &str = "info,rmcp=warn";

async fn serve(config: Config) -> Result<(), Error> {
    let format = config.telemetry.log_format;
    shared::telemetry::Telemetry::around("tool-runner", format, DEFAULT_LOG_FILTER, serve_with_telemetry(config)).await
}

async fn serve_with_telemetry(config: Config) -> Result<(), Error> {
    config.validate()?;
    let (listen, metrics_listen) = (config.server.listen, config.server.metrics_listen.0);
    shared::shutdown::serve_until_stopped(listen, metrics_listen, |listener, shutdown| {
        tool_runner::serve(listener, config, shutdown)
    })
    .await
}
