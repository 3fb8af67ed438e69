//! What a turn of a long run costs (`bench --long-run 50`): one run on one orchestrator replica,
//! every turn reading a page of its own of `--long-run-page` bytes with the runner's `read_file`,
//! so its transcript grows by a page a turn (50 turns of 16 KiB: about 200k tokens). At each
//! `turn_finished` the orchestrator's CPU (its threads' scheduled time) and, on the NATS store,
//! the bytes nats-server took in (`/varz` `in_bytes`) are read: a turn's cost is the difference
//! from the turn before.
//!
//! Reported, early (turns 2–7) against late (the last six): the orchestrator's CPU per turn with
//! the memory store (the median of three runs: what building and sending a request costs as the
//! transcript grows), the same with the NATS store, and the store bytes per turn with the bytes a
//! turn added (the page and the model's words) — what a checkpoint of the whole transcript at
//! every safe point costs. Writes `long_run.md` / `.json`.

use std::path::Path;

use futures::StreamExt as _;
use mock_llm::{Scenario, Scenarios, Step, Turn};
use proto::orchestrator::v1 as pb;
use serde::Serialize;

use crate::procstat;
use crate::stack::{Launch, Stack, spawn};

/// Turns averaged at each end of the run.
const WINDOW: usize = 6;
/// Runs with the memory store, their median taken.
const MEMORY_RUNS: usize = 3;

/// A long run measured on one store.
#[derive(Debug, Serialize)]
pub(crate) struct Turns {
    /// Orchestrator CPU per turn (µs), turns 2–7.
    pub cpu_early_us: f64,
    /// Orchestrator CPU per turn (µs), the last six turns.
    pub cpu_late_us: f64,
    /// Store bytes per turn (KiB), turns 2–7 (NATS only).
    pub store_early_kib: Option<f64>,
    /// Store bytes per turn (KiB), the last six turns (NATS only).
    pub store_late_kib: Option<f64>,
    /// nats-server's CPU per turn (µs), turns 2–7 (NATS only).
    pub nats_cpu_early_us: Option<f64>,
    /// nats-server's CPU per turn (µs), the last six turns (NATS only).
    pub nats_cpu_late_us: Option<f64>,
}

/// What is read at each turn's end: the orchestrator's CPU (µs) and, on NATS, nats-server's bytes
/// in and its CPU (µs), so far.
struct Sample {
    cpu: f64,
    nats: Option<(f64, f64)>,
}

/// The report.
#[derive(Debug, Serialize)]
pub(crate) struct LongRun {
    pub turns: usize,
    pub page_bytes: usize,
    /// What one turn adds to the transcript (the page, the model's words and the call), bytes.
    pub added_per_turn_bytes: usize,
    pub memory: Turns,
    /// Late CPU per turn over early, memory store: the goal is at most 1.2.
    pub memory_cpu_ratio: f64,
    /// `None`: nats-server is not installed (the reason is in the markdown).
    pub nats: Option<Turns>,
    /// Late store bytes per turn over early: the goal is at most 1.5.
    pub store_ratio: Option<f64>,
    /// Late store bytes per turn over the bytes a turn added: the goal is at most 4.
    pub store_amplification: Option<f64>,
    /// NATS-store CPU per turn over memory-store CPU per turn, early turns.
    pub durable_cpu_ratio: Option<f64>,
}

/// The model's script: `turns - 1` turns each reading a page of its own, then an answer.
fn scenario(turns: usize) -> Scenario {
    let mut script: Vec<Turn> = (1..turns)
        .map(|n| Turn::text(&said(n)).then(Step::call("read_file", read_page(n))))
        .collect();
    script.push(Turn::text("Done."));
    Scenario::new(script)
}

/// What the model says in turn `turn`.
fn said(turn: usize) -> String {
    format!("Reading the next page, turn {turn}.")
}

/// The arguments of turn `turn`'s call.
fn read_page(turn: usize) -> serde_json::Value {
    serde_json::json!({ "path": page_name(turn) })
}

fn page_name(turn: usize) -> String {
    format!("page-{turn}.txt")
}

/// The page turn `turn` reads: `bytes` of words in an order of its own, so no two pages (and no
/// two stretches of one) are alike, as the results of a real run's calls are not.
fn page(turn: usize, bytes: usize) -> String {
    const WORDS: [&str; 8] = ["quick", "brown", "fox", "jumps", "over", "the", "lazy", "dog"];
    let mut rng = fastrand::Rng::with_seed(turn as u64);
    let mut page = String::with_capacity(bytes + 8);
    while page.len() < bytes {
        page.push_str(WORDS[rng.usize(..WORDS.len())]);
        page.push(' ');
    }
    page.truncate(bytes);
    page
}

fn request(run_id: String, turns: usize) -> anyhow::Result<pb::OrchestrateRequest> {
    let turns = u32::try_from(turns)?;
    Ok(pb::OrchestrateRequest {
        run_id,
        messages: vec![pb::ChatMessage {
            role: "user".into(),
            content: "Read the page until you are done.".into(),
            ..Default::default()
        }],
        tools: Some(pb::ToolSelection {
            normal: vec!["read_file".into()],
            ..Default::default()
        }),
        limits: Some(pb::RunLimits {
            max_turns: Some(turns),
            tool_call_budget: Some(turns),
            ..Default::default()
        }),
        ..Default::default()
    })
}

