//! `bench --approvals`: runs parked waiting for approvals, with the memory and the NATS store
//! (`./scripts/test` installs nats-server). It must park and complete every run on both stores
//! and report every figure; what they are is the report's business. A thousand runs wait at once
//! on 16 run slots, as many as the design asks to be parked holding none.

use crate::common;

#[test]
fn parked_runs_are_measured_on_both_stores() -> anyhow::Result<()> {
    let out = tempfile::tempdir()?;
    let output = common::run_bench(&["--approvals", "1000"], out.path())?;
    anyhow::ensure!(
        output.status.success(),
        "bench failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let report: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(out.path().join("approvals.json"))?)?;
    let rows = report.as_array().cloned().unwrap_or_default();
    let stores: Vec<&str> = rows.iter().filter_map(|r| r["store"].as_str()).collect();
    assert_eq!(stores, ["memory", "nats"], "{report}");
    for row in &rows {
        assert_eq!(row["completed"], 1000, "{row}");
        assert_eq!(row["slots"], 16, "{row}");
        for field in ["rss_per_parked_run_kib", "park_all_s", "decide_all_s", "complete_all_s"] {
            assert!(row[field].is_number(), "{field} in {row}");
        }
    }
    assert!(rows[1]["nats_rss_per_parked_run_kib"].is_number(), "{report}");
    let markdown = std::fs::read_to_string(out.path().join("approvals.md"))?;
    assert!(
        markdown.contains("| memory | 1000 | 16 |") && markdown.contains("| nats | 1000 | 16 |"),
        "{markdown}"
    );
    Ok(())
}
