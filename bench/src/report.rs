//! The report of a grid run: the figures derived from several rows, the performance targets
//! checked, and `<name>.md` and `.json` written.

use serde::Serialize;

use crate::cli::Cli;
use crate::measure::{Measured, TracingCost, find};
use crate::micro;
use crate::workload::Tool;
use crate::{durability, real_server};

/// One performance target and whether it was met.
#[derive(Debug, Serialize)]
pub(crate) struct Target {
    pub(crate) what: String,
    pub(crate) limit: String,
    pub(crate) measured: String,
    pub(crate) met: bool,
}

pub(crate) fn targets(results: &mut [Measured], echo_floor: Option<f64>) -> Vec<Target> {
    derive_figures(results, echo_floor);
    let cpu_turn = find(results, "text_only").map(|m| m.cpu_per_turn_us);
    let mut out = Vec::new();
    let mut push = |what: &str, limit: String, measured: String, met: bool| {
        out.push(Target {
            what: what.to_owned(),
            limit,
            measured,
            met,
        });
    };
    cost_targets(results, cpu_turn, echo_floor, &mut push);
    latency_targets(results, &mut push);
    out
}

/// Figures derived from several rows: the CPU per tool call (the dispatch row's CPU less its
/// turns' cost, from the text-only row) and each row's comparison with its floor.
pub(crate) fn derive_figures(results: &mut [Measured], echo_floor: Option<f64>) {
    let cpu_turn = find(results, "text_only").map(|m| m.cpu_per_turn_us);
    if let (Some(turn_cost), Some(m)) = (cpu_turn, results.iter_mut().find(|m| m.workload.name == "dispatch_x64")) {
        let calls = (m.runs_ok * m.workload.calls_per_turn) as f64;
        let turns = m.runs_ok as f64 * f64::from(m.workload.turns());
        m.cpu_per_tool_call_us = Some(((m.orchestrator_cpu_s * 1e6) - turn_cost * turns).max(0.0) / calls.max(1.0));
    }
    for m in results.iter_mut() {
        m.vs_floor = match (&m.model_direct_ms, m.workload.tool) {
            (Some(direct), _) => Some(format!("run p50 ×{:.3} of the model alone", m.run_ms.p50 / direct.p50)),
            (None, Tool::Sleep(ms)) if m.workload.calls_per_turn > 1 => Some(format!(
                "first turn p99 ×{:.2} of the slowest call",
                m.first_turn_ms.p99 / ms as f64
            )),
            _ if m.workload.calls_per_turn >= 64 => {
                echo_floor.map(|floor| format!("calls/s ×{:.2} of the tonic echo", m.tool_calls_per_s / floor))
            }
            _ => None,
        };
    }
}

/// The targets on what the orchestrator costs: overhead per turn, CPU per turn and per call,
/// dispatch throughput against raw tonic.
pub(crate) fn cost_targets(
    results: &[Measured],
    cpu_turn: Option<f64>,
    echo_floor: Option<f64>,
    push: &mut impl FnMut(&str, String, String, bool),
) {
    if let Some(m) = find(results, "overhead_c1000_x4_paced") {
        let p99 = m.overhead_vs_served_per_turn_us.p99;
        push(
            &format!(
                "overhead per turn p99, {} concurrent runs in flight, 4 parallel calls (vs the model as served)",
                m.workload.concurrency
            ),
            "≤ 1000 µs".into(),
            format!("{p99:.0} µs, {} errors", m.errors),
            p99 <= 1000.0 && m.errors == 0,
        );
    }
    if let Some(turn) = cpu_turn {
        push(
            "orchestrator CPU per turn",
            "≤ 150 µs".into(),
            format!("{turn:.0} µs"),
            turn <= 150.0,
        );
    }
    if let Some(call) = find(results, "dispatch_x64").and_then(|m| m.cpu_per_tool_call_us) {
        push(
            "orchestrator CPU per tool call",
            "≤ 50 µs".into(),
            format!("{call:.1} µs"),
            call <= 50.0,
        );
    }
    if let (Some(m), Some(floor)) = (find(results, "dispatch_x64"), echo_floor) {
        let ratio = m.tool_calls_per_s / floor;
        push(
            "tool-call dispatch throughput vs raw tonic echo",
            "≥ 60 %".into(),
            format!(
                "{:.0} calls/s vs {floor:.0} calls/s = {:.0} %",
                m.tool_calls_per_s,
                ratio * 100.0
            ),
            ratio >= 0.6,
        );
    }
}