/// The model, a runner in this process reading from `sandbox`, and an orchestrator with `flags`.
async fn stack(bin: &Path, sandbox: &Path, turns: usize, flags: &[&str]) -> anyhow::Result<Stack> {
    let mock = mock_llm::MockLlm::start_timed(Scenarios::from(scenario(turns))).await?;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let runner = format!("http://{}", listener.local_addr()?);
    let mut config = tool_runner::Config::default();
    config.builtins.sandbox_root = Some(sandbox.to_owned());
    tokio::spawn(tool_runner::serve(listener, config, std::future::pending()));
    let launch = Launch {
        bin: bin.to_owned(),
        model_url: mock.base_url(),
        runner: runner.clone(),
        otlp: None,
        rust_log: "warn".into(),
        extra: flags.iter().map(|f| (*f).to_owned()).collect(),
        env: Vec::new(),
    };
    let process = spawn(&launch, "127.0.0.1:0").await?;
    Stack::of(mock, runner, process)
}

/// One run of `turns` turns on `stack`: at each turn's end, a [`Sample`] (nats-server's part with
/// `nats`).
async fn one_run(
    stack: &Stack,
    run_id: &str,
    turns: usize,
    nats: Option<&testkit::nats::Nats>,
) -> anyhow::Result<Vec<Sample>> {
    let mut client = stack.client(0);
    let mut events = client
        .orchestrate(request(run_id.to_owned(), turns)?)
        .await?
        .into_inner();
    let mut samples = vec![sample(stack.pid, nats).await?];
    while let Some(event) = events.next().await {
        match event?.event {
            Some(pb::orchestrate_event::Event::TurnFinished(_)) => samples.push(sample(stack.pid, nats).await?),
            Some(pb::orchestrate_event::Event::RunFinished(finished)) => {
                let status = finished.result.map(|r| r.status);
                anyhow::ensure!(
                    status == Some(pb::RunStatus::Completed as i32),
                    "the long run ended {status:?}"
                );
            }
            _ => {}
        }
    }
    anyhow::ensure!(samples.len() > turns, "{} turns ended of {turns}", samples.len() - 1);
    Ok(samples)
}

/// The [`Sample`] of now (the orchestrator's pid `pid`).
async fn sample(pid: u32, nats: Option<&testkit::nats::Nats>) -> anyhow::Result<Sample> {
    let cpu = procstat::scheduled_time(pid)?.as_secs_f64() * 1e6;
    let nats = match nats {
        Some(nats) => {
            let varz = nats.varz().await?;
            let bytes = varz.get("in_bytes").and_then(serde_json::Value::as_f64);
            let server = nats.pid().ok_or_else(|| anyhow::anyhow!("nats-server has no pid"))?;
            let server_cpu = procstat::scheduled_time(server)?.as_secs_f64() * 1e6;
            Some((
                bytes.ok_or_else(|| anyhow::anyhow!("/varz has no in_bytes"))?,
                server_cpu,
            ))
        }
        None => None,
    };
    Ok(Sample { cpu, nats })
}

/// The mean per-turn difference of `values` (one per turn end, the start first) over turns
/// `from..from + WINDOW` (1-based turns).
fn per_turn(values: &[f64], from: usize) -> f64 {
    let (start, end) = (from - 1, (from - 1 + WINDOW).min(values.len() - 1));
    (values[end] - values[start]) / (end - start).max(1) as f64
}

/// Early and late figures of one run's samples.
fn turns_of(samples: &[Sample]) -> Turns {
    let late = samples.len().saturating_sub(WINDOW).max(2);
    let cpu: Vec<f64> = samples.iter().map(|s| s.cpu).collect();
    let bytes: Option<Vec<f64>> = samples.iter().map(|s| s.nats.map(|n| n.0)).collect();
    let server: Option<Vec<f64>> = samples.iter().map(|s| s.nats.map(|n| n.1)).collect();
    Turns {
        cpu_early_us: per_turn(&cpu, 2),
        cpu_late_us: per_turn(&cpu, late),
        store_early_kib: bytes.as_ref().map(|b| per_turn(b, 2) / 1024.0),
        store_late_kib: bytes.as_ref().map(|b| per_turn(b, late) / 1024.0),
        nats_cpu_early_us: server.as_ref().map(|c| per_turn(c, 2)),
        nats_cpu_late_us: server.as_ref().map(|c| per_turn(c, late)),
    }
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values.get(values.len() / 2).copied().unwrap_or(0.0)
}

