//! Running the benchmark binary from its tests: against the orchestrator built beside it, with
//! its report written into a fresh directory.

use std::path::Path;
use std::process::{Command, Output};

/// Runs `bench` with `args` on the orchestrator built beside it, writing into `out`.
pub(crate) fn run_bench(args: &[&str], out: &Path) -> anyhow::Result<Output> {
    let bench = env!("CARGO_BIN_EXE_bench");
    let orchestrator = Path::new(bench).with_file_name("orchestrator");
    anyhow::ensure!(
        orchestrator.exists(),
        "{} is missing: run the workspace tests (./scripts/test)",
        orchestrator.display()
    );
    Ok(Command::new(bench)
        .args(args)
        .arg("--orchestrator-bin")
        .arg(&orchestrator)
        .arg("--out")
        .arg(out)
        .output()?)
}
