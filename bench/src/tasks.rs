//! What runs waiting on tools' tasks cost (`bench --tasks N`): N runs, each one call its MCP
//! server runs as a task (the tests' FastMCP server with `fastmcp-tasks`, over streamable HTTP,
//! `tests/fixtures/mcp/tasks_server.py`), on an orchestrator with 16 run slots that parks a run
//! as soon as it follows a task (`--task-park-after 0s`), so the runs hold no slot while their
//! tasks run and are woken for each poll. Reports the orchestrator's RSS per parked run (its
//! growth from a warmed-up baseline, divided by N), how many read `AWAITING_TASK` at that moment,
//! how long parking all took, and how many completed once their tasks ended. Writes `tasks.md` /
//! `.json`.

use std::path::Path;
use std::time::{Duration, Instant};

use futures::StreamExt;
use mock_llm::{MockLlm, Scenario, Scenarios, Step, Turn};
use proto::orchestrator::v1 as pb;
use serde::Serialize;

use crate::procstat;
use crate::stack::{Launch, Stack, spawn, start_runs};

/// Run slots of the orchestrator measured: far fewer than the runs parked.
const SLOTS: &str = "16";
/// Requests in flight at once while starting runs.
const CONCURRENCY: usize = 16;
/// Runs warmed up (started, parked, completed) before the baseline is read.
const WARM_UP: usize = 16;
/// How long each measured run's task works: longer than parking them all takes.
const TASK_SECONDS: f64 = 40.0;

/// The figures.
#[derive(Debug, Serialize)]
pub(crate) struct ParkedOnTasks {
    pub runs: usize,
    pub slots: usize,
    /// Runs that read `AWAITING_TASK` when the RSS was read (the others were awake for a poll).
    pub parked_when_measured: usize,
    /// Orchestrator RSS growth per run waiting on its task.
    pub rss_per_parked_run_kib: f64,
    pub park_all_s: f64,
    pub completed: usize,
    pub complete_all_s: f64,
}

/// Every run's one call becomes a task working `seconds`; turn 2 answers.
fn scenario(seconds: f64) -> Scenario {
    Scenario::new(vec![
        Turn::text("Crunching.").then(Step::call(
            "batch__crunch",
            serde_json::json!({"dataset": "bench", "seconds": seconds}),
        )),
        Turn::text("Done."),
    ])
}