/// Measures a run of `turns` turns reading a page of `page_bytes`, on the memory store and (when
/// nats-server is installed) on NATS; writes the report.
pub(crate) async fn run(bin: &Path, turns: usize, page_bytes: usize, out: &Path) -> anyhow::Result<()> {
    anyhow::ensure!(turns > 2 * WINDOW, "--long-run needs more than {} turns", 2 * WINDOW);
    let sandbox = tempfile::tempdir()?;
    for n in 1..turns {
        std::fs::write(sandbox.path().join(page_name(n)), page(n, page_bytes))?;
    }

    eprint!("bench: long-run {turns} turns of a {page_bytes}-byte page, memory store … ");
    let memory = stack(bin, sandbox.path(), turns, &[]).await?;
    let mut runs = Vec::new();
    for n in 0..MEMORY_RUNS {
        runs.push(turns_of(&one_run(&memory, &format!("long-{n}"), turns, None).await?));
    }
    memory.stop().await;
    let memory = Turns {
        cpu_early_us: median(runs.iter().map(|t| t.cpu_early_us).collect()),
        cpu_late_us: median(runs.iter().map(|t| t.cpu_late_us).collect()),
        store_early_kib: None,
        store_late_kib: None,
        nats_cpu_early_us: None,
        nats_cpu_late_us: None,
    };
    eprintln!("{:.0} → {:.0} µs/turn", memory.cpu_early_us, memory.cpu_late_us);

    let (nats, reason) = match testkit::nats::Nats::start_monitored().await {
        Ok(server) => {
            eprint!("bench: long-run on the NATS store … ");
            let durable = stack(bin, sandbox.path(), turns, &["--run-store", &server.url()]).await?;
            let samples = one_run(&durable, "long-nats", turns, Some(&server)).await?;
            durable.stop().await;
            let measured = turns_of(&samples);
            eprintln!(
                "{:.0} → {:.0} KiB/turn in the store",
                measured.store_early_kib.unwrap_or(0.0),
                measured.store_late_kib.unwrap_or(0.0)
            );
            (Some(measured), String::new())
        }
        Err(e) => (None, format!("NATS not measured: {e}")),
    };
    // The page, the model's words and its call, as the transcript holds them.
    let added = page_bytes + said(10).len() + read_page(10).to_string().len();
    let added_kib = added as f64 / 1024.0;
    let report = LongRun {
        turns,
        page_bytes,
        added_per_turn_bytes: added,
        memory_cpu_ratio: memory.cpu_late_us / memory.cpu_early_us.max(1.0),
        store_ratio: nats
            .as_ref()
            .and_then(|n| Some(n.store_late_kib? / n.store_early_kib?.max(0.001))),
        store_amplification: nats.as_ref().and_then(|n| Some(n.store_late_kib? / added_kib)),
        durable_cpu_ratio: nats.as_ref().map(|n| n.cpu_early_us / memory.cpu_early_us.max(1.0)),
        memory,
        nats,
    };
    std::fs::create_dir_all(out)?;
    std::fs::write(out.join("long_run.json"), serde_json::to_string_pretty(&report)?)?;
    std::fs::write(out.join("long_run.md"), markdown(&report, &reason))?;
    eprintln!("bench: wrote {}", out.join("long_run.md").display());
    Ok(())
}

fn markdown(r: &LongRun, reason: &str) -> String {
    let mut s = format!(
        "# A long run, turn by turn\n\n`cargo run --release -p bench -- --long-run {} --long-run-page {}`: one run, every \
         turn reading a {}-byte page of its own, so the transcript grows by {} bytes a turn. Early is turns 2–{}, late the \
         last {WINDOW}. CPU is the orchestrator's; on NATS, nats-server's beside it.\n\n| store | CPU/turn early (µs) | CPU/turn late (µs) | late/early | store KiB/turn early | store KiB/turn late | late/early | late/added | nats-server CPU/turn early / late (µs) |\n\
         |---|---:|---:|---:|---:|---:|---:|---:|---:|\n",
        r.turns,
        r.page_bytes,
        r.page_bytes,
        r.added_per_turn_bytes,
        WINDOW + 1
    );
    s.push_str(&format!(
        "| memory (median of {MEMORY_RUNS}) | {:.0} | {:.0} | {:.2} | – | – | – | – | – |\n",
        r.memory.cpu_early_us, r.memory.cpu_late_us, r.memory_cpu_ratio
    ));
    match &r.nats {
        Some(n) => s.push_str(&format!(
            "| NATS | {:.0} | {:.0} | {:.2} | {:.1} | {:.1} | {:.2} | {:.1} | {:.0} / {:.0} |\n",
            n.cpu_early_us,
            n.cpu_late_us,
            n.cpu_late_us / n.cpu_early_us.max(1.0),
            n.store_early_kib.unwrap_or(0.0),
            n.store_late_kib.unwrap_or(0.0),
            r.store_ratio.unwrap_or(0.0),
            r.store_amplification.unwrap_or(0.0),
            n.nats_cpu_early_us.unwrap_or(0.0),
            n.nats_cpu_late_us.unwrap_or(0.0)
        )),
        None => s.push_str(&format!("\n{reason}\n")),
    }
    s.push_str(
        "\nGoals: CPU per turn late ≤ 1.2× early (memory store); store bytes per turn late ≤ 1.5× early and ≤ 4× \
         what the turn added.\n",
    );
    s
}
