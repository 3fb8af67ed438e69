//! `bench`: measures what the orchestrator itself costs. It starts the stand-in model and a
//! tool-runner in this process and the orchestrator as its own process (release build), drives a
//! grid of workloads through the real gRPC API, reads the orchestrator's CPU time and memory from
//! `/proc`, measures the baselines (the model called directly; a raw tonic echo loop to the
//! tool-runner), checks the performance targets, and writes `bench/results/<name>.md` and `.json`.
//!
//! `cargo run --release -p bench` runs the full grid (minutes); `--quick` a small one (seconds,
//! run in CI so the benchmark cannot rot).

mod admission;
mod approvals;
mod durability;
mod fence;
mod fleet;
mod floor;
mod listing;
mod long_run;
mod micro;
mod otlp;
mod paced;
mod peers;
mod pending;
mod procstat;
mod quiet;
mod real_server;
mod relay;
mod replicas;
mod shards;
mod soak;
mod stack;
mod takeover;
mod tasks;
mod workload;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use clap::Parser;
use mock_llm::Scenarios;
use serde::Serialize;
use workload::{Tool, Workload, quantile};

/// Benchmark of the orchestrator.
#[derive(Parser)]
#[command(name = "bench", about)]
struct Cli {
    /// A small grid that runs in seconds (CI); the full grid otherwise.
    #[arg(long)]
    quick: bool,
    /// The orchestrator binary (default: next to this binary).
    #[arg(long)]
    orchestrator_bin: Option<PathBuf>,
    /// Where the report goes.
    #[arg(long, default_value = "bench/results")]
    out: PathBuf,
    /// Only these workloads (comma-separated names, the real-server row's among them); the report
    /// is then written as `partial.*`.
    #[arg(long, value_delimiter = ',')]
    only: Vec<String>,
    /// The real-server row (`llama_server_text`: the same prompt through the orchestrator and
    /// directly to llama-server): `auto` runs it when `./scripts/model-servers` has installed
    /// llama-server and says why not otherwise, `require` fails without it, `skip` never runs it.
    #[arg(long, value_enum, default_value_t = RealServerMode::Auto)]
    real_server: RealServerMode,
    /// Skip the tracing comparison (the same workloads with OTLP export off and on).
    #[arg(long)]
    no_tracing: bool,
    /// Skip the durability comparison (the same workloads with the memory and the NATS store).
    #[arg(long)]
    no_durability: bool,
    /// Run each workload this many times (1–9) and report the run with the median CPU per turn,
    /// with the range seen: on a shared machine one run can be 30 % off.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=9))]
    repeat: u32,
    /// Instead of the grid: a soak of this many runs (1–10000000) with faults injected, checked
    /// run by run (see `--soak-fault-rate`); writes `soak.md` / `soak.json`.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=10_000_000))]
    soak: Option<u64>,
    /// Share of the soak's runs that get a fault (0–1).
    #[arg(long, default_value_t = 0.05)]
    soak_fault_rate: f64,
    /// The soak's result store: `memory`, or `nats` (a `nats-server -js` the benchmark starts; the
    /// results in its key-value bucket and every run's events in its JetStream event log).
    #[arg(long, value_parser = ["memory", "nats"], default_value = "memory")]
    soak_store: String,
    /// With `--soak-store nats`: the run store spread over this many shards
    /// (`--run-store-shards`, 1–64).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=64))]
    soak_shards: u64,
    /// Soak runs at once (1–10000).
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u64).range(1..=10_000))]
    soak_concurrency: u64,
    /// With `--soak-store nats`: run the soak on three replicas and, every this long (e.g. `3s`),
    /// one of them in turn is killed, drained, cut off from NATS or paused (SIGSTOP) for three
    /// seconds, in that order (a killed or drained one is replaced), while callers follow their
    /// runs across replicas.
    #[arg(long, value_parser = humantime::parse_duration)]
    soak_replica_faults: Option<Duration>,
    /// Instead of the grid: the paced relay (one turn of streamed text at each stream interval;
    /// CPU and wake-ups per token, time to first token); writes `paced.md` / `paced.json`.
    #[arg(long)]
    paced: bool,
    /// The paced relay with its peers on the same stand-in model in the same run (so far the
    /// LiteLLM proxy, from the test cache), each figure as a ratio to theirs.
    #[arg(long)]
    peers: bool,
    /// Instead of the grid: the model's time on two real llama-servers, sticky against round
    /// robin, and the transcript's prefix replayed with and without the per-turn BIOS line;
    /// writes `fleet.md` / `fleet.json` (needs `./scripts/model-servers`).
    #[arg(long)]
    fleet: bool,
    /// Instead of the grid: this many runs (1–100000) parked waiting for approvals at once on 16
    /// run slots, with the memory and the NATS store: RSS per parked run, then every call
    /// approved; writes `approvals.md` / `approvals.json`.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=100_000))]
    approvals: Option<u64>,
    /// Instead of the grid: this many runs (1–10000) each waiting on a task its MCP server runs
    /// (the tests' FastMCP server, installed by ./scripts/mcp-servers), parked on 16 run slots:
    /// RSS per parked run, then every run completed; writes `tasks.md` / `tasks.json`.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=10_000))]
    tasks: Option<u64>,
    /// Instead of the grid: this many `RunTool` calls (100–1000000) to a runner without and with
    /// the run fence (a NATS on loopback, `nats-server` on the PATH), beside one bare key-value
    /// read; writes `fence.md` / `fence.json`.
    #[arg(long, value_parser = clap::value_parser!(u64).range(100..=1_000_000))]
    fence: Option<u64>,
    /// Instead of the grid: this many ended runs (100–1000000) stored in a NATS (`nats-server`
    /// on the PATH), then the latency of `ListRuns` pages of 50 for several queries beside one
    /// `GetRun`; writes `list_runs.md` / `list_runs.json`.
    #[arg(long, value_parser = clap::value_parser!(u64).range(100..=1_000_000))]
    list_runs: Option<u64>,
    /// Instead of the grid: this many one-turn runs (10–100000) one after the other with the
    /// memory and the NATS store, by a caller without and with a max_runs: admission time and
    /// CPU per run; writes `admission.md` / `admission.json`.
    #[arg(long, value_parser = clap::value_parser!(u64).range(10..=100_000))]
    admission: Option<u64>,
    /// Instead of the grid: this many waits of other principals (10–100000) parked in a NATS
    /// (`nats-server` on the PATH) beside one of alice's, then the store messages and time of
    /// her `ListPendingApprovals` beside an approver's; writes `pending_approvals.md` / `.json`.
    #[arg(long, value_parser = clap::value_parser!(u64).range(10..=100_000))]
    pending_approvals: Option<u64>,
    /// Instead of the grid: for each of these counts of durable runs (1–100000 each), every run
    /// waiting on a long tool call on one replica and one nats-server (on the PATH): the store's
    /// messages, the orchestrator's CPU and RSS per quiet run per second over `--idle-window`;
    /// fails above 0.01 store requests per quiet run per second. Writes `idle_cost.md` / `.json`.
    #[arg(long, value_delimiter = ',', value_parser = clap::value_parser!(u64).range(1..=100_000))]
    idle_cost: Vec<u64>,
    /// The quiet window `--idle-cost` measures (1s–10m).
    #[arg(long, default_value = "20s", value_parser = one_second_to_ten_minutes)]
    idle_window: Duration,
    /// Instead of the grid: this many durable runs (10–100000) waiting on a long tool call on
    /// one replica of two sharing one nats-server (on the PATH); that replica SIGKILLed, the
    /// time until the other runs every one again and the store requests per run taken over.
    /// Writes `takeover.md` / `.json`.
    #[arg(long, value_parser = clap::value_parser!(u64).range(10..=100_000))]
    takeover_quiet: Option<u64>,
    /// Instead of the grid: one run of this many turns (13–128), each reading a page of
    /// `--long-run-page` bytes, on the memory store and on NATS (nats-server on the PATH): the
    /// orchestrator's CPU and the store's bytes per turn, early against late. Writes
    /// `long_run.md` / `.json`.
    #[arg(long, value_parser = clap::value_parser!(u64).range(13..=128))]
    long_run: Option<u64>,
    /// The page `--long-run` reads each turn, in bytes (1–1048576).
    #[arg(long, default_value_t = 16_384, value_parser = clap::value_parser!(u64).range(1..=1_048_576))]
    long_run_page: u64,
    /// The run-store lease of `--takeover-quiet`'s replicas (1s–10m; the orchestrator's default).
    #[arg(long, default_value = "15s", value_parser = one_second_to_ten_minutes)]
    takeover_lease: Duration,
    /// Instead of the grid: the same durable workload with the run store in each of these
    /// numbers of shards (1–64, e.g. `1,4`), each on fresh JetStream clusters of three and six
    /// nodes (nats-server on the PATH): turns per second and every node's CPU per turn. Writes
    /// `shards.md` / `.json`.
    #[arg(long, value_delimiter = ',', value_parser = clap::value_parser!(u64).range(1..=64))]
    shards: Vec<u64>,
    /// Runs of each `--shards` count (8 turns each; 10–100000).
    #[arg(long, default_value_t = 400, value_parser = clap::value_parser!(u64).range(10..=100_000))]
    shard_runs: u64,
}

