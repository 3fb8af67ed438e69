//! The CI soak: 2,000 runs through the real orchestrator process with 5 % faults from the fault
//! matrix; the soak itself checks every run (terminal, retrievable, as its fault says), the
//! in-flight gauges and the resident memory, and exits non-zero when a check fails. Every run is
//! also replayed from its event log (AttachRun), on the in-memory store and on the NATS store; and
//! a soak on three replicas, killed and drained in turn while the runs go on.

use crate::common;

/// Runs the soak with `args` and returns its JSON report, failing with the Markdown one.
fn soak(args: &[&str]) -> anyhow::Result<serde_json::Value> {
    let out = tempfile::tempdir()?;
    let output = common::run_bench(args, out.path())?;
    let report = std::fs::read_to_string(out.path().join("soak.md")).unwrap_or_default();
    anyhow::ensure!(
        output.status.success(),
        "the soak failed:\n{report}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(out.path().join("soak.json"))?)?;
    assert_eq!(json["passed"], true, "{report}");
    Ok(json)
}

#[test]
fn two_thousand_runs_with_five_percent_faults_leave_nothing_behind() -> anyhow::Result<()> {
    let json = soak(&["--soak", "2000", "--soak-fault-rate", "0.05"])?;
    assert_eq!(json["runs"], 2000);
    assert!(json["faults_injected"].as_u64().unwrap_or(0) >= 50, "{json}");
    Ok(())
}

/// The same with the NATS store: results in the key-value bucket and every run's events in the
/// JetStream event log, each replayed with AttachRun and checked against the stored result.
#[test]
fn a_thousand_runs_on_the_nats_store_replay_whole_from_their_event_logs() -> anyhow::Result<()> {
    let json = soak(&["--soak", "1000", "--soak-fault-rate", "0.05", "--soak-store", "nats"])?;
    assert_eq!(
        (json["runs"].as_u64(), json["store"].as_str()),
        (Some(1000), Some("nats"))
    );
    Ok(())
}

/// Replica faults: the soak on three replicas sharing the NATS store (spread over four shards),
/// one of them killed, drained,
/// cut off from NATS or paused (past its lease) every second while the runs go on. Every caller
/// follows its run across replicas and must see one gap-free stream telling the stored text; every
/// run ends as its fault says, wherever its replica was killed (a run is resumable from its claim
/// on), and nothing is left in flight.
#[test]
fn runs_followed_across_replicas_killed_drained_cut_off_and_paused_end_as_their_faults_say() -> anyhow::Result<()> {
    let json = soak(&[
        "--soak",
        "500",
        "--soak-fault-rate",
        "0.05",
        "--soak-store",
        "nats",
        "--soak-concurrency",
        "32",
        "--soak-replica-faults",
        "1s",
        "--soak-shards",
        "4",
    ])?;
    for fault in [
        "replicas_killed",
        "replicas_drained",
        "replicas_cut_off",
        "replicas_paused",
    ] {
        assert!(json[fault].as_u64().unwrap_or(0) >= 1, "{fault}: {json}");
    }
    Ok(())
}
