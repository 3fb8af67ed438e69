//! Running the benchmark binary from its tests: against the orchestrator built beside it, with
//! its report written into a fresh directory.

use std::path::Path;
use std::process::{Command, Output};
use std::sync::Mutex;

/// Runs `bench` with `args` on the orchestrator built beside it, writing into `out`.
pub(crate) fn run_bench(args: &[&str], out: &Path) -> anyhow::Result<Output> {
    run_alone(&mut bench_command(args, out)?)
}

/// Runs `command` to its end while no other benchmark runs: a workload measures the machine,
/// and two at once on two cores would make each other's figures (and leases) meaningless.
pub(crate) fn run_alone(command: &mut Command) -> anyhow::Result<Output> {
    static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());
    // A test that failed while holding the lock poisoned it; the next one may still run alone.
    let _alone = ONE_AT_A_TIME.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    Ok(command.output()?)
}

/// Runs `bench` with `args`, failing with its stderr unless it succeeded; its JSON report `file`.
pub(crate) fn report(args: &[&str], file: &str) -> anyhow::Result<serde_json::Value> {
    let out = tempfile::tempdir()?;
    let output = run_bench(args, out.path())?;
    anyhow::ensure!(
        output.status.success(),
        "bench failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    Ok(serde_json::from_str(&std::fs::read_to_string(out.path().join(file))?)?)
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
