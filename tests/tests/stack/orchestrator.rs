//! End-to-end tests of the orchestrator: the real orchestrator, tool-runner and stand-in model
//! on loopback, one scenario per rule of the loop (docs/architecture.md). Every run also passes the four
//! invariants (docs/architecture.md, "Invariants"; checked by `Stack::run`): streamed text equals the result's text,
//! one terminal status with `run_finished` last, `GetRun` equals the final result, and output
//! produced before a failure is kept.

use std::time::Duration;

use mock_llm::{Scenario, Step, Turn};
use proto::orchestrator::v1 as pb;
use proto::orchestrator::v1::orchestrate_event::Event as E;
use proto::orchestrator::v1::{FailureReason as R, RunStatus as S};
use serde_json::{Value, json};
use testkit::stack::{Outcome, Stack, request, runner_config};
use testkit::{read_pids, wait_gone};

type TestResult = anyhow::Result<()>;

async fn scripted(turns: Vec<Turn>) -> anyhow::Result<Stack> {
    Stack::start(Scenario::new(turns), runner_config(None), |_| {}).await
}

fn with_limits(mut req: pb::OrchestrateRequest, limits: pb::RunLimits) -> pb::OrchestrateRequest {
    req.limits = Some(limits);
    req
}

fn call_raw(name: &str, raw_arguments: &str) -> Step {
    Step::ToolCall {
        name: name.into(),
        arguments: Value::String(raw_arguments.into()),
        id: None,
        fragments: Some(2),
    }
}

#[tokio::test]
async fn a_plain_answer_completes() -> TestResult {
    let stack = scripted(vec![Turn::text("Hello there. Nothing to call.")]).await?;
    let out = stack.run(request("hi", &[])).await?;
    assert_eq!(out.status(), S::Completed);
    assert_eq!(out.result.text, "Hello there. Nothing to call.");
    assert_eq!((out.result.turns, out.result.finish_reason.as_str()), (1, "stop"));
    assert!(out.result.usage.is_some_and(|u| u.completion_tokens > 0));
    // The model saw the BIOS first, then the user message, and the tools.
    let sent = &stack.mock.requests()[0];
    assert_eq!(sent["messages"][0]["role"], "system");
    assert!(
        sent["messages"][0]["content"]
            .as_str()
            .is_some_and(|s| s.contains("turn 1 of at most 16"))
    );
    assert_eq!(sent["messages"][1], json!({"role": "user", "content": "hi"}));
    assert_eq!(sent["stream"], true);
    assert!(
        sent["tools"]
            .as_array()
            .is_some_and(|t| t.iter().any(|t| t["function"]["name"] == "sleep"))
    );
    Ok(())
}

#[tokio::test]
async fn parallel_calls_run_concurrently_and_results_keep_model_order() -> TestResult {
    let mut first = Turn::text("Four naps at once.\n");
    for ms in [500, 450, 400, 350] {
        first = first.then(Step::call("sleep", json!({"ms": ms})));
    }
    let stack = scripted(vec![first, Turn::text("Rested.")]).await?;
    let out = stack.run(request("sleep", &[])).await?;
    assert_eq!(out.status(), S::Completed);
    assert!(
        out.elapsed < Duration::from_millis(1500),
        "4 calls of ≤500 ms took {:?}",
        out.elapsed
    );
    let ids = ["call_1_0", "call_1_1", "call_1_2", "call_1_3"];
    let started: Vec<String> = out.of(|e| {
        if let E::ToolCallStarted(c) = e {
            Some(c.call_id.clone())
        } else {
            None
        }
    });
    let finished: Vec<String> = out.of(|e| {
        if let E::ToolCallFinished(c) = e {
            Some(c.call_id.clone())
        } else {
            None
        }
    });
    assert_eq!(started, ids);
    assert_eq!(finished, ids);
    let records: Vec<&str> = out.result.tool_calls.iter().map(|c| c.call_id.as_str()).collect();
    assert_eq!(records, ids);
    // The second request carries one assistant message with the calls and the tool results in order.
    let second = &stack.mock.requests()[1];
    let messages = second["messages"].as_array().cloned().unwrap_or_default();
    let assistant = messages
        .iter()
        .find(|m| m["role"] == "assistant")
        .cloned()
        .unwrap_or_default();
    assert_eq!(assistant["content"], "Four naps at once.\n");
    let call_ids: Vec<&str> = assistant["tool_calls"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|c| c["id"].as_str())
        .collect();
    assert_eq!(call_ids, ids);
    let tool_ids: Vec<&str> = messages
        .iter()
        .filter(|m| m["role"] == "tool")
        .filter_map(|m| m["tool_call_id"].as_str())
        .collect();
    assert_eq!(tool_ids, ids);
    let slept: Vec<Value> = messages
        .iter()
        .filter(|m| m["role"] == "tool")
        .filter_map(|m| serde_json::from_str::<Value>(m["content"].as_str()?).ok())
        .map(|v| v["slept_ms"].clone())
        .collect();
    assert_eq!(slept, [json!(500), json!(450), json!(400), json!(350)]);
    Ok(())
}

#[tokio::test]
async fn an_exit_signal_is_published_costs_no_budget_and_stays_out_of_the_conversation() -> TestResult {
    let stack = scripted(vec![
        Turn::text("Reporting and echoing.\n")
            .then(Step::call("submit_report", json!({"title": "t"})))
            .then(Step::call("echo", json!({"x": 1}))),
        Turn::text("Done."),
    ])
    .await?;
    let mut subscriber = stack
        .client()
        .await?
        .subscribe_signals(pb::SubscribeSignalsRequest::default())
        .await?
        .into_inner();
    let mut req = with_limits(
        request("go", &["submit_report"]),
        pb::RunLimits {
            tool_call_budget: Some(5),
            ..Default::default()
        },
    );
    req.metadata.insert("ticket".into(), "T-1".into());
    let out = stack.run(req).await?;
    assert_eq!(out.status(), S::Completed);

    let signals: Vec<pb::Signal> = out.of(|e| if let E::Signal(s) = e { Some(s.clone()) } else { None });
    assert_eq!(signals.len(), 1);
    let signal = &signals[0];
    assert_eq!(
        (signal.tool_name.as_str(), signal.turn, signal.arguments_valid),
        ("submit_report", 1, true)
    );
    assert_eq!(
        serde_json::from_str::<Value>(&signal.arguments_json)?,
        json!({"title": "t"})
    );
    assert_eq!(signal.metadata.get("ticket").map(String::as_str), Some("T-1"));
    assert_eq!(out.result.signals, signals);

    let published = tokio::time::timeout(Duration::from_secs(5), subscriber.message()).await??;
    assert_eq!(
        published.and_then(|e| e.event),
        Some(pb::signal_event::Event::Signal(signal.clone()))
    );

    // Only the echo call cost budget.
    let budgets: Vec<u32> = out.of(|e| {
        if let E::TurnFinished(t) = e {
            Some(t.tool_call_budget_remaining)
        } else {
            None
        }
    });
    assert_eq!(budgets, [4, 4]);
    // The exit call is offered as a tool but is absent from the next request's conversation.
    let second = &stack.mock.requests()[1];
    assert!(
        second["tools"]
            .as_array()
            .is_some_and(|t| t.iter().any(|t| t["function"]["name"] == "submit_report"))
    );
    let text = second["messages"].to_string();
    assert!(!text.contains("submit_report\""), "{text}");
    let calls = second["messages"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|m| m["role"] == "assistant")
        .flat_map(|m| m["tool_calls"].as_array().cloned().unwrap_or_default())
        .count();
    assert_eq!(calls, 1);
    Ok(())
}

