//! `bench --long-run`: a long run's turns measured early against late, on both stores — the
//! orchestrator's CPU per turn and the store's bytes per turn beside what a turn added.

use crate::common;

#[test]
fn a_long_runs_turns_are_measured_early_and_late_on_both_stores() -> anyhow::Result<()> {
    let report = common::report(&["--long-run", "14", "--long-run-page", "4096"], "long_run.json")?;
    assert_eq!(report["turns"].as_u64(), Some(14), "{report}");
    assert!(
        report["added_per_turn_bytes"].as_u64().is_some_and(|b| b > 4096),
        "{report}"
    );
    for figure in [
        "/memory/cpu_early_us",
        "/memory/cpu_late_us",
        "/nats/cpu_early_us",
        "/nats/cpu_late_us",
        "/nats/nats_cpu_early_us",
        "/nats/nats_cpu_late_us",
    ] {
        let value = report.pointer(figure).and_then(serde_json::Value::as_f64);
        assert!(value.is_some_and(|v| v > 0.0), "{figure}: {report}");
    }
    // Every turn writes its page to the store at least once (the event log holds the result).
    let late = report
        .pointer("/nats/store_late_kib")
        .and_then(serde_json::Value::as_f64);
    assert!(late.is_some_and(|kib| kib >= 4.0), "{report}");
    assert!(
        report["store_amplification"].as_f64().is_some_and(|a| a >= 1.0),
        "{report}"
    );
    Ok(())
}