/// The targets on what callers see: parallel calls' turn time, memory per held run, and
/// end-to-end latency against the model alone.
pub(crate) fn latency_targets(results: &[Measured], push: &mut impl FnMut(&str, String, String, bool)) {
    if let Some(m) = find(results, "parallel_16x100ms") {
        let p99 = m.first_turn_ms.p99;
        push(
            "16 parallel calls of 100 ms: turn time p99",
            "≤ 105 ms".into(),
            format!("{p99:.1} ms"),
            p99 <= 105.0,
        );
    }
    if let Some(m) = find(results, "hold_c10000") {
        let per_run = m.rss_per_in_flight_run_kib;
        push(
            &format!(
                "{} concurrent runs held: RSS per in-flight run, no error",
                m.workload.concurrency
            ),
            "≤ 64 KiB, 0 errors".into(),
            format!("{per_run:.1} KiB, {} errors", m.errors),
            per_run <= 64.0 && m.errors == 0,
        );
    }
    if let Some(m) = find(results, "e2e_200ms_20ms")
        && let Some(direct) = m.model_direct_ms.as_ref().map(|d| d.p50)
    {
        let ratio = m.run_ms.p50 / direct;
        push(
            &format!(
                "end-to-end latency vs the model alone ({} ms / {} ms model)",
                m.workload.ttft_ms, m.workload.token_delay_ms
            ),
            "≤ +0.5 %".into(),
            format!(
                "{:.1} ms vs {direct:.1} ms = {:+.2} %",
                m.run_ms.p50,
                (ratio - 1.0) * 100.0
            ),
            ratio <= 1.005,
        );
    }
}

/// The floors measured beside the workloads.
#[derive(Debug, Serialize)]
pub(crate) struct Baselines {
    /// Raw tonic unary echo calls per second to the tool-runner (many at once).
    pub(crate) echo_floor_calls_per_s: Option<f64>,
    /// One raw tonic unary echo round trip, one at a time (µs).
    pub(crate) round_trip_us: f64,
}

pub(crate) fn markdown(
    results: &[Measured],
    targets: &[Target],
    baselines: &Baselines,
    quick: bool,
    repeat: u32,
) -> String {
    let echo_floor = baselines.echo_floor_calls_per_s;
    let mut s = String::new();
    s.push_str(&format!(
        "# Orchestrator benchmark ({})\n\nMachine: {} cores. The orchestrator runs as its own process (release); the stand-in model and a tool-runner run in the benchmark's process. Overhead = run wall time minus what the model and tools were scripted to take, per turn (the floor of a workload whose model and tools take no time is zero, so overhead is its excess over the floor); \"vs served\" subtracts instead the time the stand-in model actually took serving the run's requests (measured at the model, from each request's arrival to its last byte), so the model's own timer lateness is not counted as the orchestrator's. CPU vs budget = orchestrator CPU per run ÷ (150 µs × turns + 50 µs × normal calls), the CPU target as one figure per workload. Workloads without a model delay and without pacing are closed loops that saturate the machine: their latency is queueing (runs in flight ÷ throughput), their throughput and CPU are the figures; `_paced` workloads hold their runs in flight at a steady rate below saturation and measure latency.\n\n",
        if quick { "quick" } else { "full" },
        std::thread::available_parallelism().map_or(0, |n| n.get())
    ));
    s.push_str("| workload | conc. | runs | errors | turns | calls/turn | runs/s | calls/s | overhead/turn p50 / p99 / max (µs) | vs served p50 / p99 (µs) | CPU/turn (µs) | CPU/call (µs) | CPU vs budget | peak RSS (MiB) | RSS/run (KiB) | first turn p99 (ms) | vs floor |\n");
    s.push_str("|---|---:|---:|---:|---:|---:|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---|\n");
    for m in results {
        let w = &m.workload;
        s.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} | {:.0} | {:.0} | {:.0} / {:.0} / {:.0} | {:.0} / {:.0} | {} | {} | ×{:.2} | {:.1} | {:.1} | {:.1} | {} |\n",
            w.name,
            w.concurrency,
            m.runs_ok,
            m.errors,
            w.turns(),
            w.calls_per_turn,
            m.runs_per_s,
            m.tool_calls_per_s,
            m.overhead_per_turn_us.p50,
            m.overhead_per_turn_us.p99,
            m.overhead_per_turn_us.max,
            m.overhead_vs_served_per_turn_us.p50,
            m.overhead_vs_served_per_turn_us.p99,
            if repeat > 1 {
                format!(
                    "{:.0} ({:.0}–{:.0})",
                    m.cpu_per_turn_us, m.cpu_per_turn_range_us.0, m.cpu_per_turn_range_us.1
                )
            } else {
                format!("{:.0}", m.cpu_per_turn_us)
            },
            m.cpu_per_tool_call_us.map_or("–".into(), |c| format!("{c:.1}")),
            m.cpu_vs_budget,
            m.peak_rss_mib,
            m.rss_per_in_flight_run_kib,
            m.first_turn_ms.p99,
            m.vs_floor.as_deref().unwrap_or("–"),
        ));
    }
    if let Some(floor) = echo_floor {
        s.push_str(&format!(
            "\nBaseline: raw tonic unary echo to the tool-runner: {floor:.0} calls/s.\n"
        ));
    }
    s.push_str(&format!(
        "\nBaseline: one raw tonic unary round trip, one at a time: {:.0} µs (the floor of a hop on this machine; a tool turn is at least two: the model request and a tool call).\n",
        baselines.round_trip_us
    ));
    if repeat > 1 {
        s.push_str(&format!(
            "\nEach workload ran {repeat} times; the row is the run with the median CPU per turn (the range in brackets), memory the highest of the runs.\n"
        ));
    }
    s.push_str("\n## Targets\n\n| target | limit | measured | |\n|---|---|---|---|\n");
    for t in targets {
        s.push_str(&format!(
            "| {} | {} | {} | {} |\n",
            t.what,
            t.limit,
            t.measured,
            if t.met { "met" } else { "**missed**" }
        ));
    }
    s
}

