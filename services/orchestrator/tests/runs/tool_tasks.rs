//! A tool whose MCP server runs its calls as tasks (the MCP tasks extension), through the real
//! `orchestrator` binary, a tool-runner in this process serving the tests' own FastMCP server
//! (`tests/fixtures/mcp/tasks_server.py`, `fastmcp-tasks`: `crunch` always becomes a task) and
//! the stand-in model: the run streams `tool_call_progress` while it polls the task, and the
//! task's result is the call's; past `--task-park-after` the run parks holding no slot
//! (`RUN_STATUS_AWAITING_TASK`) and is woken for each poll; a run canceled while its task runs
//! has the server cancel the task. On NATS, a replica SIGKILLed while its run follows a task
//! leaves it to another, which polls the same task: the work runs once. A call that is not a
//! task reports its progress too (server-everything's long-running operation, its
//! `notifications/progress` streamed by the runner): `tool_call_progress` while it runs.

use std::time::Duration;

use mock_llm::{Scenario, Step, Turn};
use proto::orchestrator::v1 as pb;
use proto::orchestrator::v1::orchestrate_event::Event as E;
use serde_json::json;
use testkit::runs::{read_until, wait_status};

type TestResult = anyhow::Result<()>;

const BIN: &str = env!("CARGO_BIN_EXE_orchestrator");

/// Orchestrator binaries (several on one NATS store, or one in memory) on a tool-runner in this
/// process that serves the tasks server.
type World = testkit::runs::Fleet;

async fn world(
    scenario: Scenario,
    flags: &[&str],
    replicas: usize,
    nats: Option<testkit::nats::Nats>,
) -> anyhow::Result<World> {
    let dir = tempfile::tempdir()?;
    let manifest = testkit::mcp_servers::tasks_server_table(&dir.path().join("tasks.log"))?;
    world_serving(dir, manifest, scenario, (flags, replicas), nats).await
}

/// As [`world`], the runner serving the manifest `manifest` (written into `dir`), its tasks
/// polled at least every 100 ms.
async fn world_serving(
    dir: tempfile::TempDir,
    manifest: String,
    scenario: Scenario,
    (flags, replicas): (&[&str], usize),
    nats: Option<testkit::nats::Nats>,
) -> anyhow::Result<World> {
    let flags: Vec<&str> = ["--task-poll-min", "100ms"].iter().chain(flags).copied().collect();
    World::start((BIN, dir, &manifest), scenario, (&flags, replicas), nats).await
}

/// What the tasks server logged: `started D`, `done D`, `cancelled D`.
fn log(world: &World) -> Vec<String> {
    world.lines_of("tasks.log")
}

/// Waits until the tasks server logged `line`.
async fn log_shows(world: &World, line: &str) -> anyhow::Result<()> {
    testkit::wait::until(
        &format!("the tasks server to log {line:?}"),
        Duration::from_secs(30),
        || {
            let found = log(world).iter().any(|l| l == line);
            async move { found.then_some(()) }
        },
    )
    .await
}

/// Turn 1 crunches `dataset` for `seconds`; turn 2 answers.
fn crunch(dataset: &str, seconds: f64) -> Scenario {
    Scenario::new(vec![
        Turn::text("Crunching.").then(Step::call(
            "batch__crunch",
            json!({"dataset": dataset, "seconds": seconds}),
        )),
        Turn::text("Done."),
    ])
}

fn request(run_id: &str) -> pb::OrchestrateRequest {
    pb::OrchestrateRequest {
        run_id: run_id.into(),
        ..testkit::user("crunch the data")
    }
}

fn finished(events: &[pb::OrchestrateEvent]) -> Option<pb::RunResult> {
    events.iter().find_map(|e| match &e.event {
        Some(E::RunFinished(f)) => f.result.clone(),
        _ => None,
    })
}

