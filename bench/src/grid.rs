//! The grid: the workloads measured on one orchestrator, then tracing, durability and the real
//! model server, and the report written.

use std::path::Path;

use mock_llm::Scenarios;

use crate::cli::{Cli, RealServerMode};
use crate::measure::{floors, measure_repeated, tracing_costs};
use crate::report::{GridRun, RealServerOutcome, write_report};
use crate::workload::{Tool, Workload};
use crate::{durability, micro, real_server, stack};

/// The workloads of the grid, in the report's order (`--quick`: small enough for CI).
pub(crate) fn grid(quick: bool) -> Vec<Workload> {
    let scale = Scale { quick };
    let base = Workload::base();
    [plain, turns_and_calls, parallel, held_and_streamed]
        .into_iter()
        .flat_map(|rows| rows(scale, &base))
        .collect()
}

/// The size of the grid's rows: full, or `--quick`'s.
#[derive(Clone, Copy)]
struct Scale {
    quick: bool,
}

impl Scale {
    /// `full`, or `quick_value` under `--quick`.
    fn q(self, full: usize, quick_value: usize) -> usize {
        if self.quick { quick_value } else { full }
    }
}

/// The runs with nothing but the orchestrator's own work: text only, and one turn of four calls
/// and an exit call, alone, 1000 at once, and paced as in service.
fn plain(scale: Scale, base: &Workload) -> Vec<Workload> {
    vec![
        Workload {
            name: "text_only".into(),
            concurrency: scale.q(100, 10),
            runs: scale.q(5000, 200),
            ..base.clone()
        },
        Workload {
            name: "overhead_c1_x4".into(),
            concurrency: 1,
            runs: scale.q(300, 30),
            tool_turns: 1,
            calls_per_turn: 4,
            exit_calls: 1,
            ..base.clone()
        },
        Workload {
            name: "overhead_c1000_x4".into(),
            concurrency: scale.q(1000, 50),
            runs: scale.q(5000, 200),
            tool_turns: 1,
            calls_per_turn: 4,
            exit_calls: 1,
            ..base.clone()
        },
        Workload {
            // The target's case: 1000 runs in flight as in service, the model taking 2 s per turn
            // (its answer then arrives at once), the runs' starts spread so the load is steady.
            // Compared with the same model streams called directly under the same pacing.
            name: "overhead_c1000_x4_paced".into(),
            concurrency: scale.q(1000, 50),
            runs: scale.q(3000, 150),
            tool_turns: 1,
            calls_per_turn: 4,
            exit_calls: 1,
            ttft_ms: scale.q(2000, 200) as u64,
            paced: true,
            ..base.clone()
        },
    ]
}

/// Many turns of one call, and one turn of 64 calls: the turn boundary and the dispatch.
fn turns_and_calls(scale: Scale, base: &Workload) -> Vec<Workload> {
    vec![
        Workload {
            name: "turns8_x1".into(),
            concurrency: scale.q(100, 10),
            runs: scale.q(500, 40),
            tool_turns: 7,
            calls_per_turn: 1,
            ..base.clone()
        },
        Workload {
            name: "dispatch_x64".into(),
            concurrency: scale.q(100, 10),
            runs: scale.q(500, 20),
            tool_turns: 1,
            calls_per_turn: 64,
            ..base.clone()
        },
    ]
}

/// Calls that take their time, in parallel: one run's 16 alone, and 20 such runs at once.
fn parallel(scale: Scale, base: &Workload) -> Vec<Workload> {
    vec![
        Workload {
            // The target's case: one run's 16 calls in parallel, nothing else competing.
            name: "parallel_16x100ms".into(),
            concurrency: 1,
            runs: scale.q(50, 5),
            tool_turns: 1,
            calls_per_turn: 16,
            tool: Tool::Sleep(100),
            ..base.clone()
        },
        Workload {
            // The same under load: 20 such runs (320 calls) at once, started together.
            name: "parallel_16x100ms_c20".into(),
            concurrency: scale.q(20, 5),
            runs: scale.q(200, 10),
            tool_turns: 1,
            calls_per_turn: 16,
            tool: Tool::Sleep(100),
            ..base.clone()
        },
    ]
}

/// Runs held open by a slow model (10,000 at once), and the end-to-end latency on a model that
/// streams at a human pace.
fn held_and_streamed(scale: Scale, base: &Workload) -> Vec<Workload> {
    vec![
        Workload {
            name: "hold_c10000".into(),
            concurrency: scale.q(10_000, 200),
            runs: scale.q(10_000, 200),
            ttft_ms: if scale.quick { 1000 } else { 4000 },
            ..base.clone()
        },
        Workload {
            name: "e2e_200ms_20ms".into(),
            concurrency: scale.q(10, 4),
            runs: scale.q(50, 8),
            tool_turns: 1,
            calls_per_turn: 1,
            text_words: scale.q(50, 10),
            ttft_ms: if scale.quick { 50 } else { 200 },
            token_delay_ms: if scale.quick { 5 } else { 20 },
            ..base.clone()
        },
    ]
}

