//! `tool-runner` binary: parse flags, set up telemetry, serve until SIGTERM/SIGINT, drain, flush
//! spans, exit.
//! Exit codes: 0 stopped cleanly (or the command succeeded), 1 runtime failure (cannot listen,
//! server error, a `call` that failed), 2 invalid configuration or manifest.

use std::process::ExitCode;

use clap::Parser;
use tool_runner::Error;
use tool_runner::cli::{self, Cli, Command, ServeArgs};

fn main() -> ExitCode {
    shared::runtime::block_on("tool-runner", run())
}

async fn run() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command.unwrap_or(Command::Serve(cli.serve)) {
        Command::Serve(args) => serve(args).await,
        Command::List(client) => cli::list(&client).await,
        Command::Call {
            client,
            tool,
            arguments,
        } => match cli::call(&client, &tool, &arguments).await {
            Ok(true) => Ok(()),
            Ok(false) => return ExitCode::FAILURE,
            Err(e) => Err(e),
        },
        Command::CheckManifest { file } => cli::check_manifest(&file),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("tool-runner: {e}");
            match e {
                Error::Config(_) | Error::Limit(_) | Error::Manifest { .. } => ExitCode::from(2),
                _ => ExitCode::FAILURE,
            }
        }
    }
}

async fn serve(args: ServeArgs) -> Result<(), Error> {
    let format = args.log_format;
    shared::telemetry::Telemetry::around("tool-runner", format, "info", serve_with_telemetry(args)).await
}

async fn serve_with_telemetry(args: ServeArgs) -> Result<(), Error> {
    let config = args.to_config();
    config.validate()?;
    shared::shutdown::serve_until_stopped(args.listen, args.metrics_listen.0, |listener, shutdown| {
        tool_runner::run(listener, config, shutdown)
    })
    .await
}