#[tokio::test]
async fn a_task_is_followed_to_its_result_which_the_model_is_fed() -> TestResult {
    let world = world(crunch("q3", 1.5), &[], 1, None).await?;
    let mut client = world.client_of(0).await?;
    let mut stream = client.orchestrate(request("task-1")).await?.into_inner();
    let events = read_until(&mut stream, |e| matches!(e, E::RunFinished(_))).await?;
    let result = finished(&events).ok_or_else(|| anyhow::anyhow!("no end"))?;
    assert_eq!(result.status, pb::RunStatus::Completed as i32, "{result:?}");
    let progress: Vec<&pb::ToolCallProgress> = events
        .iter()
        .filter_map(|e| match &e.event {
            Some(E::ToolCallProgress(p)) => Some(p),
            _ => None,
        })
        .collect();
    let first = progress
        .first()
        .ok_or_else(|| anyhow::anyhow!("no tool_call_progress: {events:?}"))?;
    assert_eq!((first.name.as_str(), first.turn), ("batch__crunch", 1));
    assert!(first.message.contains("working"), "{first:?}");
    let call = &result.tool_calls[0];
    assert!(call.ok, "{call:?}");
    assert_eq!(call.call_id, first.call_id);
    assert!(world.fed_back().contains("crunched q3"), "{}", world.fed_back());
    assert!(
        !world.fed_back().contains("working"),
        "progress never reaches the model"
    );
    assert_eq!(log(&world), ["started q3", "done q3"]);
    Ok(())
}

#[tokio::test]
async fn past_task_park_after_the_run_parks_holding_no_slot_and_is_woken_to_poll() -> TestResult {
    let world = world(
        crunch("q4", 4.0),
        &["--task-park-after", "0s", "--max-runs", "1"],
        1,
        None,
    )
    .await?;
    let mut client = world.client_of(0).await?;
    let mut stream = client.orchestrate(request("task-park")).await?.into_inner();
    let parked = wait_status(&client, "task-park", pb::RunStatus::AwaitingTask).await?;
    assert!(parked.pending_approvals.is_empty(), "{parked:?}");
    let listed = client
        .list_runs(pb::ListRunsRequest {
            statuses: vec![pb::RunStatus::AwaitingTask.into()],
            ..Default::default()
        })
        .await?
        .into_inner();
    assert_eq!(listed.runs[0].waiting_for, pb::WaitingFor::Task as i32, "{listed:?}");
    // Parked, it holds no slot: with --max-runs 1 a second run starts its own task before the
    // first one's is done.
    let mut second = request("task-park-2");
    second.detached = true;
    let mut second = client.orchestrate(second).await?.into_inner();
    let events = read_until(&mut stream, |e| matches!(e, E::RunFinished(_))).await?;
    let result = finished(&events).ok_or_else(|| anyhow::anyhow!("no end"))?;
    assert_eq!(result.status, pb::RunStatus::Completed as i32, "{result:?}");
    assert!(world.fed_back().contains("crunched q4"), "{}", world.fed_back());
    let events = read_until(&mut second, |e| matches!(e, E::RunFinished(_))).await?;
    let result = finished(&events).ok_or_else(|| anyhow::anyhow!("no end"))?;
    assert_eq!(result.status, pb::RunStatus::Completed as i32, "{result:?}");
    assert_eq!(log(&world), ["started q4", "started q4", "done q4", "done q4"]);
    Ok(())
}

#[tokio::test]
async fn a_run_canceled_while_its_task_runs_has_the_server_cancel_it() -> TestResult {
    // Following in place, then parked: both cancels reach the server.
    for (run_id, park_after, status) in [
        ("cancel-live", "60s", pb::RunStatus::Running),
        ("cancel-parked", "0s", pb::RunStatus::AwaitingTask),
    ] {
        let world = world(crunch(run_id, 60.0), &["--task-park-after", park_after], 1, None).await?;
        let mut client = world.client_of(0).await?;
        let mut run = request(run_id);
        run.detached = true;
        let mut stream = client.orchestrate(run).await?.into_inner();
        read_until(&mut stream, |e| matches!(e, E::ToolCallProgress(_))).await?;
        log_shows(&world, &format!("started {run_id}")).await?;
        wait_status(&client, run_id, status).await?;
        let canceled = client
            .cancel_run(pb::CancelRunRequest {
                run_id: run_id.into(),
                ..Default::default()
            })
            .await?
            .into_inner();
        assert!(canceled.canceled, "{run_id}: {canceled:?}");
        log_shows(&world, &format!("cancelled {run_id}")).await?;
        let ended = wait_status(&client, run_id, pb::RunStatus::Canceled).await?;
        assert_eq!(
            ended.tool_calls.len(),
            0,
            "{run_id}: the call never finished: {ended:?}"
        );
    }
    Ok(())
}

