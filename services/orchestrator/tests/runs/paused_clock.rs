//! Waits that time ends, with the stack in one process on tokio's paused clock: the server's own
//! `Core` (`orchestrator::server::harness`) over the stores the default configuration opens (in
//! this process), a scripted model and tools, its Unix clock following the paused one
//! (`shared::sync::UnixClockOnTokio`). An hour's approval timeout passes in no time, and what is
//! asserted is what happens when it passes: a call nobody decides expires on time and the run
//! goes on, a decision after the expiry is refused naming it, and a run's deadline runs while it
//! waits unless the request pauses it. (The same rules through the binary, a store on NATS
//! across processes, are in `approvals.rs`.)

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::future::BoxFuture;
use futures::stream::BoxStream;
use futures::{FutureExt, StreamExt};
use orchestrator::domain::approval::{
    ApprovalOutcome, ApprovalRules, Decision, DecisionKind, OnTimeout, PendingApproval, TIMEOUT_PRINCIPAL,
};
use orchestrator::domain::chat::{Message, ToolDefinition};
use orchestrator::domain::model::{ChatModel, ChatRequest, LlmError, LlmEvent};
use orchestrator::domain::ports::{ToolExecutor, ToolInvocation, ToolOutput};
use orchestrator::domain::spec::{Deadline, Limits, ParsePolicy};
use orchestrator::domain::{FailureReason, RunResult, RunSpec, RunStatus, ToolCallError, ToolCallRecord};
use orchestrator::server::harness::{Ports, Replica};
use shared::auth::Principal;
use shared::sync::{UnixClockOnTokio, unix_ms};

type TestResult = anyhow::Result<()>;

/// A Unix time at the start of an hour: what the runs' clock reads when a test starts.
const START_MS: u64 = 1_800_000_000_000;

const HOUR: Duration = Duration::from_secs(3600);

/// Plays one list of events per turn (then answers "end").
struct Script(Mutex<VecDeque<Vec<LlmEvent>>>);

impl ChatModel for Script {
    fn stream(
        &self,
        _request: ChatRequest,
    ) -> BoxFuture<'static, Result<BoxStream<'static, Result<LlmEvent, LlmError>>, LlmError>> {
        let turn = shared::sync::lock(&self.0)
            .pop_front()
            .unwrap_or_else(|| vec![LlmEvent::TextDelta("end".into())]);
        futures::future::ready(Ok(futures::stream::iter(turn.into_iter().map(Ok)).boxed())).boxed()
    }
}

/// `echo` answers at once; `nap` answers once the test lets it (the run stays in its turn).
#[derive(Default)]
struct Tools {
    nap_ends: Arc<tokio::sync::Notify>,
}

