//! Human approval of tool calls, through the real `orchestrator` binary (in-memory store), a
//! tool-runner and the stand-in model: a call waits with `approval_requested`, the turn's other
//! calls run at once, the run parks holding no slot (`RUN_STATUS_AWAITING_APPROVAL`), and a
//! decision (`DecideToolCalls`) approves, rejects or edits it; a second decision, a wrong principal
//! and an edit the tool's schema refuses are refused; a timeout rejects the call or fails the run;
//! the run's deadline keeps running unless paused; the caller's stream goes on across the wait;
//! `orchestrator approvals` and `orchestrator decide` do the same from a shell.

use std::time::Duration;

use futures::StreamExt;
use mock_llm::{MockLlm, Scenario, Step, Turn};
use proto::orchestrator::v1 as pb;
use proto::orchestrator::v1::orchestrate_event::Event as E;
use serde_json::json;
use testkit::Service;
use testkit::runs::read_until;
use testkit::stack::Outcome;
use tokio::process::Command;
use tonic::transport::Channel;

type TestResult = anyhow::Result<()>;
type Client = pb::orchestrator_client::OrchestratorClient<Channel>;

const BIN: &str = env!("CARGO_BIN_EXE_orchestrator");

/// Turn 1 calls `sleep` (which waits for approval in these runs) and `echo` (which does not), in
/// parallel; turn 2 answers.
fn refund_then_answer() -> Scenario {
    Scenario::new(vec![
        Turn::text("Refunding and noting it.")
            .then(Step::call("sleep", json!({"ms": 5})))
            .then(Step::call("echo", json!({"note": "refund"}))),
        Turn::text("Done."),
    ])
}

/// The orchestrator binary with a tokens file (alice and bob own runs, carol approves), on a
/// tool-runner in this process and the stand-in model.
struct World {
    orchestrator: Service,
    llm: MockLlm,
    _dir: tempfile::TempDir,
}

async fn world(scenario: Scenario, flags: &[&str]) -> anyhow::Result<World> {
    world_with(scenario, flags, None, None).await
}

/// [`world`], its tool-runner also serving the command tools of `manifest` (TOML), the
/// orchestrator exporting its spans to `otlp` when given.
async fn world_with(
    scenario: Scenario,
    flags: &[&str],
    manifest: Option<&str>,
    otlp: Option<&str>,
) -> anyhow::Result<World> {
    let dir = tempfile::tempdir()?;
    let tokens = dir.path().join("tokens.toml");
    std::fs::write(
        &tokens,
        testkit::pki::tokens_toml(&[
            ("alice", "alice-token", ""),
            ("bob", "bob-token", ""),
            ("carol", "carol-token", "roles = [\"approver\"]"),
        ]),
    )?;
    let llm = MockLlm::start(scenario).await?;
    let mut runner = tool_runner::Config::default();
    if let Some(manifest) = manifest {
        let path = dir.path().join("tools.toml");
        std::fs::write(&path, manifest)?;
        runner.tools_manifest = Some(path);
    }
    let runner = testkit::helpers::tool_runner_in_process_with(runner).await?;
    let mut command = Command::new(BIN);
    command
        .env("LLM_BASE_URL", llm.base_url())
        .env_remove("OTEL_EXPORTER_OTLP_ENDPOINT")
        .args(["--tool-runner", &runner])
        .args(["--auth-tokens", &tokens.display().to_string()])
        .args(flags);
    if let Some(otlp) = otlp {
        command.env("OTEL_EXPORTER_OTLP_ENDPOINT", otlp);
    }
    let orchestrator = Service::orchestrator(command).await?;
    Ok(World {
        orchestrator,
        llm,
        _dir: dir,
    })
}

impl World {
    async fn client(&self) -> anyhow::Result<Client> {
        Ok(Client::connect(format!("http://{}", self.orchestrator.grpc)).await?)
    }

    fn endpoint(&self) -> String {
        format!("http://{}", self.orchestrator.grpc)
    }
}

/// `message` sent as `token`'s principal.
fn as_<T>(token: &str, message: T) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    if let Ok(value) = format!("Bearer {token}").parse() {
        request.metadata_mut().insert("authorization", value);
    }
    request
}