/// Following a task is bounded: a run whose deadline pauses while a person decides is held to it
/// while it only follows a task (parked or not: it ends `DEADLINE_EXCEEDED` and the server is
/// asked to cancel the task), and past `--task-max-follow` a task still working fails its call,
/// is canceled, and the run goes on to its answer.
#[tokio::test]
async fn a_task_wait_is_bounded_by_the_deadline_and_the_follow_ceiling() -> TestResult {
    let world = world(crunch("deadline-task", 60.0), &["--task-park-after", "0s"], 1, None).await?;
    let mut client = world.client_of(0).await?;
    let mut run = request("deadline-task");
    run.limits = Some(pb::RunLimits {
        run_timeout_ms: Some(2000),
        ..Default::default()
    });
    run.tools = Some(pb::ToolSelection {
        approval: Some(pb::ApprovalPolicy {
            pause_deadline: true,
            ..Default::default()
        }),
        ..Default::default()
    });
    let mut stream = client.orchestrate(run).await?.into_inner();
    let events = read_until(&mut stream, |e| matches!(e, E::RunFinished(_))).await?;
    let result = finished(&events).ok_or_else(|| anyhow::anyhow!("no end"))?;
    assert_eq!(
        result.failure_reason,
        pb::FailureReason::DeadlineExceeded as i32,
        "{result:?}"
    );
    log_shows(&world, "cancelled deadline-task").await?;

    let world = world_serving_ceiling().await?;
    let mut client = world.client_of(0).await?;
    let mut stream = client.orchestrate(request("ceiling-task")).await?.into_inner();
    let events = read_until(&mut stream, |e| matches!(e, E::RunFinished(_))).await?;
    let result = finished(&events).ok_or_else(|| anyhow::anyhow!("no end"))?;
    assert_eq!(result.status, pb::RunStatus::Completed as i32, "{result:?}");
    let error = result.tool_calls[0].error.clone().unwrap_or_default();
    assert!(error.message.contains("--task-max-follow"), "{result:?}");
    log_shows(&world, "cancelled ceiling-task").await?;
    Ok(())
}

/// A runner serving the tasks server to an orchestrator that follows a task for 1 s at most.
async fn world_serving_ceiling() -> anyhow::Result<World> {
    world(crunch("ceiling-task", 60.0), &["--task-max-follow", "1s"], 1, None).await
}

#[tokio::test]
async fn on_nats_a_replica_killed_while_its_run_follows_a_task_leaves_the_same_task_to_another() -> TestResult {
    let nats = testkit::nats::Nats::start().await?;
    let mut world = world(crunch("q5", 6.0), &["--task-park-after", "60s"], 2, Some(nats)).await?;
    let (mut a, b) = (world.client_of(0).await?, world.client_of(1).await?);
    let mut run = request("nats-task");
    run.detached = true;
    let mut stream = a.orchestrate(run).await?.into_inner();
    read_until(&mut stream, |e| matches!(e, E::ToolCallProgress(_))).await?;
    log_shows(&world, "started q5").await?;
    if let Some(replica) = world.replicas[0].take() {
        replica.kill().await?;
    }
    let done = wait_status(&b, "nats-task", pb::RunStatus::Completed).await?;
    assert!(done.tool_calls[0].ok, "{done:?}");
    assert_eq!(log(&world), ["started q5", "done q5"], "the work ran once");
    assert!(world.fed_back().contains("crunched q5"), "{}", world.fed_back());
    Ok(())
}