/// A duration of 1s to 10m (a window or a lease of the bench).
fn one_second_to_ten_minutes(s: &str) -> Result<Duration, String> {
    let window = humantime::parse_duration(s).map_err(|e| e.to_string())?;
    match (Duration::from_secs(1)..=Duration::from_secs(600)).contains(&window) {
        true => Ok(window),
        false => Err(format!("{s}: between 1s and 10m")),
    }
}

/// Whether the real-server row runs.
#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum RealServerMode {
    Auto,
    Require,
    Skip,
}

/// The real-server row, or why it did not run.
#[derive(Serialize)]
#[serde(rename_all = "snake_case")]
enum RealServerOutcome {
    Measured(real_server::RealServerRow),
    NotRun(String),
}

/// Whether to run the real-server row: `Err` when `--real-server require` cannot be met, the
/// reason it will not run as `Ok(Some(…))`, or `Ok(None)` to run it.
fn real_server_skip_reason(cli: &Cli) -> anyhow::Result<Option<String>> {
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

/// `--soak`: the soak instead of the grid; exits 1 when a check fails.
async fn soak(cli: &Cli, bin: &std::path::Path, runs: u64) -> anyhow::Result<()> {
    anyhow::ensure!(
        (0.0..=1.0).contains(&cli.soak_fault_rate),
        "--soak-fault-rate {} must be from 0 to 1",
        cli.soak_fault_rate
    );
    let concurrency = usize::try_from(cli.soak_concurrency)?;
    let nats = match cli.soak_store.as_str() {
        "nats" => Some(testkit::nats::Nats::start().await?),
        _ => None,
    };
    let mut flags: Vec<String> = soak::FLAGS.iter().map(|f| (*f).to_owned()).collect();
    if cli.soak_shards > 1 {
        anyhow::ensure!(nats.is_some(), "--soak-shards needs --soak-store nats");
        flags.extend(["--run-store-shards".to_owned(), cli.soak_shards.to_string()]);
    }
    let settings = soak::Soak {
        runs,
        store: cli.soak_store.clone(),
        fault_rate: cli.soak_fault_rate,
        concurrency,
    };
    let passed = match cli.soak_replica_faults {
        None => {
            let mut flags: Vec<&str> = flags.iter().map(String::as_str).collect();
            let url = nats.as_ref().map(testkit::nats::Nats::url);
            if let Some(url) = &url {
                flags.extend(["--run-store", url]);
            }
            let stack = stack::Stack::start(
                bin,
                soak::scenarios(runs),
                concurrency.div_ceil(50),
                None,
                "warn,shared::metrics=info",
                &flags,
                &[],
            )
            .await?;
            eprintln!(
                "bench: soak of {runs} runs, {} at once, {} store, orchestrator pid {}",
                concurrency, cli.soak_store, stack.pid
            );
            let passed = settings.run(soak::Target::One(&stack), &cli.out).await;
            stack.stop().await;
            passed
        }
        Some(every) => {
            let Some(nats) = &nats else {
                anyhow::bail!("--soak-replica-faults needs --soak-store nats");
            };
            let nats: std::net::SocketAddr = nats.url().trim_start_matches("nats://").parse()?;
            anyhow::ensure!(
                every >= Duration::from_millis(100),
                "--soak-replica-faults {} is too often (at least 100ms)",
                humantime::format_duration(every)
            );
            let channels = concurrency.div_ceil(50);
            let fleet = replicas::Replicas::start(bin, soak::scenarios(runs), 3, channels, &flags, nats).await?;
            eprintln!(
                "bench: soak of {runs} runs, {concurrency} at once, on 3 replicas (NATS store, {} shard(s)), one killed, drained, cut off from NATS or paused every {}",
                cli.soak_shards,
                humantime::format_duration(every)
            );
            let passed = settings.run(soak::Target::Fleet(&fleet, every), &cli.out).await;
            fleet.stop().await;
            passed
        }
    };
    // Stopped before exiting: `exit` would skip its drop and leave it running.
    drop(nats);
    if !passed? {
        eprintln!("bench: the soak FAILED (see {})", cli.out.join("soak.md").display());
        std::process::exit(1);
    }
    Ok(())
}

/// One workload with OTLP export off and on.
#[derive(Debug, Serialize)]
struct TracingCost {
    workload: String,
    cpu_per_turn_off_us: f64,
    cpu_per_turn_on_us: f64,
    overhead_p50_off_us: f64,
    overhead_p50_on_us: f64,
    spans_exported: usize,
}

/// Measurements of one workload.
#[derive(Debug, Serialize)]
struct Measured {
    workload: Workload,
    runs_ok: usize,
    errors: usize,
    wall_s: f64,
    runs_per_s: f64,
    tool_calls_per_s: f64,
    /// Run wall time minus what the model and tools were scripted to take, per turn.
    overhead_per_turn_us: Quantiles,
    /// Wall time of the first turn (for the parallel-calls target).
    first_turn_ms: Quantiles,
    orchestrator_cpu_s: f64,
    cpu_per_turn_us: f64,
    /// Lowest and highest CPU per turn over the repeats (`--repeat`).
    cpu_per_turn_range_us: (f64, f64),
    cpu_per_tool_call_us: Option<f64>,
    peak_rss_mib: f64,
    rss_per_in_flight_run_kib: f64,
    /// The model called directly for the same streams and pacing (workloads whose model takes
    /// time): each "run"'s wall time.
    model_direct_ms: Option<Quantiles>,
    /// Each run's wall time through the orchestrator.
    run_ms: Quantiles,
    /// Run wall time minus the time the stand-in model took serving the run's requests (measured
    /// at the model, from each request's arrival to its last byte) and the tools' scripted time,
    /// per turn. Unlike `overhead_per_turn_us` this does not count the stand-in model's own timer
    /// lateness (up to ~1 ms per scripted delay, more when the machine is busy).
    overhead_vs_served_per_turn_us: Quantiles,
    /// Orchestrator CPU per run against the target budget (150 µs per turn + 50 µs per normal
    /// tool call): 1.0 spends exactly the budget.
    cpu_vs_budget: f64,
    /// The figure against its floor: run time vs the model alone (model delays), first turn vs
    /// the slowest call (parallel calls), calls/s vs the raw tonic echo (dispatch).
    vs_floor: Option<String>,
}

#[derive(Debug, Serialize, Default)]
struct Quantiles {
    p50: f64,
    p99: f64,
    max: f64,
}

fn quantiles(values: &[Duration], unit: f64) -> Quantiles {
    Quantiles {
        p50: quantile(values, 0.5).as_secs_f64() * unit,
        p99: quantile(values, 0.99).as_secs_f64() * unit,
        max: quantile(values, 1.0).as_secs_f64() * unit,
    }
}

/// One performance target and whether it was met.
#[derive(Debug, Serialize)]
struct Target {
    what: String,
    limit: String,
    measured: String,
    met: bool,
}

fn grid(quick: bool) -> Vec<Workload> {
    let q = |full: usize, quick_value: usize| if quick { quick_value } else { full };
    let base = Workload::base();
    vec![
        Workload {
            name: "text_only".into(),
            concurrency: q(100, 10),
            runs: q(5000, 200),
            ..base.clone()
        },
        Workload {
            name: "overhead_c1_x4".into(),
            concurrency: 1,
            runs: q(300, 30),
            tool_turns: 1,
            calls_per_turn: 4,
            exit_calls: 1,
            ..base.clone()
        },
        Workload {
            name: "overhead_c1000_x4".into(),
            concurrency: q(1000, 50),
            runs: q(5000, 200),
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
            concurrency: q(1000, 50),
            runs: q(3000, 150),
            tool_turns: 1,
            calls_per_turn: 4,
            exit_calls: 1,
            ttft_ms: q(2000, 200) as u64,
            paced: true,
            ..base.clone()
        },
        Workload {
            name: "turns8_x1".into(),
            concurrency: q(100, 10),
            runs: q(500, 40),
            tool_turns: 7,
            calls_per_turn: 1,
            ..base.clone()
        },
        Workload {
            name: "dispatch_x64".into(),
            concurrency: q(100, 10),
            runs: q(500, 20),
            tool_turns: 1,
            calls_per_turn: 64,
            ..base.clone()
        },
        Workload {
            // The target's case: one run's 16 calls in parallel, nothing else competing.
            name: "parallel_16x100ms".into(),
            concurrency: 1,
            runs: q(50, 5),
            tool_turns: 1,
            calls_per_turn: 16,
            tool: Tool::Sleep(100),
            ..base.clone()
        },
        Workload {
            // The same under load: 20 such runs (320 calls) at once, started together.
            name: "parallel_16x100ms_c20".into(),
            concurrency: q(20, 5),
            runs: q(200, 10),
            tool_turns: 1,
            calls_per_turn: 16,
            tool: Tool::Sleep(100),
            ..base.clone()
        },
        Workload {
            name: "hold_c10000".into(),
            concurrency: q(10_000, 200),
            runs: q(10_000, 200),
            ttft_ms: if quick { 1000 } else { 4000 },
            ..base.clone()
        },
        Workload {
            name: "e2e_200ms_20ms".into(),
            concurrency: q(10, 4),
            runs: q(50, 8),
            tool_turns: 1,
            calls_per_turn: 1,
            text_words: q(50, 10),
            ttft_ms: if quick { 50 } else { 200 },
            token_delay_ms: if quick { 5 } else { 20 },
            ..base
        },
    ]
}

async fn measure(stack: &stack::Stack, workload: &Workload) -> anyhow::Result<Measured> {
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
fn median_run(mut repeats: Vec<Measured>) -> Measured {
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

fn find<'a>(results: &'a [Measured], name: &str) -> Option<&'a Measured> {
    results.iter().find(|m| m.workload.name == name)
}

fn targets(results: &mut [Measured], echo_floor: Option<f64>) -> Vec<Target> {
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
fn derive_figures(results: &mut [Measured], echo_floor: Option<f64>) {
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
fn cost_targets(
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
fn latency_targets(results: &[Measured], push: &mut impl FnMut(&str, String, String, bool)) {
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
struct Baselines {
    /// Raw tonic unary echo calls per second to the tool-runner (many at once).
    echo_floor_calls_per_s: Option<f64>,
    /// One raw tonic unary echo round trip, one at a time (µs).
    round_trip_us: f64,
}

fn markdown(results: &[Measured], targets: &[Target], baselines: &Baselines, quick: bool, repeat: u32) -> String {
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

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    stack::raise_open_files();
    let bin = match cli.orchestrator_bin.clone() {
        Some(bin) => bin,
        None => std::env::current_exe()?.with_file_name("orchestrator"),
    };
    anyhow::ensure!(
        bin.exists(),
        "{} is missing: cargo build --release -p orchestrator (or pass --orchestrator-bin)",
        bin.display()
    );
    if one_measurement(&cli, &bin).await? || one_store_measurement(&cli, &bin).await? {
        return Ok(());
    }
    run_grid(&cli, &bin).await
}

/// Runs the measurement a flag asks for instead of the grid (soak, relay, fleet, parking, fence,
/// admission); whether one did.
async fn one_measurement(cli: &Cli, bin: &Path) -> anyhow::Result<bool> {
    let out = &cli.out;
    if let Some(runs) = cli.soak {
        soak(cli, bin, runs).await?;
    } else if cli.paced || cli.peers {
        paced::run(bin, cli.quick, cli.peers, out).await?;
    } else if cli.fleet {
        fleet::run(bin, cli.quick, out).await?;
    } else if let Some(runs) = cli.approvals {
        approvals::run(bin, usize::try_from(runs)?, out).await?;
    } else if let Some(runs) = cli.tasks {
        tasks::run(bin, usize::try_from(runs)?, out).await?;
    } else if let Some(calls) = cli.fence {
        fence::run(usize::try_from(calls)?, out).await?;
    } else if let Some(runs) = cli.admission {
        admission::run(bin, usize::try_from(runs)?, out).await?;
    } else {
        return Ok(false);
    }
    Ok(true)
}

/// Runs the durable-store measurement a flag asks for instead of the grid (a long run, listing,
/// quiet runs, shards, takeover, pending approvals); whether one did.
async fn one_store_measurement(cli: &Cli, bin: &Path) -> anyhow::Result<bool> {
    let out = &cli.out;
    let counts = |values: &[u64]| {
        values
            .iter()
            .map(|&n| usize::try_from(n))
            .collect::<Result<Vec<_>, _>>()
    };
    if let Some(turns) = cli.long_run {
        long_run::run(bin, usize::try_from(turns)?, usize::try_from(cli.long_run_page)?, out).await?;
    } else if let Some(runs) = cli.list_runs {
        listing::run(bin, usize::try_from(runs)?, out).await?;
    } else if !cli.idle_cost.is_empty() {
        quiet::run(bin, &counts(&cli.idle_cost)?, cli.idle_window, out).await?;
    } else if !cli.shards.is_empty() {
        shards::run(bin, &counts(&cli.shards)?, usize::try_from(cli.shard_runs)?, out).await?;
    } else if let Some(runs) = cli.takeover_quiet {
        takeover::run(bin, usize::try_from(runs)?, cli.takeover_lease, out).await?;
    } else if let Some(waits) = cli.pending_approvals {
        pending::run(usize::try_from(waits)?, out).await?;
    } else {
        return Ok(false);
    }
    Ok(true)
}

/// The grid of workloads on one orchestrator, then tracing, durability and the real server.
async fn run_grid(cli: &Cli, bin: &Path) -> anyhow::Result<()> {
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

/// The grid, or the rows `--only` names (an unknown name is an error listing the known ones).
fn selected_workloads(cli: &Cli) -> anyhow::Result<Vec<Workload>> {
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

/// One row measured `repeat` times; the median run is kept.
async fn measure_repeated(stack: &stack::Stack, workload: &Workload, repeat: u32) -> anyhow::Result<Measured> {
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

/// The floors beside the grid: one tonic round trip with nothing else running (the least a
/// turn can take: a model request and, with tools, a tool call), and raw tonic echo calls per
/// second at the dispatch row's concurrency (when that row ran).
async fn floors(stack: &stack::Stack, results: &[Measured]) -> anyhow::Result<(f64, Option<f64>)> {
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

/// The real-model-server row: the same requests to llama-server directly and through the
/// orchestrator.
async fn measure_real_server(bin: &std::path::Path, quick: bool) -> anyhow::Result<real_server::RealServerRow> {
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

/// A fresh orchestrator playing `workloads` (and the demo by default), started with `otlp`,
/// `rust_log` and `extra` flags.
async fn fresh_stack(
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

/// Each of `workloads` measured on `stack` (`label` in the progress lines), which is then stopped.
async fn measure_each(stack: stack::Stack, workloads: &[&Workload], label: &str) -> anyhow::Result<Vec<Measured>> {
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

/// The traced workloads on a fresh orchestrator with OTLP export off, then on.
async fn tracing_costs(
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

/// Everything one grid run measured.
struct GridRun {
    results: Vec<Measured>,
    echo_floor: Option<f64>,
    round_trip_us: f64,
    sse: micro::SseDecode,
    tracing_costs: Vec<TracingCost>,
    durability_costs: Result<Vec<durability::DurabilityCost>, String>,
    real_server: RealServerOutcome,
}

/// Checks the targets and writes the report (`latest`, `quick` or `partial` `.md` / `.json`).
fn write_report(cli: &Cli, run: GridRun) -> anyhow::Result<()> {
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
