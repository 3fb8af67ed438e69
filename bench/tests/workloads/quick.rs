//! The quick benchmark runs in CI so it cannot rot: it must finish, measure every workload
//! without errors, and write a report with every figure and a verdict per target. Speed itself
//! is never asserted here; the benchmark's report measures it.

use crate::common;

/// Every workload of the grid is in the report, ran without errors, and has every figure.
fn every_workload_is_measured_without_errors(report: &serde_json::Value) {
    let workloads = report["workloads"].as_array().cloned().unwrap_or_default();
    let names: Vec<&str> = workloads
        .iter()
        .filter_map(|w| w["workload"]["name"].as_str())
        .collect();
    for expected in [
        "text_only",
        "overhead_c1000_x4",
        "overhead_c1000_x4_paced",
        "dispatch_x64",
        "parallel_16x100ms",
        "parallel_16x100ms_c20",
        "hold_c10000",
        "e2e_200ms_20ms",
    ] {
        assert!(names.contains(&expected), "{expected} missing from {names:?}");
    }
    for w in &workloads {
        assert_eq!(w["errors"], 0, "{w}");
        assert!(w["runs_ok"].as_u64().unwrap_or(0) > 0, "{w}");
        for field in [
            "runs_per_s",
            "overhead_per_turn_us",
            "cpu_per_turn_us",
            "peak_rss_mib",
            "rss_per_in_flight_run_kib",
            "cpu_vs_budget",
        ] {
            assert!(!w[field].is_null(), "{field} missing in {w}");
        }
    }
}

#[test]
fn the_quick_benchmark_runs_and_reports_every_figure() -> anyhow::Result<()> {
    let out = tempfile::tempdir()?;
    let output = common::run_bench(&["--quick", "--real-server", "require"], out.path())?;
    anyhow::ensure!(
        output.status.success(),
        "bench failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let report: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(out.path().join("quick.json"))?)?;
    every_workload_is_measured_without_errors(&report);
    assert!(report["echo_floor_calls_per_s"].as_f64().unwrap_or(0.0) > 0.0);
    let targets = report["targets"].as_array().cloned().unwrap_or_default();
    assert_eq!(targets.len(), 7, "one verdict per target: {targets:?}");
    assert!(
        targets
            .iter()
            .all(|t| t["met"].is_boolean() && t["measured"].is_string())
    );
    let markdown = std::fs::read_to_string(out.path().join("quick.md"))?;
    assert!(markdown.contains("## Targets"));

    // The real-server row: the same answer through the orchestrator and directly, both measured.
    let real = &report["real_server"]["measured"];
    assert_eq!(real["name"], "llama_server_text", "{}", report["real_server"]);
    assert_eq!(real["tokens_per_run"], 32, "{real}");
    for field in ["direct_ms", "via_ms", "direct_first_token_ms", "via_first_token_ms"] {
        assert!(real[field]["p50"].as_f64().unwrap_or(0.0) > 0.0, "{field} in {real}");
    }
    for field in ["orchestrator_cpu_per_turn_us", "server_cpu_per_turn_ms"] {
        assert!(real[field].as_f64().unwrap_or(0.0) > 0.0, "{field} in {real}");
    }
    assert!(markdown.contains("## Real model server") && markdown.contains("| llama_server_text | 3 | 32 |"));

    // Durability: the same workloads with the memory and the NATS store (./scripts/test installs
    // nats-server), each figure measured on both sides.
    let durability = report["durability"].as_array().cloned().unwrap_or_default();
    let measured: Vec<&str> = durability.iter().filter_map(|d| d["workload"].as_str()).collect();
    assert_eq!(measured, ["text_only", "e2e_200ms_20ms"], "{}", report["durability"]);
    for d in &durability {
        for field in [
            "cpu_per_turn_memory_us",
            "cpu_per_turn_nats_us",
            "cpu_per_chunk_memory_us",
            "cpu_per_chunk_nats_us",
            "nats_server_cpu_per_turn_us",
        ] {
            assert!(d[field].as_f64().unwrap_or(0.0) > 0.0, "{field} in {d}");
        }
    }
    assert!(markdown.contains("## Durability"));
    Ok(())
}

#[test]
fn a_subset_goes_to_its_own_report_and_unknown_names_are_refused() -> anyhow::Result<()> {
    let out = tempfile::tempdir()?;
    let run = |only: &str| common::run_bench(&["--quick", "--no-tracing", "--only", only], out.path());
    let bad = run("text_only,no_such_workload")?;
    assert!(!bad.status.success());
    let stderr = String::from_utf8_lossy(&bad.stderr);
    assert!(
        stderr.contains("no_such_workload") && stderr.contains("text_only"),
        "{stderr}"
    );

    let ok = run("text_only")?;
    assert!(ok.status.success(), "{}", String::from_utf8_lossy(&ok.stderr));
    let report: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(out.path().join("partial.json"))?)?;
    assert_eq!(report["workloads"].as_array().map(Vec::len), Some(1));
    assert_eq!(report["real_server"]["not_run"], "not selected by --only");
    assert!(!out.path().join("quick.json").exists() && !out.path().join("latest.json").exists());
    Ok(())
}