#[tokio::test]
async fn a_long_call_reports_its_progress_while_it_runs_and_the_model_never_sees_it() -> TestResult {
    let manifest = format!(
        "[[mcp_servers]]\nname = \"everything\"\ncommand = \"node\"\nargs = [\"{}\", \"stdio\"]\nrequired = true\n",
        testkit::mcp_servers::everything_js()?.display()
    );
    let scenario = Scenario::new(vec![
        Turn::text("Working.").then(Step::call(
            "everything__trigger-long-running-operation",
            json!({"duration": 2, "steps": 4}),
        )),
        Turn::text("Done."),
    ]);
    let world = world_serving(tempfile::tempdir()?, manifest, scenario, (&[], 1), None).await?;
    let mut client = world.client_of(0).await?;
    let mut stream = client.orchestrate(request("progress-1")).await?.into_inner();
    let events = read_until(&mut stream, |e| matches!(e, E::RunFinished(_))).await?;
    let result = finished(&events).ok_or_else(|| anyhow::anyhow!("no end"))?;
    assert_eq!(result.status, pb::RunStatus::Completed as i32, "{result:?}");
    let reports: Vec<(u64, &pb::ToolCallProgress)> = events
        .iter()
        .filter_map(|e| match &e.event {
            Some(E::ToolCallProgress(p)) => Some((e.seq, p)),
            _ => None,
        })
        .collect();
    assert!(reports.len() >= 2, "progress while the call ran: {events:?}");
    assert!(
        reports
            .iter()
            .all(|(_, p)| p.total == 4.0 && p.call_id == result.tool_calls[0].call_id)
    );
    assert!(
        reports.windows(2).all(|w| w[0].1.progress < w[1].1.progress),
        "{reports:?}"
    );
    let finished_at = events
        .iter()
        .find(|e| matches!(e.event, Some(E::ToolCallFinished(_))))
        .map(|e| e.seq)
        .ok_or_else(|| anyhow::anyhow!("no tool_call_finished"))?;
    assert!(
        reports.iter().all(|(seq, _)| *seq < finished_at),
        "progress comes before the result"
    );
    assert!(world.fed_back().contains("Steps: 4"), "{}", world.fed_back());
    assert!(!world.fed_back().contains("progress"), "{}", world.fed_back());
    Ok(())
}

/// A task that asks a person inside it: the run parks waiting for the answer
/// (`AWAITING_INPUT`), `AnswerToolInput` takes it, the answer goes to the task
/// (`tasks/update`) and the task's result is the call's.
#[tokio::test]
async fn a_task_that_asks_a_person_parks_the_run_and_the_answer_goes_to_the_task() -> TestResult {
    let scenario = Scenario::new(vec![
        Turn::text("Asking.").then(Step::call("batch__approve_batch", json!({"batch": "b9"}))),
        Turn::text("Done."),
    ]);
    let world = world(scenario, &[], 1, None).await?;
    let mut client = world.client_of(0).await?;
    let mut stream = client.orchestrate(request("task-asks")).await?.into_inner();
    read_until(&mut stream, |e| matches!(e, E::ToolInputRequested(_))).await?;
    let parked = wait_status(&client, "task-asks", pb::RunStatus::AwaitingInput).await?;
    let pending = &parked.pending_approvals[0];
    let question = &pending.input_requests[0];
    assert!(question.message.contains("b9"), "{question:?}");
    assert!(log(&world).is_empty(), "nothing processed before the answer");
    client
        .answer_tool_input(pb::AnswerToolInputRequest {
            round: String::new(),
            run_id: "task-asks".into(),
            call_id: pending.call_id.clone(),
            answers: vec![pb::ToolInputAnswer {
                key: question.key.clone(),
                action: pb::InputAction::Accept.into(),
                content_json: r#"{"approve": true}"#.into(),
            }],
        })
        .await?;
    let events = read_until(&mut stream, |e| matches!(e, E::RunFinished(_))).await?;
    let result = finished(&events).ok_or_else(|| anyhow::anyhow!("no end"))?;
    assert_eq!(result.status, pb::RunStatus::Completed as i32, "{result:?}");
    assert!(world.fed_back().contains("batch b9 processed"), "{}", world.fed_back());
    assert_eq!(log(&world), ["processed b9"]);
    Ok(())
}
