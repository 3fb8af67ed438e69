//! `bench --paced`: what relaying streamed text costs. One turn of `tokens` tokens, one SSE event
//! each, `pace` apart (the stand-in model), `concurrency` runs at once, through the orchestrator at
//! each stream interval; per token relayed, the CPU of the orchestrator's threads and how many times
//! they were switched in (from `/proc/<pid>/task/*/schedstat`), and the time to first token through
//! the orchestrator beside the model's own (the model called directly, as many at once). Writes
//! `paced.md` and `paced.json`.

use std::time::{Duration, Instant};

use futures::StreamExt;
use proto::orchestrator::v1 as pb;
use serde::Serialize;

use crate::procstat;
use crate::relay::{MODEL, Paced, text_chunks};
use crate::stack::{Stack, Target};
use crate::workload::quantile;

/// One stream interval, measured.
#[derive(Debug, Serialize)]
pub(crate) struct Row {
    /// Which orchestrator: `default`, or a variant's label.
    pub setup: String,
    pub interval_ms: u32,
    pub tokens_relayed: u64,
    pub cpu_us_per_token: f64,
    pub switches_per_token: f64,
    /// Text events a run's caller received (one per token without gathering).
    pub text_events_per_run: f64,
    pub ttft_p50_ms: f64,
    pub ttft_p99_ms: f64,
    pub runs_failed: usize,
}

/// The report.
#[derive(Debug, Serialize)]
pub(crate) struct Report {
    pub workload: Paced,
    pub cores: usize,
    /// The model's own time to first token, called directly, as many at once.
    pub model_ttft_p50_ms: f64,
    pub model_ttft_p99_ms: f64,
    /// The orchestrator as shipped, at every interval.
    pub rows: Vec<Row>,
    /// Other shapes of it in the same run (at 0 and 20 ms): the baseline and the costs of options.
    pub variants: Vec<Row>,
    /// Variants that could not be measured, and why.
    pub variants_not_run: Vec<String>,
    /// The peers (`--peers`), on the same stand-in model after the orchestrator.
    pub peers: Vec<crate::peers::Peer>,
    /// A run of two turns and one tool call, the orchestrator beside the Agents SDK (`--peers`).
    pub agent_runs: Option<crate::peers::AgentRuns>,
}

/// What one run's caller saw.
struct Seen {
    ttft: Option<Duration>,
    text_events: usize,
    ok: bool,
}

/// An orchestrator measured beside the shipped one: its label, flags and environment.
struct Variant {
    label: String,
    flags: Vec<String>,
    env: Vec<(&'static str, &'static str)>,
    /// Another orchestrator binary (`BENCH_PACED_AGAINST`), to compare two builds in one run.
    bin: Option<std::path::PathBuf>,
}

/// Set to an orchestrator binary, `--paced` measures it as one more variant: two builds compared
/// round by round in the same run, where one after another they move by ±25 % on this machine.
const AGAINST_ENV: &str = "BENCH_PACED_AGAINST";

/// The variants: the shared HTTP client reading the model (the baseline this release improves
/// on), one runtime worker, and the durable mode (the NATS store, against `nats`).
fn variants(nats: Option<&str>) -> Vec<Variant> {
    let variant = |label: &str, flags: &[&str], env| Variant {
        label: label.to_owned(),
        flags: flags.iter().map(|f| (*f).to_owned()).collect(),
        env,
        bin: None,
    };
    let mut all = vec![
        variant(
            "pooled reader (--llm-reader pooled)",
            &["--llm-reader", "pooled"],
            Vec::new(),
        ),
        variant(
            "one worker (TOKIO_WORKER_THREADS=1)",
            &[],
            vec![(shared::runtime::WORKER_THREADS_ENV, "1")],
        ),
    ];
    if let Some(url) = nats {
        all.push(variant("durable (--run-store nats)", &["--run-store", url], Vec::new()));
    }
    if let Some(bin) = std::env::var_os(AGAINST_ENV) {
        let mut against = variant(&format!("{AGAINST_ENV}={}", bin.to_string_lossy()), &[], Vec::new());
        against.bin = Some(bin.into());
        all.push(against);
    }
    all
}

