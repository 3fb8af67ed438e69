//! `bench --idle-cost`: durable runs waiting on a long tool call cost the store next to nothing
//! while they wait. The bench itself fails above the goal (0.01 requests per quiet run per
//! second, counted at nats-server's `/varz`); a per-run lease (one write every third of the lease)
//! would cost 0.2 at the least, twenty times more.

use crate::common;

#[test]
fn quiet_durable_runs_cost_the_store_next_to_nothing() -> anyhow::Result<()> {
    let report = common::report(&["--idle-cost", "200", "--idle-window", "10s"], "idle_cost.json")?;
    let row = report
        .as_array()
        .and_then(|rows| rows.first())
        .ok_or_else(|| anyhow::anyhow!("no row in {report}"))?;
    assert_eq!(row["runs"].as_u64(), Some(200), "{row}");
    let per_run = row["in_per_run_s"].as_f64().unwrap_or(f64::MAX);
    assert!(
        per_run <= 0.01,
        "{per_run} store requests per quiet run per second: {row}"
    );
    assert!(
        row["idle_in_per_s"].as_f64().is_some_and(|idle| idle > 0.0),
        "the replica keeps its incarnation: {row}"
    );
    Ok(())
}