/// The grid, or the rows `--only` names (an unknown name is an error listing the known ones).
pub(crate) fn selected_workloads(cli: &Cli) -> anyhow::Result<Vec<Workload>> {
    let mut workloads = grid(cli.quick);
    if !cli.only.is_empty() {
        let mut known: Vec<String> = workloads.iter().map(|w| w.name.clone()).collect();
        known.push(real_server::NAME.into());
        let unknown: Vec<&String> = cli.only.iter().filter(|n| !known.contains(n)).collect();
        anyhow::ensure!(
            unknown.is_empty(),
            "unknown workload(s) {unknown:?} in --only; the grid has {}",
            known.join(", ")
        );
        workloads.retain(|w| cli.only.contains(&w.name));
    }
    Ok(workloads)
}

/// Whether to run the real-server row: `Err` when `--real-server require` cannot be met, the
/// reason it will not run as `Ok(Some(…))`, or `Ok(None)` to run it.
pub(crate) fn real_server_skip_reason(cli: &Cli) -> anyhow::Result<Option<String>> {
    if !cli.only.is_empty() && !cli.only.iter().any(|n| n == real_server::NAME) {
        return Ok(Some("not selected by --only".into()));
    }
    if cli.real_server == RealServerMode::Skip {
        return Ok(Some("skipped (--real-server skip)".into()));
    }
    let installed = testkit::model_servers::installed("bin/llama-server")
        .and_then(|_| testkit::model_servers::installed(&format!("models/{}", testkit::model_servers::MODEL_FILE)));
    match (installed, cli.real_server) {
        (Ok(_), _) => Ok(None),
        (Err(e), RealServerMode::Require) => Err(e.context("--real-server require")),
        (Err(e), _) => Ok(Some(format!("not run: {e}"))),
    }
}

/// The grid of workloads on one orchestrator, then tracing, durability and the real server.
pub(crate) async fn run_grid(cli: &Cli, bin: &Path) -> anyhow::Result<()> {
    let workloads = selected_workloads(cli)?;
    let real_server_skipped = real_server_skip_reason(cli)?;
    let scenarios = Scenarios {
        default: mock_llm::Scenario::demo(),
        named: workloads.iter().map(|w| (w.name.clone(), w.scenario())).collect(),
    };
    let max_concurrency = workloads.iter().map(|w| w.concurrency).max().unwrap_or(1);
    // Logs at warn: the grid measures orchestration, not logging.
    let stack = stack::Stack::start(bin, scenarios, max_concurrency.div_ceil(50), None, "warn", &[], &[]).await?;
    eprintln!(
        "bench: orchestrator pid {} ({}), {} workloads",
        stack.pid,
        bin.display(),
        workloads.len()
    );

    eprint!("bench: {:<20} … ", "sse decode");
    let sse = micro::sse_decode(if cli.quick { 20 } else { 500 }).await?;
    eprintln!(
        "{:.0} ns/event in one read, {:.0} ns/event one per read",
        sse.one_read_ns_per_event, sse.read_per_event_ns_per_event
    );

    let mut results = Vec::new();
    for workload in &workloads {
        results.push(measure_repeated(&stack, workload, cli.repeat).await?);
    }
    let (round_trip_us, echo_floor) = floors(&stack, &results).await?;
    stack.stop().await;

    // Tracing: the same workloads on a fresh orchestrator exporting every span over OTLP.
    let tracing_costs = if cli.no_tracing {
        Vec::new()
    } else {
        tracing_costs(bin, &workloads, max_concurrency).await?
    };

    let durability_costs = if cli.no_durability {
        Ok(Vec::new())
    } else {
        durability::costs(bin, &workloads, max_concurrency.div_ceil(50)).await?
    };

    // Last, so the model server competes with nothing else for the machine.
    let real_server = match real_server_skipped {
        Some(reason) => RealServerOutcome::NotRun(reason),
        None => RealServerOutcome::Measured(measure_real_server(bin, cli.quick).await?),
    };

    let measured = GridRun {
        results,
        echo_floor,
        round_trip_us,
        sse,
        tracing_costs,
        durability_costs,
        real_server,
    };
    write_report(cli, measured)
}

/// The real-model-server row: the same requests to llama-server directly and through the
/// orchestrator.
pub(crate) async fn measure_real_server(
    bin: &std::path::Path,
    quick: bool,
) -> anyhow::Result<real_server::RealServerRow> {
    let row = real_server::RealServer::new(quick);
    eprint!(
        "bench: {:<20} {} runs each way, {} tokens each … ",
        real_server::NAME,
        row.runs,
        row.max_tokens
    );
    let measured = row.measure(bin).await?;
    eprintln!("+{:.1} ms p50 through the orchestrator", measured.added_p50_ms);
    Ok(measured)
}