/// A run whose `sleep` calls wait for approval.
fn approval_run(run_id: &str) -> pb::OrchestrateRequest {
    pb::OrchestrateRequest {
        run_id: run_id.into(),
        tools: Some(pb::ToolSelection {
            approval: Some(pb::ApprovalPolicy {
                tools: vec!["sleep".into()],
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..testkit::user("refund order 7")
    }
}

async fn get(client: &mut Client, token: &str, run_id: &str) -> anyhow::Result<pb::RunResult> {
    Ok(client
        .get_run(as_(token, pb::GetRunRequest { run_id: run_id.into() }))
        .await?
        .into_inner())
}

/// Waits until the run reads `status`.
async fn wait_status(
    client: &mut Client,
    token: &str,
    run_id: &str,
    status: pb::RunStatus,
) -> anyhow::Result<pb::RunResult> {
    // A run started by another process may not be there yet.
    testkit::wait::until(
        &format!("run {run_id} to read {status:?}"),
        Duration::from_secs(20),
        || {
            let mut client = client.clone();
            async move {
                let result = client
                    .get_run(as_(token, pb::GetRunRequest { run_id: run_id.into() }))
                    .await
                    .ok()?
                    .into_inner();
                (result.status == status as i32).then_some(result)
            }
        },
    )
    .await
}

fn decision(call_id: &str, kind: pb::DecisionKind, message: &str, arguments: &str) -> pb::ToolCallDecision {
    pb::ToolCallDecision {
        call_id: call_id.into(),
        kind: kind.into(),
        message: message.into(),
        arguments_json: arguments.into(),
    }
}

async fn decide(
    client: &mut Client,
    token: &str,
    run_id: &str,
    decisions: Vec<pb::ToolCallDecision>,
) -> Result<pb::DecideToolCallsResponse, tonic::Status> {
    let request = pb::DecideToolCallsRequest {
        run_id: run_id.into(),
        decisions,
    };
    Ok(client.decide_tool_calls(as_(token, request)).await?.into_inner())
}

/// The finished run: the rest of the caller's stream, checked against the stream invariants and
/// against `GetRun`.
async fn finish(
    client: &mut Client,
    mut events: Vec<pb::OrchestrateEvent>,
    mut stream: tonic::Streaming<pb::OrchestrateEvent>,
) -> anyhow::Result<Outcome> {
    while let Some(event) = tokio::time::timeout(Duration::from_secs(20), stream.next()).await? {
        events.push(event?);
    }
    let outcome = Outcome::new(events, Duration::ZERO)?;
    let stored = get(client, "alice-token", &outcome.result.run_id).await?;
    anyhow::ensure!(stored == outcome.result, "GetRun differs from run_finished");
    Ok(outcome)
}

/// The record of the run's `sleep` call.
fn sleep_record(result: &pb::RunResult) -> anyhow::Result<&pb::ToolCallRecord> {
    result
        .tool_calls
        .iter()
        .find(|c| c.name == "sleep")
        .ok_or_else(|| anyhow::anyhow!("no sleep call in {result:?}"))
}

fn outcome_of(record: &pb::ToolCallRecord) -> pb::ApprovalOutcome {
    record
        .approval
        .as_ref()
        .and_then(|a| pb::ApprovalOutcome::try_from(a.outcome).ok())
        .unwrap_or(pb::ApprovalOutcome::Unspecified)
}

/// The approve path, with the caller's stream open across the wait: `approval_requested` for
/// `sleep` while `echo` runs at once and its `tool_call_finished` arrives; the run parks
/// (`AWAITING_APPROVAL`, pending in `GetRun` and in the listing); once carol (an approver)
/// approves, `sleep` is announced and runs, and the same stream goes on to `run_finished`; the
/// decision is in the call's record.
#[tokio::test]
async fn an_approved_call_runs_and_the_callers_stream_goes_on_across_the_wait() -> TestResult {
    let w = world(refund_then_answer(), &[]).await?;
    let mut client = w.client().await?;
    let mut stream = client
        .orchestrate(as_("alice-token", approval_run("approve-1")))
        .await?
        .into_inner();
    let mut events = read_until(&mut stream, |e| matches!(e, E::ApprovalRequested(_))).await?;
    let Some(E::ApprovalRequested(asked)) = events.last().and_then(|e| e.event.clone()) else {
        anyhow::bail!("no approval_requested");
    };
    assert_eq!((asked.name.as_str(), asked.turn), ("sleep", 1));
    assert!(asked.expires_at_unix_ms > shared::sync::unix_ms());

    // echo's outcome reaches the caller while sleep waits, not once it is decided.
    events.extend(read_until(&mut stream, |e| matches!(e, E::ToolCallFinished(c) if c.name == "echo")).await?);
    let parked = wait_status(&mut client, "alice-token", "approve-1", pb::RunStatus::AwaitingApproval).await?;
    assert_eq!(parked.pending_approvals.len(), 1, "{parked:?}");
    assert_eq!(parked.pending_approvals[0].call_id, asked.call_id);
    assert_eq!(
        parked.tool_calls.iter().map(|c| c.name.as_str()).collect::<Vec<_>>(),
        ["echo"],
        "echo's outcome is recorded while sleep waits"
    );
    let listed = client
        .list_pending_approvals(as_("carol-token", pb::ListPendingApprovalsRequest::default()))
        .await?
        .into_inner();
    assert_eq!(
        listed
            .approvals
            .iter()
            .map(|a| (a.run_id.as_str(), a.principal.as_str()))
            .collect::<Vec<_>>(),
        [("approve-1", "alice")]
    );
    let answer = decide(
        &mut client,
        "carol-token",
        "approve-1",
        vec![decision(&asked.call_id, pb::DecisionKind::Approve, "", "")],
    )
    .await?;
    assert!(answer.still_pending.is_empty());

    events.extend(read_until(&mut stream, |e| matches!(e, E::RunFinished(_))).await?);
    let outcome = finish(&mut client, events, stream).await?;
    assert_eq!(outcome.status(), pb::RunStatus::Completed);
    let started: Vec<String> = outcome.of(|e| match e {
        E::ToolCallStarted(c) => Some(c.name.clone()),
        _ => None,
    });
    assert_eq!(started, ["echo", "sleep"], "echo ran at once, sleep once approved");
    let record = sleep_record(&outcome.result)?;
    assert!(record.ok, "{record:?}");
    assert_eq!(outcome_of(record), pb::ApprovalOutcome::Approved);
    assert_eq!(record.approval.as_ref().map(|a| a.principal.as_str()), Some("carol"));
    assert!(outcome.result.pending_approvals.is_empty());
    let listed = client
        .list_pending_approvals(as_("carol-token", pb::ListPendingApprovalsRequest::default()))
        .await?
        .into_inner();
    assert!(listed.approvals.is_empty(), "{listed:?}");
    Ok(())
}

/// A rejection is fed back to the model as the call's error and is no failure: with
/// `max_tool_failures` 0 the run still completes. The owner may decide its own run.
#[tokio::test]
async fn a_rejection_is_fed_back_to_the_model_and_is_not_a_failure() -> TestResult {
    let w = world(refund_then_answer(), &[]).await?;
    let mut client = w.client().await?;
    let mut request = approval_run("reject-1");
    request.limits = Some(pb::RunLimits {
        max_tool_failures: Some(0),
        ..Default::default()
    });
    request.detached = true;
    let mut stream = client.orchestrate(as_("alice-token", request)).await?.into_inner();
    let events = read_until(&mut stream, |e| matches!(e, E::ApprovalRequested(_))).await?;
    let call_id = events
        .iter()
        .find_map(|e| match &e.event {
            Some(E::ApprovalRequested(a)) => Some(a.call_id.clone()),
            _ => None,
        })
        .unwrap_or_default();
    wait_status(&mut client, "alice-token", "reject-1", pb::RunStatus::AwaitingApproval).await?;
    decide(
        &mut client,
        "alice-token",
        "reject-1",
        vec![decision(
            &call_id,
            pb::DecisionKind::Reject,
            "refunds over 5 need a manager",
            "",
        )],
    )
    .await?;
    let outcome = finish(&mut client, events, stream).await?;
    assert_eq!(outcome.status(), pb::RunStatus::Completed, "{:?}", outcome.result);
    assert_eq!(outcome.result.failed_turns, 0);
    let record = sleep_record(&outcome.result)?;
    assert!(!record.ok);
    assert_eq!(record.error.as_ref().map(|e| e.code.as_str()), Some("REJECTED"));
    assert_eq!(outcome_of(record), pb::ApprovalOutcome::Rejected);
    let requests = w.llm.requests();
    let fed_back = requests.get(1).map(|r| r["messages"].to_string()).unwrap_or_default();
    assert!(
        fed_back.contains("refunds over 5 need a manager") && fed_back.contains("REJECTED"),
        "{fed_back}"
    );
    let started: Vec<String> = outcome.of(|e| match e {
        E::ToolCallStarted(c) => Some(c.name.clone()),
        _ => None,
    });
    assert_eq!(started, ["echo"], "a rejected call is never announced as started");
    Ok(())
}

/// The refusal of a decision that must be refused.
fn refused(answer: Result<pb::DecideToolCallsResponse, tonic::Status>) -> anyhow::Result<tonic::Status> {
    answer.err().ok_or_else(|| anyhow::anyhow!("the decision was taken"))
}

/// On Alice's run `edit-1`, waiting for `call_id`: a stranger's decision reads as one for an
/// unknown run; an edit that breaks the tool's schema is `INVALID_ARGUMENT` and leaves the call
/// waiting; an unknown call is `FAILED_PRECONDITION`, an unknown run `NOT_FOUND`.
async fn refused_decisions_leave_the_call_waiting(client: &mut Client, call_id: &str) -> TestResult {
    let call_id = call_id.to_owned();
    let stranger = decide(
        client,
        "bob-token",
        "edit-1",
        vec![decision(&call_id, pb::DecisionKind::Approve, "", "")],
    )
    .await;
    let stranger = refused(stranger)?;
    assert_eq!(stranger.code(), tonic::Code::NotFound, "{stranger:?}");
    let bad = decide(
        client,
        "alice-token",
        "edit-1",
        vec![decision(
            &call_id,
            pb::DecisionKind::ApproveEdited,
            "",
            r#"{"ms": "soon"}"#,
        )],
    )
    .await;
    let bad = refused(bad)?;
    assert_eq!(bad.code(), tonic::Code::InvalidArgument, "{bad:?}");
    assert!(bad.message().contains("still waits"), "{}", bad.message());
    let still = get(client, "alice-token", "edit-1").await?;
    assert_eq!(still.status, pb::RunStatus::AwaitingApproval as i32);
    assert!(
        still.pending_approvals[0].decision.is_none(),
        "a refused edit leaves the call waiting"
    );
    let unknown_call = decide(
        client,
        "alice-token",
        "edit-1",
        vec![decision("nope", pb::DecisionKind::Approve, "", "")],
    )
    .await;
    assert_eq!(refused(unknown_call)?.code(), tonic::Code::FailedPrecondition);
    let unknown_run = decide(
        client,
        "alice-token",
        "nope",
        vec![decision(&call_id, pb::DecisionKind::Approve, "", "")],
    )
    .await;
    let unknown_run = refused(unknown_run)?;
    assert_eq!(unknown_run.code(), tonic::Code::NotFound);
    assert_eq!(
        stranger.message(),
        unknown_run.message().replace("\"nope\"", "\"edit-1\""),
        "another owner's run answers as an unknown one"
    );

    Ok(())
}

/// An edit is checked against the tool's schema: refused with `INVALID_ARGUMENT` (the call still
/// waits), then a valid one runs with the edited arguments; the record keeps both. A second
/// decision, an unknown call and an unknown run are refused with their codes; a principal that is
/// neither owner nor approver is answered as for an unknown run.
#[tokio::test]
async fn edits_are_checked_and_second_decisions_and_strangers_are_refused() -> TestResult {
    let w = world(refund_then_answer(), &[]).await?;
    let mut client = w.client().await?;
    let mut request = approval_run("edit-1");
    request.detached = true;
    let mut stream = client.orchestrate(as_("alice-token", request)).await?.into_inner();
    let events = read_until(&mut stream, |e| matches!(e, E::ApprovalRequested(_))).await?;
    let call_id = events
        .iter()
        .find_map(|e| match &e.event {
            Some(E::ApprovalRequested(a)) => Some(a.call_id.clone()),
            _ => None,
        })
        .unwrap_or_default();
    wait_status(&mut client, "alice-token", "edit-1", pb::RunStatus::AwaitingApproval).await?;

    refused_decisions_leave_the_call_waiting(&mut client, &call_id).await?;

    decide(
        &mut client,
        "alice-token",
        "edit-1",
        vec![decision(&call_id, pb::DecisionKind::ApproveEdited, "", r#"{"ms": 7}"#)],
    )
    .await?;
    let twice = decide(
        &mut client,
        "carol-token",
        "edit-1",
        vec![decision(&call_id, pb::DecisionKind::Reject, "", "")],
    )
    .await
    .map(|_| ())
    .unwrap_err();
    // The run may not have resumed yet (the call names its decision) or have gone on already
    // (it waits for no decision now): either way FAILED_PRECONDITION saying so, not NOT_FOUND.
    assert_eq!(twice.code(), tonic::Code::FailedPrecondition, "{twice:?}");
    assert!(
        twice.message().contains("edited by \"alice\" at 20") || twice.message().contains("waits for no decision now"),
        "{}",
        twice.message()
    );
    let outcome = finish(&mut client, events, stream).await?;
    assert_eq!(outcome.status(), pb::RunStatus::Completed);
    let record = sleep_record(&outcome.result)?;
    assert_eq!(record.arguments_json, r#"{"ms": 7}"#);
    let approval = record.approval.clone().unwrap_or_default();
    assert_eq!(outcome_of(record), pb::ApprovalOutcome::Edited);
    assert_eq!(approval.original_arguments_json, r#"{"ms":5}"#);
    let finished: Vec<String> = outcome.of(|e| match e {
        E::ToolCallFinished(c) if c.name == "sleep" => Some(c.content_json.clone()),
        _ => None,
    });
    assert_eq!(
        finished,
        [r#"{"slept_ms":7}"#],
        "the call ran with the edited arguments"
    );
    Ok(())
}

/// A decision sent twice before the run resumes is refused the second time naming the first,
/// while the run still waits for another call.
#[tokio::test]
async fn a_second_decision_names_the_first() -> TestResult {
    let scenario = Scenario::new(vec![
        Turn::default()
            .then(Step::call("sleep", json!({"ms": 1})))
            .then(Step::call("sleep", json!({"ms": 2}))),
        Turn::text("ok"),
    ]);
    let w = world(scenario, &[]).await?;
    let mut client = w.client().await?;
    let mut request = approval_run("twice-1");
    request.detached = true;
    let stream = client.orchestrate(as_("alice-token", request)).await?.into_inner();
    let parked = wait_status(&mut client, "alice-token", "twice-1", pb::RunStatus::AwaitingApproval).await?;
    let ids: Vec<String> = parked.pending_approvals.iter().map(|p| p.call_id.clone()).collect();
    assert_eq!(ids.len(), 2);
    let left = decide(
        &mut client,
        "alice-token",
        "twice-1",
        vec![decision(&ids[0], pb::DecisionKind::Approve, "", "")],
    )
    .await?;
    assert_eq!(left.status, pb::RunStatus::AwaitingApproval as i32);
    assert_eq!(
        left.still_pending.iter().map(|p| p.call_id.clone()).collect::<Vec<_>>(),
        [ids[1].clone()]
    );
    let again = decide(
        &mut client,
        "carol-token",
        "twice-1",
        vec![decision(&ids[0], pb::DecisionKind::Reject, "", "")],
    )
    .await
    .map(|_| ())
    .unwrap_err();
    assert_eq!(again.code(), tonic::Code::FailedPrecondition);
    assert!(again.message().contains("approved by \"alice\""), "{}", again.message());
    // A request whose second decision is refused applies none of it.
    let partly = decide(
        &mut client,
        "carol-token",
        "twice-1",
        vec![
            decision(&ids[1], pb::DecisionKind::Approve, "", ""),
            decision(&ids[0], pb::DecisionKind::Approve, "", ""),
        ],
    )
    .await;
    assert_eq!(partly.map(|_| ()).unwrap_err().code(), tonic::Code::FailedPrecondition);
    let still = get(&mut client, "alice-token", "twice-1").await?;
    assert!(
        still
            .pending_approvals
            .iter()
            .any(|p| p.call_id == ids[1] && p.decision.is_none())
    );
    decide(
        &mut client,
        "carol-token",
        "twice-1",
        vec![decision(&ids[1], pb::DecisionKind::Approve, "", "")],
    )
    .await?;
    let outcome = finish(&mut client, Vec::new(), stream).await?;
    assert_eq!(outcome.status(), pb::RunStatus::Completed);
    assert!(outcome.result.tool_calls.iter().all(|c| c.ok), "{:?}", outcome.result);
    Ok(())
}

/// Nobody decides: past `approval_timeout_ms` the call is rejected ("approval timed out", fed
/// back) and the run goes on, or, asked so, the run ends `APPROVAL_TIMEOUT`.
#[tokio::test]
async fn an_expired_wait_rejects_the_call_or_fails_the_run() -> TestResult {
    let w = world(refund_then_answer(), &[]).await?;
    let mut client = w.client().await?;
    for (run_id, action) in [
        ("timeout-reject", pb::ApprovalTimeoutAction::Reject),
        ("timeout-fail", pb::ApprovalTimeoutAction::FailRun),
    ] {
        let mut request = approval_run(run_id);
        if let Some(approval) = request.tools.as_mut().and_then(|t| t.approval.as_mut()) {
            approval.on_timeout = action.into();
        }
        request.limits = Some(pb::RunLimits {
            approval_timeout_ms: Some(300),
            ..Default::default()
        });
        let stream = client.orchestrate(as_("alice-token", request)).await?.into_inner();
        let outcome = finish(&mut client, Vec::new(), stream).await?;
        match action {
            pb::ApprovalTimeoutAction::FailRun => {
                assert_eq!(outcome.status(), pb::RunStatus::Failed);
                assert_eq!(outcome.reason(), pb::FailureReason::ApprovalTimeout);
                assert!(outcome.result.text.contains("Refunding"), "the output so far is kept");
            }
            _ => {
                assert_eq!(outcome.status(), pb::RunStatus::Completed, "{:?}", outcome.result);
                let record = sleep_record(&outcome.result)?;
                assert_eq!(record.error.as_ref().map(|e| e.code.as_str()), Some("APPROVAL_TIMEOUT"));
                assert_eq!(outcome_of(record), pb::ApprovalOutcome::TimedOut);
            }
        }
    }
    // A wait above the server's ceiling is refused.
    let mut request = approval_run("too-long");
    request.limits = Some(pb::RunLimits {
        approval_timeout_ms: Some(25 * 3600 * 1000),
        ..Default::default()
    });
    let refused = client
        .orchestrate(as_("alice-token", request))
        .await
        .map(|_| ())
        .unwrap_err();
    assert_eq!(refused.code(), tonic::Code::InvalidArgument);
    assert!(
        refused.message().contains("approval_timeout_ms"),
        "{}",
        refused.message()
    );
    Ok(())
}

/// Turn 1 calls `echo` (which waits for approval in [`echo_waits`] runs) and a slow `sleep`, so the
/// run is still in its turn, not parked, when `echo`'s wait expires; turn 2 answers.
fn slow_turn_with_a_waiting_echo() -> Scenario {
    Scenario::new(vec![
        Turn::default()
            .then(Step::call("echo", json!({"refund": 7})))
            .then(Step::call("sleep", json!({"ms": 2500}))),
        Turn::text("Done."),
    ])
}

/// A run whose `echo` calls wait for approval at most `timeout_ms`.
fn echo_waits(run_id: &str, timeout_ms: u32) -> pb::OrchestrateRequest {
    let mut request = approval_run(run_id);
    request.tools = Some(pb::ToolSelection {
        approval: Some(pb::ApprovalPolicy {
            tools: vec!["echo".into()],
            ..Default::default()
        }),
        ..Default::default()
    });
    request.limits = Some(pb::RunLimits {
        approval_timeout_ms: Some(timeout_ms),
        ..Default::default()
    });
    request
}

/// A decision taken after `approval_timeout_ms` is refused when it is taken, though nothing has
/// applied the timeout yet (the run is still in its turn): `FAILED_PRECONDITION` naming the
/// expiry; the call then ends as timed out, and the run completes. Here through the binary with
/// the NATS store; with the stack in one process on the paused clock in `paused_clock.rs`.
async fn a_late_decision_is_refused(client: &mut Client, run_id: &str) -> TestResult {
    let mut stream = client
        .orchestrate(as_("alice-token", echo_waits(run_id, 300)))
        .await?
        .into_inner();
    let mut events = read_until(&mut stream, |e| matches!(e, E::ApprovalRequested(_))).await?;
    let Some(E::ApprovalRequested(asked)) = events.last().and_then(|e| e.event.clone()) else {
        anyhow::bail!("no approval_requested");
    };
    let expires_in = asked.expires_at_unix_ms.saturating_sub(shared::sync::unix_ms());
    // Stays: the expiry is a time, and the decision must come after it.
    tokio::time::sleep(Duration::from_millis(expires_in + 400)).await;
    let Err(late) = decide(
        client,
        "carol-token",
        run_id,
        vec![decision(&asked.call_id, pb::DecisionKind::Approve, "", "")],
    )
    .await
    else {
        anyhow::bail!("a decision after the expiry was taken");
    };
    assert_eq!(late.code(), tonic::Code::FailedPrecondition, "{late:?}");
    assert!(
        late.message().contains("expired at") && late.message().contains("approval_timeout_ms"),
        "{}",
        late.message()
    );
    events.extend(read_until(&mut stream, |e| matches!(e, E::RunFinished(_))).await?);
    let outcome = finish(client, events, stream).await?;
    assert_eq!(outcome.status(), pb::RunStatus::Completed, "{:?}", outcome.result);
    let echo = outcome
        .result
        .tool_calls
        .iter()
        .find(|c| c.name == "echo")
        .ok_or_else(|| anyhow::anyhow!("no echo record"))?;
    assert_eq!(outcome_of(echo), pb::ApprovalOutcome::TimedOut, "{echo:?}");
    Ok(())
}

#[tokio::test]
async fn a_decision_after_the_wait_expired_is_refused_with_the_nats_store() -> TestResult {
    let f = fleet(slow_turn_with_a_waiting_echo(), 1).await?;
    a_late_decision_is_refused(&mut f.client(0).await?, "late-nats").await
}

/// With `--approvals-need-approver` a run's owner cannot approve its own calls
/// (`PERMISSION_DENIED` naming the setting) nor finds them in its listing; a stranger is answered
/// as for an unknown run; an approver decides.
#[tokio::test]
async fn a_server_may_let_only_approvers_decide() -> TestResult {
    let w = world(refund_then_answer(), &["--approvals-need-approver"]).await?;
    let mut client = w.client().await?;
    let mut request = approval_run("four-eyes");
    request.detached = true;
    let stream = client.orchestrate(as_("alice-token", request)).await?.into_inner();
    let parked = wait_status(&mut client, "alice-token", "four-eyes", pb::RunStatus::AwaitingApproval).await?;
    let call_id = parked.pending_approvals[0].call_id.clone();
    let approve = || vec![decision(&call_id, pb::DecisionKind::Approve, "", "")];
    let own = decide(&mut client, "alice-token", "four-eyes", approve())
        .await
        .map(|_| ())
        .unwrap_err();
    assert_eq!(own.code(), tonic::Code::PermissionDenied, "{own:?}");
    assert!(own.message().contains("--approvals-need-approver"), "{}", own.message());
    let stranger = decide(&mut client, "bob-token", "four-eyes", approve())
        .await
        .map(|_| ())
        .unwrap_err();
    assert_eq!(stranger.code(), tonic::Code::NotFound, "{stranger:?}");
    let listed = |token: &'static str| {
        let mut client = client.clone();
        async move {
            anyhow::Ok(
                client
                    .list_pending_approvals(as_(token, pb::ListPendingApprovalsRequest::default()))
                    .await?
                    .into_inner()
                    .approvals
                    .len(),
            )
        }
    };
    assert_eq!((listed("alice-token").await?, listed("carol-token").await?), (0, 1));
    decide(&mut client, "carol-token", "four-eyes", approve()).await?;
    let outcome = finish(&mut client, Vec::new(), stream).await?;
    assert_eq!(outcome.status(), pb::RunStatus::Completed, "{:?}", outcome.result);
    assert_eq!(
        outcome_of(sleep_record(&outcome.result)?),
        pb::ApprovalOutcome::Approved
    );
    Ok(())
}

/// The run's deadline keeps running while it waits: the run ends `DEADLINE_EXCEEDED`, keeping its
/// output. (That a request may pause it, and the timeout's other rules, are checked on the
/// paused clock in `paused_clock.rs`.)
#[tokio::test]
async fn the_deadline_runs_while_waiting() -> TestResult {
    let w = world(refund_then_answer(), &[]).await?;
    let mut client = w.client().await?;
    let mut request = approval_run("deadline-1");
    request.limits = Some(pb::RunLimits {
        run_timeout_ms: Some(800),
        ..Default::default()
    });
    let stream = client.orchestrate(as_("alice-token", request)).await?.into_inner();
    let outcome = finish(&mut client, Vec::new(), stream).await?;
    assert_eq!(
        outcome.reason(),
        pb::FailureReason::DeadlineExceeded,
        "{:?}",
        outcome.result
    );
    assert!(outcome.result.text.contains("Refunding"));
    Ok(())
}

/// A detached run is bounded by its own timeout, never by the gRPC deadline of the call that
/// started it: one started with a one-second deadline and left waiting for a person still waits
/// once that deadline passed, and goes on to complete when the person approves.
#[tokio::test]
async fn a_detached_run_outlives_the_deadline_of_the_call_that_started_it() -> TestResult {
    let w = world(refund_then_answer(), &[]).await?;
    let mut client = w.client().await?;
    let request = pb::OrchestrateRequest {
        detached: true,
        ..approval_run("outlives-1")
    };
    let mut starting = as_("alice-token", request);
    starting.set_timeout(Duration::from_secs(1));
    let started = tokio::time::Instant::now();
    let stream = client.orchestrate(starting).await?.into_inner();
    let parked = wait_status(
        &mut client,
        "alice-token",
        "outlives-1",
        pb::RunStatus::AwaitingApproval,
    )
    .await?;
    // Stays: the starting call's deadline must pass, and what is asserted is that nothing happens.
    tokio::time::sleep_until(started + Duration::from_millis(1500)).await;
    let still = get(&mut client, "alice-token", "outlives-1").await?;
    assert_eq!(
        still.status,
        pb::RunStatus::AwaitingApproval as i32,
        "the starting call's deadline does not end a detached run: {still:?}"
    );
    drop(stream);
    let call_id = parked.pending_approvals[0].call_id.clone();
    decide(
        &mut client,
        "carol-token",
        "outlives-1",
        vec![decision(&call_id, pb::DecisionKind::Approve, "", "")],
    )
    .await?;
    let done = wait_status(&mut client, "alice-token", "outlives-1", pb::RunStatus::Completed).await?;
    assert!(done.text.contains("Refunding"), "{done:?}");
    Ok(())
}

/// `StartRun` returns the run's id as soon as the run is let in, and the run is detached whatever
/// the request says: started by a call with a one-second deadline, it waits for a person past
/// that deadline and completes once approved. Its id is refused while it is live
/// (`ALREADY_EXISTS`); once it ended, starting it again starts nothing and answers its final
/// status, for its owner only (another principal is told `NOT_FOUND`). An empty run id gets one
/// made by the server.
#[tokio::test]
async fn a_run_started_in_the_background_returns_its_id_at_once_and_outlives_the_call() -> TestResult {
    let w = world(refund_then_answer(), &[]).await?;
    let mut client = w.client().await?;
    let mut starting = as_("alice-token", approval_run("background-1"));
    starting.set_timeout(Duration::from_secs(1));
    let began = tokio::time::Instant::now();
    let started = client.start_run(starting).await?.into_inner();
    assert_eq!(
        (started.run_id.as_str(), started.status),
        ("background-1", pb::RunStatus::Running as i32),
        "{started:?}"
    );
    let parked = wait_status(
        &mut client,
        "alice-token",
        "background-1",
        pb::RunStatus::AwaitingApproval,
    )
    .await?;
    let again = client
        .start_run(as_("alice-token", approval_run("background-1")))
        .await
        .err()
        .map(|status| status.code());
    assert_eq!(again, Some(tonic::Code::AlreadyExists), "a live run's id is refused");
    // Stays: the starting call's deadline must pass, and what is asserted is that nothing happens.
    tokio::time::sleep_until(began + Duration::from_millis(1500)).await;
    let still = get(&mut client, "alice-token", "background-1").await?;
    assert_eq!(
        still.status,
        pb::RunStatus::AwaitingApproval as i32,
        "the starting call's deadline does not end a run started in the background: {still:?}"
    );
    let call_id = parked.pending_approvals[0].call_id.clone();
    decide(
        &mut client,
        "carol-token",
        "background-1",
        vec![decision(&call_id, pb::DecisionKind::Approve, "", "")],
    )
    .await?;
    wait_status(&mut client, "alice-token", "background-1", pb::RunStatus::Completed).await?;
    let ended = client
        .start_run(as_("alice-token", approval_run("background-1")))
        .await?
        .into_inner();
    assert_eq!(ended.status, pb::RunStatus::Completed as i32, "{ended:?}");
    let foreign = client
        .start_run(as_("bob-token", approval_run("background-1")))
        .await
        .err()
        .map(|status| status.code());
    assert_eq!(foreign, Some(tonic::Code::NotFound), "another principal's run");
    let unnamed = client
        .start_run(as_("alice-token", approval_run("")))
        .await?
        .into_inner();
    assert!(
        unnamed.run_id.len() == 36 && unnamed.run_id != "background-1",
        "a UUIDv7 made by the server: {unnamed:?}"
    );
    get(&mut client, "alice-token", &unnamed.run_id).await?;
    Ok(())
}

/// Starts 200 runs that each park for approval, four at a time on the four slots (waiting for
/// each group to park before the next: they hold no slot once parked), and waits until all wait.
async fn park_200_runs_four_at_a_time(
    client: &mut Client,
) -> anyhow::Result<Vec<tonic::Streaming<pb::OrchestrateEvent>>> {
    let mut streams = Vec::new();
    for i in 0..200 {
        let mut request = approval_run(&format!("park-{i}"));
        request.detached = true;
        streams.push(client.orchestrate(as_("alice-token", request)).await?.into_inner());
        // The four slots are free again once each run of the four parked (they park in any
        // order).
        if i % 4 == 3 {
            for parked in i - 3..=i {
                wait_status(
                    client,
                    "alice-token",
                    &format!("park-{parked}"),
                    pb::RunStatus::AwaitingApproval,
                )
                .await?;
            }
        }
    }
    for i in 0..200 {
        wait_status(
            client,
            "alice-token",
            &format!("park-{i}"),
            pb::RunStatus::AwaitingApproval,
        )
        .await?;
    }
    Ok(streams)
}

/// With `--max-parked-runs` runs waiting, one more has its call rejected at once (naming the
/// flag), and it completes.
async fn one_more_waiting_run_than_allowed_has_its_call_rejected_at_once(client: &mut Client) -> TestResult {
    let stream = client
        .orchestrate(as_("alice-token", approval_run("park-full")))
        .await?
        .into_inner();
    let outcome = finish(client, Vec::new(), stream).await?;
    assert_eq!(outcome.status(), pb::RunStatus::Completed);
    let record = sleep_record(&outcome.result)?;
    assert!(
        record
            .error
            .as_ref()
            .is_some_and(|e| e.message.contains("--max-parked-runs")),
        "{record:?}"
    );

    Ok(())
}

/// Parked runs hold no slot: with `--max-runs 4`, 200 runs wait at once and new runs still
/// start; `--max-parked-runs` bounds them (one more has its call rejected at once); CancelRun
/// ends a waiting run; once approved, every run completes within the 4 slots.
#[tokio::test]
async fn parked_runs_hold_no_slot_and_are_bounded() -> TestResult {
    let w = world(refund_then_answer(), &["--max-runs", "4", "--max-parked-runs", "200"]).await?;
    let mut client = w.client().await?;
    let streams = park_200_runs_four_at_a_time(&mut client).await?;
    one_more_waiting_run_than_allowed_has_its_call_rejected_at_once(&mut client).await?;
    let canceled = client
        .cancel_run(as_(
            "alice-token",
            pb::CancelRunRequest {
                run_id: "park-0".into(),
                ..Default::default()
            },
        ))
        .await?
        .into_inner();
    assert!(canceled.canceled);
    let listed = client
        .list_pending_approvals(as_(
            "alice-token",
            pb::ListPendingApprovalsRequest {
                run_id: String::new(),
                limit: 500,
            },
        ))
        .await?
        .into_inner();
    let mut decided = 0;
    assert!(
        listed.approvals.iter().all(|p| p.run_id != "park-0"),
        "a canceled run waits for nothing"
    );
    for pending in &listed.approvals {
        decide(
            &mut client,
            "carol-token",
            &pending.run_id,
            vec![decision(&pending.call_id, pb::DecisionKind::Approve, "", "")],
        )
        .await?;
        decided += 1;
    }
    assert_eq!(decided, 199);
    for (i, stream) in streams.into_iter().enumerate() {
        let outcome = finish(&mut client, Vec::new(), stream).await?;
        let expected = if i == 0 {
            pb::RunStatus::Canceled
        } else {
            pb::RunStatus::Completed
        };
        assert_eq!(outcome.status(), expected, "park-{i}: {:?}", outcome.result);
    }
    let metrics = testkit::scrape(&w.orchestrator.metrics).await?;
    assert_eq!(metrics.get("orchestrator_runs_awaiting_approval{}"), Some(&0.0));
    assert_eq!(metrics.get("orchestrator_runs_in_flight{}"), Some(&0.0));
    assert_eq!(
        metrics.get("orchestrator_approval_decisions_total{outcome=\"approved\"}"),
        Some(&199.0),
        "{metrics:?}"
    );
    Ok(())
}

/// Which calls wait: the tools a runner's manifest marks (`needs_approval = true`) and those the
/// server names (`--approval-tool`, globs), in every run, though the request asks for none; the
/// turn's other calls run at once; `ListTools` carries the mark.
#[tokio::test]
async fn the_runner_and_the_server_decide_which_tools_wait_too() -> TestResult {
    let manifest = "[[tool]]\nname = \"stamp\"\ndescription = \"stamps the order\"\nargv = [\"echo\", \"stamped\"]\noutput = \"text\"\nneeds_approval = true\n";
    let scenario = Scenario::new(vec![
        Turn::default()
            .then(Step::call("stamp", json!({})))
            .then(Step::call("echo", json!({"n": 1})))
            .then(Step::call("sleep", json!({"ms": 1}))),
        Turn::text("ok"),
    ]);
    let w = world_with(scenario, &["--approval-tool", "ec*"], Some(manifest), None).await?;
    let mut client = w.client().await?;
    let request = pb::OrchestrateRequest {
        run_id: "marked-1".into(),
        detached: true,
        ..testkit::user("go")
    };
    let stream = client.orchestrate(as_("alice-token", request)).await?.into_inner();
    let parked = wait_status(&mut client, "alice-token", "marked-1", pb::RunStatus::AwaitingApproval).await?;
    let mut waiting: Vec<String> = parked.pending_approvals.iter().map(|p| p.name.clone()).collect();
    waiting.sort();
    assert_eq!(waiting, ["echo", "stamp"]);
    let decisions = parked
        .pending_approvals
        .iter()
        .map(|p| decision(&p.call_id, pb::DecisionKind::Approve, "", ""))
        .collect();
    decide(&mut client, "carol-token", "marked-1", decisions).await?;
    let outcome = finish(&mut client, Vec::new(), stream).await?;
    assert_eq!(outcome.status(), pb::RunStatus::Completed, "{:?}", outcome.result);
    let approved: Vec<(String, bool)> = outcome
        .result
        .tool_calls
        .iter()
        .map(|c| (c.name.clone(), c.approval.is_some()))
        .collect();
    assert_eq!(
        approved,
        [("stamp".into(), true), ("echo".into(), true), ("sleep".into(), false)]
    );
    Ok(())
}

/// `orchestrator ARGS` run to its end: exit code, stdout, stderr.
async fn cli(args: &[&str]) -> anyhow::Result<(Option<i32>, String, String)> {
    let mut command = Command::new(BIN);
    command.env("ORCHESTRATOR_METRICS_LISTEN", "off");
    testkit::run_to_end(command, args, &[]).await
}

/// From a shell: `orchestrator call --needs-approval` prints the call waiting with the command
/// that decides it, `orchestrator approvals` lists it with what the run was asked, its labels and
/// what the model said before the call (and `--watch` sees it come and go), `get` shows what it
/// was asked, `orchestrator decide RUN_ID --approve` lets the run go on, and `call` prints the
/// rest of the run.
#[tokio::test]
async fn the_command_line_lists_and_decides() -> TestResult {
    let w = world(refund_then_answer(), &[]).await?;
    let endpoint = w.endpoint();
    let mut call = Command::new(BIN);
    call.args([
        "call",
        "--endpoint",
        &endpoint,
        "--prompt",
        "refund order 7",
        "--run-id",
        "cli-1",
    ])
    .args(["--needs-approval", "sleep", "--token", "alice-token"])
    .args(["--label", "ticket=T-7", "--label", "queue=refunds"])
    .env("ORCHESTRATOR_METRICS_LISTEN", "off")
    .stdout(std::process::Stdio::piped())
    .stderr(std::process::Stdio::piped())
    .kill_on_drop(true);
    let call = call.spawn()?;
    let mut client = w.client().await?;
    let parked = wait_status(&mut client, "alice-token", "cli-1", pb::RunStatus::AwaitingApproval).await?;
    let call_id = parked.pending_approvals[0].call_id.clone();

    let carol = ["--endpoint", &endpoint, "--token", "carol-token"];
    let (code, listed, stderr) = cli(&[&["approvals"][..], &carol].concat()).await?;
    assert_eq!(code, Some(0), "{stderr}");
    assert!(
        listed.contains("cli-1") && listed.contains(&call_id) && listed.contains("sleep"),
        "{listed}"
    );
    // What a person decides on: what the run was asked, its labels, what the model said.
    for told in [
        "    asked: refund order 7",
        "    labels: queue=refunds, ticket=T-7",
        "    the model said: Refunding and noting it.",
    ] {
        assert!(listed.lines().any(|l| l == told), "{told:?} in:\n{listed}");
    }
    let (_, shown, _) = cli(&[&["get", "cli-1"][..], &carol].concat()).await?;
    assert!(shown.lines().any(|l| l == "  asked: refund order 7"), "{shown}");
    let mut watch = Command::new(BIN);
    watch
        .env("ORCHESTRATOR_METRICS_LISTEN", "off")
        .args(["approvals", "cli-1", "--watch", "--watch-every", "100ms"])
        .args(carol);
    let mut watching = testkit::helpers::Printing::spawn(watch)?;
    let limit = Duration::from_secs(20);
    watching
        .line_where("the call waiting", limit, |l| l.contains(&call_id))
        .await?;
    let approve = ["decide", "cli-1", "--approve", &call_id];
    let bob = ["--endpoint", &endpoint, "--token", "bob-token"];
    let (code, _, stderr) = cli(&[&approve[..], &bob].concat()).await?;
    assert_ne!(code, Some(0));
    assert!(stderr.contains("no run \"cli-1\" waits for a person"), "{stderr}");
    let (code, decided, stderr) = cli(&[&approve[..], &carol].concat()).await?;
    assert_eq!(code, Some(0), "{stderr}");
    assert!(decided.contains("goes on"), "{decided}");
    let gone = format!("cli-1  {call_id}  sleep no longer waits");
    watching.line_where("the call decided", limit, |l| l == gone).await?;

    let output = tokio::time::timeout(Duration::from_secs(30), call.wait_with_output()).await??;
    let printed = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "{printed}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(
        printed.contains(&format!("⏸ sleep {{\"ms\":5}}  [{call_id}] waits for approval"))
            && printed.contains(&format!("orchestrator decide cli-1 --approve {call_id}"))
            && printed.contains("✔ approved by carol after")
            && printed.contains("■ COMPLETED"),
        "the decision is an event of the run, who and after how long: {printed}"
    );
    let (code, shown, stderr) = cli(&[&["get", "cli-1"][..], &carol].concat()).await?;
    assert_eq!(code, Some(0), "{stderr}");
    assert!(shown.contains("✔ approved by carol"), "get shows who decided: {shown}");
    // A second decision, once the run went on and ended, names the first: who, and when.
    let (code, _, stderr) = cli(&[&approve[..], &carol].concat()).await?;
    assert_eq!(code, Some(3), "a refused decision exits 3");
    assert!(
        stderr.contains(&format!(
            "call \"{call_id}\" was decided already: approved by \"carol\" at 20"
        )) && stderr.contains("waits for no decision now (COMPLETED)")
            && stderr.contains("(FAILED_PRECONDITION)"),
        "{stderr}"
    );
    Ok(())
}

/// From a shell: `orchestrator call --detach` prints the id of the run it started in the
/// background, alone on stdout, and exits 0 at once, though the run waits for a person; `--json`
/// prints the answer as JSON; the run is followed with `call --attach` once approved.
#[tokio::test]
async fn the_command_line_starts_a_run_in_the_background_and_prints_its_id() -> TestResult {
    let w = world(refund_then_answer(), &[]).await?;
    let endpoint = w.endpoint();
    let alice = ["--endpoint", &endpoint, "--token", "alice-token"];
    let start = [
        "call",
        "--detach",
        "--prompt",
        "refund order 7",
        "--needs-approval",
        "sleep",
    ];
    let (code, printed, stderr) = cli(&[&start[..], &alice, &["--timeout", "5s"]].concat()).await?;
    assert_eq!(code, Some(0), "{stderr}");
    let run_id = printed.trim().to_owned();
    assert_eq!(
        (run_id.len(), printed.lines().count()),
        (36, 1),
        "the id alone: {printed}"
    );
    assert!(
        stderr.contains(&format!("orchestrator call --attach {run_id}")),
        "{stderr}"
    );
    let mut client = w.client().await?;
    let parked = wait_status(&mut client, "alice-token", &run_id, pb::RunStatus::AwaitingApproval).await?;

    let json = ["--json", "--run-id", "cli-detached-2"];
    let (code, printed, stderr) = cli(&[&start[..], &alice, &json].concat()).await?;
    assert_eq!(code, Some(0), "{stderr}");
    let answer: serde_json::Value = serde_json::from_str(printed.trim())?;
    assert_eq!(
        (answer["runId"].as_str(), answer["status"].as_str()),
        (Some("cli-detached-2"), Some("RUN_STATUS_RUNNING")),
        "{printed}"
    );

    let call_id = parked.pending_approvals[0].call_id.clone();
    let approve = ["decide", "--run-id", &run_id, "--approve", &call_id];
    let carol = ["--endpoint", &endpoint, "--token", "carol-token"];
    let (code, _, stderr) = cli(&[&approve[..], &carol].concat()).await?;
    assert_eq!(code, Some(0), "{stderr}");
    let (code, printed, stderr) = cli(&[&["call", "--attach", &run_id][..], &alice].concat()).await?;
    assert_eq!(code, Some(0), "{printed}\n{stderr}");
    assert!(printed.contains("■ COMPLETED"), "{printed}");
    Ok(())
}

/// Named agents (`--agents`): "refunds" is alice's only, sends its own system message and model,
/// and makes its `sleep` calls wait for approval; a request naming it sets only what it allows.
const AGENTS: &str = r#"
[[agent]]
name = "refunds"
description = "Refunds orders once a person approves"
model = "refund-model"
system = "You handle refunds for the shop."
tools = ["sleep", "echo"]
needs_approval = ["sleep"]
principals = ["alice"]
overridable = ["params"]
[agent.limits]
max_turns = 4

[[agent]]
name = "helper"
"#;

/// A request naming an agent takes its definition (its model and system message reach the
/// model server; its approval rules park the run) and may set only what it allows; `ListAgents`
/// lists the agents open to each caller, and another's is `NOT_FOUND`; the run records the
/// agent and its version (`GetRun`, `ListRuns` filtered by agent, `orchestrator get`,
/// `orchestrator runs --agent`, `orchestrator agents`); a changed file is read again, with a new
/// version for new runs while a run keeps the version it ran as.
#[tokio::test]
async fn a_named_agent_fills_a_request_and_its_runs_record_it() -> TestResult {
    let dir = tempfile::tempdir()?;
    let agents = dir.path().join("agents.toml");
    std::fs::write(&agents, AGENTS)?;
    let agents_flag = agents.display().to_string();
    let w = world(
        refund_then_answer(),
        &["--agents", &agents_flag, "--tls-reload-interval", "1s"],
    )
    .await?;
    let mut client = w.client().await?;
    let lister = client.clone();
    let listed = |token: &'static str| {
        let mut client = lister.clone();
        async move {
            let answer = client
                .list_agents(as_(token, pb::ListAgentsRequest {}))
                .await?
                .into_inner();
            anyhow::Ok(answer.agents)
        }
    };
    let alices = listed("alice-token").await?;
    let names: Vec<&str> = alices.iter().map(|a| a.name.as_str()).collect();
    assert_eq!(names, ["helper", "refunds"]);
    let bobs: Vec<String> = listed("bob-token").await?.into_iter().map(|a| a.name).collect();
    assert_eq!(bobs, ["helper"], "refunds is alice's only");
    let version = alices[1].version.clone();

    let naming = |run_id: &str| pb::OrchestrateRequest {
        agent: "refunds".into(),
        run_id: run_id.into(),
        ..testkit::user("refund order 7")
    };
    let code = |answer: Result<tonic::Response<pb::StartRunResponse>, tonic::Status>| {
        answer.err().map(|s| (s.code(), s.message().to_owned()))
    };
    let foreign = code(client.start_run(as_("bob-token", naming("agent-bob"))).await);
    assert_eq!(foreign.map(|f| f.0), Some(tonic::Code::NotFound));
    let overriding = pb::OrchestrateRequest {
        model: "other".into(),
        ..naming("agent-model")
    };
    let refused =
        code(client.start_run(as_("alice-token", overriding)).await).unwrap_or((tonic::Code::Ok, String::new()));
    assert_eq!(refused.0, tonic::Code::InvalidArgument);
    assert!(refused.1.contains("does not let a request set model"), "{}", refused.1);

    client.start_run(as_("alice-token", naming("agent-1"))).await?;
    let parked = wait_status(&mut client, "alice-token", "agent-1", pb::RunStatus::AwaitingApproval).await?;
    assert_eq!(
        (parked.agent.as_str(), parked.agent_version.as_str()),
        ("refunds", version.as_str())
    );
    let sent = w.llm.requests();
    let first = sent.first().cloned().unwrap_or_default();
    assert_eq!(first["model"], "refund-model", "the agent's model");
    assert!(
        first["messages"]
            .to_string()
            .contains("You handle refunds for the shop."),
        "the agent's system message: {first}"
    );

    let by_agent = |agent: &str| pb::ListRunsRequest {
        agent: agent.into(),
        ..Default::default()
    };
    let found = client
        .list_runs(as_("alice-token", by_agent("refunds")))
        .await?
        .into_inner();
    let ids: Vec<&str> = found.runs.iter().map(|r| r.run_id.as_str()).collect();
    assert_eq!(ids, ["agent-1"]);
    assert_eq!(found.runs[0].agent_version, version);
    let none = client
        .list_runs(as_("alice-token", by_agent("helper")))
        .await?
        .into_inner();
    assert!(none.runs.is_empty(), "{none:?}");

    let endpoint = w.endpoint();
    let alice = ["--endpoint", &endpoint, "--token", "alice-token"];
    let (code_, printed, stderr) = cli(&[&["get", "agent-1"][..], &alice].concat()).await?;
    assert_eq!(code_, Some(0), "{stderr}");
    assert!(
        printed.contains(&format!("agent refunds (version {version})")),
        "{printed}"
    );
    let (code_, printed, stderr) = cli(&[&["runs", "--agent", "refunds"][..], &alice].concat()).await?;
    assert_eq!(code_, Some(0), "{stderr}");
    assert!(printed.contains("agent-1") && printed.contains("AGENT"), "{printed}");
    let (code_, printed, stderr) = cli(&[&["agents"][..], &alice].concat()).await?;
    assert_eq!(code_, Some(0), "{stderr}");
    assert!(
        printed.contains("refunds") && printed.contains(&version) && printed.contains("refund-model"),
        "{printed}"
    );

    std::fs::write(&agents, AGENTS.replace("max_turns = 4", "max_turns = 5"))?;
    let changed = testkit::wait::until("the changed agents file to be read", Duration::from_secs(20), || {
        let (listed, version) = (listed("alice-token"), version.clone());
        async move {
            let agents = listed.await.ok()?;
            agents.into_iter().find(|a| a.name == "refunds" && a.version != version)
        }
    })
    .await?;
    assert_ne!(changed.version, version);
    let still = get(&mut client, "alice-token", "agent-1").await?;
    assert_eq!(
        still.agent_version, version,
        "a run keeps the version it was admitted with"
    );
    Ok(())
}

/// Replicas sharing a real `nats-server -js` (the NATS store): each with the tokens file, on one
/// tool-runner and the stand-in model, with a lease of 2 s.
struct Fleet {
    replicas: Vec<Option<Service>>,
    _nats: testkit::nats::Nats,
    _llm: MockLlm,
    _dir: tempfile::TempDir,
}

async fn fleet(scenario: Scenario, replicas: usize) -> anyhow::Result<Fleet> {
    let dir = tempfile::tempdir()?;
    let tokens = dir.path().join("tokens.toml");
    std::fs::write(
        &tokens,
        testkit::pki::tokens_toml(&[
            ("alice", "alice-token", ""),
            ("carol", "carol-token", "roles = [\"approver\"]"),
        ]),
    )?;
    // For A2A: an agent whose sleep calls wait for approval.
    let agents = dir.path().join("agents.toml");
    std::fs::write(
        &agents,
        "[[agent]]\nname = \"reviewed\"\nneeds_approval = [\"sleep\"]\n",
    )?;
    let nats = testkit::nats::Nats::start().await?;
    let llm = MockLlm::start(scenario).await?;
    let mut runner = tool_runner::Config::default();
    runner.server.max_concurrency = 256;
    let runner = testkit::helpers::tool_runner_in_process_with(runner).await?;
    let mut started = Vec::new();
    for _ in 0..replicas {
        let mut command = Command::new(BIN);
        command
            .env("LLM_BASE_URL", llm.base_url())
            .env("ORCHESTRATOR_RUN_STORE", nats.url())
            .env_remove("OTEL_EXPORTER_OTLP_ENDPOINT")
            .args(["--tool-runner", &runner])
            .args(["--auth-tokens", &tokens.display().to_string()])
            .args(["--run-store-lease", "2s"])
            .args(["--agents", &agents.display().to_string(), "--a2a-listen", "127.0.0.1:0"]);
        started.push(Some(Service::orchestrator(command).await?));
    }
    Ok(Fleet {
        replicas: started,
        _nats: nats,
        _llm: llm,
        _dir: dir,
    })
}

impl Fleet {
    /// Replica `i`'s A2A address.
    fn a2a(&self, i: usize) -> anyhow::Result<String> {
        self.replicas[i]
            .as_ref()
            .and_then(|replica| replica.address_logged("a2a serving"))
            .ok_or_else(|| anyhow::anyhow!("replica {i} logged no A2A address"))
    }

    async fn client(&self, i: usize) -> anyhow::Result<Client> {
        let replica = self.replicas[i]
            .as_ref()
            .ok_or_else(|| anyhow::anyhow!("replica {i} is gone"))?;
        Ok(Client::connect(format!("http://{}", replica.grpc)).await?)
    }
}

/// A2A over replicas sharing the NATS store: a task started on one replica's endpoint (to return
/// at once) is followed with `SubscribeToTask` on the other's, from its run's first event to
/// where it waits for approval; the caller's reply "approve" there lets it complete, and the
/// first replica reads it `COMPLETED`.
#[tokio::test]
async fn an_a2a_task_is_followed_and_answered_on_another_replica() -> TestResult {
    let f = fleet(refund_then_answer(), 2).await?;
    let caller = |i: usize, args: &[&str]| -> anyhow::Result<Command> {
        let mut command = testkit::python::a2a_caller()?;
        command
            .args([
                "--url",
                &format!("http://{}/agents/reviewed", f.a2a(i)?),
                "--token",
                "alice-token",
            ])
            .args(args);
        Ok(command)
    };
    let lines = |output: &std::process::Output| -> anyhow::Result<Vec<serde_json::Value>> {
        let text = String::from_utf8(output.stdout.clone())?;
        Ok(text.lines().map(serde_json::from_str).collect::<Result<_, _>>()?)
    };
    let run = |mut command: Command| async move {
        command.kill_on_drop(true);
        anyhow::Ok(tokio::time::timeout(Duration::from_secs(60), command.output()).await??)
    };
    let started = run(caller(0, &["--text", "refund order 7", "--mode", "immediate"])?).await?;
    let seen = lines(&started)?;
    let task_id = seen[0]["event"]["task"]["id"].as_str().unwrap_or_default().to_owned();
    assert!(!task_id.is_empty(), "{seen:?}");

    let followed = run(caller(1, &["--follow", &task_id, "--reply", "approve"])?).await?;
    let out = String::from_utf8_lossy(&followed.stdout).into_owned();
    assert_eq!(
        followed.status.code(),
        Some(0),
        "{}{out}",
        String::from_utf8_lossy(&followed.stderr)
    );
    let seen = lines(&followed)?;
    let subscribed: Vec<&serde_json::Value> = seen.iter().filter_map(|l| l.get("subscribed")).collect();
    let texts: String = subscribed
        .iter()
        .filter_map(|e| e["artifactUpdate"]["artifact"]["parts"][0]["text"].as_str())
        .collect();
    assert!(
        texts.starts_with("Refunding and noting it."),
        "from the run's first event: {out}"
    );
    let last = subscribed
        .last()
        .and_then(|e| e["statusUpdate"]["status"]["state"].as_str());
    assert_eq!(last, Some("TASK_STATE_INPUT_REQUIRED"), "{out}");
    let ended = seen.last().and_then(|l| l["task"]["status"]["state"].as_str());
    assert_eq!(ended, Some("TASK_STATE_COMPLETED"), "{out}");
    let mut client = f.client(0).await?;
    let done = get(&mut client, "alice-token", &task_id).await?;
    assert_eq!(done.status, pb::RunStatus::Completed as i32, "{done:?}");
    Ok(())
}

/// With the NATS store a parked run belongs to no replica: it is listed and decided on another
/// replica than the one that ran its turn, goes on there (or on any replica), and the caller's
/// stream on the first replica goes on to `run_finished`, gap-free and equal to `GetRun`; the
/// approved call's duration is the call's own.
#[tokio::test]
async fn a_decision_on_another_replica_lets_the_run_go_on() -> TestResult {
    let f = fleet(refund_then_answer(), 2).await?;
    let (mut a, mut b) = (f.client(0).await?, f.client(1).await?);
    let mut stream = a
        .orchestrate(as_("alice-token", approval_run("nats-1")))
        .await?
        .into_inner();
    let events = read_until(&mut stream, |e| matches!(e, E::ApprovalRequested(_))).await?;
    let parked = wait_status(&mut b, "alice-token", "nats-1", pb::RunStatus::AwaitingApproval).await?;
    assert_eq!(parked.pending_approvals.len(), 1, "{parked:?}");
    let listed = b
        .list_pending_approvals(as_("carol-token", pb::ListPendingApprovalsRequest::default()))
        .await?
        .into_inner();
    assert_eq!(listed.approvals.len(), 1, "{listed:?}");
    let call_id = listed.approvals[0].call_id.clone();
    let answer = decide(
        &mut b,
        "carol-token",
        "nats-1",
        vec![decision(&call_id, pb::DecisionKind::Approve, "", "")],
    )
    .await?;
    assert!(answer.still_pending.is_empty());
    let again = decide(
        &mut a,
        "alice-token",
        "nats-1",
        vec![decision(&call_id, pb::DecisionKind::Reject, "", "")],
    )
    .await
    .map(|_| ())
    .unwrap_err();
    assert!(
        matches!(again.code(), tonic::Code::FailedPrecondition | tonic::Code::NotFound),
        "{again:?}"
    );
    let outcome = finish(&mut a, events, stream).await?;
    assert_eq!(outcome.status(), pb::RunStatus::Completed, "{:?}", outcome.result);
    let record = sleep_record(&outcome.result)?;
    assert!(record.ok);
    assert_eq!(record.approval.as_ref().map(|d| d.principal.as_str()), Some("carol"));
    // A 5 ms call, resumed by a later claim: its duration is its own, not the fence grace
    // (2 s) its new owner waits before sending it.
    assert!(record.duration_ms < 1500, "{} ms", record.duration_ms);
    assert_eq!(get(&mut b, "alice-token", "nats-1").await?, outcome.result);
    Ok(())
}

/// Runs parked on a replica that is then killed lose nothing: they are decided on the other
/// replica, which resumes each of them, and every one completes.
#[tokio::test]
async fn runs_waiting_on_a_killed_replica_are_decided_and_go_on_elsewhere() -> TestResult {
    let mut f = fleet(refund_then_answer(), 2).await?;
    let mut a = f.client(0).await?;
    let runs: Vec<String> = (0..20).map(|i| format!("killed-{i}")).collect();
    for run_id in &runs {
        let mut request = approval_run(run_id);
        request.detached = true;
        drop(a.orchestrate(as_("alice-token", request)).await?);
    }
    let mut b = f.client(1).await?;
    for run_id in &runs {
        wait_status(&mut b, "alice-token", run_id, pb::RunStatus::AwaitingApproval).await?;
    }
    if let Some(replica) = f.replicas[0].take() {
        replica.kill().await?;
    }
    for run_id in &runs {
        let parked = get(&mut b, "alice-token", run_id).await?;
        let call_id = parked.pending_approvals[0].call_id.clone();
        decide(
            &mut b,
            "carol-token",
            run_id,
            vec![decision(&call_id, pb::DecisionKind::Approve, "", "")],
        )
        .await?;
    }
    for run_id in &runs {
        let done = wait_status(&mut b, "alice-token", run_id, pb::RunStatus::Completed).await?;
        assert!(sleep_record(&done)?.ok, "{done:?}");
        let replayed = b
            .attach_run(as_(
                "alice-token",
                pb::AttachRunRequest {
                    run_id: run_id.clone(),
                    after_seq: 0,
                },
            ))
            .await?
            .into_inner()
            .collect::<Vec<_>>()
            .await
            .into_iter()
            .collect::<Result<Vec<_>, _>>()?;
        let outcome = Outcome::new(replayed, Duration::ZERO)?;
        assert_eq!(outcome.result, done, "{run_id}: the log replays to the stored result");
    }
    Ok(())
}

/// With the NATS store too, a wait that expires is rejected (the replica that wakes the run
/// takes it over), and CancelRun on another replica ends a parked run `CANCELED`.
#[tokio::test]
async fn expiry_and_cancel_of_parked_runs_with_the_nats_store() -> TestResult {
    let f = fleet(refund_then_answer(), 2).await?;
    let (mut a, mut b) = (f.client(0).await?, f.client(1).await?);
    let mut expiring = approval_run("nats-expiring");
    expiring.detached = true;
    expiring.limits = Some(pb::RunLimits {
        approval_timeout_ms: Some(500),
        ..Default::default()
    });
    drop(a.orchestrate(as_("alice-token", expiring)).await?);
    let mut canceled = approval_run("nats-canceled");
    canceled.detached = true;
    drop(a.orchestrate(as_("alice-token", canceled)).await?);
    wait_status(&mut b, "alice-token", "nats-canceled", pb::RunStatus::AwaitingApproval).await?;
    let answer = b
        .cancel_run(as_(
            "alice-token",
            pb::CancelRunRequest {
                run_id: "nats-canceled".into(),
                ..Default::default()
            },
        ))
        .await?
        .into_inner();
    assert!(answer.canceled);
    let ended = wait_status(&mut b, "alice-token", "nats-canceled", pb::RunStatus::Canceled).await?;
    assert!(ended.text.contains("Refunding"), "the output so far is kept: {ended:?}");
    let expired = wait_status(&mut b, "alice-token", "nats-expiring", pb::RunStatus::Completed).await?;
    let record = sleep_record(&expired)?;
    assert_eq!(
        record.error.as_ref().map(|e| e.code.as_str()),
        Some("APPROVAL_TIMEOUT"),
        "{record:?}"
    );
    Ok(())
}

/// A decision is on the run's trace: the approved call's `execute_tool` span says how it was
/// decided, by whom and when, and an `approval decided` event is on the span the run applied it
/// in (the turn's `chat {model}` when decided before the run parked, else the `invoke_agent`
/// span of the run going on).
#[tokio::test]
async fn the_decision_is_recorded_on_the_calls_span() -> TestResult {
    let (collector, otlp) = testkit::otlp::Collector::start().await?;
    let w = world_with(refund_then_answer(), &[], None, Some(&otlp)).await?;
    let mut client = w.client().await?;
    let mut stream = client
        .orchestrate(as_("alice-token", approval_run("traced-1")))
        .await?
        .into_inner();
    let events = read_until(&mut stream, |e| matches!(e, E::ApprovalRequested(_))).await?;
    let Some(E::ApprovalRequested(asked)) = events.last().and_then(|e| e.event.clone()) else {
        anyhow::bail!("no approval_requested");
    };
    let edit = decision(&asked.call_id, pb::DecisionKind::ApproveEdited, "", r#"{"ms": 1}"#);
    decide(&mut client, "carol-token", "traced-1", vec![edit]).await?;
    let outcome = finish(&mut client, events, stream).await?;
    assert_eq!(outcome.status(), pb::RunStatus::Completed);
    let World { orchestrator, .. } = w;
    orchestrator.stop().await?;

    let spans = collector.0.lock().map_err(|_| anyhow::anyhow!("poisoned"))?.clone();
    let attribute = |span: &opentelemetry_proto::tonic::trace::v1::Span, key: &str| {
        testkit::otlp::string_attr(&span.attributes, key).unwrap_or_default()
    };
    let sleep = spans
        .iter()
        .map(|(_, span)| span)
        .find(|span| span.name == "execute_tool sleep")
        .ok_or_else(|| anyhow::anyhow!("no execute_tool sleep span"))?;
    assert_eq!(attribute(sleep, "orchestrator.approval.outcome"), "edited");
    assert_eq!(attribute(sleep, "orchestrator.approval.principal"), "carol");
    assert!(attribute(sleep, "orchestrator.approval.decided_at_unix_ms").parse::<u64>()? > 0);
    let echo = spans
        .iter()
        .map(|(_, span)| span)
        .find(|span| span.name == "execute_tool echo")
        .ok_or_else(|| anyhow::anyhow!("no execute_tool echo span"))?;
    assert_eq!(
        attribute(echo, "orchestrator.approval.outcome"),
        "",
        "echo needed no approval"
    );
    let decided = spans
        .iter()
        .filter(|(_, span)| span.name.starts_with("chat ") || span.name.starts_with("invoke_agent"))
        .flat_map(|(_, span)| span.events.iter())
        .find(|event| event.name == "approval decided")
        .ok_or_else(|| anyhow::anyhow!("no approval decided event on the run's spans"))?;
    assert_eq!(
        testkit::otlp::string_attr(&decided.attributes, "orchestrator.approval.principal").as_deref(),
        Some("carol")
    );
    Ok(())
}