/// Measures every interval of `paced` on a fresh orchestrator and each variant at 0 and 20 ms on
/// a fresh orchestrator of its own, interval by interval in turn (so a noisy moment of the
/// machine falls on all of them alike), then the peers when asked.
pub(crate) async fn measure(bin: &std::path::Path, paced: &Paced, with_peers: bool) -> anyhow::Result<Report> {
    let channels = paced.concurrency.div_ceil(50);
    let shipped = Stack::start(
        bin,
        paced.scenarios(),
        channels,
        None,
        orchestrator::DEFAULT_LOG_FILTER,
        &[],
        &[],
    )
    .await?;
    let model = model_ttft(&shipped.mock.base_url(), paced).await?;
    let nats = testkit::nats::Nats::start().await;
    let mut variants_not_run = Vec::new();
    if let Err(e) = &nats {
        variants_not_run.push(format!("durable (--run-store nats): no nats-server: {e:#}"));
    }
    let mut others = Vec::new();
    for variant in variants(nats.as_ref().ok().map(|n| n.url()).as_deref()) {
        let flags: Vec<&str> = variant.flags.iter().map(String::as_str).collect();
        let bin = variant.bin.as_deref().unwrap_or(bin);
        let stack = Stack::start(
            bin,
            paced.scenarios(),
            channels,
            None,
            orchestrator::DEFAULT_LOG_FILTER,
            &flags,
            &variant.env,
        )
        .await?;
        others.push((variant.label, stack));
    }
    let floor = match crate::floor::Floor::start(&shipped.mock.base_url(), channels).await {
        Ok(floor) => Some(floor),
        Err(e) => {
            variants_not_run.push(format!("{FLOOR_LABEL}: {e:#}"));
            None
        }
    };
    let grpcio = match testkit::python::python() {
        Ok(python) => Some(Caller::Grpcio(python)),
        Err(e) => {
            variants_not_run.push(format!("{GRPCIO_LABEL}: {e:#}"));
            None
        }
    };
    let (mut rows, mut variant_rows) = (Vec::new(), Vec::new());
    for &interval_ms in &paced.intervals_ms {
        rows.extend(rows_of(&shipped.target(), &Caller::Tonic, paced, "default", &[interval_ms]).await?);
        if interval_ms == 0
            && let Some(floor) = &floor
        {
            variant_rows.extend(rows_of(&floor.target(), &Caller::Tonic, paced, FLOOR_LABEL, &[0]).await?);
        }
        if [0, 20].contains(&interval_ms) {
            if let Some(grpcio) = &grpcio {
                let target = shipped.target();
                variant_rows.extend(rows_of(&target, grpcio, paced, GRPCIO_LABEL, &[interval_ms]).await?);
            }
            for (label, stack) in &others {
                variant_rows.extend(rows_of(&stack.target(), &Caller::Tonic, paced, label, &[interval_ms]).await?);
            }
        }
    }
    for (_, stack) in others {
        stack.stop().await;
    }
    if let Some(floor) = floor {
        floor.stop().await;
    }
    let (peers, agent_runs) = match with_peers {
        true => (
            crate::peers::measure(&shipped.mock.base_url(), paced).await,
            Some(crate::peers::agent_runs(bin, paced).await),
        ),
        false => (Vec::new(), None),
    };
    shipped.stop().await;
    Ok(Report {
        workload: paced.clone(),
        cores: std::thread::available_parallelism().map_or(1, usize::from),
        model_ttft_p50_ms: ms(quantile(&model, 0.5)),
        model_ttft_p99_ms: ms(quantile(&model, 0.99)),
        rows,
        variants: variant_rows,
        variants_not_run,
        peers,
        agent_runs,
    })
}

