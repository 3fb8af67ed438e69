//! `tool-runner` binary: parse flags, set up telemetry, serve until SIGTERM/SIGINT, drain, flush
//! spans, exit.
//! Exit codes: 0 stopped cleanly (or the command succeeded), 1 runtime failure (cannot listen,
//! server error, a `call` that failed), 2 invalid configuration or manifest.

use std::process::ExitCode;

use clap::Parser;
use tool_runner::Error;
use tool_runner::cli::{self, Cli, Command, ServeArgs};

fn main() -> ExitCode {
    match shared::runtime::build() {
        Ok(runtime) => runtime.block_on(run()),
        Err(e) => {
            eprintln!("tool-runner: {e}");
            ExitCode::from(2)
        }
    }
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
    let telemetry = shared::telemetry::Telemetry::init("tool-runner", args.log_format, "info")
        .map_err(|e| Error::Config(e.to_string()))?;
    if let Some(to) = &telemetry.exporting_to {
        tracing::info!(otlp = %to, "exporting traces");
    }
    let result = serve_with_telemetry(args).await;
    telemetry.shutdown().await;
    result
}

async fn serve_with_telemetry(args: ServeArgs) -> Result<(), Error> {
    let config = args.to_config();
    config.validate()?;
    shared::shutdown::serve_until_stopped(args.listen, args.metrics_listen.0, |listener, shutdown| {
        tool_runner::run(listener, config, shutdown)
    })
    .await
}
