//! What quiet durable runs cost the store (`bench --idle-cost 400,1000`): one orchestrator
//! replica on one `nats-server -js` (monitored), N durable runs each waiting on a tool call that
//! outlasts the window, then the window measured quiet. Reported per quiet run per second: the
//! messages nats-server took in (requests: writes, reads, acks) and sent out, beyond what the
//! same replica cost with no run at all (measured first, in the same process), and the
//! orchestrator's CPU; and the orchestrator's RSS per quiet run (its growth from the idle
//! replica, over N). The goal: at most [`GOAL_REQUESTS`] requests per quiet run per second.
//! Writes `idle_cost.md` / `.json`.

use std::path::Path;
use std::time::{Duration, Instant};

use mock_llm::{MockLlm, Scenario, Scenarios, Step, Turn};
use proto::orchestrator::v1 as pb;
use serde::Serialize;

use crate::procstat;
use crate::stack::{Launch, Stack, spawn, start_runs};

/// Store requests a quiet run may cost per second (issue goal; it was 0.40 with a lease per run).
pub(crate) const GOAL_REQUESTS: f64 = 0.01;
/// Requests in flight at once while starting runs.
const CONCURRENCY: usize = 32;

/// The figures for one count of quiet runs.
#[derive(Debug, Serialize)]
pub(crate) struct Quiet {
    pub runs: usize,
    pub window_s: f64,
    /// Messages into nats-server per second with no run (the replica's own keeping).
    pub idle_in_per_s: f64,
    /// Messages into nats-server per quiet run per second, all of them (runs and replica).
    pub in_per_run_s: f64,
    /// The same less the idle replica's: what the runs themselves cost.
    pub added_in_per_run_s: f64,
    pub out_per_run_s: f64,
    /// Orchestrator CPU per quiet run per second of the window (µs).
    pub cpu_us_per_run_s: f64,
    /// Orchestrator RSS growth per quiet run (KiB).
    pub rss_kib_per_run: f64,
    /// Orchestrator RSS with the runs quiet (KiB): the slope between two counts is a quiet
    /// run's own memory, without what the burst of starts grew once.
    pub rss_kib: f64,
    /// Runs started until every call was in flight (s).
    pub start_all_s: f64,
}

/// Every run calls the runner's `sleep` for `ms`, then answers.
pub(crate) fn scenario(ms: u64) -> Scenario {
    Scenario::new(vec![
        Turn::text("Waiting.").then(Step::call("sleep", serde_json::json!({ "ms": ms }))),
        Turn::text("Done."),
    ])
}