/// Who calls the orchestrator: the benchmark's own tonic client, or Python through grpcio (its
/// HTTP/2 stack acknowledges, pings and updates windows its own way, which the server pays for).
enum Caller {
    Tonic,
    /// The Python of the test virtualenv (grpcio), running `bench/peers/grpcio_caller.py`.
    Grpcio(std::path::PathBuf),
}

const GRPCIO_LABEL: &str = "shipped, Python grpcio callers";

/// The floor's label: a bare relay of the same stream (`bench/src/bin/relay_floor.rs`).
pub(crate) const FLOOR_LABEL: &str = "floor: a bare relay (relay_floor)";

/// The rows of one orchestrator (`setup`) called by `caller` at `intervals`: a round of warm-up,
/// then `rounds` rounds measured per interval.
async fn rows_of(
    stack: &Target<'_>,
    caller: &Caller,
    paced: &Paced,
    setup: &str,
    intervals: &[u32],
) -> anyhow::Result<Vec<Row>> {
    let mut rows = Vec::new();
    for &interval_ms in intervals {
        caller.round(stack, paced, interval_ms).await?;
        let (cpu, switches) = (procstat::scheduled_time(stack.pid)?, procstat::switches(stack.pid)?);
        let mut seen = Vec::new();
        for _ in 0..paced.rounds {
            seen.extend(caller.round(stack, paced, interval_ms).await?);
        }
        let cpu = procstat::scheduled_time(stack.pid)?.saturating_sub(cpu);
        let switches = procstat::switches(stack.pid)?.saturating_sub(switches);
        let row = row(paced, setup, interval_ms, &seen, cpu, switches);
        eprintln!(
            "bench: paced, {setup}, interval {interval_ms:>3} ms: {:.1} µs and {:.2} switches per token, {:.1} events per run, TTFT p99 {:.1} ms",
            row.cpu_us_per_token, row.switches_per_token, row.text_events_per_run, row.ttft_p99_ms
        );
        rows.push(row);
    }
    Ok(rows)
}

