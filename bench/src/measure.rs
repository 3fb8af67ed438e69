//! One workload measured on an orchestrator: its runs driven through the gRPC API, the
//! orchestrator's CPU time and memory read from `/proc`, the figures per turn and per call; and
//! the floors measured beside the grid (a raw tonic round trip and echo rate).

use std::time::{Duration, Instant};

use mock_llm::Scenarios;
use serde::Serialize;

use crate::workload::{self, Workload, quantile};
use crate::{otlp, procstat, stack};

/// Measurements of one workload.
#[derive(Debug, Serialize)]
pub(crate) struct Measured {
    pub(crate) workload: Workload,
    pub(crate) runs_ok: usize,
    pub(crate) errors: usize,
    pub(crate) wall_s: f64,
    pub(crate) runs_per_s: f64,
    pub(crate) tool_calls_per_s: f64,
    /// Run wall time minus what the model and tools were scripted to take, per turn.
    pub(crate) overhead_per_turn_us: Quantiles,
    /// Wall time of the first turn (for the parallel-calls target).
    pub(crate) first_turn_ms: Quantiles,
    pub(crate) orchestrator_cpu_s: f64,
    pub(crate) cpu_per_turn_us: f64,
    /// Lowest and highest CPU per turn over the repeats (`--repeat`).
    pub(crate) cpu_per_turn_range_us: (f64, f64),
    pub(crate) cpu_per_tool_call_us: Option<f64>,
    pub(crate) peak_rss_mib: f64,
    pub(crate) rss_per_in_flight_run_kib: f64,
    /// The model called directly for the same streams and pacing (workloads whose model takes
    /// time): each "run"'s wall time.
    pub(crate) model_direct_ms: Option<Quantiles>,
    /// Each run's wall time through the orchestrator.
    pub(crate) run_ms: Quantiles,
    /// Run wall time minus the time the stand-in model took serving the run's requests (measured
    /// at the model, from each request's arrival to its last byte) and the tools' scripted time,
    /// per turn. Unlike `overhead_per_turn_us` this does not count the stand-in model's own timer
    /// lateness (up to ~1 ms per scripted delay, more when the machine is busy).
    pub(crate) overhead_vs_served_per_turn_us: Quantiles,
    /// Orchestrator CPU per run against the target budget (150 µs per turn + 50 µs per normal
    /// tool call): 1.0 spends exactly the budget.
    pub(crate) cpu_vs_budget: f64,
    /// The figure against its floor: run time vs the model alone (model delays), first turn vs
    /// the slowest call (parallel calls), calls/s vs the raw tonic echo (dispatch).
    pub(crate) vs_floor: Option<String>,
}

#[derive(Debug, Serialize, Default)]
pub(crate) struct Quantiles {
    pub(crate) p50: f64,
    pub(crate) p99: f64,
    pub(crate) max: f64,
}

pub(crate) fn quantiles(values: &[Duration], unit: f64) -> Quantiles {
    Quantiles {
        p50: quantile(values, 0.5).as_secs_f64() * unit,
        p99: quantile(values, 0.99).as_secs_f64() * unit,
        max: quantile(values, 1.0).as_secs_f64() * unit,
    }
}

/// One workload with OTLP export off and on.
#[derive(Debug, Serialize)]
pub(crate) struct TracingCost {
    pub(crate) workload: String,
    pub(crate) cpu_per_turn_off_us: f64,
    pub(crate) cpu_per_turn_on_us: f64,
    pub(crate) overhead_p50_off_us: f64,
    pub(crate) overhead_p50_on_us: f64,
    pub(crate) spans_exported: usize,
}

