//! A tool that asks a person before it can finish, through the real `orchestrator` binary
//! (in-memory store), a tool-runner speaking MCP 2026-07-28 to a Python `mcp` 2.x server
//! written for the tests (`tests/fixtures/mcp/refund_server.py`: a refund that asks for a
//! confirmation, a payment page), and the stand-in model: the run streams
//! `tool_input_requested` and parks holding no slot (`RUN_STATUS_AWAITING_INPUT`); answers
//! (`AnswerToolInput`) are checked against the question's schema; accepted, the call runs again
//! with them and the refund happens once; declined or expired (`cancel`), the tool says so to
//! the model; a URL question's page never reaches the model. With the NATS store the waiting run
//! belongs to no replica: answered on another one (the one that asked even killed meanwhile), it
//! goes on there and the refund happens once.

use std::time::Duration;

use mock_llm::{Scenario, Step, Turn};
use proto::orchestrator::v1 as pb;
use proto::orchestrator::v1::orchestrate_event::Event as E;
use serde_json::json;
use testkit::runs::{read_until, wait_status};
use tokio::process::Command;

type TestResult = anyhow::Result<()>;

const BIN: &str = env!("CARGO_BIN_EXE_orchestrator");

/// Orchestrator binaries (several on one NATS store, or one in memory) on a tool-runner in this
/// process that serves the refund server.
type World = testkit::runs::Fleet;

async fn world(scenario: Scenario, flags: &[&str]) -> anyhow::Result<World> {
    world_of(scenario, flags, 1, None).await
}

/// `replicas` orchestrators with `flags`, on `nats` when given.
async fn world_of(
    scenario: Scenario,
    flags: &[&str],
    replicas: usize,
    nats: Option<testkit::nats::Nats>,
) -> anyhow::Result<World> {
    let dir = tempfile::tempdir()?;
    let manifest = testkit::mcp_servers::refund_server_table(&dir.path().join("refunds.log"))?;
    World::start((BIN, dir, &manifest), scenario, (flags, replicas), nats).await
}

/// The refunds the server did.
fn refunds(world: &World) -> Vec<String> {
    world.lines_of("refunds.log")
}

/// Turn 1 calls `tool` with `args`; turn 2 answers.
fn call_then_answer(tool: &str, args: serde_json::Value) -> Scenario {
    Scenario::new(vec![
        Turn::text("On it.").then(Step::call(tool, args)),
        Turn::text("Done."),
    ])
}

/// A run whose questions expire after `timeout_ms` (`input_timeout_ms`; 0: the server's
/// default).
fn run(run_id: &str, timeout_ms: u32) -> pb::OrchestrateRequest {
    pb::OrchestrateRequest {
        run_id: run_id.into(),
        limits: Some(pb::RunLimits {
            input_timeout_ms: (timeout_ms > 0).then_some(timeout_ms),
            ..Default::default()
        }),
        ..testkit::user("refund order A-7")
    }
}

fn asked(events: &[pb::OrchestrateEvent]) -> Option<pb::ToolInputRequested> {
    events.iter().find_map(|e| match &e.event {
        Some(E::ToolInputRequested(asked)) => Some(asked.clone()),
        _ => None,
    })
}

fn finished(events: &[pb::OrchestrateEvent]) -> Option<pb::RunResult> {
    events.iter().find_map(|e| match &e.event {
        Some(E::RunFinished(f)) => f.result.clone(),
        _ => None,
    })
}

fn answer(run_id: &str, call_id: &str, answers: Vec<(&str, pb::InputAction, &str)>) -> pb::AnswerToolInputRequest {
    pb::AnswerToolInputRequest {
        run_id: run_id.into(),
        call_id: call_id.into(),
        answers: answers
            .into_iter()
            .map(|(key, action, content)| pb::ToolInputAnswer {
                key: key.into(),
                action: action.into(),
                content_json: content.into(),
            })
            .collect(),
        round: String::new(),
    }
}

