//! `bench --list-runs`: pages of `ListRuns` over runs stored in a NATS (`./scripts/test` installs
//! nats-server). Every query must answer and be reported; what the figures are is the report's
//! business, but the rows each query finds follow from how the runs were written.

use crate::common;

#[test]
fn list_runs_pages_are_measured_over_stored_runs() -> anyhow::Result<()> {
    let out = tempfile::tempdir()?;
    let output = common::run_bench(&["--list-runs", "2000"], out.path())?;
    anyhow::ensure!(
        output.status.success(),
        "bench failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let report: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(out.path().join("list_runs.json"))?)?;
    let rows = report.as_array().cloned().unwrap_or_default();
    let found: Vec<f64> = rows.iter().filter_map(|r| r["rows_per_page"].as_f64()).collect();
    // Everything, one principal's, 10 of a label, the 20 failed ones, no live one, 20 full pages.
    assert_eq!(found, [50.0, 50.0, 10.0, 20.0, 0.0, 50.0], "{report}");
    for row in &rows {
        for field in ["p50_ms", "p99_ms", "x_get_run"] {
            assert!(row[field].as_f64().is_some_and(|v| v > 0.0), "{field} in {row}");
        }
    }
    Ok(())
}
