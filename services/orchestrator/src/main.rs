//! `orchestrator` binary: parse flags, set up telemetry, serve until SIGTERM/SIGINT, drain, flush
//! spans, exit. Exit codes of `serve`: 0 stopped cleanly, 1 a failure at run time, 2 invalid
//! flags or configuration; of the client commands, how the command and its run ended
//! (`cli::Outcome`: 0 completed, 1 failed, 2 canceled, 3 the call failed).

use std::process::ExitCode;

/// mimalloc instead of the system allocator: the loop allocates many small short-lived buffers
/// (SSE chunks, events, messages), where glibc's malloc showed up as a quarter of the CPU time in
/// profiles; see bench/results for the before/after. The `system-allocator` feature leaves it
/// out, so heap profilers that watch malloc (heaptrack, massif) see every allocation.
#[cfg(not(feature = "system-allocator"))]
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;
use orchestrator::cli::{Cli, Command};
use orchestrator::{Config, Error};

fn main() -> ExitCode {
    shared::runtime::block_on("orchestrator", run())
}

async fn run() -> ExitCode {
    let cli = Cli::parse_args();
    match cli.command.unwrap_or_else(|| Command::Serve(Box::new(cli.serve))) {
        Command::Serve(args) => shared::runtime::exit_code("orchestrator", serve(*args).await.map(|()| true)),
        Command::Client(command) => orchestrator::cli::exit_code(command.run().await),
    }
}

async fn serve(config: Config) -> Result<(), Error> {
    let format = config.telemetry.log_format;
    shared::telemetry::Telemetry::around(
        "orchestrator",
        format,
        orchestrator::DEFAULT_LOG_FILTER,
        serve_with_telemetry(config),
    )
    .await
}

async fn serve_with_telemetry(config: Config) -> Result<(), Error> {
    config.validate()?;
    let (listen, metrics_listen) = (config.server.listen, config.server.metrics_listen.0);
    shared::shutdown::serve_until_stopped(listen, metrics_listen, |listener, shutdown| {
        orchestrator::serve(listener, config, shutdown)
    })
    .await
}