#[tokio::test]
async fn an_exit_only_turn_completes_the_run() -> TestResult {
    let stack = scripted(vec![
        Turn::text("Escalating.").then(Step::call("escalate_to_human", json!({"why": "unsure"}))),
    ])
    .await?;
    let out = stack.run(request("help", &["escalate_to_human"])).await?;
    assert_eq!(
        (out.status(), out.result.turns, out.result.signals.len()),
        (S::Completed, 1, 1)
    );
    assert!(out.result.tool_calls.is_empty());
    Ok(())
}

fn failing_turn() -> Turn {
    // The runner refuses each: -1 violates the sleep schema.
    Turn::text("Trying.\n")
        .then(Step::call("sleep", json!({"ms": -1})))
        .then(Step::call("sleep", json!({"ms": -2})))
        .then(Step::call("sleep", json!({"ms": -3})))
}

#[tokio::test]
async fn three_failing_calls_in_one_turn_count_as_one_failed_turn() -> TestResult {
    let stack = scripted(vec![failing_turn(), Turn::text("Recovered.")]).await?;
    let out = stack
        .run(with_limits(
            request("x", &[]),
            pb::RunLimits {
                max_tool_failures: Some(1),
                ..Default::default()
            },
        ))
        .await?;
    assert_eq!(out.status(), S::Completed);
    assert_eq!(out.result.failed_turns, 1);
    assert_eq!(out.result.tool_calls.iter().filter(|c| !c.ok).count(), 3);
    // Errors are fed back as {"error": {"code", "message"}}.
    let content: Value = serde_json::from_str(&fed_back_tool_answer(&stack)?)?;
    assert_eq!(content["error"]["code"], "INVALID_ARGUMENTS");
    assert!(
        content["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("minimum"))
    );
    Ok(())
}

#[tokio::test]
async fn the_failure_limit_on_both_sides_of_its_edge() -> TestResult {
    let turns = vec![failing_turn(), failing_turn(), Turn::text("Recovered.")];
    let limit = |n| pb::RunLimits {
        max_tool_failures: Some(n),
        ..Default::default()
    };
    let stack = scripted(turns).await?;
    let out = stack.run(with_limits(request("x", &[]), limit(2))).await?;
    assert_eq!((out.status(), out.result.failed_turns), (S::Completed, 2));
    let out = stack.run(with_limits(request("x", &[]), limit(1))).await?;
    assert_eq!(
        (out.status(), out.reason(), out.result.failed_turns),
        (S::Failed, R::ToolFailureLimit, 2)
    );
    assert!(
        out.result.text.starts_with("Trying.\nTrying.\n"),
        "output before the failure is kept"
    );
    let out = stack.run(with_limits(request("x", &[]), limit(0))).await?;
    assert_eq!(
        (out.status(), out.reason(), out.result.turns),
        (S::Failed, R::ToolFailureLimit, 1)
    );
    Ok(())
}

#[tokio::test]
async fn the_budget_executes_what_remains_then_ends_the_run() -> TestResult {
    let three = Turn::text("Three echoes.\n")
        .then(Step::call("echo", json!({"n": 1})))
        .then(Step::call("echo", json!({"n": 2})))
        .then(Step::call("echo", json!({"n": 3})));
    let stack = scripted(vec![three, Turn::text("All echoed.")]).await?;
    let budget = |n| pb::RunLimits {
        tool_call_budget: Some(n),
        ..Default::default()
    };
    let out = stack.run(with_limits(request("x", &[]), budget(2))).await?;
    assert_eq!((out.status(), out.reason()), (S::Failed, R::ToolBudgetExhausted));
    let executed: Vec<&str> = out
        .result
        .tool_calls
        .iter()
        .map(|c| c.arguments_json.as_str())
        .collect();
    assert_eq!(
        executed,
        [r#"{"n":1}"#, r#"{"n":2}"#],
        "the first two in model order ran"
    );
    let out = stack.run(with_limits(request("x", &[]), budget(3))).await?;
    assert_eq!((out.status(), out.result.tool_calls.len()), (S::Completed, 3));
    Ok(())
}

#[tokio::test]
async fn unknown_tools_fail_the_run_or_are_fed_back_by_policy() -> TestResult {
    let stack = scripted(vec![
        Turn::text("Hm.\n").then(Step::call("teleport", json!({}))),
        Turn::text("Sorry."),
    ])
    .await?;
    let out = stack.run(request("x", &[])).await?;
    assert_eq!((out.status(), out.reason()), (S::Failed, R::ToolParseError));
    assert!(out.result.failure_detail.contains("teleport"));
    assert_eq!(out.result.text, "Hm.\n");

    let mut req = request("x", &[]);
    req.parse_policy = pb::ParsePolicy::FeedBack.into();
    let out = stack.run(req).await?;
    assert_eq!((out.status(), out.result.failed_turns), (S::Completed, 1));
    let record = &out.result.tool_calls[0];
    assert_eq!((record.name.as_str(), record.ok), ("teleport", false));
    assert_eq!(record.error.as_ref().map(|e| e.code.as_str()), Some("NOT_FOUND"));
    Ok(())
}

#[tokio::test]
async fn arguments_that_are_not_an_object_are_a_parse_error() -> TestResult {
    let stack = scripted(vec![Turn::text("Calling.\n").then(call_raw("echo", "[1, 2]"))]).await?;
    let out = stack.run(request("x", &[])).await?;
    assert_eq!((out.status(), out.reason()), (S::Failed, R::ToolParseError));
    assert!(
        out.result.failure_detail.contains("not a JSON object"),
        "{}",
        out.result.failure_detail
    );
    let broken = scripted(vec![Turn::text("Calling.\n").then(call_raw("echo", "{\"broken\": "))]).await?;
    let out = broken.run(request("x", &[])).await?;
    assert_eq!((out.status(), out.reason()), (S::Failed, R::ToolParseError));
    Ok(())
}

#[tokio::test]
async fn fallback_calls_in_text_run_normal_tools_and_signal_exit_tools() -> TestResult {
    let stack = scripted(vec![
        Turn {
            steps: vec![Step::Text {
                text: "Let me echo.\n<tool_call>{\"name\": \"echo\", \"arguments\": {\"x\": 7}}</tool_call>".into(),
                chunk_chars: Some(5),
            }],
            ..Turn::default()
        },
        Turn::text("Filing.\n```json\n{\"tool\": \"submit_report\", \"arguments\": {\"ok\": true}}\n```\n"),
    ])
    .await?;
    let out = stack.run(request("x", &["submit_report"])).await?;
    assert_eq!(out.status(), S::Completed);
    assert_eq!(out.result.tool_calls.len(), 1);
    assert_eq!(out.result.tool_calls[0].arguments_json, r#"{"x":7}"#);
    assert_eq!(out.result.signals.len(), 1);
    assert_eq!(out.result.signals[0].tool_name, "submit_report");
    assert!(
        !out.result.text.contains("tool_call") && !out.result.text.contains("submit_report"),
        "{:?}",
        out.result.text
    );
    assert_eq!(out.result.text.trim_end(), "Let me echo.\nFiling.");

    // A malformed directive keeps the text as written and fails the run.
    let stack = e2e_stack_text("Here: <tool_call>{\"name\": \"echo\"</tool_call> ok").await?;
    let out = stack.run(request("x", &[])).await?;
    assert_eq!((out.status(), out.reason()), (S::Failed, R::ToolParseError));
    assert_eq!(out.result.text, "Here: <tool_call>{\"name\": \"echo\"</tool_call> ok");
    Ok(())
}

async fn e2e_stack_text(text: &str) -> anyhow::Result<Stack> {
    scripted(vec![Turn::text(text)]).await
}

#[tokio::test]
async fn the_loop_detector_on_both_sides_of_its_threshold() -> TestResult {
    let line = "I am thinking about the answer.\n";
    let tweak = |c: &mut orchestrator::Config| {
        c.runs.loop_detector.window = 20;
        c.runs.loop_detector.threshold = 5;
    };
    let below = Stack::start(
        Scenario::new(vec![Turn::text(&line.repeat(4))]),
        runner_config(None),
        tweak,
    )
    .await?;
    let out = below.run(request("x", &[])).await?;
    assert_eq!(out.status(), S::Completed);
    let at = Stack::start(
        Scenario::new(vec![Turn::text(&format!("{}never shown\n", line.repeat(5)))]),
        runner_config(None),
        tweak,
    )
    .await?;
    let out = at.run(request("x", &[])).await?;
    assert_eq!((out.status(), out.reason()), (S::Failed, R::RepeatedLineLoop));
    assert_eq!(
        out.result.text,
        line.repeat(5),
        "the text up to the fifth repetition is kept"
    );
    Ok(())
}

#[tokio::test]
async fn llm_500_and_429_are_retried_then_succeed() -> TestResult {
    let turn = Turn {
        fail_first: vec![500, 429],
        ..Turn::text("Third time lucky.")
    };
    let stack = scripted(vec![turn]).await?;
    let out = stack.run(request("x", &[])).await?;
    assert_eq!(
        (out.status(), out.result.text.as_str()),
        (S::Completed, "Third time lucky.")
    );
    assert_eq!(stack.mock.requests().len(), 3);
    // Beyond the retries the run fails with the server's message.
    let turn = Turn {
        fail_first: vec![503; 5],
        ..Turn::text("never")
    };
    let stack = Stack::start(Scenario::new(vec![turn]), runner_config(None), |c| {
        c.llm.max_retries = 1
    })
    .await?;
    let out = stack.run(request("x", &[])).await?;
    assert_eq!((out.status(), out.reason()), (S::Failed, R::LlmError));
    assert!(
        out.result.failure_detail.contains("503"),
        "{}",
        out.result.failure_detail
    );
    assert_eq!(stack.mock.requests().len(), 2);
    Ok(())
}

#[tokio::test]
async fn a_stream_cut_mid_call_keeps_the_partial_text() -> TestResult {
    let partial_call = "data: {\"choices\":[{\"index\":0,\"delta\":{\"tool_calls\":[{\"index\":0,\"id\":\"c\",\"function\":{\"name\":\"echo\",\"arguments\":\"{\\\"x\\\"\"}}]}}]}\n\n";
    let stack = scripted(vec![
        Turn::text("Partial answer, then ")
            .then(Step::Raw {
                sse: partial_call.into(),
            })
            .then(Step::Cut),
    ])
    .await?;
    let out = stack.run(request("x", &[])).await?;
    assert_eq!((out.status(), out.reason()), (S::Failed, R::LlmError));
    assert_eq!(out.result.text, "Partial answer, then ");
    assert!(out.result.tool_calls.is_empty());
    Ok(())
}

#[tokio::test]
async fn a_stalled_stream_ends_the_run_and_keeps_the_text() -> TestResult {
    let scenario = Scenario::new(vec![Turn::text("Before the silence.").then(Step::Stall)]);
    let stack = Stack::start(scenario, runner_config(None), |c| {
        c.llm.idle_timeout = Duration::from_millis(300)
    })
    .await?;
    let out = stack.run(request("x", &[])).await?;
    assert_eq!((out.status(), out.reason()), (S::Failed, R::LlmStreamStalled));
    assert_eq!(out.result.text, "Before the silence.");
    assert!(out.elapsed < Duration::from_secs(5));
    Ok(())
}

/// Writes `toml` as the tools manifest in `dir`; its path.
fn write_manifest(dir: &std::path::Path, toml: &str) -> anyhow::Result<std::path::PathBuf> {
    let path = dir.join("tools.toml");
    std::fs::write(&path, toml)?;
    Ok(path)
}

fn hang_manifest(dir: &std::path::Path) -> anyhow::Result<std::path::PathBuf> {
    write_manifest(
        dir,
        &format!(
            "[[tool]]\nname = \"hang\"\ndescription = \"waits\"\nargv = [\"sh\", \"-c\", \"sleep 30 & echo $$ $! > {}; wait\"]\n",
            dir.join("pids").display()
        ),
    )
}

#[tokio::test]
async fn cancel_run_mid_tool_cancels_the_call_on_the_runner() -> TestResult {
    let dir = tempfile::tempdir()?;
    let scenario = Scenario::new(vec![
        Turn::text("Waiting on a slow tool.\n").then(Step::call("hang", json!({}))),
    ]);
    let stack = Stack::start(scenario, runner_config(Some(hang_manifest(dir.path())?)), |_| {}).await?;
    let mut req = request("x", &[]);
    req.run_id = "cancel-me".into();
    let running = tokio::spawn({
        let client = stack.client().await?;
        async move {
            let mut client = client;
            let mut stream = client.orchestrate(req).await?.into_inner();
            let mut events = Vec::new();
            while let Some(e) = futures::StreamExt::next(&mut stream).await {
                events.push(e?);
            }
            anyhow::Ok(events)
        }
    });
    let pids = read_pids(&dir.path().join("pids"), 2).await?;
    let live = stack
        .client()
        .await?
        .get_run(pb::GetRunRequest {
            run_id: "cancel-me".into(),
        })
        .await?
        .into_inner();
    assert_eq!(
        (live.status(), live.text.as_str()),
        (S::Running, "Waiting on a slow tool.\n"),
        "GetRun on a live run"
    );
    let answer = stack
        .client()
        .await?
        .cancel_run(pb::CancelRunRequest {
            run_id: "cancel-me".into(),
            ..Default::default()
        })
        .await?
        .into_inner();
    assert!(answer.canceled);
    let out = Outcome::new(running.await??, Duration::ZERO)?;
    assert_eq!(out.status(), S::Canceled);
    assert_eq!(out.result.text, "Waiting on a slow tool.\n");
    assert_eq!(
        wait_gone(&pids, Duration::from_secs(5)).await,
        Vec::<u32>::new(),
        "the runner killed the tool"
    );
    let again = stack
        .client()
        .await?
        .cancel_run(pb::CancelRunRequest {
            run_id: "cancel-me".into(),
            ..Default::default()
        })
        .await?
        .into_inner();
    assert_eq!((again.canceled, again.status()), (false, S::Canceled));
    let missing = stack
        .client()
        .await?
        .get_run(pb::GetRunRequest { run_id: "nope".into() })
        .await
        .unwrap_err();
    assert_eq!(missing.code(), tonic::Code::NotFound);
    Ok(())
}

#[tokio::test]
async fn the_caller_going_away_cancels_a_run_unless_detached() -> TestResult {
    let dir = tempfile::tempdir()?;
    let scenario = Scenario::new(vec![Turn::text("Slow.\n").then(Step::call("hang", json!({})))]);
    let stack = Stack::start(scenario, runner_config(Some(hang_manifest(dir.path())?)), |_| {}).await?;
    let mut req = request("x", &[]);
    req.run_id = "abandoned".into();
    {
        let mut client = stack.client().await?;
        let mut stream = client.orchestrate(req).await?.into_inner();
        let _first = stream.message().await?;
        read_pids(&dir.path().join("pids"), 2).await?;
        // Dropping the stream and the client here is the caller going away.
    }
    let pids = read_pids(&dir.path().join("pids"), 2).await?;
    assert_eq!(wait_gone(&pids, Duration::from_secs(5)).await, Vec::<u32>::new());
    let client = stack.client().await?;
    let result = ended(&client, "abandoned").await?;
    assert_eq!(result.status(), S::Canceled);
    assert!(result.failure_detail.contains("went away"));

    // Detached: the run goes on without its caller.
    let stack = stack_detached().await?;
    let mut req = request("x", &[]);
    req.run_id = "detached".into();
    req.detached = true;
    {
        let mut client = stack.client().await?;
        let mut stream = client.orchestrate(req).await?.into_inner();
        let _first = stream.message().await?;
    }
    let client = stack.client().await?;
    let result = ended(&client, "detached").await?;
    assert_eq!((result.status(), result.tool_calls.len()), (S::Completed, 1));
    Ok(())
}

/// Run `run_id` once it is no longer RUNNING (within 10 s).
async fn ended(
    client: &pb::orchestrator_client::OrchestratorClient<tonic::transport::Channel>,
    run_id: &str,
) -> anyhow::Result<pb::RunResult> {
    testkit::wait::until(&format!("{run_id} to end"), Duration::from_secs(10), || {
        let mut client = client.clone();
        async move {
            let r = client
                .get_run(pb::GetRunRequest { run_id: run_id.into() })
                .await
                .ok()?
                .into_inner();
            (r.status() != S::Running).then_some(r)
        }
    })
    .await
}

async fn stack_detached() -> anyhow::Result<Stack> {
    scripted(vec![
        Turn::text("Napping.\n").then(Step::call("sleep", json!({"ms": 300}))),
        Turn::text("Awake."),
    ])
    .await
}

#[tokio::test]
async fn the_run_deadline_ends_the_run() -> TestResult {
    let stack = scripted(vec![
        Turn::text("Long nap.\n").then(Step::call("sleep", json!({"ms": 5000}))),
    ])
    .await?;
    let out = stack
        .run(with_limits(
            request("x", &[]),
            pb::RunLimits {
                run_timeout_ms: Some(500),
                ..Default::default()
            },
        ))
        .await?;
    assert_eq!((out.status(), out.reason()), (S::Failed, R::DeadlineExceeded));
    assert_eq!(out.result.text, "Long nap.\n");
    assert!(out.elapsed < Duration::from_secs(3), "{:?}", out.elapsed);
    // The caller's own gRPC deadline shortens the run the same way.
    let mut req = tonic::Request::new(request("x", &[]));
    req.set_timeout(Duration::from_millis(700));
    let mut stream = stack.client().await?.orchestrate(req).await?.into_inner();
    let mut last = None;
    while let Ok(Some(e)) = stream.message().await {
        last = Some(e);
    }
    if let Some(E::RunFinished(f)) = last.and_then(|e| e.event) {
        assert_eq!(f.result.map(|r| r.failure_reason()), Some(R::DeadlineExceeded));
    }
    Ok(())
}

#[tokio::test]
async fn max_turns_ends_a_model_that_never_stops() -> TestResult {
    let scenario = Scenario {
        repeat_last: true,
        ..Scenario::new(vec![Turn::text("Again.\n").then(Step::call("echo", json!({})))])
    };
    let stack = Stack::start(scenario, runner_config(None), |_| {}).await?;
    let out = stack
        .run(with_limits(
            request("x", &[]),
            pb::RunLimits {
                max_turns: Some(3),
                ..Default::default()
            },
        ))
        .await?;
    assert_eq!(
        (out.status(), out.reason(), out.result.turns),
        (S::Failed, R::MaxTurnsExceeded, 3)
    );
    assert_eq!(out.result.tool_calls.len(), 3);
    // The third request's newest message is the status note of its turn.
    let third = &stack.mock.requests()[2]["messages"];
    let newest = third.as_array().and_then(|m| m.last()).cloned().unwrap_or_default();
    assert_eq!(newest["role"], "user", "{third}");
    assert!(
        newest["content"]
            .as_str()
            .is_some_and(|s| s.contains("Turn 3 of at most 3")),
        "{newest}"
    );
    Ok(())
}

/// With no room to wait (`--max-queued-runs 0`) a run that finds every slot taken is refused at
/// once (`tests/runs/sharing.rs` has the runs that wait).
#[tokio::test]
async fn full_run_slots_refuse_at_once() -> TestResult {
    let scenario = Scenario::new(vec![
        Turn::text("Busy.\n").then(Step::call("sleep", json!({"ms": 1000}))),
        Turn::text("Free."),
    ]);
    let stack = Stack::start(scenario, runner_config(None), |c| {
        c.runs.max_runs = 1;
        c.runs.max_queued_runs = 0;
    })
    .await?;
    let mut client = stack.client().await?;
    let mut first = client.orchestrate(request("a", &[])).await?.into_inner();
    let _started = first.message().await?;
    let refused = stack.client().await?.orchestrate(request("b", &[])).await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::ResourceExhausted);
    while first.message().await?.is_some() {}
    // The slot is free again.
    assert_eq!(stack.run(request("c", &[])).await?.status(), S::Completed);
    Ok(())
}

/// A stack whose model writes, then calls `sleep` for a second.
async fn sleepy_stack() -> anyhow::Result<Stack> {
    scripted(vec![
        Turn::text("Sleepy.\n").then(Step::call("sleep", json!({"ms": 1000}))),
    ])
    .await
}

/// Requests that break a rule of the contract, each with the words its refusal must hold: no
/// user message, an unknown role, a tool not offered, an exit tool named as a normal one, a bad
/// exit schema, limits past their ceilings or below their minimums, a bad run id.
fn malformed_requests() -> Vec<(pb::OrchestrateRequest, &'static str)> {
    let base = request("x", &[]);
    let mut cases: Vec<(pb::OrchestrateRequest, &str)> = Vec::new();
    cases.push((
        pb::OrchestrateRequest {
            messages: vec![],
            ..base.clone()
        },
        "at least one message with role \"user\"",
    ));
    let mut r = base.clone();
    r.messages[0].role = "robot".into();
    cases.push((r, "role \"robot\""));
    let mut r = base.clone();
    r.tools = Some(pb::ToolSelection {
        normal: vec!["nope".into()],
        ..Default::default()
    });
    cases.push((r, "tools.normal names \"nope\""));
    let mut r = request("x", &["echo"]);
    r.tools.get_or_insert_default().normal = vec!["echo".into()];
    cases.push((r, "has the name of a normal tool"));
    let exit_schema = |schema: &str| {
        let mut r = base.clone();
        r.tools = Some(pb::ToolSelection {
            normal: vec![],
            exit: vec![pb::ExitToolSpec {
                name: "done".into(),
                description: String::new(),
                parameters_json_schema: schema.into(),
            }],
            ..Default::default()
        });
        r
    };
    cases.push((
        exit_schema("{\"type\": \"object\", \"required\": 5}"),
        "tools.exit[0] (done)",
    ));
    cases.push((exit_schema("{not json"), "not valid JSON"));
    cases.push((
        with_limits(
            base.clone(),
            pb::RunLimits {
                max_turns: Some(129),
                ..Default::default()
            },
        ),
        "limits.max_turns = 129 is above this server's maximum of 128",
    ));
    cases.push((
        with_limits(
            base.clone(),
            pb::RunLimits {
                tool_call_budget: Some(1001),
                ..Default::default()
            },
        ),
        "limits.tool_call_budget = 1001",
    ));
    cases.push((
        with_limits(
            base.clone(),
            pb::RunLimits {
                run_timeout_ms: Some(0),
                ..Default::default()
            },
        ),
        "below the minimum",
    ));
    cases.push((
        pb::OrchestrateRequest {
            run_id: "has space".into(),
            ..base.clone()
        },
        "run_id \"has space\" holds a space: an id is 1-128 printable ASCII characters without spaces",
    ));
    cases
}

#[tokio::test]
async fn malformed_requests_get_invalid_argument_with_an_actionable_message() -> TestResult {
    let stack = sleepy_stack().await?;
    let mut client = stack.client().await?;
    for (req, expected) in malformed_requests() {
        let status = client.orchestrate(req).await.unwrap_err();
        assert_eq!(status.code(), tonic::Code::InvalidArgument, "{expected}: {status:?}");
        assert!(
            status.message().contains(expected),
            "{:?} should contain {expected:?}",
            status.message()
        );
    }
    Ok(())
}

#[tokio::test]
async fn a_limit_exactly_at_its_ceiling_is_accepted() -> TestResult {
    let stack = sleepy_stack().await?;
    let mut client = stack.client().await?;
    let ok = client
        .orchestrate(with_limits(
            request("x", &[]),
            pb::RunLimits {
                max_turns: Some(128),
                ..Default::default()
            },
        ))
        .await;
    assert!(ok.is_ok());
    Ok(())
}

/// A second request with the id of a live run is `ALREADY_EXISTS`, not a malformed request.
#[tokio::test]
async fn a_live_duplicate_run_id_already_exists() -> TestResult {
    let stack = sleepy_stack().await?;
    let mut client = stack.client().await?;
    let live = pb::OrchestrateRequest {
        run_id: "twice".into(),
        ..request("x", &[])
    };
    let mut stream = client.orchestrate(live.clone()).await?.into_inner();
    let _started = stream.message().await?;
    let status = client.orchestrate(live).await.unwrap_err();
    assert_eq!(
        status.code(),
        tonic::Code::AlreadyExists,
        "a live duplicate is not a malformed request"
    );
    assert!(status.message().contains("already running"), "{}", status.message());
    Ok(())
}

#[tokio::test]
async fn a_finished_run_id_replays_its_result() -> TestResult {
    let stack = scripted(vec![Turn::text("Once.")]).await?;
    let req = pb::OrchestrateRequest {
        run_id: "idem".into(),
        ..request("x", &[])
    };
    let first = stack.run(req.clone()).await?;
    let second = stack.run(req).await?;
    assert_eq!(
        second.events, first.events,
        "the log's events, as the first caller saw them"
    );
    assert_eq!(first.result, second.result);
    assert_eq!(stack.mock.requests().len(), 1, "the model was not asked again");
    Ok(())
}

#[tokio::test]
async fn garbage_from_the_llm_ends_the_run_llm_error_keeping_the_text() -> TestResult {
    let cases: Vec<(&str, Vec<Step>, &str)> = vec![
        (
            "non-JSON data line",
            vec![Step::Raw {
                sse: "data: {oops\n\n".into(),
            }],
            "invalid chunk",
        ),
        (
            "wrong types",
            vec![Step::Raw {
                sse: "data: {\"choices\": [{\"delta\": {\"content\": 42}}]}\n\n".into(),
            }],
            "invalid chunk",
        ),
        (
            "not SSE",
            vec![Step::Raw {
                sse: "<html><body>Bad gateway</body></html>".into(),
            }],
            "no SSE data",
        ),
        (
            "endless line",
            vec![Step::Raw {
                sse: format!("data: {}", "x".repeat(300_000)),
            }],
            "longer than",
        ),
        (
            "error chunk",
            vec![Step::Error {
                message: "model overloaded".into(),
            }],
            "model overloaded",
        ),
    ];
    for (name, steps, expected) in cases {
        let mut turn = if name == "not SSE" {
            Turn::default()
        } else {
            Turn::text("So far so good. ")
        };
        turn.steps.extend(steps);
        turn.done = false;
        let stack = Stack::start(Scenario::new(vec![turn]), runner_config(None), |c| {
            c.llm.max_line_bytes = 100_000
        })
        .await?;
        let out = stack.run(request("x", &[])).await?;
        assert_eq!((out.status(), out.reason()), (S::Failed, R::LlmError), "{name}");
        assert!(
            out.result.failure_detail.contains(expected),
            "{name}: {}",
            out.result.failure_detail
        );
        if name != "not SSE" {
            assert_eq!(out.result.text, "So far so good. ", "{name}");
        }
    }
    Ok(())
}

#[tokio::test]
async fn a_slow_reader_slows_its_own_run() -> TestResult {
    // Far more than the HTTP/2 flow-control windows and the event buffer hold.
    let text = "word ".repeat(50_000);
    let stack = Stack::start(Scenario::new(vec![Turn::text(&text)]), runner_config(None), |c| {
        c.runs.event_buffer = 2
    })
    .await?;
    let mut client = stack.client().await?;
    let req = pb::OrchestrateRequest {
        run_id: "slow-reader".into(),
        ..request("x", &[])
    };
    let mut stream = client.orchestrate(req).await?.into_inner();
    let _started = stream.message().await?;
    // Stays: the run must be given time to produce more than the buffers hold, had it not been
    // held back by its reader; what is asserted is that it was not (nothing to wait for).
    tokio::time::sleep(Duration::from_millis(500)).await;
    let live = stack
        .client()
        .await?
        .get_run(pb::GetRunRequest {
            run_id: "slow-reader".into(),
        })
        .await?
        .into_inner();
    assert_eq!(live.status(), S::Running, "the run waits for its reader");
    assert!(
        live.text.len() < text.len(),
        "only what fits the buffers was produced: {}",
        live.text.len()
    );
    let mut events = vec![];
    while let Some(e) = stream.message().await? {
        events.push(e);
    }
    let finished = events.last().and_then(|e| e.event.clone());
    assert!(matches!(finished, Some(E::RunFinished(f)) if f.result.as_ref().is_some_and(|r| r.text == text)));
    Ok(())
}

#[tokio::test]
async fn subscribe_signals_filters_by_run_and_tool() -> TestResult {
    let stack = scripted(vec![
        Turn::text("Two signals.")
            .then(Step::call("finish", json!({})))
            .then(Step::call("escalate", json!({}))),
    ])
    .await?;
    let mut only = stack
        .client()
        .await?
        .subscribe_signals(pb::SubscribeSignalsRequest {
            run_id: "r2".into(),
            tool_names: vec!["escalate".into()],
        })
        .await?
        .into_inner();
    for id in ["r1", "r2"] {
        let req = pb::OrchestrateRequest {
            run_id: id.into(),
            ..request("x", &["finish", "escalate"])
        };
        assert_eq!(stack.run(req).await?.result.signals.len(), 2);
    }
    let first = tokio::time::timeout(Duration::from_secs(5), only.message())
        .await??
        .and_then(|e| e.event);
    let Some(pb::signal_event::Event::Signal(signal)) = first else {
        anyhow::bail!("{first:?}")
    };
    assert_eq!((signal.run_id.as_str(), signal.tool_name.as_str()), ("r2", "escalate"));
    assert!(
        tokio::time::timeout(Duration::from_millis(300), only.message())
            .await
            .is_err(),
        "nothing else matches"
    );
    Ok(())
}

#[tokio::test]
async fn draining_finishes_runs_in_flight_and_refuses_new_ones() -> TestResult {
    let mut stack = scripted(vec![
        Turn::text("Napping.\n").then(Step::call("sleep", json!({"ms": 600}))),
        Turn::text("Awake."),
    ])
    .await?;
    let mut client = stack.client().await?;
    let mut stream = client
        .orchestrate(pb::OrchestrateRequest {
            run_id: "drain".into(),
            ..request("x", &[])
        })
        .await?
        .into_inner();
    let _started = stream.message().await?;
    stack.begin_shutdown();
    {
        use tonic_health::pb::{HealthCheckRequest, health_check_response::ServingStatus, health_client::HealthClient};
        let channel = tonic::transport::Channel::from_shared(format!("http://{}", stack.addr))?
            .connect()
            .await?;
        testkit::wait::until("the health to say NOT_SERVING", Duration::from_secs(10), || {
            let mut health = HealthClient::new(channel.clone());
            async move {
                let request = HealthCheckRequest {
                    service: "orchestrator.v1.Orchestrator".into(),
                };
                let status = health.check(request).await.ok()?.into_inner().status();
                (status == ServingStatus::NotServing).then_some(())
            }
        })
        .await?;
    }
    let refused = client.orchestrate(request("y", &[])).await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::Unavailable);
    let mut events = vec![];
    while let Some(e) = stream.message().await? {
        events.push(e);
    }
    let Some(E::RunFinished(f)) = events.last().and_then(|e| e.event.clone()) else {
        anyhow::bail!("no run_finished")
    };
    assert_eq!(f.result.map(|r| r.status()), Some(S::Completed));
    stack.shutdown().await
}

#[tokio::test]
async fn draining_past_the_grace_period_cancels_with_a_stored_result() -> TestResult {
    let scenario = Scenario::new(vec![
        Turn::text("Very long nap.\n").then(Step::call("sleep", json!({"ms": 20_000}))),
    ]);
    let mut stack = Stack::start(scenario, runner_config(None), |c| {
        c.server.shutdown_grace = Duration::from_millis(500)
    })
    .await?;
    let mut client = stack.client().await?;
    let mut stream = client.orchestrate(request("x", &[])).await?.into_inner();
    let started = stream.message().await?;
    let began = std::time::Instant::now();
    stack.begin_shutdown();
    let mut events: Vec<pb::OrchestrateEvent> = started.into_iter().collect();
    while let Ok(Some(e)) = stream.message().await {
        events.push(e);
    }
    let out = Outcome::new(events, began.elapsed())?;
    assert_eq!(out.status(), S::Canceled);
    assert!(out.result.failure_detail.contains("shutting down"));
    assert_eq!(out.result.text, "Very long nap.\n");
    assert!(out.elapsed < Duration::from_secs(3), "{:?}", out.elapsed);
    stack.shutdown().await
}

#[tokio::test]
async fn health_and_reflection_v1_and_v1alpha_describe_the_orchestrator() -> TestResult {
    use tonic_health::pb::{HealthCheckRequest, health_check_response::ServingStatus, health_client::HealthClient};
    let stack = scripted(vec![Turn::text("ok")]).await?;
    let channel = tonic::transport::Channel::from_shared(format!("http://{}", stack.addr))?
        .connect()
        .await?;
    let status = HealthClient::new(channel.clone())
        .check(HealthCheckRequest {
            service: "orchestrator.v1.Orchestrator".into(),
        })
        .await?
        .into_inner()
        .status();
    assert_eq!(status, ServingStatus::Serving);
    for names in testkit::reflected_services(channel.clone()).await? {
        for expected in [
            "orchestrator.v1.Orchestrator",
            "grpc.reflection.v1alpha.ServerReflection",
        ] {
            assert!(names.iter().any(|n| n == expected), "{names:?} lacks {expected}");
        }
        assert!(
            !names.iter().any(|n| n == "toolrunner.v1.ToolRunner"),
            "the orchestrator does not serve it: {names:?}"
        );
    }
    Ok(())
}

#[tokio::test]
async fn run_id_call_id_and_metadata_reach_the_tool() -> TestResult {
    let dir = tempfile::tempdir()?;
    let manifest = write_manifest(
        dir.path(),
        "[[tool]]\nname = \"whoami\"\ndescription = \"prints its context\"\nargv = [\"env\"]\noutput = \"text\"\n",
    )?;
    let scenario = Scenario::new(vec![
        Turn::text("Who am I?\n").then(Step::call("whoami", json!({}))),
        Turn::text("I see."),
    ]);
    let stack = Stack::start(scenario, runner_config(Some(manifest)), |_| {}).await?;
    let mut req = pb::OrchestrateRequest {
        run_id: "ctx-run".into(),
        ..request("x", &[])
    };
    req.metadata.insert("ticket".into(), "T-42".into());
    let out = stack.run(req).await?;
    assert_eq!(out.status(), S::Completed);
    let results: Vec<String> = out.of(|e| {
        if let E::ToolCallFinished(c) = e {
            Some(c.content_json.clone())
        } else {
            None
        }
    });
    let env: String = serde_json::from_str(&results[0])?;
    for line in ["TOOL_RUN_ID=ctx-run", "TOOL_CALL_ID=call_1_0", "TOOL_META_TICKET=T-42"] {
        assert!(env.lines().any(|l| l == line), "{line} missing from {env}");
    }
    Ok(())
}

#[tokio::test]
async fn request_counts_on_both_sides_of_their_limits() -> TestResult {
    let stack = Stack::start(Scenario::new(vec![Turn::text("ok")]), runner_config(None), |c| {
        c.runs.request.max_messages = 2;
        c.runs.request.max_request_exit_tools = 1;
        c.runs.request.max_metadata_entries = 2;
        c.runs.request.max_metadata_bytes = 12;
    })
    .await?;
    let messages = |n: usize| {
        let mut r = request("x", &[]);
        r.messages = vec![r.messages[0].clone(); n];
        r
    };
    let metadata = |pairs: &[(&str, &str)]| pb::OrchestrateRequest {
        metadata: pairs.iter().map(|(k, v)| ((*k).into(), (*v).into())).collect(),
        ..request("x", &[])
    };
    let accepted = [
        messages(2),
        request("x", &["done"]),
        metadata(&[("a", "1"), ("b", "2")]),
        metadata(&[("key", "123456789")]),
    ];
    for r in accepted {
        assert_eq!(stack.run(r).await?.status(), S::Completed);
    }
    let refused = [
        (messages(3), "messages has 3 entries; this server accepts at most 2"),
        (
            request("x", &["a", "b"]),
            "tools.exit has 2 entries; this server accepts at most 1",
        ),
        (
            metadata(&[("a", "1"), ("b", "2"), ("c", "3")]),
            "metadata has 3 entries",
        ),
        (
            metadata(&[("key", "1234567890")]),
            "metadata has 13 bytes of keys and values",
        ),
    ];
    let mut client = stack.client().await?;
    for (r, expected) in refused {
        let status = client
            .orchestrate(r)
            .await
            .err()
            .ok_or_else(|| anyhow::anyhow!("accepted: {expected}"))?;
        assert_eq!(status.code(), tonic::Code::InvalidArgument, "{expected}: {status:?}");
        assert!(
            status.message().contains(expected),
            "{:?} vs {expected:?}",
            status.message()
        );
    }
    Ok(())
}

#[tokio::test]
async fn output_over_the_limits_ends_the_run_output_limit_keeping_what_fits() -> TestResult {
    let long = "0123456789abcdef".repeat(100);
    let mut scenarios = mock_llm::Scenarios::from(Scenario::new(vec![Turn::text(&long)]));
    let fan_out = (0..3).fold(Turn::text("Three at once.\n"), |t, _| {
        t.then(Step::call("sleep", json!({"ms": 1})))
    });
    scenarios.named.insert("fan-out".into(), Scenario::new(vec![fan_out]));
    let stack = Stack::start(scenarios, runner_config(None), |c| {
        c.runs.output.max_output_bytes = 1024;
        c.runs.output.max_calls_per_turn = 2;
    })
    .await?;
    let text = stack.run(request("x", &[])).await?;
    assert_eq!((text.status(), text.reason()), (S::Failed, R::OutputLimit));
    assert_eq!(text.result.text, long[..1024], "the output up to the limit is kept");

    let fan_out = |eager| pb::OrchestrateRequest {
        model: "fan-out".into(),
        eager_tool_dispatch: Some(eager),
        ..request("x", &[])
    };
    let calls = stack.run(fan_out(false)).await?;
    assert_eq!((calls.status(), calls.reason()), (S::Failed, R::OutputLimit));
    assert!(calls.result.failure_detail.contains("more than 2 tool calls"));
    assert!(calls.result.tool_calls.is_empty(), "none of them ran");
    assert_eq!(calls.result.text, "Three at once.\n");
    // Started while the model wrote (the next call began), the first call ran and is recorded.
    let calls = stack.run(fan_out(true)).await?;
    assert_eq!((calls.status(), calls.reason()), (S::Failed, R::OutputLimit));
    let detail = &calls.result.failure_detail;
    assert!(
        detail.contains("only the 1 started while the model wrote ran"),
        "{detail}"
    );
    let ran: Vec<(&str, bool)> = calls
        .result
        .tool_calls
        .iter()
        .map(|c| (c.name.as_str(), c.ok))
        .collect();
    assert_eq!(ran, [("sleep", true)]);
    Ok(())
}

/// The model's view of the first tool answer in the second turn's request.
fn fed_back_tool_answer(stack: &Stack) -> anyhow::Result<String> {
    let requests = stack.mock.requests();
    let second = requests.get(1).ok_or_else(|| anyhow::anyhow!("no second turn"))?;
    second["messages"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|m| m["role"] == "tool")
        .and_then(|m| m["content"].as_str().map(str::to_owned))
        .ok_or_else(|| anyhow::anyhow!("no tool answer in {second}"))
}

/// `--tool-runner-max-response-bytes` on both sides: a runner's answer over it fails the call
/// (fed back to the model, the run goes on); under it, the answer is taken and what the model
/// sees is cut to `--max-tool-result-bytes`.
#[tokio::test]
async fn runner_answers_over_the_response_limit_fail_the_call_and_the_run_goes_on() -> TestResult {
    let dir = tempfile::tempdir()?;
    // 100,000 bytes of text: a JSON string of that length in the answer.
    let manifest = write_manifest(
        dir.path(),
        "[[tool]]\nname = \"big\"\ndescription = \"a large answer\"\nargv = [\"sh\", \"-c\", \"head -c 100000 /dev/zero | tr '\\\\0' a\"]\noutput = \"text\"\n",
    )?;
    let scenario = || {
        Scenario::new(vec![
            Turn::text("Big.\n").then(Step::call("big", json!({}))),
            Turn::text("Done."),
        ])
    };
    for (limit, ok) in [(64 * 1024, false), (128 * 1024, true)] {
        let stack = Stack::start(scenario(), runner_config(Some(manifest.clone())), |c| {
            c.tool_runners.max_response_bytes = limit;
            c.runs.max_tool_result_bytes = 1000;
        })
        .await?;
        let out = stack.run(request("x", &[])).await?;
        assert_eq!(out.status(), S::Completed, "limit {limit}: the run goes on");
        assert_eq!(out.result.text, "Big.\nDone.");
        let calls: Vec<bool> = out.result.tool_calls.iter().map(|c| c.ok).collect();
        assert_eq!(calls, [ok], "limit {limit}");
        let answer = fed_back_tool_answer(&stack)?;
        if ok {
            assert!(answer.starts_with("\"aaaa"), "{answer:.80}");
            assert!(
                answer.len() < 1200,
                "cut to --max-tool-result-bytes: {} bytes",
                answer.len()
            );
        } else {
            let error: Value = serde_json::from_str(&answer)?;
            assert_eq!(error["error"]["code"], "FAILED", "{answer}");
            let message = error["error"]["message"].as_str().unwrap_or_default();
            assert!(
                message.contains("too large") && message.contains(&limit.to_string()),
                "{message}"
            );
        }
    }
    Ok(())
}

/// A tool list larger than tonic's 4 MiB default message is taken under
/// `--tool-runner-max-response-bytes`; over it, the catalog fetch fails and a run is refused
/// `UNAVAILABLE` naming the bound rather than run without its tools.
#[tokio::test]
async fn a_large_tool_list_is_taken_up_to_the_response_limit() -> TestResult {
    let dir = tempfile::tempdir()?;
    // 600 tools with 8 KB descriptions: about 4.9 MB of ListTools answer.
    let description = "d".repeat(8 * 1024);
    let tools: String = (0..600)
        .map(|i| format!("[[tool]]\nname = \"t{i}\"\ndescription = \"{description}\"\nargv = [\"true\"]\n\n"))
        .collect();
    let manifest = write_manifest(dir.path(), &tools)?;
    for (limit, served) in [(8 * 1024 * 1024, true), (2 * 1024 * 1024, false)] {
        let stack = Stack::start(
            Scenario::new(vec![Turn::text("Fine.")]),
            runner_config(Some(manifest.clone())),
            |c| {
                c.tool_runners.max_response_bytes = limit;
            },
        )
        .await?;
        let mut client = stack.client().await?;
        match client.orchestrate(request("x", &[])).await {
            Ok(_) => {
                assert!(served, "limit {limit}: the list is over it");
                let offered = stack.run(request("x", &[])).await?;
                assert_eq!(offered.status(), S::Completed, "{:?}", offered.result.failure_detail);
                let first = &stack.mock.requests()[0];
                let offered_tools = first["tools"].as_array().map_or(0, Vec::len);
                assert!(offered_tools >= 600, "every tool is offered: {offered_tools}");
            }
            Err(status) => {
                assert!(!served, "limit {limit}: {status:?}");
                assert_eq!(status.code(), tonic::Code::Unavailable, "{status:?}");
                assert!(status.message().contains("too large"), "{}", status.message());
            }
        }
    }
    Ok(())
}

/// `--tool-runner-token-file` reaches a runner started with `--auth-tokens`, and a rotated token
/// is taken without a restart: once the runner accepts only the new token, calls fail (fed back
/// to the model, naming the refusal) until the orchestrator's file has it too, then succeed.
#[tokio::test]
async fn the_runner_token_is_sent_and_rotated_without_a_restart() -> TestResult {
    let dir = tempfile::tempdir()?;
    let runner_tokens = dir.path().join("runner-tokens.toml");
    let token_file = dir.path().join("runner-token");
    let accept = |token: &str| {
        format!(
            "[[token]]\nprincipal = \"orchestrator\"\nsha256 = \"{}\"\n",
            shared::auth::token_sha256(token)
        )
    };
    std::fs::write(&runner_tokens, accept("first-token"))?;
    std::fs::write(&token_file, "first-token\n")?;
    let mut runner = runner_config(None);
    runner.security.auth_tokens = Some(runner_tokens.clone());
    runner.security.tls_reload_interval = Duration::from_secs(1);
    let scenario = Scenario::new(vec![
        Turn::default().then(Step::call("calculate", json!({"expression": "6*7"}))),
        Turn::text("42."),
    ]);
    let stack = Stack::start(scenario, runner, |c| {
        c.tool_runners.token_file = Some(token_file.clone());
        c.security.tls_reload_interval = Duration::from_secs(1);
    })
    .await?;
    // The first call's outcome: Ok(true) ran, Ok(false) refused by the runner, Err(_) no run.
    let call_ran = || async {
        let out = stack.run(request("x", &[])).await?;
        let call = out.result.tool_calls.first().cloned().unwrap_or_default();
        anyhow::Ok((call.ok, call.error.map(|e| e.message).unwrap_or_default()))
    };
    let (ok, error) = call_ran().await?;
    assert!(ok, "the token reaches the runner: {error}");

    std::fs::write(&runner_tokens, accept("second-token"))?;
    let refused = poll(|| async { Ok(call_ran().await.ok().filter(|(ok, _)| !ok)) }).await?;
    assert!(refused.1.contains("Unauthenticated"), "{}", refused.1);

    std::fs::write(&token_file, "second-token\n")?;
    poll(|| async { Ok(call_ran().await.ok().filter(|(ok, _)| *ok)) }).await?;
    Ok(())
}

/// Polls `check` until it yields something, for at most 15 s (an error counts as not yet).
async fn poll<T, F, Fut>(check: F) -> anyhow::Result<T>
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<Option<T>>>,
{
    testkit::wait::until("the check to pass", Duration::from_secs(15), || async {
        check().await.ok().flatten()
    })
    .await
}

/// A stack whose model calls `calculate` then answers, and whose server sets `--llm-*`
/// defaults: temperature 0.3, max_tokens 256, and top_k and min_p in the extra body.
async fn parameters_stack() -> anyhow::Result<Stack> {
    Stack::start(
        Scenario::new(vec![
            Turn::default().then(Step::call("calculate", json!({"expression": "1+1"}))),
            Turn::text("Two."),
        ]),
        runner_config(None),
        |config| {
            config.llm.temperature = Some(0.3);
            config.llm.max_tokens = Some(256);
            config.llm.extra_body = json!({"top_k": 40, "min_p": 0.05}).as_object().cloned();
        },
    )
    .await
}

/// The model parameters through the API: what the caller sets and the server's `--llm-*`
/// defaults reach the model server's request body exactly; `tool_choice` naming a tool forces the
/// first turn only; `extra_body_json` merges flat.
#[tokio::test]
async fn model_parameters_and_server_defaults_reach_the_request_body() -> TestResult {
    let stack = parameters_stack().await?;
    let mut asked = request("add", &[]);
    asked.params = Some(pb::ModelParams {
        temperature: Some(0.0),
        presence_penalty: Some(0.5),
        frequency_penalty: Some(-0.5),
        tool_choice: "calculate".into(),
        parallel_tool_calls: Some(false),
        reasoning_effort: "low".into(),
        extra_body_json: r#"{"top_k": 1, "chat_template_kwargs": {"enable_thinking": false}}"#.into(),
        ..Default::default()
    });
    let out = stack.run(asked.clone()).await?;
    assert_eq!(out.status(), S::Completed);
    let requests = stack.mock.requests();
    let field = |turn: usize, name: &str| requests[turn][name].clone();
    for (name, value) in [
        ("temperature", json!(0.0)),
        ("max_tokens", json!(256)),
        ("presence_penalty", json!(0.5)),
        ("frequency_penalty", json!(-0.5)),
        ("parallel_tool_calls", json!(false)),
        ("reasoning_effort", json!("low")),
        ("top_k", json!(1)),
        ("min_p", json!(0.05)),
        ("chat_template_kwargs", json!({"enable_thinking": false})),
        (
            "tool_choice",
            json!({"type": "function", "function": {"name": "calculate"}}),
        ),
    ] {
        assert_eq!(field(0, name), value, "turn 1: {name}");
    }
    assert_eq!(
        field(1, "tool_choice"),
        "auto",
        "a named tool_choice forces the first turn only"
    );
    assert!(requests[0].get("top_p").is_none() && requests[0].get("seed").is_none());

    Ok(())
}

/// Bad model parameters are INVALID_ARGUMENT naming the field and what is wrong with it.
#[tokio::test]
async fn bad_model_parameters_are_refused_naming_the_field() -> TestResult {
    let stack = parameters_stack().await?;
    let mut client = stack.client().await?;
    for (params, expected) in [
        (
            pb::ModelParams {
                extra_body_json: r#"{"model": "other"}"#.into(),
                ..Default::default()
            },
            "extra_body_json may not set \"model\"",
        ),
        (
            pb::ModelParams {
                extra_body_json: r#"{"temperature": 1}"#.into(),
                temperature: Some(0.5),
                ..Default::default()
            },
            "temperature is set twice",
        ),
        (
            pb::ModelParams {
                extra_body_json: "[1]".into(),
                ..Default::default()
            },
            "must be a JSON object",
        ),
        (
            pb::ModelParams {
                tool_choice: "no_such_tool".into(),
                ..Default::default()
            },
            "tool_choice names \"no_such_tool\", which this run does not offer",
        ),
        (
            pb::ModelParams {
                tool_choice: "any tool".into(),
                ..Default::default()
            },
            "tool_choice \"any tool\"",
        ),
        (
            pb::ModelParams {
                presence_penalty: Some(2.5),
                ..Default::default()
            },
            "presence_penalty = 2.5 is outside -2..=2",
        ),
    ] {
        let mut bad = request("add", &[]);
        bad.params = Some(params);
        let status = client
            .orchestrate(bad)
            .await
            .err()
            .ok_or_else(|| anyhow::anyhow!("accepted: {expected}"))?;
        assert_eq!(status.code(), tonic::Code::InvalidArgument, "{}", status.message());
        assert!(status.message().contains(expected), "{}", status.message());
    }
    Ok(())
}

/// A server default gives way to a run's `extra_body_json` setting the same field.
#[tokio::test]
async fn a_server_default_gives_way_to_a_runs_extra_body() -> TestResult {
    let stack = parameters_stack().await?;
    let mut own = request("add", &[]);
    own.params = Some(pb::ModelParams {
        extra_body_json: r#"{"temperature": 1.5}"#.into(),
        ..Default::default()
    });
    let out = stack.run(own).await?;
    assert_eq!(out.status(), S::Completed);
    let last = stack.mock.requests().last().cloned().unwrap_or_default();
    assert_eq!(
        (last["temperature"].clone(), last["max_tokens"].clone()),
        (json!(1.5), json!(256))
    );
    Ok(())
}

/// A run whose model reasons before its call and before its answer.
fn reasoning_scenario() -> Scenario {
    Scenario::new(vec![
        Turn::default()
            .then(Step::Reasoning {
                text: "The user wants a sum. calculate does sums.".into(),
            })
            .then(Step::call("calculate", json!({"expression": "1+1"}))),
        Turn::default()
            .then(Step::Reasoning {
                text: "It said 2.".into(),
            })
            .then(Step::text("Two.")),
    ])
}

#[tokio::test]
async fn reasoning_is_streamed_kept_capped_and_sent_back_only_when_configured() -> TestResult {
    let all = "The user wants a sum. calculate does sums.It said 2.";
    let stack = Stack::start(reasoning_scenario(), runner_config(None), |_| {}).await?;
    // Outcome checks that the reasoning deltas add up to the result's, and GetRun agrees.
    let out = stack.run(request("add", &[])).await?;
    assert_eq!(
        (out.status(), out.result.text.as_str(), out.result.reasoning.as_str()),
        (S::Completed, "Two.", all)
    );
    assert!(!out.result.reasoning_truncated);
    let turns = out.of(|e| match e {
        E::ReasoningDelta(r) => Some(r.turn),
        _ => None,
    });
    assert_eq!(turns.first().copied(), Some(1));
    assert_eq!(turns.last().copied(), Some(2));
    let requests = stack.mock.requests();
    let messages = requests[1]["messages"].as_array().cloned().unwrap_or_default();
    let assistant = messages
        .iter()
        .find(|m| m["role"] == "assistant")
        .cloned()
        .unwrap_or_default();
    assert!(
        assistant.get("reasoning_content").is_none(),
        "not sent back by default: {assistant}"
    );

    // Sent back when configured; capped at --max-reasoning-bytes, one byte under what the model said.
    let cap = all.len() - 1;
    let stack = Stack::start(reasoning_scenario(), runner_config(None), |config| {
        config.llm.send_reasoning = true;
        config.runs.output.max_reasoning_bytes = cap;
    })
    .await?;
    let out = stack.run(request("add", &[])).await?;
    assert_eq!(out.status(), S::Completed, "a run does not fail over its reasoning");
    assert_eq!(
        (out.result.reasoning.as_str(), out.result.reasoning_truncated),
        (&all[..cap], true)
    );
    let requests = stack.mock.requests();
    let messages = requests[1]["messages"].as_array().cloned().unwrap_or_default();
    let assistant = messages
        .iter()
        .find(|m| m["role"] == "assistant")
        .cloned()
        .unwrap_or_default();
    assert_eq!(
        assistant["reasoning_content"], "The user wants a sum. calculate does sums.",
        "{assistant}"
    );
    Ok(())
}
