//! `bench`: measures what the orchestrator itself costs. It starts the stand-in model and a
//! tool-runner in this process and the orchestrator as its own process (release build), drives a
//! grid of workloads through the real gRPC API, reads the orchestrator's CPU time and memory from
//! `/proc`, measures the baselines (the model called directly; a raw tonic echo loop to the
//! tool-runner), checks the performance targets, and writes `bench/results/<name>.md` and `.json`.
//!
//! `cargo run --release -p bench` runs the full grid (minutes); `--quick` a small one (seconds,
//! run in CI so the benchmark cannot rot).
//!
//! Files: `cli.rs` (the flags), `grid.rs` (the workloads and a grid run), `measure.rs` (one
//! workload measured, the floors), `report.rs` (targets and the report), `commands.rs` (the
//! measurements a flag asks for instead of the grid), and a file per measurement.

mod admission;
mod approvals;
mod cli;
mod commands;
mod durability;
mod fence;
mod fleet;
mod floor;
mod grid;
mod listing;
mod long_run;
mod measure;
mod micro;
mod otlp;
mod paced;
mod peers;
mod pending;
mod procstat;
mod quiet;
mod real_server;
mod relay;
mod replicas;
mod report;
mod shards;
mod soak;
mod stack;
mod takeover;
mod tasks;
mod workload;

use clap::Parser;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = cli::Cli::parse();
    stack::raise_open_files();
    let bin = match cli.orchestrator_bin.clone() {
        Some(bin) => bin,
        None => std::env::current_exe()?.with_file_name("orchestrator"),
    };
    anyhow::ensure!(
        bin.exists(),
        "{} is missing: cargo build --release -p orchestrator (or pass --orchestrator-bin)",
        bin.display()
    );
    if commands::one_measurement(&cli, &bin).await? || commands::one_store_measurement(&cli, &bin).await? {
        return Ok(());
    }
    grid::run_grid(&cli, &bin).await
}
