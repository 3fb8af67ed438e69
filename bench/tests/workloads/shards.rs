//! `bench --shards`: the same durable workload over a run store in shards, on fresh JetStream
//! clusters of three and six nodes; the report gives every node's CPU per turn and which node
//! leads each shard's streams.

use crate::common;

#[test]
fn the_run_store_in_shards_is_measured_on_every_cluster() -> anyhow::Result<()> {
    let report = common::report(&["--shards", "2", "--shard-runs", "10"], "shards.json")?;
    let rows = report.as_array().map(Vec::as_slice).unwrap_or_default();
    // The count on each of the three clusters.
    assert_eq!(rows.len(), 3, "{report}");
    for row in rows {
        let (shards, nodes) = (row["shards"].as_u64().unwrap_or(0), row["nodes"].as_u64().unwrap_or(0));
        assert_eq!(row["runs_ok"].as_u64(), Some(10), "{row}");
        assert_eq!(row["turns"].as_u64(), Some(80), "eight turns a run: {row}");
        let per_node = row["node_cpu_per_turn_us"].as_array().map_or(0, Vec::len);
        assert_eq!(per_node as u64, nodes, "{row}");
        // Three streams per shard (its bucket, checkpoints and event log), each led by a node.
        let led: u64 = row["leaders_per_node"]
            .as_array()
            .map(|l| l.iter().filter_map(serde_json::Value::as_u64).sum())
            .unwrap_or(0);
        assert_eq!(led, 3 * shards, "{row}");
        assert!(row["nats_cpu_per_turn_us"].as_f64().is_some_and(|us| us > 0.0), "{row}");
    }
    Ok(())
}