/// Checks the targets and writes the report (`latest`, `quick` or `partial` `.md` / `.json`).
pub(crate) fn write_report(cli: &Cli, run: GridRun) -> anyhow::Result<()> {
    let GridRun {
        mut results,
        echo_floor,
        round_trip_us,
        sse,
        tracing_costs,
        durability_costs,
        real_server,
    } = run;
    let targets = targets(&mut results, echo_floor);
    let baselines = Baselines {
        echo_floor_calls_per_s: echo_floor,
        round_trip_us,
    };
    let mut report = markdown(&results, &targets, &baselines, cli.quick, cli.repeat);
    report.push_str(&format!(
        "\n## Micro-benchmark: SSE decoding\n\nA {}-event completion stream (framing, chunk JSON, semantic events), in this process on one thread: {:.0} ns per event when the stream arrives in one read, {:.0} ns per event when each event arrives in a read of its own.\n",
        sse.events_per_stream, sse.one_read_ns_per_event, sse.read_per_event_ns_per_event
    ));
    if !tracing_costs.is_empty() {
        report.push_str("\n## Tracing overhead (OTLP export off → on)\n\n| workload | CPU/turn off (µs) | CPU/turn on (µs) | overhead p50 off (µs) | overhead p50 on (µs) |\n|---|---:|---:|---:|---:|\n");
        for c in &tracing_costs {
            report.push_str(&format!(
                "| {} | {:.0} | {:.0} | {:.0} | {:.0} |\n",
                c.workload, c.cpu_per_turn_off_us, c.cpu_per_turn_on_us, c.overhead_p50_off_us, c.overhead_p50_on_us
            ));
        }
        report.push_str(&format!("\nSpans received by the in-process OTLP sink: {} (the orchestrator was stopped, so its batch was flushed).\n", tracing_costs[0].spans_exported));
    }
    report.push_str(&durability::markdown(&durability_costs));
    match &real_server {
        RealServerOutcome::Measured(row) => report.push_str(&real_server::markdown(row)),
        RealServerOutcome::NotRun(reason) => {
            report.push_str(&format!("\n## Real model server\n\n{}: {reason}\n", real_server::NAME));
        }
    }
    std::fs::create_dir_all(&cli.out)?;
    // A subset never overwrites the full report it would be compared with.
    let name = match (cli.only.is_empty(), cli.quick) {
        (false, _) => "partial",
        (true, true) => "quick",
        (true, false) => "latest",
    };
    std::fs::write(cli.out.join(format!("{name}.md")), &report)?;
    let json = serde_json::json!({
        "quick": cli.quick,
        "echo_floor_calls_per_s": echo_floor,
        "round_trip_us": round_trip_us,
        "repeat": cli.repeat,
        "sse_decode": sse,
        "workloads": results,
        "targets": targets,
        "tracing": tracing_costs,
        "durability": match &durability_costs {
            Ok(costs) => serde_json::json!(costs),
            Err(reason) => serde_json::json!({ "not_measured": reason }),
        },
        "real_server": real_server,
    });
    std::fs::write(
        cli.out.join(format!("{name}.json")),
        serde_json::to_string_pretty(&json)?,
    )?;
    println!("{report}");
    eprintln!("bench: wrote {}/{name}.md and .json", cli.out.display());
    Ok(())
}

/// The real-server row, or why it did not run.
#[derive(Serialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum RealServerOutcome {
    Measured(real_server::RealServerRow),
    NotRun(String),
}

/// Everything one grid run measured.
pub(crate) struct GridRun {
    pub(crate) results: Vec<Measured>,
    pub(crate) echo_floor: Option<f64>,
    pub(crate) round_trip_us: f64,
    pub(crate) sse: micro::SseDecode,
    pub(crate) tracing_costs: Vec<TracingCost>,
    pub(crate) durability_costs: Result<Vec<durability::DurabilityCost>, String>,
    pub(crate) real_server: RealServerOutcome,
}