#[test]
fn the_real_server_row_says_why_it_did_not_run_and_require_refuses_to_go_without_it() -> anyhow::Result<()> {
    let out = tempfile::tempdir()?;
    let empty_cache = tempfile::tempdir()?;
    let run = |mode: &str| {
        let mut command = common::bench_command(
            &[
                "--quick",
                "--no-tracing",
                "--only",
                "llama_server_text",
                "--real-server",
                mode,
            ],
            out.path(),
        )?;
        common::run_alone(command.env("ORCHESTRATOR_TEST_CACHE", empty_cache.path()))
    };

    let required = run("require")?;
    assert!(!required.status.success());
    let stderr = String::from_utf8_lossy(&required.stderr);
    assert!(
        stderr.contains("--real-server require") && stderr.contains("scripts/model-servers"),
        "{stderr}"
    );
    assert!(
        !out.path().join("partial.json").exists(),
        "nothing is measured when the row cannot run"
    );

    for mode in ["auto", "skip"] {
        let output = run(mode)?;
        assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
        let report: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(out.path().join("partial.json"))?)?;
        let reason = report["real_server"]["not_run"].as_str().unwrap_or_default().to_owned();
        let expected = if mode == "auto" {
            "scripts/model-servers"
        } else {
            "--real-server skip"
        };
        assert!(reason.contains(expected), "{mode}: {reason}");
        let markdown = std::fs::read_to_string(out.path().join("partial.md"))?;
        assert!(markdown.contains(&reason), "{markdown}");
    }
    Ok(())
}

