//! `CancelRun`'s modes through the real binary, on both stores: a cancel after the turn lets the
//! turn's tool call run to its end and be recorded, asks the model nothing more, and ends the run
//! `CANCELED` with everything kept (on the NATS store, asked on a replica that does not run the
//! run); an immediate cancel that follows wins.

use std::time::Duration;

use mock_llm::{MockLlm, Scenario, Step, Turn};
use orchestrator_client::{Client, Event, RunRequest};
use proto::orchestrator::v1 as pb;
use testkit::Service;
use testkit::nats::Nats;
use testkit::runs::{client, ended, until_the_call_runs};

type TestResult = anyhow::Result<()>;

/// A model whose first turn writes, then calls `sleep` for `ms`; its second turn would answer.
async fn a_nap_then_an_answer(ms: u64) -> anyhow::Result<MockLlm> {
    Ok(MockLlm::start(Scenario::new(vec![
        Turn::text("Working.\n").then(Step::call("sleep", serde_json::json!({ "ms": ms }))),
        Turn::text("Never asked."),
    ]))
    .await?)
}

/// One orchestrator on the memory store, its model napping `ms` in the first turn, and a client.
async fn one_replica(ms: u64) -> anyhow::Result<(MockLlm, Service, Client)> {
    let model = a_nap_then_an_answer(ms).await?;
    let runner = testkit::tool_runner_in_process().await?;
    let service = orchestrator(&model, &runner, None).await?;
    let client = client(&service).await?;
    Ok((model, service, client))
}

/// An orchestrator process on `model`, keeping runs in `nats` when given.
async fn orchestrator(model: &MockLlm, runner: &str, nats: Option<&Nats>) -> anyhow::Result<Service> {
    let bin = env!("CARGO_BIN_EXE_orchestrator");
    testkit::runs::orchestrator(bin, (&model.base_url(), runner), nats.map(Nats::url).as_deref(), &[]).await
}

fn request(run_id: &str) -> RunRequest {
    RunRequest::prompt("work").run_id(run_id).tool("sleep").detached(true)
}

/// What a run canceled after its turn keeps: its text, its call run to the end and recorded, and
/// the model asked once.
fn ended_after_its_turn(run: &pb::RunResult, model: &MockLlm) {
    assert_eq!(run.status(), pb::RunStatus::Canceled, "{run:?}");
    assert!(run.failure_detail.contains("after its turn"), "{}", run.failure_detail);
    assert_eq!(run.text, "Working.\n");
    assert_eq!(run.tool_calls.len(), 1, "{run:?}");
    assert!(
        run.tool_calls[0].ok,
        "the turn's call ran to its end: {:?}",
        run.tool_calls
    );
    assert_eq!(model.requests().len(), 1, "no new model request after the turn");
}

#[tokio::test]
async fn a_cancel_after_the_turn_lets_its_call_finish_and_the_run_ends_canceled() -> TestResult {
    let (model, service, client) = one_replica(1500).await?;
    let mut stream = client.orchestrate(request("after-turn")).await?;
    until_the_call_runs(&client, "after-turn").await?;
    assert!(client.cancel_after_turn("after-turn").await?, "the run was live");
    assert_eq!(
        client.get_run("after-turn").await?.status(),
        pb::RunStatus::Running,
        "the turn goes on"
    );
    let mut finished_calls = 0;
    while let Some(event) = tokio::time::timeout(Duration::from_secs(30), stream.next_event()).await?? {
        if let Event::ToolCallFinished(call) = event {
            assert!(call.error.is_none(), "{call:?}");
            finished_calls += 1;
        }
    }
    assert_eq!(finished_calls, 1, "the caller saw the call finish");
    let run = ended(&client, "after-turn").await?;
    ended_after_its_turn(&run, &model);
    assert_eq!(stream.text(), run.text, "the stream tells the result's text");
    service.stop().await
}

#[tokio::test]
async fn an_immediate_cancel_after_a_cancel_after_the_turn_wins() -> TestResult {
    let (model, service, client) = one_replica(60_000).await?;
    client.orchestrate(request("both")).await?;
    until_the_call_runs(&client, "both").await?;
    assert!(client.cancel_after_turn("both").await?);
    assert!(client.cancel_run("both").await?);
    let run = ended(&client, "both").await?;
    assert_eq!(run.status(), pb::RunStatus::Canceled);
    assert_eq!(run.failure_detail, "canceled by CancelRun");
    assert!(
        run.tool_calls.iter().all(|c| !c.ok),
        "the call in flight was abandoned, not waited for: {:?}",
        run.tool_calls
    );
    assert_eq!(model.requests().len(), 1);
    service.stop().await
}

#[tokio::test]
async fn a_cancel_after_the_turn_asked_on_another_replica_reaches_the_run() -> TestResult {
    let nats = Nats::start().await?;
    let model = a_nap_then_an_answer(1500).await?;
    let runner = testkit::tool_runner_in_process().await?;
    let a = orchestrator(&model, &runner, Some(&nats)).await?;
    let b = orchestrator(&model, &runner, Some(&nats)).await?;
    let (on_a, on_b) = (client(&a).await?, client(&b).await?);
    on_a.orchestrate(request("elsewhere")).await?;
    until_the_call_runs(&on_a, "elsewhere").await?;
    assert!(on_b.cancel_after_turn("elsewhere").await?, "b asked a, which runs it");
    let run = ended(&on_b, "elsewhere").await?;
    ended_after_its_turn(&run, &model);
    assert!(
        a.logged("a cancel asked on another replica", Duration::from_secs(1))
            .await
    );
    a.stop().await?;
    b.stop().await
}