#[tokio::test]
async fn a_question_is_asked_the_run_parks_and_the_answer_finishes_the_call() -> TestResult {
    let world = world(
        call_then_answer("shop__refund", json!({"order": "A-7", "amount": 5.0})),
        &[],
    )
    .await?;
    let mut client = world.client_of(0).await?;
    let mut stream = client.orchestrate(run("ask-1", 0)).await?.into_inner();
    let events = read_until(&mut stream, |e| matches!(e, E::ToolInputRequested(_))).await?;
    let question = asked(&events).ok_or_else(|| anyhow::anyhow!("no question"))?;
    assert_eq!((question.name.as_str(), question.turn), ("shop__refund", 1));
    let [request] = &question.requests[..] else {
        anyhow::bail!("one question expected: {question:?}");
    };
    assert_eq!((request.key.as_str(), request.mode.as_str()), ("confirm", "form"));
    assert!(request.message.contains("A-7"), "{request:?}");
    let schema: serde_json::Value = serde_json::from_str(&request.schema_json)?;
    assert_eq!(schema["properties"]["confirm"]["type"], "boolean");

    // It waits, holding no slot, shown as waiting for input and listed with approvals.
    let waiting = testkit::wait::until("the run to wait for input", Duration::from_secs(20), || {
        let mut client = client.clone();
        async move {
            let run = client
                .get_run(pb::GetRunRequest { run_id: "ask-1".into() })
                .await
                .ok()?
                .into_inner();
            (run.status == pb::RunStatus::AwaitingInput as i32).then_some(run)
        }
    })
    .await?;
    assert_eq!(waiting.pending_approvals[0].input_requests[0].key, "confirm");
    let listed = client
        .list_pending_approvals(pb::ListPendingApprovalsRequest::default())
        .await?
        .into_inner();
    assert_eq!(listed.approvals[0].call_id, question.call_id);
    assert!(refunds(&world).is_empty(), "nothing refunded before the answer");

    // The questions are a round, named the same in the stream, the run and the listing; answers
    // to another round are refused, not taken for this one.
    assert_eq!(question.round.len(), 16, "{question:?}");
    assert_eq!(listed.approvals[0].input_round, question.round);
    assert_eq!(waiting.pending_approvals[0].input_round, question.round);
    let other_round = pb::AnswerToolInputRequest {
        round: "0123456789abcdef".into(),
        ..answer(
            "ask-1",
            &question.call_id,
            vec![("confirm", pb::InputAction::Accept, r#"{"confirm": true}"#)],
        )
    };
    let refused = client
        .answer_tool_input(other_round)
        .await
        .err()
        .ok_or_else(|| anyhow::anyhow!("an answer to another round was taken"))?;
    assert_eq!(refused.code(), tonic::Code::FailedPrecondition, "{refused:?}");
    assert!(
        refused
            .message()
            .contains(&format!("asks round {} now", question.round)),
        "{refused:?}"
    );

    // Approving it is refused (it is answered), and so are answers its schema refuses.
    let refused = client
        .decide_tool_calls(pb::DecideToolCallsRequest {
            run_id: "ask-1".into(),
            decisions: vec![pb::ToolCallDecision {
                call_id: question.call_id.clone(),
                kind: pb::DecisionKind::Approve.into(),
                ..Default::default()
            }],
        })
        .await
        .err()
        .ok_or_else(|| anyhow::anyhow!("an approval of questions was taken"))?;
    assert_eq!(refused.code(), tonic::Code::InvalidArgument, "{refused:?}");
    assert!(refused.message().contains("AnswerToolInput"), "{refused:?}");
    let accept = pb::InputAction::Accept;
    for (content, says) in [
        (r#"{"confirm": "yes"}"#, "refused"),
        ("", "takes content_json"),
        ("not json", "not JSON"),
    ] {
        let bad = answer("ask-1", &question.call_id, vec![("confirm", accept, content)]);
        let refused = client
            .answer_tool_input(bad)
            .await
            .err()
            .ok_or_else(|| anyhow::anyhow!("{content:?} was taken"))?;
        assert_eq!(refused.code(), tonic::Code::InvalidArgument, "{content}: {refused:?}");
        assert!(refused.message().contains(says), "{content}: {refused:?}");
    }

    // Accepted (naming its round): the call runs again with the answer, the refund happens
    // once, the run ends.
    let taken = client
        .answer_tool_input(pb::AnswerToolInputRequest {
            round: question.round.clone(),
            ..answer(
                "ask-1",
                &question.call_id,
                vec![("confirm", accept, r#"{"confirm": true}"#)],
            )
        })
        .await?
        .into_inner();
    assert!(taken.still_pending.is_empty(), "{taken:?}");
    let again = client
        .answer_tool_input(answer(
            "ask-1",
            &question.call_id,
            vec![("confirm", accept, r#"{"confirm": true}"#)],
        ))
        .await
        .err()
        .ok_or_else(|| anyhow::anyhow!("a second answer was taken"))?;
    assert!(
        matches!(again.code(), tonic::Code::FailedPrecondition | tonic::Code::NotFound),
        "{again:?}"
    );
    let events = read_until(&mut stream, |e| matches!(e, E::RunFinished(_))).await?;
    let result = finished(&events).ok_or_else(|| anyhow::anyhow!("no end"))?;
    assert_eq!(result.status, pb::RunStatus::Completed as i32, "{result:?}");
    let call = &result.tool_calls[0];
    assert!(call.ok, "{call:?}");
    let decision = call
        .approval
        .as_ref()
        .ok_or_else(|| anyhow::anyhow!("no answer recorded"))?;
    assert_eq!(decision.outcome, pb::ApprovalOutcome::Answered as i32);
    assert_eq!(refunds(&world), ["A-7 5.0"]);
    assert!(
        world.fed_back().contains("refunded 5.0 for order A-7"),
        "{}",
        world.fed_back()
    );
    Ok(())
}

#[tokio::test]
async fn declined_and_expired_questions_reach_the_model_as_the_tools_answer() -> TestResult {
    let world = world(
        call_then_answer("shop__refund", json!({"order": "B-2", "amount": 9.0})),
        &[],
    )
    .await?;
    let mut client = world.client_of(0).await?;
    let mut stream = client.orchestrate(run("ask-2", 0)).await?.into_inner();
    let events = read_until(&mut stream, |e| matches!(e, E::ToolInputRequested(_))).await?;
    let question = asked(&events).ok_or_else(|| anyhow::anyhow!("no question"))?;
    client
        .answer_tool_input(answer(
            "ask-2",
            &question.call_id,
            vec![("confirm", pb::InputAction::Decline, "")],
        ))
        .await?;
    let events = read_until(&mut stream, |e| matches!(e, E::RunFinished(_))).await?;
    assert_eq!(
        finished(&events).map(|r| r.status),
        Some(pb::RunStatus::Completed as i32)
    );
    assert!(
        world.fed_back().contains("the person answered decline"),
        "{}",
        world.fed_back()
    );
    assert!(refunds(&world).is_empty());

    // Nobody answers a run whose questions expire after 1.5 s: each is answered cancel. The
    // server's ceiling (--input-timeout-ceiling 2s here) is taken, a wait above it refused.
    let world = world_again(&world, "C-3").await?;
    let mut client = world.client_of(0).await?;
    let refused = client
        .orchestrate(run("ask-too-long", 2001))
        .await
        .err()
        .ok_or_else(|| anyhow::anyhow!("a wait above the ceiling was taken"))?;
    assert_eq!(refused.code(), tonic::Code::InvalidArgument, "{refused:?}");
    assert!(refused.message().contains("input_timeout_ms"), "{refused:?}");
    let mut stream = client.orchestrate(run("ask-3", 1500)).await?.into_inner();
    let events = read_until(&mut stream, |e| matches!(e, E::RunFinished(_))).await?;
    assert!(asked(&events).is_some(), "{events:?}");
    assert!(
        world.fed_back().contains("the person answered cancel"),
        "{}",
        world.fed_back()
    );
    assert!(refunds(&world).is_empty());
    Ok(())
}

/// A new world for order `order` (its own stand-in model script), its answer waits at most 2 s
/// and 1 s by default.
async fn world_again(_: &World, order: &str) -> anyhow::Result<World> {
    world(
        call_then_answer("shop__refund", json!({"order": order, "amount": 1.0})),
        &["--input-timeout", "1s", "--input-timeout-ceiling", "2s"],
    )
    .await
}

#[tokio::test]
async fn a_url_questions_page_goes_to_the_person_never_to_the_model() -> TestResult {
    let world = world(call_then_answer("shop__pay", json!({"order": "D-4"})), &[]).await?;
    let mut client = world.client_of(0).await?;
    let mut stream = client.orchestrate(run("ask-4", 0)).await?.into_inner();
    let events = read_until(&mut stream, |e| matches!(e, E::ToolInputRequested(_))).await?;
    let question = asked(&events).ok_or_else(|| anyhow::anyhow!("no question"))?;
    assert_eq!(
        (question.requests[0].mode.as_str(), question.requests[0].url.as_str()),
        ("url", "https://pay.example/D-4")
    );
    client
        .answer_tool_input(answer(
            "ask-4",
            &question.call_id,
            vec![("visit", pb::InputAction::Accept, "")],
        ))
        .await?;
    read_until(&mut stream, |e| matches!(e, E::RunFinished(_))).await?;
    let requests = serde_json::to_string(&world.llm.requests())?;
    assert!(
        !requests.contains("pay.example"),
        "the page reached the model: {requests}"
    );
    assert!(
        world.fed_back().contains("payment page for D-4: accept"),
        "{}",
        world.fed_back()
    );
    Ok(())
}

#[tokio::test]
async fn on_nats_a_question_asked_on_one_replica_is_answered_on_another_and_the_run_goes_on() -> TestResult {
    let nats = testkit::nats::Nats::start().await?;
    let world = world_of(
        call_then_answer("shop__refund", json!({"order": "E-5", "amount": 2.0})),
        &[],
        2,
        Some(nats),
    )
    .await?;
    let (mut a, mut b) = (world.client_of(0).await?, world.client_of(1).await?);
    let mut stream = a.orchestrate(run("nats-ask-1", 0)).await?.into_inner();
    let events = read_until(&mut stream, |e| matches!(e, E::ToolInputRequested(_))).await?;
    let question = asked(&events).ok_or_else(|| anyhow::anyhow!("no question"))?;
    let parked = wait_status(&b, "nats-ask-1", pb::RunStatus::AwaitingInput).await?;
    assert_eq!(parked.pending_approvals[0].input_requests[0].key, "confirm");
    b.answer_tool_input(answer(
        "nats-ask-1",
        &question.call_id,
        vec![("confirm", pb::InputAction::Accept, r#"{"confirm": true}"#)],
    ))
    .await?;
    let events = read_until(&mut stream, |e| matches!(e, E::RunFinished(_))).await?;
    let result = finished(&events).ok_or_else(|| anyhow::anyhow!("no end"))?;
    assert_eq!(result.status, pb::RunStatus::Completed as i32, "{result:?}");
    assert_eq!(refunds(&world), ["E-5 2.0"]);
    let stored = b
        .get_run(pb::GetRunRequest {
            run_id: "nats-ask-1".into(),
        })
        .await?
        .into_inner();
    assert_eq!(stored, result, "every replica reads the end the caller saw");

    // The replica that asked is killed while the next run waits; answered on the other, it
    // goes on there.
    let mut request = run("nats-ask-2", 0);
    request.detached = true;
    drop(a.orchestrate(request).await?);
    let parked = wait_status(&b, "nats-ask-2", pb::RunStatus::AwaitingInput).await?;
    let call_id = parked.pending_approvals[0].call_id.clone();
    let mut world = world;
    if let Some(replica) = world.replicas[0].take() {
        replica.kill().await?;
    }
    b.answer_tool_input(answer(
        "nats-ask-2",
        &call_id,
        vec![("confirm", pb::InputAction::Accept, r#"{"confirm": true}"#)],
    ))
    .await?;
    let done = wait_status(&b, "nats-ask-2", pb::RunStatus::Completed).await?;
    assert!(done.tool_calls[0].ok, "{done:?}");
    assert_eq!(refunds(&world), ["E-5 2.0", "E-5 2.0"], "each run's refund once");
    Ok(())
}

/// From a shell: `orchestrator approvals` lists the questions, `orchestrator answer RUN_ID`
/// answers them, and the run goes on; an answer for a run that waits for nothing (`--run-id`
/// spells the run too) is refused saying no run waits for a person.
#[tokio::test]
async fn the_command_line_lists_and_answers_questions() -> TestResult {
    let world = world(
        call_then_answer("shop__refund", json!({"order": "F-6", "amount": 3.0})),
        &[],
    )
    .await?;
    let endpoint = format!(
        "http://{}",
        world.replicas[0]
            .as_ref()
            .ok_or_else(|| anyhow::anyhow!("no replica"))?
            .grpc
    );
    let mut client = world.client_of(0).await?;
    let mut stream = client.orchestrate(run("cli-ask", 0)).await?.into_inner();
    let events = read_until(&mut stream, |e| matches!(e, E::ToolInputRequested(_))).await?;
    let question = asked(&events).ok_or_else(|| anyhow::anyhow!("no question"))?;
    wait_status(&client, "cli-ask", pb::RunStatus::AwaitingInput).await?;
    let listed = Command::new(BIN)
        .args(["approvals", "--endpoint", &endpoint])
        .output()
        .await?;
    let printed = String::from_utf8_lossy(&listed.stdout);
    assert!(listed.status.success(), "{printed}");
    assert!(
        printed.contains("waits for answers") && printed.contains("? confirm (form): Refund 3.0 for order F-6?"),
        "{printed}"
    );
    let answered = Command::new(BIN)
        .args(["answer", "cli-ask", "--endpoint", &endpoint])
        .args([
            "--call-id",
            &question.call_id,
            "--accept",
            r#"confirm={"confirm": true}"#,
        ])
        .output()
        .await?;
    let printed = String::from_utf8_lossy(&answered.stdout);
    assert!(
        answered.status.success() && printed.contains("answered; run cli-ask goes on"),
        "{printed}\n{}",
        String::from_utf8_lossy(&answered.stderr)
    );
    let events = read_until(&mut stream, |e| matches!(e, E::RunFinished(_))).await?;
    assert_eq!(
        finished(&events).map(|r| r.status),
        Some(pb::RunStatus::Completed as i32)
    );
    assert_eq!(refunds(&world), ["F-6 3.0"]);
    let again = Command::new(BIN)
        .args(["answer", "--run-id", "cli-other", "--endpoint", &endpoint])
        .args(["--call-id", &question.call_id, "--decline", "confirm"])
        .output()
        .await?;
    let told = String::from_utf8_lossy(&again.stderr);
    assert!(
        !again.status.success() && told.contains("no run \"cli-other\" waits for a person"),
        "an answer to a run that waits for nothing says so, not that it waits for approval: {told}"
    );
    Ok(())
}

/// A tool that asks twice (two rounds) finishes once both are answered; with
/// `--max-input-rounds 1` its second round fails the call instead, and the model is told why.
#[tokio::test]
async fn a_tool_asks_again_up_to_max_input_rounds() -> TestResult {
    for (rounds, finishes) in [("2", true), ("1", false)] {
        let world = world(
            call_then_answer("shop__close_account", json!({"account": "H-8"})),
            &["--max-input-rounds", rounds],
        )
        .await?;
        let mut client = world.client_of(0).await?;
        let mut stream = client.orchestrate(run("rounds", 0)).await?.into_inner();
        for key in ["close", "sure"].into_iter().take(if finishes { 2 } else { 1 }) {
            let events = read_until(&mut stream, |e| matches!(e, E::ToolInputRequested(_))).await?;
            let question = asked(&events).ok_or_else(|| anyhow::anyhow!("no question"))?;
            assert_eq!(question.requests[0].key, key, "{question:?}");
            client
                .answer_tool_input(answer(
                    "rounds",
                    &question.call_id,
                    vec![(key, pb::InputAction::Accept, r#"{"yes": true}"#)],
                ))
                .await?;
        }
        let events = read_until(&mut stream, |e| matches!(e, E::RunFinished(_))).await?;
        let result = finished(&events).ok_or_else(|| anyhow::anyhow!("no end"))?;
        let call = &result.tool_calls[0];
        assert_eq!(call.ok, finishes, "--max-input-rounds {rounds}: {call:?}");
        if !finishes {
            let error = call.error.as_ref().map(|e| e.message.clone()).unwrap_or_default();
            assert!(error.contains("at most 1 times (--max-input-rounds)"), "{error}");
        }
    }
    Ok(())
}

/// What a person types never reaches a log line: an answer's form content, a rejection's reason
/// and edited arguments, each a planted secret, through the real orchestrator and tool-runner
/// binaries (the runner serving the refund server), are searched for in every line both logged.
#[tokio::test]
async fn answers_reasons_and_edits_never_reach_a_log_line() -> TestResult {
    const ANSWER: &str = "PLANTED-answer-31c7";
    const REASON: &str = "PLANTED-reason-8d02";
    const EDIT: &str = "PLANTED-edit-5f4a";
    let dir = tempfile::tempdir()?;
    let manifest = dir.path().join("tools.toml");
    std::fs::write(
        &manifest,
        testkit::mcp_servers::refund_server_table(&dir.path().join("refunds.log"))?,
    )?;
    let mut runner_command = Command::new(testkit::tool_runner_bin!()?);
    runner_command
        .env_remove("OTEL_EXPORTER_OTLP_ENDPOINT")
        .arg("--tools-manifest")
        .arg(&manifest);
    let runner = testkit::Service::spawn(runner_command, "127.0.0.1", "tool-runner serving").await?;
    let llm =
        mock_llm::MockLlm::start(call_then_answer("shop__refund", json!({"order": "A-7", "amount": 5.0}))).await?;
    let command = testkit::orchestrator_command(BIN, &llm.base_url(), &format!("http://{}", runner.grpc));
    let orchestrator = testkit::Service::orchestrator(command).await?;
    let mut client =
        pb::orchestrator_client::OrchestratorClient::connect(format!("http://{}", orchestrator.grpc)).await?;

    // An answer whose form carries the secret.
    let mut stream = client.orchestrate(run("secret-answer", 0)).await?.into_inner();
    let events = read_until(&mut stream, |e| matches!(e, E::ToolInputRequested(_))).await?;
    let question = asked(&events).ok_or_else(|| anyhow::anyhow!("no question"))?;
    let content = json!({"confirm": true, "note": ANSWER}).to_string();
    let accept = pb::InputAction::Accept;
    client
        .answer_tool_input(answer(
            "secret-answer",
            &question.call_id,
            vec![("confirm", accept, &content)],
        ))
        .await?;
    read_until(&mut stream, |e| matches!(e, E::RunFinished(_))).await?;

    // A rejection whose reason is the secret, and an edit whose arguments carry one.
    for (run_id, decision) in [
        (
            "secret-reason",
            pb::ToolCallDecision {
                kind: pb::DecisionKind::Reject.into(),
                message: REASON.into(),
                ..Default::default()
            },
        ),
        (
            "secret-edit",
            pb::ToolCallDecision {
                kind: pb::DecisionKind::ApproveEdited.into(),
                arguments_json: json!({"order": "A-7", "amount": 5.0, "memo": EDIT}).to_string(),
                ..Default::default()
            },
        ),
    ] {
        let mut request = run(run_id, 0);
        request.tools = Some(pb::ToolSelection {
            approval: Some(pb::ApprovalPolicy {
                tools: vec!["shop__refund".into()],
                ..Default::default()
            }),
            ..Default::default()
        });
        let mut stream = client.orchestrate(request).await?.into_inner();
        let events = read_until(&mut stream, |e| matches!(e, E::ApprovalRequested(_))).await?;
        let call_id = events
            .iter()
            .find_map(|e| match &e.event {
                Some(E::ApprovalRequested(a)) => Some(a.call_id.clone()),
                _ => None,
            })
            .ok_or_else(|| anyhow::anyhow!("no approval asked"))?;
        let decided = client
            .decide_tool_calls(pb::DecideToolCallsRequest {
                run_id: run_id.into(),
                decisions: vec![pb::ToolCallDecision { call_id, ..decision }],
            })
            .await;
        // An edit the tool's schema refuses is refused with the checker's words: still typed.
        if let Err(refused) = decided {
            assert!(!refused.message().contains(EDIT), "{refused:?}");
            continue;
        }
        read_until(&mut stream, |e| {
            matches!(e, E::RunFinished(_) | E::ToolInputRequested(_))
        })
        .await?;
    }

    let logs = [("orchestrator", orchestrator.logs()), ("tool-runner", runner.logs())];
    for (service, lines) in &logs {
        assert!(!lines.is_empty(), "{service} logged nothing");
        for line in lines {
            for secret in [ANSWER, REASON, EDIT] {
                assert!(!line.contains(secret), "{service} logged {secret}: {line}");
            }
        }
    }
    orchestrator.stop().await?;
    runner.stop().await?;
    Ok(())
}
