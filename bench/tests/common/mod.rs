//! Running the benchmark binary from its tests: against the orchestrator built beside it, with
//! its report written into a fresh directory.

use std::path::Path;
use std::process::{Command, Output};

/// Runs `bench` with `args` on the orchestrator built beside it, writing into `out`.
pub(crate) fn run_bench(args: &[&str], out: &Path) -> anyhow::Result<Output> {
    Ok(bench_command(args, out)?.output()?)
}

/// The command [`run_bench`] runs, to add to before running it.
pub(crate) fn bench_command(args: &[&str], out: &Path) -> anyhow::Result<Command> {
    let bench = env!("CARGO_BIN_EXE_bench");
    let orchestrator = Path::new(bench).with_file_name("orchestrator");
    anyhow::ensure!(
        orchestrator.exists(),
        "{} is missing: run the workspace tests (./scripts/test)",
        orchestrator.display()
    );
    let mut command = Command::new(bench);
    command
        .args(args)
        .arg("--orchestrator-bin")
        .arg(&orchestrator)
        .arg("--out")
        .arg(out);
    Ok(command)
}
