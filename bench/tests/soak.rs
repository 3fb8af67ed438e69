//! The CI soak: 2,000 runs through the real orchestrator process with 5 % faults from the fault
//! matrix; the soak itself checks every run (terminal, retrievable, as its fault says), the
//! in-flight gauges and the resident memory, and exits non-zero when a check fails.

mod common;

#[test]
fn two_thousand_runs_with_five_percent_faults_leave_nothing_behind() -> anyhow::Result<()> {
    let out = tempfile::tempdir()?;
    let output = common::run_bench(&["--soak", "2000", "--soak-fault-rate", "0.05"], out.path())?;
    let report = std::fs::read_to_string(out.path().join("soak.md")).unwrap_or_default();
    anyhow::ensure!(
        output.status.success(),
        "the soak failed:\n{report}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(out.path().join("soak.json"))?)?;
    assert_eq!(json["runs"], 2000);
    assert!(json["faults_injected"].as_u64().unwrap_or(0) >= 50, "{json}");
    assert_eq!(json["passed"], true, "{report}");
    Ok(())
}