pub(crate) fn request(run_id: String) -> pb::OrchestrateRequest {
    pb::OrchestrateRequest {
        run_id,
        detached: true,
        messages: vec![pb::ChatMessage {
            role: "user".into(),
            content: "wait".into(),
            ..Default::default()
        }],
        tools: Some(pb::ToolSelection {
            normal: vec!["sleep".into()],
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// The model, a runner in this process whose `sleep` may last an hour, and an orchestrator on
/// the NATS store `url` with room for `runs`; `extra` flags added.
pub(crate) async fn stack(bin: &Path, url: &str, runs: usize, call: Duration, extra: &[&str]) -> anyhow::Result<Stack> {
    let mock = MockLlm::start_timed(Scenarios::from(scenario(u64::try_from(call.as_millis())?))).await?;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let runner = format!("http://{}", listener.local_addr()?);
    let mut config = tool_runner::Config::default();
    config.server.max_concurrency = 10_000;
    config.builtins.sleep_max = Duration::from_secs(3600);
    tokio::spawn(tool_runner::serve(listener, config, std::future::pending()));
    let process = spawn(
        &launch(bin, (&mock.base_url(), &runner), url, runs, extra),
        "127.0.0.1:0",
    )
    .await?;
    Stack::of(mock, runner, process)
}

/// An orchestrator on the model and runner `(model_url, runner)` and the NATS store `url`, with
/// room for `runs` held an hour each, its `/metrics` served; `extra` flags added.
pub(crate) fn launch(bin: &Path, (model_url, runner): (&str, &str), url: &str, runs: usize, extra: &[&str]) -> Launch {
    let slots = (runs + 16).to_string();
    let mut flags: Vec<String> = [
        "--run-store",
        url,
        "--max-runs",
        &slots,
        "--tool-timeout-ceiling",
        "1h",
        "--tool-timeout",
        "1h",
        "--metrics-listen",
        "127.0.0.1:0",
    ]
    .map(str::to_owned)
    .to_vec();
    flags.extend(extra.iter().map(|f| (*f).to_owned()));
    Launch {
        bin: bin.to_owned(),
        model_url: model_url.to_owned(),
        runner: runner.to_owned(),
        otlp: None,
        // Where /metrics serves is told at info; the runs themselves log at warn.
        rust_log: "warn,shared::metrics=info".into(),
        extra: flags,
        env: Vec::new(),
    }
}

/// The value of gauge `name` at the orchestrator's `/metrics`.
pub(crate) async fn gauge(metrics: &str, name: &str) -> anyhow::Result<f64> {
    let text = reqwest::get(format!("http://{metrics}/metrics")).await?.text().await?;
    Ok(text
        .lines()
        .filter(|line| line.starts_with(name))
        .filter_map(|line| line.rsplit_once(' ')?.1.parse::<f64>().ok())
        .sum())
}

/// Every one of `runs` calls in flight on the orchestrator serving `/metrics` at `metrics`,
/// waited for (as `what`) until `limit`.
pub(crate) async fn all_in_flight(metrics: &str, runs: usize, limit: Duration, what: &str) -> anyhow::Result<()> {
    testkit::wait::until(what, limit, || async {
        let in_flight = gauge(metrics, "orchestrator_tool_calls_in_flight").await.ok()?;
        (in_flight >= runs as f64).then_some(())
    })
    .await
}

/// nats-server's message counters (in, out).
pub(crate) async fn counters(nats: &testkit::nats::Nats) -> anyhow::Result<(f64, f64)> {
    let varz = nats.varz().await?;
    let read = |field: &str| varz.get(field).and_then(serde_json::Value::as_f64).unwrap_or(0.0);
    Ok((read("in_msgs"), read("out_msgs")))
}

/// Messages in and out per second over `window`.
pub(crate) async fn rates(nats: &testkit::nats::Nats, window: Duration) -> anyhow::Result<(f64, f64)> {
    let before = counters(nats).await?;
    // Stays: the window is what is measured.
    tokio::time::sleep(window).await;
    let after = counters(nats).await?;
    let s = window.as_secs_f64();
    Ok(((after.0 - before.0) / s, (after.1 - before.1) / s))
}

/// Measures `runs` quiet runs over `window`.
async fn measure(bin: &Path, runs: usize, window: Duration) -> anyhow::Result<Quiet> {
    let nats = testkit::nats::Nats::start_monitored().await?;
    // The calls outlast starting them all and the window, with room.
    let call = window * 3 + Duration::from_secs(60 + runs as u64 / 20);
    let stack = stack(bin, &nats.url(), runs, call, &[]).await?;
    let metrics = stack
        .metrics
        .clone()
        .ok_or_else(|| anyhow::anyhow!("the orchestrator serves no /metrics"))?;
    let (idle_in, _) = rates(&nats, window).await?;
    let base_rss = procstat::rss(stack.pid)?;

    eprint!("bench: idle-cost {runs} quiet runs … ");
    let started = Instant::now();
    start_runs(&stack, ("quiet", runs, CONCURRENCY), request).await?;
    all_in_flight(&metrics, runs, call / 2, "every run's call in flight").await?;
    let start_all = started.elapsed();
    let cpu_before = procstat::cpu_time(stack.pid)?;
    let (in_rate, out_rate) = rates(&nats, window).await?;
    let cpu = procstat::cpu_time(stack.pid)?.saturating_sub(cpu_before);
    let rss = procstat::rss(stack.pid)?;
    stack.stop().await;
    let n = runs as f64;
    let quiet = Quiet {
        runs,
        window_s: window.as_secs_f64(),
        idle_in_per_s: idle_in,
        in_per_run_s: in_rate / n,
        added_in_per_run_s: (in_rate - idle_in).max(0.0) / n,
        out_per_run_s: out_rate / n,
        cpu_us_per_run_s: cpu.as_secs_f64() * 1e6 / window.as_secs_f64() / n,
        rss_kib_per_run: rss.saturating_sub(base_rss) as f64 / 1024.0 / n,
        rss_kib: rss as f64 / 1024.0,
        start_all_s: start_all.as_secs_f64(),
    };
    eprintln!(
        "{:.4} requests/run/s ({:.4} added), {:.1} µs CPU/run/s, {:.1} KiB/run",
        quiet.in_per_run_s, quiet.added_in_per_run_s, quiet.cpu_us_per_run_s, quiet.rss_kib_per_run
    );
    Ok(quiet)
}

/// Measures each count; writes the report; fails when a count misses the goal.
pub(crate) async fn run(bin: &Path, counts: &[usize], window: Duration, out: &Path) -> anyhow::Result<()> {
    let mut measured = Vec::new();
    for &runs in counts {
        measured.push(measure(bin, runs, window).await?);
    }
    std::fs::create_dir_all(out)?;
    std::fs::write(out.join("idle_cost.json"), serde_json::to_string_pretty(&measured)?)?;
    std::fs::write(out.join("idle_cost.md"), markdown(&measured))?;
    eprintln!("bench: wrote {}", out.join("idle_cost.md").display());
    let missed: Vec<&Quiet> = measured.iter().filter(|q| q.in_per_run_s > GOAL_REQUESTS).collect();
    anyhow::ensure!(
        missed.is_empty(),
        "quiet runs cost the store more than {GOAL_REQUESTS} requests/run/s: {missed:?}"
    );
    Ok(())
}

fn markdown(measured: &[Quiet]) -> String {
    let mut s = String::from(
        "# Quiet durable runs\n\n`cargo run --release -p bench -- --idle-cost <counts>`: one orchestrator replica on one \
         nats-server, each run waiting on a tool call that outlasts the window. Messages are nats-server's `/varz` \
         counters over the window; \"added\" is less the same replica's cost with no run.\n\n\
         | quiet runs | window (s) | idle replica in/s | in/run/s | added in/run/s | out/run/s | CPU/run/s (µs) | RSS/run (KiB) | start all (s) |\n\
         |---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for q in measured {
        s.push_str(&format!(
            "| {} | {:.0} | {:.2} | {:.4} | {:.4} | {:.4} | {:.2} | {:.1} | {:.1} |\n",
            q.runs,
            q.window_s,
            q.idle_in_per_s,
            q.in_per_run_s,
            q.added_in_per_run_s,
            q.out_per_run_s,
            q.cpu_us_per_run_s,
            q.rss_kib_per_run,
            q.start_all_s
        ));
    }
    if let Some(slope) = rss_slope(measured) {
        s.push_str(&format!(
            "\nRSS slope from {} to {} quiet runs: {slope:.1} KiB per run.\n",
            measured[0].runs,
            measured[measured.len() - 1].runs
        ));
    }
    s.push_str(&format!(
        "\nGoal: at most {GOAL_REQUESTS} requests per quiet run per second.\n"
    ));
    s
}

/// The RSS each quiet run adds between the fewest and the most runs measured (KiB per run).
fn rss_slope(measured: &[Quiet]) -> Option<f64> {
    let (first, last) = (measured.first()?, measured.last()?);
    (last.runs > first.runs).then(|| (last.rss_kib - first.rss_kib) / (last.runs - first.runs) as f64)
}