fn row(paced: &Paced, setup: &str, interval_ms: u32, seen: &[Seen], cpu: Duration, switches: u64) -> Row {
    let ok: Vec<&Seen> = seen.iter().filter(|s| s.ok).collect();
    let tokens = (ok.len() * paced.tokens) as u64;
    let per_token = |x: f64| x / tokens.max(1) as f64;
    let ttfts: Vec<Duration> = ok.iter().filter_map(|s| s.ttft).collect();
    Row {
        setup: setup.to_owned(),
        interval_ms,
        tokens_relayed: tokens,
        cpu_us_per_token: per_token(cpu.as_secs_f64() * 1e6),
        switches_per_token: per_token(switches as f64),
        text_events_per_run: ok.iter().map(|s| s.text_events).sum::<usize>() as f64 / ok.len().max(1) as f64,
        ttft_p50_ms: ms(quantile(&ttfts, 0.5)),
        ttft_p99_ms: ms(quantile(&ttfts, 0.99)),
        runs_failed: seen.len() - ok.len(),
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

impl Caller {
    /// `concurrency` runs at once, each read to its end.
    async fn round(&self, stack: &Target<'_>, paced: &Paced, interval_ms: u32) -> anyhow::Result<Vec<Seen>> {
        match self {
            Self::Tonic => Ok(round(stack, paced, interval_ms).await),
            Self::Grpcio(python) => grpcio_round(python, stack, paced, interval_ms).await,
        }
    }
}

/// One round from a Python process (its start-up falls between the measured runs: the
/// orchestrator is idle then); a run it could not finish counts as failed.
async fn grpcio_round(
    python: &std::path::Path,
    stack: &Target<'_>,
    paced: &Paced,
    interval_ms: u32,
) -> anyhow::Result<Vec<Seen>> {
    let script = testkit::repo_root().join("bench/peers/grpcio_caller.py");
    let output = tokio::process::Command::new(python)
        .arg(script)
        .args(["--target", stack.address, "--model", MODEL])
        .args(["--runs", &paced.concurrency.to_string()])
        .args(["--interval-ms", &interval_ms.to_string()])
        .kill_on_drop(true)
        .output();
    let output = tokio::time::timeout(Duration::from_secs(300), output)
        .await
        .map_err(|_| anyhow::anyhow!("the grpcio callers did not finish within 300 s"))??;
    anyhow::ensure!(
        output.status.success(),
        "the grpcio callers failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let mut seen = Vec::new();
    for line in String::from_utf8_lossy(&output.stdout).lines() {
        let run: serde_json::Value = serde_json::from_str(line)?;
        seen.push(Seen {
            ttft: run["ttft_ms"].as_f64().map(|ms| Duration::from_secs_f64(ms / 1e3)),
            text_events: usize::try_from(run["text_events"].as_u64().unwrap_or(0)).unwrap_or(0),
            ok: run["ok"].as_bool().unwrap_or(false),
        });
    }
    Ok(seen)
}

/// `concurrency` runs at once, each read to its end.
async fn round(stack: &Target<'_>, paced: &Paced, interval_ms: u32) -> Vec<Seen> {
    let runs = (0..paced.concurrency).map(|n| {
        let mut client = stack.client(n);
        let request = paced.request(interval_ms, n);
        async move {
            let started = Instant::now();
            let mut seen = Seen {
                ttft: None,
                text_events: 0,
                ok: false,
            };
            let Ok(response) = client.orchestrate(request).await else {
                return seen;
            };
            let mut stream = response.into_inner();
            while let Some(Ok(event)) = stream.next().await {
                match event.event {
                    Some(pb::orchestrate_event::Event::TextDelta(_)) => {
                        seen.ttft.get_or_insert_with(|| started.elapsed());
                        seen.text_events += 1;
                    }
                    Some(pb::orchestrate_event::Event::RunFinished(f)) => {
                        seen.ok = f.result.is_some_and(|r| r.status() == pb::RunStatus::Completed);
                    }
                    _ => {}
                }
            }
            seen
        }
    });
    futures::future::join_all(runs).await
}

/// The model's time to first token called directly, `concurrency` at once, twice.
async fn model_ttft(base_url: &str, paced: &Paced) -> anyhow::Result<Vec<Duration>> {
    let client = reqwest::Client::new();
    let url = format!("{base_url}/chat/completions");
    let body = serde_json::json!({
        "model": MODEL,
        "stream": true,
        "messages": [{"role": "user", "content": "direct"}],
    });
    let mut all = Vec::new();
    for _ in 0..2 {
        let calls = (0..paced.concurrency).map(|_| {
            let request = client.post(&url).json(&body);
            async move {
                let started = Instant::now();
                let mut bytes = request.send().await?.error_for_status()?.bytes_stream();
                let mut first = None;
                while let Some(chunk) = bytes.next().await {
                    let chunk = chunk?;
                    if first.is_none() && has_text(&chunk) {
                        first = Some(started.elapsed());
                    }
                }
                anyhow::Ok(first)
            }
        });
        for first in futures::future::join_all(calls).await {
            all.extend(first?);
        }
    }
    Ok(all)
}

/// Whether a chunk of a streamed completion carries text (a non-empty `content`; the first
/// chunk, which names the role, carries an empty one).
fn has_text(chunk: &[u8]) -> bool {
    text_chunks(chunk) > 0
}

/// The report as Markdown.
pub(crate) fn markdown(report: &Report) -> String {
    let w = &report.workload;
    let mut md = format!(
        "# Paced relay: {} tokens, one SSE event each, {} ms apart, {} runs at once\n\n\
         Machine: {} cores. CPU and switches are the orchestrator's threads' (`/proc/<pid>/task/*/schedstat`), per token relayed, over {} rounds of {} runs per interval. The model's own time to first token (called directly, as many at once): p50 {:.1} ms, p99 {:.1} ms.\n\n\
         | stream interval | CPU per token | switches per token | text events per run | TTFT p50 / p99 | runs failed |\n|---:|---:|---:|---:|---|---:|\n",
        w.tokens,
        w.pace_ms,
        w.concurrency,
        report.cores,
        w.rounds,
        w.concurrency,
        report.model_ttft_p50_ms,
        report.model_ttft_p99_ms
    );
    for r in &report.rows {
        md.push_str(&format!(
            "| {} ms | {:.1} µs | {:.2} | {:.1} | {:.1} / {:.1} ms | {} |\n",
            r.interval_ms,
            r.cpu_us_per_token,
            r.switches_per_token,
            r.text_events_per_run,
            r.ttft_p50_ms,
            r.ttft_p99_ms,
            r.runs_failed
        ));
    }
    md.push_str(&variants_markdown(report));
    if !report.peers.is_empty() {
        md.push_str(&peers_markdown(report));
    }
    if let Some(runs) = &report.agent_runs {
        md.push_str(&agent_runs_markdown(runs));
    }
    if !report.peers.is_empty() {
        md.push_str(&targets_markdown(report));
    }
    md
}

/// The shipped orchestrator's row at `interval_ms`.
fn shipped(report: &Report, interval_ms: u32) -> Option<&Row> {
    report.rows.iter().find(|r| r.interval_ms == interval_ms)
}

/// The variants' rows, each as a ratio to the shipped orchestrator at the same interval.
fn variants_markdown(report: &Report) -> String {
    if report.variants.is_empty() && report.variants_not_run.is_empty() {
        return String::new();
    }
    let mut md = String::from(
        "\n## Variants (same model, same run)\n\nThe same workload on an orchestrator started another way. Ratio: the variant's CPU per token ÷ the shipped orchestrator's at the same interval.\n\n| orchestrator | stream interval | CPU per token | switches per token | text events per run | TTFT p99 | ÷ shipped |\n|---|---:|---:|---:|---:|---:|---:|\n",
    );
    for r in &report.variants {
        let ratio = shipped(report, r.interval_ms).map_or_else(String::new, |s| {
            format!("{:.2}", r.cpu_us_per_token / s.cpu_us_per_token)
        });
        md.push_str(&format!(
            "| {} | {} ms | {:.1} µs | {:.2} | {:.1} | {:.1} ms | {ratio} |\n",
            r.setup, r.interval_ms, r.cpu_us_per_token, r.switches_per_token, r.text_events_per_run, r.ttft_p99_ms
        ));
    }
    for reason in &report.variants_not_run {
        md.push_str(&format!("| {reason} | | | | | | |\n"));
    }
    md
}

/// Two-turn agent runs: the orchestrator's CPU per run beside the Agents SDK's.
fn agent_runs_markdown(runs: &crate::peers::AgentRuns) -> String {
    let figure = |x: Option<f64>| x.map_or_else(|| "not run".to_owned(), |us| format!("{us:.0} µs"));
    let mut md = format!(
        "\n## An agent run: two turns, one tool call ({} runs, one after another)\n\n| who | CPU per run |\n|---|---:|\n| orchestrator + tool-runner (two processes, the call over gRPC) | {} |\n| openai-agents (one process, the tool a Python function) | {} |\n",
        runs.runs,
        figure(runs.orchestrator_cpu_us_per_run),
        figure(runs.agents_sdk_cpu_us_per_run)
    );
    for reason in &runs.not_run {
        md.push_str(&format!("\nNot measured: {reason}\n"));
    }
    md
}

/// The targets, each as measured in this run.
fn targets_markdown(report: &Report) -> String {
    let peer_cpu = |name: &str| {
        report
            .peers
            .iter()
            .find(|p| p.name == name)
            .and_then(|p| p.cpu_us_per_token)
    };
    let ratio = |interval: u32, peer: &str| Some(shipped(report, interval)?.cpu_us_per_token / peer_cpu(peer)?);
    let run_ratio = report
        .agent_runs
        .as_ref()
        .and_then(|r| Some(r.orchestrator_cpu_us_per_run? / r.agents_sdk_cpu_us_per_run?));
    let ttft_excess = shipped(report, 0).map(|r| r.ttft_p99_ms - report.model_ttft_p99_ms);
    let mut md = String::from("\n## Targets (this run)\n\n| target | measured | met |\n|---|---:|---|\n");
    let mut line = |what: &str, measured: Option<f64>, limit: f64, unit: &str| {
        let (shown, met) = match measured {
            None => ("not measured".to_owned(), "—".to_owned()),
            Some(m) if m <= limit => (format!("{m:.3}{unit}"), "met".to_owned()),
            Some(m) => (format!("{m:.3}{unit}"), format!("missed by {:.1}×", m / limit)),
        };
        md.push_str(&format!("| {what} | {shown} | {met} |\n"));
    };
    line(
        "CPU per token at 0 ms ÷ openai-agents ≤ 1/10",
        ratio(0, "openai-agents"),
        0.1,
        "",
    );
    line(
        "CPU per token at 0 ms ÷ agentic-api ≤ 1/2",
        ratio(0, "agentic-api"),
        0.5,
        "",
    );
    line(
        "CPU per token at 20 ms ÷ openai-agents ≤ 1/50",
        ratio(20, "openai-agents"),
        0.02,
        "",
    );
    line("CPU per 2-turn run ÷ openai-agents ≤ 1/30", run_ratio, 1.0 / 30.0, "");
    line("CPU per token at 0 ms ÷ the floor's ≤ 1.5", over_floor(report), 1.5, "");
    line("TTFT p99 at 0 ms − the model's own ≤ 1 ms", ttft_excess, 1.0, " ms");
    md.push_str("| RSS per held run ≤ 32 KiB | the main bench's (`latest.md`, 10,000 runs held) | see there |\n");
    md
}

/// The shipped orchestrator's CPU per token at 0 ms over the bare relay's.
fn over_floor(report: &Report) -> Option<f64> {
    let floor = report.variants.iter().find(|r| r.setup == FLOOR_LABEL)?;
    Some(shipped(report, 0)?.cpu_us_per_token / floor.cpu_us_per_token)
}

/// The peers' rows, each with the orchestrator's CPU per token as a ratio to the peer's (at each
/// interval).
fn peers_markdown(report: &Report) -> String {
    let mut md = String::from(
        "\n## Peers (same model, same run)\n\n| peer | what it does per token | CPU per token | switches per token | orchestrator's CPU ÷ peer's, by interval |\n|---|---|---:|---:|---|\n",
    );
    for peer in &report.peers {
        let (Some(cpu), Some(switches)) = (peer.cpu_us_per_token, peer.switches_per_token) else {
            md.push_str(&format!(
                "| {} | {} | not run: {} | | |\n",
                peer.name,
                peer.role,
                peer.not_run.as_deref().unwrap_or("unknown")
            ));
            continue;
        };
        let ratios: Vec<String> = report
            .rows
            .iter()
            .map(|r| format!("{} ms: {:.2}", r.interval_ms, r.cpu_us_per_token / cpu))
            .collect();
        md.push_str(&format!(
            "| {} | {} | {cpu:.1} µs | {switches:.2} | {} |\n",
            peer.name,
            peer.role,
            ratios.join(", ")
        ));
    }
    md
}

/// Runs `--paced` (`--peers`: with the peers) and writes its report into `out`; fails when a run
/// failed.
pub(crate) async fn run(
    bin: &std::path::Path,
    quick: bool,
    with_peers: bool,
    out: &std::path::Path,
) -> anyhow::Result<()> {
    let report = measure(bin, &Paced::new(quick), with_peers).await?;
    std::fs::create_dir_all(out)?;
    std::fs::write(out.join("paced.json"), serde_json::to_string_pretty(&report)?)?;
    let md = markdown(&report);
    std::fs::write(out.join("paced.md"), &md)?;
    eprintln!("{md}");
    let failed: usize = report.rows.iter().chain(&report.variants).map(|r| r.runs_failed).sum();
    anyhow::ensure!(failed == 0, "{failed} paced runs did not complete");
    Ok(())
}