fn request(run_id: String, model: &str) -> pb::OrchestrateRequest {
    pb::OrchestrateRequest {
        run_id,
        model: model.into(),
        detached: true,
        messages: vec![pb::ChatMessage {
            role: "user".into(),
            content: "crunch".into(),
            ..Default::default()
        }],
        tools: Some(pb::ToolSelection {
            normal: vec!["batch__crunch".into()],
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// The tasks server over HTTP on a free port, its work parallel without bound.
async fn tasks_server() -> anyhow::Result<(tokio::process::Child, u16)> {
    let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
    let child = tokio::process::Command::new(testkit::mcp_servers::python()?)
        .arg(testkit::mcp_servers::tasks_server())
        .args(["http", &port.to_string()])
        .env("FASTMCP_DOCKET_CONCURRENCY", "100000")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()?;
    testkit::wait::until("the tasks server to listen", Duration::from_secs(60), || async move {
        tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .ok()
            .map(|_| ())
    })
    .await?;
    Ok((child, port))
}

/// The stand-in model, a tool-runner in this process serving the tasks server, and an
/// orchestrator on them.
async fn stack(bin: &Path, port: u16, dir: &Path) -> anyhow::Result<Stack> {
    let mut scenarios = Scenarios::from(scenario(TASK_SECONDS));
    scenarios.named.insert("warm".to_owned(), scenario(1.0));
    let mock = MockLlm::start_timed(scenarios).await?;
    let manifest = dir.join("tools.toml");
    std::fs::write(
        &manifest,
        format!("[[mcp_servers]]\nname = \"batch\"\nurl = \"http://127.0.0.1:{port}/mcp\"\nrequired = true\n"),
    )?;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let runner = format!("http://{}", listener.local_addr()?);
    let mut config = tool_runner::Config::default();
    config.server.max_concurrency = 10_000;
    config.tools_manifest = Some(manifest);
    tokio::spawn(tool_runner::serve(listener, config, std::future::pending()));
    let launch = Launch {
        bin: bin.to_owned(),
        model_url: mock.base_url(),
        runner: runner.clone(),
        otlp: None,
        rust_log: "warn".into(),
        extra: ["--max-runs", SLOTS, "--task-park-after", "0s", "--task-poll-min", "2s"]
            .map(str::to_owned)
            .to_vec(),
        env: Vec::new(),
    };
    let process = spawn(&launch, "127.0.0.1:0").await?;
    Stack::of(mock, runner, process)
}

/// Measures; writes the report.
pub(crate) async fn run(bin: &Path, runs: usize, out: &Path) -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let (_server, port) = tasks_server().await?;
    let stack = stack(bin, port, dir.path()).await?;
    start_runs(&stack, ("warm", WARM_UP, CONCURRENCY), |id| request(id, "warm")).await?;
    wait_status(
        &stack,
        "warm",
        WARM_UP,
        &[pb::RunStatus::Completed],
        Duration::from_secs(120),
    )
    .await?;
    let base = procstat::rss(stack.pid)?;

    eprint!("bench: tasks parking {runs} runs … ");
    let started = Instant::now();
    start_runs(&stack, ("parked", runs, CONCURRENCY), |id| request(id, "")).await?;
    let parked_when_measured = wait_parked(&stack, runs).await?;
    let park_all = started.elapsed();
    let parked_rss = procstat::rss(stack.pid)?;
    eprintln!("{:.1} s", park_all.as_secs_f64());
    let window = Duration::from_secs_f64(TASK_SECONDS * 4.0);
    let completed = wait_status(&stack, "parked", runs, &[pb::RunStatus::Completed], window).await?;
    let complete_all = started.elapsed();
    stack.stop().await;
    let measured = ParkedOnTasks {
        runs,
        slots: SLOTS.parse().unwrap_or(0),
        parked_when_measured,
        rss_per_parked_run_kib: parked_rss.saturating_sub(base) as f64 / 1024.0 / runs as f64,
        park_all_s: park_all.as_secs_f64(),
        completed,
        complete_all_s: complete_all.as_secs_f64(),
    };
    std::fs::create_dir_all(out)?;
    std::fs::write(out.join("tasks.json"), serde_json::to_string_pretty(&measured)?)?;
    std::fs::write(out.join("tasks.md"), markdown(&measured))?;
    eprintln!("bench: wrote {}", out.join("tasks.md").display());
    anyhow::ensure!(completed == runs, "not every run completed: {measured:?}");
    Ok(())
}

/// The statuses of runs `<prefix>-0` … `<prefix>-(n-1)`.
async fn statuses(stack: &Stack, prefix: &str, n: usize) -> anyhow::Result<Vec<pb::RunStatus>> {
    futures::stream::iter(0..n)
        .map(|i| {
            let mut client = stack.client(i);
            async move {
                let run = client
                    .get_run(pb::GetRunRequest {
                        run_id: format!("{prefix}-{i}"),
                    })
                    .await?
                    .into_inner();
                Ok(run.status())
            }
        })
        .buffer_unordered(CONCURRENCY)
        .collect::<Vec<anyhow::Result<pb::RunStatus>>>()
        .await
        .into_iter()
        .collect()
}

/// Waits (at most `within`) until `n` runs read one of `wanted`; how many did.
async fn wait_status(
    stack: &Stack,
    prefix: &str,
    n: usize,
    wanted: &[pb::RunStatus],
    within: Duration,
) -> anyhow::Result<usize> {
    let deadline = Instant::now() + within;
    loop {
        let done = statuses(stack, prefix, n)
            .await?
            .iter()
            .filter(|s| wanted.contains(s))
            .count();
        if done == n || Instant::now() > deadline {
            return Ok(done);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Waits (at most 5 min) until every run has parked once and at most a slot's worth are awake
/// for a poll; how many read `AWAITING_TASK` then.
async fn wait_parked(stack: &Stack, n: usize) -> anyhow::Result<usize> {
    let slots: usize = SLOTS.parse().unwrap_or(0);
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        let all = statuses(stack, "parked", n).await?;
        let parked = all.iter().filter(|s| **s == pb::RunStatus::AwaitingTask).count();
        if parked + slots >= n {
            return Ok(parked);
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "only {parked} of {n} runs parked on their tasks"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

fn markdown(m: &ParkedOnTasks) -> String {
    format!(
        "# Runs waiting on tools' tasks\n\n`bench --tasks N`: N runs, each one call its MCP server runs as a task ({TASK_SECONDS} s of work on the tests' FastMCP server with `fastmcp-tasks`, streamable HTTP), on an orchestrator with {} run slots that parks a run as soon as it follows a task (`--task-park-after 0s`, polled every 2 s). RSS per parked run is the growth from a warmed-up baseline divided by N.\n\n| runs | run slots | parked when measured | orchestrator RSS per parked run (KiB) | parking all (s) | completed | all completed (s) |\n| ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n| {} | {} | {} | {:.1} | {:.2} | {} | {:.2} |\n",
        m.slots,
        m.runs,
        m.slots,
        m.parked_when_measured,
        m.rss_per_parked_run_kib,
        m.park_all_s,
        m.completed,
        m.complete_all_s
    )
}