pub(crate) async fn measure(stack: &stack::Stack, workload: &Workload) -> anyhow::Result<Measured> {
    stack.mock.take_served();
    let cpu_before = procstat::cpu_time(stack.pid)?;
    let rss_before = procstat::rss(stack.pid)?;
    let peak = procstat::PeakRss::start(stack.pid);
    let started = Instant::now();
    let samples = workload::drive(stack, workload, &workload.name).await;
    let wall = started.elapsed();
    let peak_rss = peak.finish().await;
    let cpu = procstat::cpu_time(stack.pid)?.saturating_sub(cpu_before);

    let served = stack.mock.take_served();
    let ok: Vec<&workload::RunSample> = samples.iter().filter(|s| s.ok).collect();
    let turns = f64::from(workload.turns());
    let scripted = workload.scripted_run();
    let overhead: Vec<Duration> = ok
        .iter()
        .map(|s| s.wall.saturating_sub(scripted).div_f64(turns))
        .collect();
    let overhead_vs_served: Vec<Duration> = ok
        .iter()
        .map(|s| {
            let model = served.get(&s.key).copied().unwrap_or_default();
            s.wall.saturating_sub(model + workload.scripted_tools()).div_f64(turns)
        })
        .collect();
    let first_turn: Vec<Duration> = ok.iter().filter_map(|s| s.turns.first().copied()).collect();
    let total_turns = ok.len() as f64 * turns;
    let total_calls = ok.len() * workload.tool_turns as usize * workload.calls_per_turn;
    let walls: Vec<Duration> = ok.iter().map(|s| s.wall).collect();
    let run_ms = quantiles(&walls, 1e3);
    let model_direct = if workload.ttft_ms > 0 && workload.tool_turns > 0 && !workload.paced {
        let direct = workload::model_direct(&stack.mock.base_url(), workload, &workload.name).await?;
        Some(quantiles(&direct, 1e3))
    } else {
        None
    };
    let budget_us = 150.0 * turns + 50.0 * (workload.tool_turns as usize * workload.calls_per_turn) as f64;
    let cpu_per_run_us = cpu.as_secs_f64() * 1e6 / (ok.len().max(1)) as f64;
    Ok(Measured {
        workload: workload.clone(),
        runs_ok: ok.len(),
        errors: samples.len() - ok.len(),
        wall_s: wall.as_secs_f64(),
        runs_per_s: ok.len() as f64 / wall.as_secs_f64(),
        tool_calls_per_s: total_calls as f64 / wall.as_secs_f64(),
        overhead_per_turn_us: quantiles(&overhead, 1e6),
        first_turn_ms: quantiles(&first_turn, 1e3),
        orchestrator_cpu_s: cpu.as_secs_f64(),
        cpu_per_turn_us: cpu.as_secs_f64() * 1e6 / total_turns.max(1.0),
        cpu_per_turn_range_us: (0.0, 0.0),
        cpu_per_tool_call_us: None,
        peak_rss_mib: peak_rss as f64 / (1 << 20) as f64,
        rss_per_in_flight_run_kib: peak_rss.saturating_sub(rss_before) as f64
            / 1024.0
            / workload.concurrency.min(workload.runs) as f64,
        model_direct_ms: model_direct,
        run_ms,
        overhead_vs_served_per_turn_us: quantiles(&overhead_vs_served, 1e6),
        cpu_vs_budget: cpu_per_run_us / budget_us,
        vs_floor: None,
    })
}

/// The run with the median CPU per turn, carrying the range over all of them. Memory is the
/// highest seen: a repeat reuses what the allocator kept from the one before, so only the first
/// shows what holding the runs costs.
pub(crate) fn median_run(mut repeats: Vec<Measured>) -> Measured {
    repeats.sort_by(|a, b| a.cpu_per_turn_us.total_cmp(&b.cpu_per_turn_us));
    let range = (
        repeats.first().map_or(0.0, |m| m.cpu_per_turn_us),
        repeats.last().map_or(0.0, |m| m.cpu_per_turn_us),
    );
    let max = |f: fn(&Measured) -> f64| repeats.iter().map(f).fold(0.0, f64::max);
    let (peak_rss, per_run) = (max(|m| m.peak_rss_mib), max(|m| m.rss_per_in_flight_run_kib));
    let mut median = repeats.swap_remove(repeats.len() / 2);
    median.cpu_per_turn_range_us = range;
    median.peak_rss_mib = peak_rss;
    median.rss_per_in_flight_run_kib = per_run;
    median
}

pub(crate) fn find<'a>(results: &'a [Measured], name: &str) -> Option<&'a Measured> {
    results.iter().find(|m| m.workload.name == name)
}

