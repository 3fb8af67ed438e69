//! `SendMessage` through the real binary, on both stores: a message sent while the run's call
//! runs reaches the run's next model request and its stream (`message_added`); the message's
//! size and the run's count are bounded on both sides of their limits; a run that has ended,
//! or is unknown, refuses it with the documented codes; `orchestrator say` sends one; and on the
//! NATS store a message sent to a replica that does not run the run reaches it.

use std::time::Duration;

use mock_llm::{MockLlm, Scenario, Step, Turn};
use orchestrator_client::{Client, Event, RunRequest};
use proto::orchestrator::v1 as pb;
use testkit::Service;
use testkit::nats::Nats;
use testkit::runs::{client, ended, until_the_call_runs};

type TestResult = anyhow::Result<()>;

/// A model whose first turn calls `sleep` for `ms`; its second turn answers.
async fn a_nap_then_an_answer(ms: u64) -> anyhow::Result<MockLlm> {
    Ok(MockLlm::start(Scenario::new(vec![
        Turn::text("Working.\n").then(Step::call("sleep", serde_json::json!({ "ms": ms }))),
        Turn::text("Done, with the weather too."),
    ]))
    .await?)
}

/// An orchestrator process on `model` with `flags`, keeping runs in `nats` when given.
async fn orchestrator(model: &MockLlm, runner: &str, nats: Option<&Nats>, flags: &[&str]) -> anyhow::Result<Service> {
    let bin = env!("CARGO_BIN_EXE_orchestrator");
    testkit::runs::orchestrator(bin, (&model.base_url(), runner), nats.map(Nats::url).as_deref(), flags).await
}

fn request(run_id: &str) -> RunRequest {
    RunRequest::prompt("work").run_id(run_id).tool("sleep").detached(true)
}

/// The text of the newest message of the model's `n`th request.
fn newest_message(model: &MockLlm, n: usize) -> String {
    let requests = model.requests();
    requests
        .get(n)
        .and_then(|r| r["messages"].as_array())
        .and_then(|m| m.last())
        .and_then(|m| m["content"].as_str())
        .unwrap_or_default()
        .to_owned()
}

/// The texts of the run's `message_added` events, read from its log.
async fn messages_added(client: &Client, run_id: &str) -> anyhow::Result<Vec<(u32, String)>> {
    let mut stream = client.attach(run_id, 0).await?;
    let mut added = Vec::new();
    while let Some(event) = tokio::time::timeout(Duration::from_secs(20), stream.next_event()).await?? {
        if let Event::MessageAdded(m) = event {
            added.push((m.turn, m.message.unwrap_or_default().content));
        }
    }
    Ok(added)
}

fn code(result: Result<u32, orchestrator_client::Error>) -> Option<tonic::Code> {
    result.err().and_then(|e| e.code())
}

#[tokio::test]
async fn a_message_sent_while_the_call_runs_reaches_the_next_model_request() -> TestResult {
    let model = a_nap_then_an_answer(1500).await?;
    let runner = testkit::tool_runner_in_process().await?;
    let service = orchestrator(&model, &runner, None, &[]).await?;
    let client = client(&service).await?;
    client.orchestrate(request("steered")).await?;
    until_the_call_runs(&client, "steered").await?;
    assert_eq!(client.send_message("steered", "Also check the weather.").await?, 1);
    let run = ended(&client, "steered").await?;
    assert_eq!(run.status(), pb::RunStatus::Completed, "{run:?}");
    assert_eq!(model.requests().len(), 2);
    assert!(newest_message(&model, 1).ends_with("Also check the weather."));
    assert_eq!(
        messages_added(&client, "steered").await?,
        [(2, "Also check the weather.".to_owned())]
    );
    let after = client.send_message("steered", "and one more").await;
    assert_eq!(code(after), Some(tonic::Code::FailedPrecondition), "the run has ended");
    let unknown = client.send_message("no-such-run", "hello").await;
    assert_eq!(code(unknown), Some(tonic::Code::NotFound));
    service.stop().await
}