impl ToolExecutor for Tools {
    fn execute(&self, call: ToolInvocation) -> BoxFuture<'static, Result<ToolOutput, ToolCallError>> {
        let nap_ends = Arc::clone(&self.nap_ends);
        async move {
            if call.name == "nap" {
                nap_ends.notified().await;
            }
            Ok(ToolOutput::Result(r#"{"ok":true}"#.into()))
        }
        .boxed()
    }
}

fn call(index: u32, name: &str) -> LlmEvent {
    LlmEvent::ToolCallFragment {
        index: Some(index),
        id: Some(format!("call-{index}")),
        name: Some(name.into()),
        arguments: Some("{}".into()),
    }
}

fn tool(name: &str) -> ToolDefinition {
    ToolDefinition {
        name: name.into(),
        description: name.into(),
        parameters: serde_json::json!({"type": "object"}).into(),
    }
}

/// A replica of the default configuration whose model plays `turns`, calling `tools`.
async fn replica_playing(turns: Vec<Vec<LlmEvent>>, tools: Tools) -> anyhow::Result<Replica> {
    let config = orchestrator::Config::default();
    let ports = Ports::open(&config, Arc::new(Script(Mutex::new(turns.into()))), Arc::new(tools)).await?;
    Ok(Replica::new(&config, ports))
}

/// Turn 1 says it refunds and calls `echo` (and `nap` when `with_a_nap`); turn 2 answers.
fn refund_then_answer(with_a_nap: bool) -> Vec<Vec<LlmEvent>> {
    let mut first = vec![LlmEvent::TextDelta("Refunding.".into()), call(0, "echo")];
    if with_a_nap {
        first.push(call(1, "nap"));
    }
    vec![first, vec![LlmEvent::TextDelta("Done.".into())]]
}

/// Run `run_id`, whose `echo` calls wait for approval at most `wait`; it ends within
/// `run_timeout` unless `pause_deadline`.
fn spec(run_id: &str, wait: Duration, run_timeout: Duration, pause_deadline: bool) -> RunSpec {
    let limits = Limits {
        max_turns: 4,
        tool_call_budget: 8,
        max_tool_failures: 2,
        tool_timeout: 3 * HOUR,
        run_timeout,
        approval_timeout: wait,
        input_timeout: HOUR,
        max_total_tokens: u64::MAX,
    };
    RunSpec {
        run_id: run_id.into(),
        system: String::new(),
        messages: vec![Message::User {
            content: "Refund order 7.".into(),
            name: None,
        }],
        model: "scripted".into(),
        params: Default::default(),
        normal_tools: vec![tool("echo"), tool("nap")],
        exit_tools: Vec::new(),
        limits,
        metadata: Default::default(),
        labels: Default::default(),
        hourly_budget: None,
        queued_ms: 0,
        parse_policy: ParsePolicy::Fail,
        deadline: Deadline::new(tokio::time::Instant::now(), run_timeout, None, Duration::ZERO),
        principal: String::new(),
        max_runs: None,
        stream_interval: Duration::ZERO,
        approval: ApprovalRules {
            tools: ["echo".to_owned()].into(),
            timeout: wait,
            on_timeout: OnTimeout::Reject,
            pause_deadline,
        },
        affinity_key: String::new(),
        eager_dispatch: false,
        thread: None,
        agent: None,
        request_digests: Default::default(),
    }
}

/// Run `run_id` once `done` holds for it, looked at every virtual second for up to a day.
async fn once(replica: &Replica, run_id: &str, done: impl Fn(&RunResult) -> bool) -> anyhow::Result<RunResult> {
    testkit::wait::until_paced(run_id, 24 * HOUR, Duration::from_secs(1), || async {
        replica.get(run_id).await.ok().filter(|run| done(run))
    })
    .await
}

fn ended(run: &RunResult) -> bool {
    !run.status.is_live()
}

/// The one call waiting for a person in `replica`.
async fn the_waiting_call(replica: &Replica) -> anyhow::Result<PendingApproval> {
    let mut waiting = replica.pending(10).await?;
    anyhow::ensure!(waiting.len() == 1, "one call waits: {waiting:?}");
    Ok(waiting.remove(0))
}

fn approve(call: &PendingApproval) -> Decision {
    Decision {
        call_id: call.call_id.clone(),
        kind: DecisionKind::Approve,
        round: None,
    }
}

fn echo(run: &RunResult) -> anyhow::Result<&ToolCallRecord> {
    run.tool_calls
        .iter()
        .find(|c| c.name == "echo")
        .ok_or_else(|| anyhow::anyhow!("no echo record in {:?}", run.tool_calls))
}

/// Nobody decides: an hour after it was asked (not before, and within a look of the server's
/// unparking), the call is rejected as timed out by the orchestrator, that is fed back, and the
/// run completes.
#[tokio::test(start_paused = true)]
async fn a_call_nobody_decides_expires_on_time_and_the_run_goes_on() -> TestResult {
    let _clock = UnixClockOnTokio::starting_at(START_MS);
    let replica = replica_playing(refund_then_answer(false), Tools::default()).await?;
    replica
        .start(spec("expires", HOUR, 3 * HOUR, false), Principal::anonymous())
        .await?;
    once(&replica, "expires", |run| run.status == RunStatus::AwaitingApproval).await?;
    let asked = the_waiting_call(&replica).await?;
    let expires_at = asked.expires_at_unix_ms;
    assert_eq!(expires_at, asked.requested_at_unix_ms + 3_600_000, "{asked:?}");

    let run = once(&replica, "expires", ended).await?;
    assert_eq!(run.status, RunStatus::Completed, "{run:?}");
    assert_eq!(run.text, "Refunding.Done.");
    let decision = echo(&run)?
        .approval
        .clone()
        .ok_or_else(|| anyhow::anyhow!("no decision"))?;
    assert_eq!(decision.outcome, ApprovalOutcome::TimedOut);
    assert_eq!(decision.principal, TIMEOUT_PRINCIPAL);
    let late = decision.decided_at_unix_ms.checked_sub(expires_at);
    assert!(
        late.is_some_and(|ms| ms <= 1_000),
        "expired at {}, due at {expires_at}",
        decision.decided_at_unix_ms
    );
    Ok(())
}

/// The run is still in its turn (a `nap` beside `echo` that ends only when the test lets it) when
/// `echo`'s one-hour wait ends: nothing has applied the timeout to the run yet, and a decision
/// taken then is refused, naming the expiry; once the nap ends, the call ends timed out and the
/// run completes.
#[tokio::test(start_paused = true)]
async fn a_decision_after_the_expiry_is_refused_naming_it() -> TestResult {
    let _clock = UnixClockOnTokio::starting_at(START_MS);
    let tools = Tools::default();
    let nap_ends = Arc::clone(&tools.nap_ends);
    let replica = replica_playing(refund_then_answer(true), tools).await?;
    replica
        .start(spec("late", HOUR, 4 * HOUR, false), Principal::anonymous())
        .await?;
    testkit::wait::until("echo's wait", HOUR, || async {
        replica.pending(10).await.ok().filter(|p| !p.is_empty())
    })
    .await?;
    let asked = the_waiting_call(&replica).await?;
    let past_it = (asked.expires_at_unix_ms + 1_000).saturating_sub(unix_ms());
    tokio::time::advance(Duration::from_millis(past_it)).await;
    let Err(refused) = replica.decide("late", &[approve(&asked)]).await else {
        anyhow::bail!("a decision after the expiry was taken");
    };
    let message = refused.to_string();
    assert!(
        message.contains("expired at") && message.contains("approval_timeout_ms"),
        "{message}"
    );

    nap_ends.notify_one();
    let run = once(&replica, "late", ended).await?;
    assert_eq!(run.status, RunStatus::Completed, "{run:?}");
    let outcome = echo(&run)?.approval.as_ref().map(|d| d.outcome);
    assert_eq!(outcome, Some(ApprovalOutcome::TimedOut));
    Ok(())
}

/// A run's 30-minute deadline passes while it waits for a person: it ends `DEADLINE_EXCEEDED`
/// keeping its output. Asked to pause the deadline while a person decides, a run still waits two
/// hours later and completes once approved.
#[tokio::test(start_paused = true)]
async fn a_runs_deadline_runs_while_it_waits_unless_the_request_pauses_it() -> TestResult {
    let _clock = UnixClockOnTokio::starting_at(START_MS);
    let replica = replica_playing(refund_then_answer(false), Tools::default()).await?;
    let half_an_hour = Duration::from_secs(1800);
    replica
        .start(spec("deadline", 24 * HOUR, half_an_hour, false), Principal::anonymous())
        .await?;
    let run = once(&replica, "deadline", ended).await?;
    assert_eq!(
        (run.status, run.failure_reason),
        (RunStatus::Failed, Some(FailureReason::DeadlineExceeded)),
        "{run:?}"
    );
    assert!(run.text.contains("Refunding."), "the output so far is kept: {run:?}");

    let replica = replica_playing(refund_then_answer(false), Tools::default()).await?;
    replica
        .start(spec("paused", 24 * HOUR, half_an_hour, true), Principal::anonymous())
        .await?;
    once(&replica, "paused", |run| run.status == RunStatus::AwaitingApproval).await?;
    tokio::time::advance(2 * HOUR).await;
    let still = replica.get("paused").await?;
    assert_eq!(
        still.status,
        RunStatus::AwaitingApproval,
        "a paused deadline does not end the run"
    );
    let waiting = the_waiting_call(&replica).await?;
    replica.decide("paused", &[approve(&waiting)]).await?;
    let run = once(&replica, "paused", ended).await?;
    assert_eq!(run.status, RunStatus::Completed, "{run:?}");
    Ok(())
}