/// One row measured `repeat` times; the median run is kept.
pub(crate) async fn measure_repeated(
    stack: &stack::Stack,
    workload: &Workload,
    repeat: u32,
) -> anyhow::Result<Measured> {
    eprint!(
        "bench: {:<20} {} runs, {} at once … ",
        workload.name, workload.runs, workload.concurrency
    );
    let mut repeats = Vec::new();
    for _ in 0..repeat {
        repeats.push(measure(stack, workload).await?);
    }
    let measured = median_run(repeats);
    eprintln!("{:.1} s, {} errors", measured.wall_s, measured.errors);
    Ok(measured)
}

/// Each of `workloads` measured on `stack` (`label` in the progress lines), which is then stopped.
pub(crate) async fn measure_each(
    stack: stack::Stack,
    workloads: &[&Workload],
    label: &str,
) -> anyhow::Result<Vec<Measured>> {
    let mut measured = Vec::with_capacity(workloads.len());
    for workload in workloads {
        eprint!("bench: {:<20} {label} … ", workload.name);
        let m = measure(&stack, workload).await?;
        eprintln!("{} errors", m.errors);
        measured.push(m);
    }
    stack.stop().await;
    Ok(measured)
}

/// A fresh orchestrator playing `workloads` (and the demo by default), started with `otlp`,
/// `rust_log` and `extra` flags.
pub(crate) async fn fresh_stack(
    bin: &std::path::Path,
    workloads: &[&Workload],
    channels: usize,
    otlp: Option<&str>,
    rust_log: &str,
    extra: &[&str],
) -> anyhow::Result<stack::Stack> {
    let scenarios = Scenarios {
        default: mock_llm::Scenario::demo(),
        named: workloads.iter().map(|w| (w.name.clone(), w.scenario())).collect(),
    };
    stack::Stack::start(bin, scenarios, channels, otlp, rust_log, extra, &[]).await
}

/// The traced workloads on a fresh orchestrator with OTLP export off, then on.
pub(crate) async fn tracing_costs(
    bin: &std::path::Path,
    workloads: &[Workload],
    max_concurrency: usize,
) -> anyhow::Result<Vec<TracingCost>> {
    let traced: Vec<&Workload> = workloads
        .iter()
        .filter(|w| w.name == "text_only" || w.name == "overhead_c1000_x4")
        .collect();
    if traced.is_empty() {
        return Ok(Vec::new());
    }
    // Both sides at the production default (info), so spans exist; only export differs.
    let sink = otlp::Sink::start().await?;
    let channels = max_concurrency.div_ceil(50);
    let off_stack = fresh_stack(bin, &traced, channels, None, "info", &[]).await?;
    let off = measure_each(off_stack, &traced, "export off").await?;
    let on_stack = fresh_stack(bin, &traced, channels, Some(&sink.endpoint), "info", &[]).await?;
    let on = measure_each(on_stack, &traced, "export on").await?;
    // The orchestrator was stopped, so its batch of spans was flushed.
    let spans = sink.spans();
    Ok(traced
        .iter()
        .zip(off.iter().zip(&on))
        .map(|(workload, (off, on))| TracingCost {
            workload: workload.name.clone(),
            cpu_per_turn_off_us: off.cpu_per_turn_us,
            cpu_per_turn_on_us: on.cpu_per_turn_us,
            overhead_p50_off_us: off.overhead_per_turn_us.p50,
            overhead_p50_on_us: on.overhead_per_turn_us.p50,
            spans_exported: spans,
        })
        .collect())
}

/// The floors beside the grid: one tonic round trip with nothing else running (the least a
/// turn can take: a model request and, with tools, a tool call), and raw tonic echo calls per
/// second at the dispatch row's concurrency (when that row ran).
pub(crate) async fn floors(stack: &stack::Stack, results: &[Measured]) -> anyhow::Result<(f64, Option<f64>)> {
    eprint!("bench: {:<20} … ", "round trip (c=1)");
    let round_trip_us = 1e6 / workload::echo_floor(&stack.runner, 1, 3000).await?;
    eprintln!("{round_trip_us:.0} µs");
    let Some(m) = find(results, "dispatch_x64") else {
        return Ok((round_trip_us, None));
    };
    eprint!("bench: {:<20} … ", "echo floor");
    let calls = (m.runs_ok * m.workload.calls_per_turn).max(1000);
    let floor = workload::echo_floor(&stack.runner, (m.workload.concurrency * 8).clamp(8, 512), calls).await?;
    eprintln!("{floor:.0} calls/s");
    Ok((round_trip_us, Some(floor)))
}