/// `--max-steering-message-bytes` and `--max-steering-messages`, each on both sides.
#[tokio::test]
async fn a_run_takes_messages_up_to_its_count_and_size_limits() -> TestResult {
    let model = a_nap_then_an_answer(3000).await?;
    let runner = testkit::tool_runner_in_process().await?;
    let flags = ["--max-steering-messages", "2", "--max-steering-message-bytes", "16"];
    let service = orchestrator(&model, &runner, None, &flags).await?;
    let client = client(&service).await?;
    client.orchestrate(request("bounded")).await?;
    until_the_call_runs(&client, "bounded").await?;
    let too_long = client.send_message("bounded", &"x".repeat(17)).await;
    assert_eq!(code(too_long), Some(tonic::Code::InvalidArgument));
    assert_eq!(client.send_message("bounded", &"x".repeat(16)).await?, 1);
    assert_eq!(client.send_message("bounded", "second").await?, 2);
    let third = client.send_message("bounded", "third").await;
    assert_eq!(code(third), Some(tonic::Code::ResourceExhausted));
    let run = ended(&client, "bounded").await?;
    assert_eq!(run.status(), pb::RunStatus::Completed, "{run:?}");
    assert!(newest_message(&model, 1).ends_with(&format!("{}\n\nsecond", "x".repeat(16))));
    service.stop().await
}

#[tokio::test]
async fn orchestrator_say_sends_a_message_to_a_live_run() -> TestResult {
    let model = a_nap_then_an_answer(2000).await?;
    let runner = testkit::tool_runner_in_process().await?;
    let service = orchestrator(&model, &runner, None, &[]).await?;
    let client = client(&service).await?;
    client.orchestrate(request("said")).await?;
    until_the_call_runs(&client, "said").await?;
    let said = tokio::process::Command::new(env!("CARGO_BIN_EXE_orchestrator"))
        .args([
            "say",
            "--endpoint",
            &format!("http://{}", service.grpc),
            "said",
            "Use metric units.",
        ])
        .output()
        .await?;
    let out = String::from_utf8_lossy(&said.stdout);
    assert!(said.status.success(), "{out} {}", String::from_utf8_lossy(&said.stderr));
    assert!(out.contains("1 message(s) wait"), "{out}");
    ended(&client, "said").await?;
    assert!(newest_message(&model, 1).ends_with("Use metric units."));
    let late = tokio::process::Command::new(env!("CARGO_BIN_EXE_orchestrator"))
        .args(["say", "--endpoint", &format!("http://{}", service.grpc), "said", "late"])
        .output()
        .await?;
    assert!(!late.status.success(), "a run that ended refuses");
    assert!(String::from_utf8_lossy(&late.stderr).contains("has ended"));
    service.stop().await
}

#[tokio::test]
async fn a_message_sent_on_another_replica_reaches_the_run() -> TestResult {
    let nats = Nats::start().await?;
    let model = a_nap_then_an_answer(1500).await?;
    let runner = testkit::tool_runner_in_process().await?;
    let a = orchestrator(&model, &runner, Some(&nats), &[]).await?;
    let b = orchestrator(&model, &runner, Some(&nats), &[]).await?;
    let (on_a, on_b) = (client(&a).await?, client(&b).await?);
    on_a.orchestrate(request("elsewhere")).await?;
    until_the_call_runs(&on_a, "elsewhere").await?;
    assert_eq!(on_b.send_message("elsewhere", "Sent to b.").await?, 1);
    let run = ended(&on_b, "elsewhere").await?;
    assert_eq!(run.status(), pb::RunStatus::Completed, "{run:?}");
    assert!(newest_message(&model, 1).ends_with("Sent to b."));
    assert_eq!(
        messages_added(&on_b, "elsewhere").await?,
        [(2, "Sent to b.".to_owned())]
    );
    assert!(
        a.logged("a message sent on another replica", Duration::from_secs(1))
            .await
    );
    let after = on_b.send_message("elsewhere", "late").await;
    assert_eq!(code(after), Some(tonic::Code::FailedPrecondition));
    a.stop().await?;
    b.stop().await
}
