//! `bench --admission`: runs let in one after the other on both stores, by a caller without and
//! with a max_runs (`./scripts/test` installs nats-server). Every row must be measured; what the
//! figures are is the report's business.

use crate::common;

#[test]
fn admission_is_measured_on_both_stores_for_both_callers() -> anyhow::Result<()> {
    let out = tempfile::tempdir()?;
    let output = common::run_bench(&["--admission", "20"], out.path())?;
    anyhow::ensure!(
        output.status.success(),
        "bench failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let report: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(out.path().join("admission.json"))?)?;
    let rows = report.as_array().cloned().unwrap_or_default();
    let kinds: Vec<(String, String)> = rows
        .iter()
        .map(|r| {
            (
                r["store"].as_str().unwrap_or_default().to_owned(),
                r["caller"].as_str().unwrap_or_default().to_owned(),
            )
        })
        .collect();
    assert_eq!(
        kinds,
        [
            ("memory".to_owned(), "no max_runs".to_owned()),
            ("memory".to_owned(), "max_runs 1000".to_owned()),
            ("nats".to_owned(), "no max_runs".to_owned()),
            ("nats".to_owned(), "max_runs 1000".to_owned()),
        ],
        "{report}"
    );
    for row in &rows {
        for field in ["admission_p50_ms", "admission_p99_ms", "x_baseline"] {
            assert!(row[field].as_f64().is_some_and(|v| v > 0.0), "{field} in {row}");
        }
        // CPU time is counted in scheduler ticks: twenty short runs may read none.
        assert!(row["cpu_per_run_us"].as_f64().is_some_and(|v| v >= 0.0), "{row}");
    }
    Ok(())
}