/// The paced relay with its peers (quick): every interval measured, every run completed, figures
/// in the report, and the peers measured on the same model with the ratios: the OpenAI Agents SDK
/// and agentic-api (installed into the test cache by the benchmark on first use; the stand-in
/// model serves agentic-api `/v1/responses`) and the LiteLLM proxy (installed by
/// `./scripts/test`); the orchestrator's variants (the pooled LLM reader, one worker, the NATS
/// store, and another build named by `BENCH_PACED_AGAINST`), the shipped one called from Python
/// through grpcio (the test virtualenv's), the floor (a bare relay of the same stream), and a
/// two-turn agent run beside the Agents SDK's, in the same report. Gathering is checked on what it must do whatever the
/// machine: at a 20 ms interval a run's caller gets fewer text events than the 50 tokens it
/// relays (without it, one per token).
#[test]
fn the_paced_relay_reports_cost_per_token_at_each_stream_interval_beside_its_peers() -> anyhow::Result<()> {
    let out = tempfile::tempdir()?;
    // Another build to compare with: here the same binary, measured as one more variant.
    let against = std::path::Path::new(env!("CARGO_BIN_EXE_bench")).with_file_name("orchestrator");
    let output = common::run_alone(
        common::bench_command(&["--peers", "--quick"], out.path())?.env("BENCH_PACED_AGAINST", &against),
    )?;
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let report: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(out.path().join("paced.json"))?)?;
    let rows = report["rows"].as_array().cloned().unwrap_or_default();
    let intervals: Vec<u64> = rows.iter().filter_map(|r| r["interval_ms"].as_u64()).collect();
    assert_eq!(intervals, [0, 20]);
    for row in &rows {
        assert_eq!(row["runs_failed"], 0, "{row}");
        assert!(row["cpu_us_per_token"].as_f64().is_some_and(|c| c > 0.0), "{row}");
        assert!(row["switches_per_token"].as_f64().is_some(), "{row}");
    }
    let events = |i: usize| rows[i]["text_events_per_run"].as_f64().unwrap_or(0.0);
    assert!(events(1) < 50.0 && events(1) < events(0), "{rows:?}");
    let peers = report["peers"].as_array().cloned().unwrap_or_default();
    for name in ["openai-agents", "agentic-api", "litellm"] {
        let peer = peers.iter().find(|p| p["name"] == name);
        assert!(
            peer.is_some_and(|p| p["cpu_us_per_token"].as_f64().is_some_and(|c| c > 0.0)),
            "{name} was not measured: {peers:?}"
        );
    }
    // The variants in the same run: the shared client reading the model (the baseline), one
    // runtime worker, the durable mode (the NATS store), the other build, and Python callers.
    let variants = report["variants"].as_array().cloned().unwrap_or_default();
    for label in [
        "pooled reader",
        "one worker",
        "durable",
        "BENCH_PACED_AGAINST=",
        "shipped, Python grpcio",
    ] {
        let measured: Vec<&serde_json::Value> = variants
            .iter()
            .filter(|v| v["setup"].as_str().is_some_and(|s| s.starts_with(label)))
            .collect();
        assert_eq!(measured.len(), 2, "{label} at 0 and 20 ms: {variants:?}");
        assert!(
            measured
                .iter()
                .all(|v| v["runs_failed"] == 0 && v["cpu_us_per_token"].as_f64().is_some_and(|c| c > 0.0)),
            "{measured:?}"
        );
    }
    // The floor: a bare relay of the same stream (one SSE read, one gRPC message written), at
    // 0 ms, every run completed; the targets hold the orchestrator's ratio to it.
    let floor: Vec<&serde_json::Value> = variants
        .iter()
        .filter(|v| {
            v["setup"]
                .as_str()
                .is_some_and(|s| s.starts_with("floor: a bare relay"))
        })
        .collect();
    assert_eq!(floor.len(), 1, "the floor at 0 ms: {variants:?}");
    assert!(
        floor[0]["interval_ms"] == 0 && floor[0]["runs_failed"] == 0,
        "{floor:?}"
    );
    assert!(
        floor[0]["cpu_us_per_token"].as_f64().is_some_and(|c| c > 0.0),
        "{floor:?}"
    );
    // A two-turn agent run, the orchestrator (and its tool-runner) beside the Agents SDK.
    let runs = &report["agent_runs"];
    for who in ["orchestrator_cpu_us_per_run", "agents_sdk_cpu_us_per_run"] {
        assert!(runs[who].as_f64().is_some_and(|c| c > 0.0), "{who}: {runs}");
    }
    let markdown = std::fs::read_to_string(out.path().join("paced.md"))?;
    for section in [
        "| 20 ms |",
        "## Peers",
        "## Variants",
        "## An agent run",
        "## Targets",
        "÷ the floor's",
    ] {
        assert!(markdown.contains(section), "{section} missing: {markdown}");
    }
    Ok(())
}
