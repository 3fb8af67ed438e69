//! `bench --takeover-quiet`: a SIGKILLed replica's quiet durable runs all run again on the
//! replica beside it, found from the owner index once its incarnation lapsed; the report gives
//! the time and the store requests per run taken over.

use crate::common;

#[test]
fn a_killed_replicas_quiet_runs_all_run_again_on_the_other() -> anyhow::Result<()> {
    let report = common::report(&["--takeover-quiet", "40", "--takeover-lease", "3s"], "takeover.json")?;
    assert_eq!(report["runs"].as_u64(), Some(40), "{report}");
    let (first, all) = (
        report["first_running_s"].as_f64().unwrap_or(f64::MAX),
        report["all_running_s"].as_f64().unwrap_or(0.0),
    );
    assert!(first <= all, "{report}");
    // Its incarnation lapses a lease (and a third, between looks) after its last renewal.
    assert!(all <= 3.0 * 4.0 + 60.0, "{report}");
    assert!(
        report["requests_per_run"].as_f64().is_some_and(|r| r > 0.0),
        "a takeover writes to the store: {report}"
    );
    Ok(())
}
