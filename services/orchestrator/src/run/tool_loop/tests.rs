//! The loop without a network: a scripted model and an in-process tool executor.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};

use std::sync::Mutex;

use futures::future::BoxFuture;
use tokio::sync::mpsc;

use super::*;
use std::sync::Arc;
use std::time::Duration;

use futures::stream::BoxStream;
use futures::{FutureExt, StreamExt};

use crate::domain::ports::{ToolExecutor, ToolInvocation, ToolOutput};
use crate::domain::{
    CancelMode, Deadline, Event, EventBatch, FailureReason, Limits, LoopDetection, NumberedEvent, OutputBounds,
    ParsePolicy, RunResult, RunSpec, RunStatus, ToolCallError,
};
use crate::llm::{ChatModel, ChatRequest, LlmError, LlmEvent, Message, ToolDefinition, Usage};
use crate::run::live::{AdmittedRun, Emitter, SharedState};
use crate::run::live::{Cancel, EmitSettings};
use crate::run::steering::{Closed, Inbox, Refused, UserMessage};
use crate::signals::memory::MemoryTopic;

/// Plays one list of events per turn and records the requests.
struct Script {
    turns: Mutex<VecDeque<Vec<Result<LlmEvent, LlmError>>>>,
    requests: Mutex<Vec<ChatRequest>>,
    /// The last turn's stream stays open after its events.
    hang: bool,
    /// Each event comes this long after the one before (none: all at once).
    pace: Option<Duration>,
}

impl ChatModel for Script {
    fn stream(
        &self,
        request: ChatRequest,
    ) -> BoxFuture<'static, Result<BoxStream<'static, Result<LlmEvent, LlmError>>, LlmError>> {
        self.requests.lock().unwrap().push(request);
        let turn = self
            .turns
            .lock()
            .unwrap()
            .pop_front()
            .unwrap_or_else(|| vec![Ok(LlmEvent::TextDelta("end".into()))]);
        let last = self.turns.lock().unwrap().is_empty();
        let stream = match self.pace {
            None => futures::stream::iter(turn).boxed(),
            // Events arrive on their own schedule, as over a socket, whether or not they are
            // read.
            Some(pace) => {
                let (tx, rx) = mpsc::unbounded_channel();
                tokio::spawn(async move {
                    for event in turn {
                        tokio::time::sleep(pace).await;
                        if tx.send(event).is_err() {
                            return;
                        }
                    }
                });
                tokio_stream::wrappers::UnboundedReceiverStream::new(rx).boxed()
            }
        };
        let stream = if self.hang && last {
            stream.chain(futures::stream::pending()).boxed()
        } else {
            stream
        };
        futures::future::ready(Ok(stream)).boxed()
    }
}

/// Sleeps `ms` from the arguments, fails tools named `bad`, asks a question from tools named
/// `ask` (answered: their result is the answers), and counts calls in flight.
#[derive(Default)]
struct Tools {
    in_flight: AtomicUsize,
    peak: AtomicUsize,
    /// Call ids in the order their calls started.
    started: Mutex<Vec<String>>,
    /// Polls of each call's task so far, by call id.
    polls: Mutex<std::collections::HashMap<String, u64>>,
    /// Call ids whose task was asked to cancel.
    canceled_tasks: Mutex<Vec<String>>,
}

impl ToolExecutor for Arc<Tools> {
    fn execute(&self, call: ToolInvocation) -> BoxFuture<'static, Result<ToolOutput, ToolCallError>> {
        let this = Arc::clone(self);
        async move {
            this.started.lock().unwrap().push(call.call_id.clone());
            let now = this.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
            this.peak.fetch_max(now, Ordering::SeqCst);
            let args: serde_json::Value = serde_json::from_str(&call.arguments_json).unwrap_or_default();
            tokio::time::sleep(Duration::from_millis(args["ms"].as_u64().unwrap_or(0))).await;
            this.in_flight.fetch_sub(1, Ordering::SeqCst);
            if call.name == "bad" {
                return Err(ToolCallError::new(
                    "FAILED",
                    args["message"].as_str().unwrap_or("bad tool"),
                ));
            }
            if let Some(polls) = args["task_polls"].as_u64() {
                return this.run_as_task(&call, polls, args["ttl_ms"].as_u64());
            }
            if call.name == "ask" {
                return Ok(match &call.answers {
                    None => ToolOutput::Asked(confirm_question()),
                    Some(answers) => ToolOutput::Result(
                        serde_json::json!({
                            "state": answers.request_state,
                            "answers": answers.responses,
                        })
                        .to_string(),
                    ),
                });
            }
            Ok(ToolOutput::Result(call.arguments_json))
        }
        .boxed()
    }
}

impl Tools {
    /// A call its "server" runs as a task, done after `polls` polls (its result then names the
    /// polls), canceled when asked; the task says which poll it is at.
    fn run_as_task(&self, call: &ToolInvocation, polls: u64, ttl_ms: Option<u64>) -> Result<ToolOutput, ToolCallError> {
        if call.cancel_task {
            self.canceled_tasks.lock().unwrap().push(call.call_id.clone());
            return Err(ToolCallError::new("CANCELED", "the server canceled the task"));
        }
        let done = {
            let mut all = self.polls.lock().unwrap();
            let done = all.entry(call.call_id.clone()).or_insert(0);
            if call.task.is_some() {
                *done += 1;
            }
            *done
        };
        if done >= polls {
            return Ok(ToolOutput::Result(serde_json::json!({"polls": done}).to_string()));
        }
        Ok(ToolOutput::Task(crate::domain::task::ToolTask {
            id: format!("task-{}", call.call_id),
            status: "working".into(),
            message: format!("poll {done}"),
            ttl_ms,
            poll_interval_ms: Some(10),
            runner: None,
        }))
    }
}

fn call(index: u32, name: &str, args: &str) -> Result<LlmEvent, LlmError> {
    Ok(LlmEvent::ToolCallFragment {
        index: Some(index),
        id: Some(format!("id{index}")),
        name: Some(name.into()),
        arguments: Some(args.into()),
    })
}

fn tool(name: &str) -> ToolDefinition {
    ToolDefinition {
        name: name.into(),
        description: name.into(),
        parameters: serde_json::json!({"type": "object"}).into(),
    }
}

pub(crate) fn spec(limits: Limits) -> RunSpec {
    RunSpec {
        run_id: "r".into(),
        system: String::new(),
        messages: vec![Message::User {
            content: "go".into(),
            name: None,
        }],
        model: "m".into(),
        params: Default::default(),
        normal_tools: vec![tool("nap"), tool("bad")],
        exit_tools: vec![tool("done")],
        limits,
        metadata: Default::default(),
        labels: Default::default(),
        hourly_budget: None,
        queued_ms: 0,
        parse_policy: ParsePolicy::Fail,
        deadline: Deadline::new(Instant::now(), limits.run_timeout, None, Duration::ZERO),
        principal: String::new(),
        max_runs: None,
        stream_interval: Duration::ZERO,
        approval: Default::default(),
        affinity_key: String::new(),
        eager_dispatch: false,
        thread: None,
    }
}

const EMIT: EmitSettings = EmitSettings {
    send_timeout: Duration::from_secs(30),
    max_event_bytes: 1024,
};

pub(crate) fn limits() -> Limits {
    Limits {
        max_turns: 8,
        tool_call_budget: 10,
        max_tool_failures: 1,
        tool_timeout: Duration::from_secs(5),
        run_timeout: Duration::from_secs(30),
        approval_timeout: Duration::from_secs(60),
        input_timeout: Duration::from_secs(3600),
        max_total_tokens: u64::MAX,
    }
}

async fn play(
    turns: Vec<Vec<Result<LlmEvent, LlmError>>>,
    limits: Limits,
) -> (RunResult, Vec<NumberedEvent>, Arc<Script>, Arc<Tools>) {
    let (result, batches, script, tools) = play_batched(turns, limits).await;
    (result, batches.into_iter().flatten().collect(), script, tools)
}

/// As [`play`], with the events as the batches the caller's stream received.
async fn play_batched(
    turns: Vec<Vec<Result<LlmEvent, LlmError>>>,
    limits: Limits,
) -> (RunResult, Vec<EventBatch>, Arc<Script>, Arc<Tools>) {
    play_with(turns, limits, Outside::default()).await
}

/// What happens around a run in a test.
struct Outside {
    /// The last turn's stream stays open after its events.
    hang: bool,
    /// `CancelRun` after this long.
    cancel_after: Option<Duration>,
    /// That cancel's mode.
    cancel_mode: CancelMode,
    /// An immediate `CancelRun` after this long (after a cancel that let the turn finish).
    cancel_at_once_after: Option<Duration>,
    emit: EmitSettings,
    /// The caller's stream: its buffer, and the pause before each read (`None`: never reads
    /// until the run is over).
    buffer: usize,
    read_every: Option<Duration>,
    /// The caller is attached: it stopping to read cancels the run.
    attached: bool,
    output: OutputBounds,
    send_reasoning: bool,
    /// Checkpoints go here (a durable run).
    journal: Option<Arc<Journal>>,
    /// The run resumes from this checkpoint instead of starting.
    resumed: Option<Resumed>,
    /// The run's event log.
    log: Option<Box<dyn crate::domain::ports::LogWriter>>,
    /// The model's events come this far apart.
    pace: Option<Duration>,
    /// The run's stream interval.
    stream_interval: Duration,
    /// The run is asked to hand over (a drain) from its start.
    hand_over: bool,
    /// The run's id is claimed with its start checkpoint (a durable run, as the service admits it).
    claim_resumable: bool,
    /// Bad calls are answered with an error instead of ending the run.
    parse_policy: ParsePolicy,
    /// Calls start as soon as they are complete in the stream.
    eager: bool,
    /// The run's inbox (a clone stays with the test).
    inbox: Inbox,
    /// Messages sent to the run, each this long after the start.
    messages: Vec<(Duration, &'static str)>,
    /// The run's thread, and where threads are kept.
    thread: Option<crate::domain::thread::RunThread>,
    threads: Option<Arc<crate::threads::Keeper>>,
    /// Which calls wait for a person, and the lot they wait in.
    approval: crate::domain::approval::ApprovalRules,
    approvals: Arc<dyn crate::domain::ports::ApprovalLot>,
    /// The caller's usage book.
    usage: Arc<dyn crate::domain::ports::UsageBook>,
}

impl Default for Outside {
    fn default() -> Self {
        Self {
            hang: false,
            cancel_after: None,
            cancel_mode: CancelMode::Immediate,
            cancel_at_once_after: None,
            emit: EMIT,
            buffer: 1024,
            read_every: Some(Duration::ZERO),
            attached: false,
            output: (&crate::Config::default().runs.output).into(),
            send_reasoning: false,
            journal: None,
            resumed: None,
            log: None,
            pace: None,
            stream_interval: Duration::ZERO,
            hand_over: false,
            claim_resumable: false,
            parse_policy: ParsePolicy::Fail,
            eager: false,
            inbox: Inbox::new(16),
            messages: Vec::new(),
            thread: None,
            threads: None,
            approval: Default::default(),
            approvals: Arc::new(crate::store::memory::MemoryLot::new(16)),
            usage: Arc::new(crate::store::memory::MemoryUsage::new(Duration::from_secs(3600))),
        }
    }
}

async fn play_with(
    turns: Vec<Vec<Result<LlmEvent, LlmError>>>,
    limits: Limits,
    outside: Outside,
) -> (RunResult, Vec<EventBatch>, Arc<Script>, Arc<Tools>) {
    let script = Arc::new(Script {
        turns: Mutex::new(turns.into()),
        requests: Mutex::default(),
        hang: outside.hang,
        pace: outside.pace,
    });
    let tools = Arc::new(Tools::default());
    let deps = LoopDeps {
        model: script.clone(),
        tools: Arc::new(Arc::clone(&tools)),
        signals: Arc::new(MemoryTopic::new(16)),
        detector: LoopDetection {
            window: 64,
            threshold: 8,
        },
        trace_payloads: None,
        max_tool_result_bytes: 1024,
        output: outside.output,
        send_reasoning: outside.send_reasoning,
        log_settle_timeout: Duration::from_secs(1),
        approvals: outside.approvals,
        max_turn_restarts: 2,
        max_input_rounds: 10,
        tasks: TaskSettings {
            poll: crate::domain::task::PollBounds {
                min: Duration::from_millis(50),
                max: Duration::from_secs(1),
            },
            park_after: Duration::from_secs(30),
        },
        threads: outside.threads,
        usage: outside.usage,
        store_timeout: Duration::from_secs(5),
    };
    let state: SharedState = Arc::new(Mutex::new(RunResult::running("r")));
    let (tx, mut rx) = mpsc::channel(outside.buffer);
    let cancel = Cancel::default();
    let on_stall = outside.attached.then(|| cancel.clone());
    let admitted = AdmittedRun {
        spec: RunSpec {
            stream_interval: outside.stream_interval,
            parse_policy: outside.parse_policy,
            eager_dispatch: outside.eager,
            thread: outside.thread.map(Box::new),
            approval: outside.approval,
            ..spec(limits)
        },
        emitter: Emitter::new(Some(tx), Arc::clone(&state), outside.emit, on_stall).with_log(outside.log),
        state: Arc::clone(&state),
        cancel: cancel.clone(),
        caller: None,
        persister: outside.journal.map(|journal| durable(&state, journal)),
        slot: None,
        handoff: Default::default(),
        inbox: outside.inbox.clone(),
    };
    for (after, text) in outside.messages {
        let inbox = outside.inbox.clone();
        tokio::spawn(async move {
            tokio::time::sleep(after).await;
            let _ = inbox.send(user(text));
        });
    }
    if outside.hand_over {
        admitted.handoff.at_safe_point.cancel();
    }
    if let (true, Some(persister)) = (outside.claim_resumable, &admitted.persister) {
        let start = Checkpoint::at_start(&admitted.spec, RunResult::running("r"));
        let claim = persister.claim_resumable(|| start.snapshot()).await;
        assert!(matches!(claim, Ok(crate::domain::ports::Claim::Claimed)));
        assert!(persister.claimed_resumable(), "the claim saved the start checkpoint");
    }
    if let Some(after) = outside.cancel_after {
        let (cancel, mode) = (cancel.clone(), outside.cancel_mode);
        tokio::spawn(async move {
            tokio::time::sleep(after).await;
            cancel.cancel_with(mode, "canceled by the test");
        });
    }
    if let Some(after) = outside.cancel_at_once_after {
        tokio::spawn(async move {
            tokio::time::sleep(after).await;
            cancel.cancel("canceled at once by the test");
        });
    }
    let reader = tokio::spawn(async move {
        let mut batches = Vec::new();
        if let Some(every) = outside.read_every {
            loop {
                tokio::time::sleep(every).await;
                match rx.recv().await {
                    Some(batch) => batches.push(batch),
                    None => break,
                }
            }
        }
        (batches, rx)
    });
    let result = match outside.resumed {
        Some(resumed) => resume(admitted, resumed, deps).await,
        None => run(admitted, deps).await,
    };
    let (mut batches, mut rx) = reader.await.unwrap();
    while let Ok(batch) = rx.try_recv() {
        batches.push(batch);
    }
    (result, batches, script, tools)
}

/// Text of the events, in order, and whether seq runs 1, 2, 3 … without gaps.
fn streamed(batches: &[EventBatch]) -> (String, bool) {
    let events: Vec<&NumberedEvent> = batches.iter().flatten().collect();
    let text = events
        .iter()
        .filter_map(|e| match &e.event {
            Event::TextDelta { text, .. } => Some(text.as_str()),
            _ => None,
        })
        .collect();
    let no_gaps = events.iter().zip(1..).all(|(e, n)| e.seq == n);
    (text, no_gaps)
}

#[tokio::test(start_paused = true)]
async fn events_produced_together_reach_the_stream_as_one_batch() {
    let turn1 = vec![
        call(0, "nap", r#"{"ms": 5}"#),
        call(1, "nap", r#"{"ms": 5}"#),
        call(2, "done", r#"{"ok": true}"#),
    ];
    let turn2 = vec![Ok(LlmEvent::TextDelta("fin".into()))];
    let (result, batches, _, _) = play_batched(vec![turn1, turn2], limits()).await;
    assert_eq!(result.status, RunStatus::Completed);
    let kinds: Vec<Vec<&str>> = batches
        .iter()
        .map(|b| {
            b.iter()
                .map(|e| match &e.event {
                    Event::RunStarted { .. } => "run_started",
                    Event::TextDelta { .. } => "text",
                    Event::ReasoningDelta { .. } => "reasoning",
                    Event::ToolCallStarted { .. } => "call_started",
                    Event::ToolCallFinished { .. } => "call_finished",
                    Event::Signal(_) => "signal",
                    Event::TurnFinished { .. } => "turn_finished",
                    Event::TurnRestarted { .. } => "turn_restarted",
                    Event::ApprovalRequested { .. } => "approval_requested",
                    Event::MessageAdded { .. } => "message_added",
                    Event::ToolInputRequested { .. } => "input_requested",
                    Event::ToolCallProgress { .. } => "call_progress",
                    Event::RunFinished(_) => "run_finished",
                })
                .collect()
        })
        .collect();
    assert_eq!(
        kinds,
        [
            vec!["run_started"],
            vec!["signal", "call_started", "call_started"],
            vec!["call_finished", "call_finished", "turn_finished"],
            vec!["text"],
            vec!["turn_finished", "run_finished"],
        ]
    );
    let seqs: Vec<u64> = batches.iter().flatten().map(|e| e.seq).collect();
    assert_eq!(
        seqs,
        (1..=seqs.len() as u64).collect::<Vec<_>>(),
        "numbered without gaps"
    );
}

#[tokio::test(start_paused = true)]
async fn parallel_calls_overlap_and_exit_calls_are_signals() {
    let turn1 = vec![
        Ok(LlmEvent::TextDelta("napping".into())),
        call(0, "nap", r#"{"ms": 500}"#),
        call(1, "nap", r#"{"ms": 500}"#),
        call(2, "done", r#"{"ok": true}"#),
        call(3, "nap", r#"{"ms": 500}"#),
        Ok(LlmEvent::Usage(Usage {
            prompt_tokens: 3,
            completion_tokens: 2,
            cached_prompt_tokens: 1,
        })),
    ];
    let (result, events, script, tools) = play(vec![turn1], limits()).await;
    assert_eq!(result.status, RunStatus::Completed);
    assert_eq!(tools.peak.load(Ordering::SeqCst), 3, "all three ran at once");
    assert_eq!(
        result.tool_calls.iter().map(|c| c.call_id.as_str()).collect::<Vec<_>>(),
        ["id0", "id1", "id3"]
    );
    assert_eq!(result.signals.len(), 1);
    assert_eq!(
        result.usage,
        Usage {
            prompt_tokens: 3,
            completion_tokens: 2,
            cached_prompt_tokens: 1,
        }
    );
    // The second request: the status note after the tool messages shows the spent budget; the
    // exit call is not in the conversation.
    let second = script.requests.lock().unwrap()[1].clone();
    let Some(Message::User { content: note, .. }) = second.messages.last() else {
        panic!("a status note last: {:?}", second.messages)
    };
    assert!(
        note.contains("Turn 2 of at most 8") && note.contains("7 normal call(s) left"),
        "{note}"
    );
    let Message::Assistant { tool_calls, .. } = &second.messages[2] else {
        panic!("{:?}", second.messages)
    };
    assert_eq!(
        tool_calls.iter().map(|c| c.name.as_str()).collect::<Vec<_>>(),
        ["nap", "nap", "nap"]
    );
    assert!(events.windows(2).all(|w| w[1].seq == w[0].seq + 1));
}

#[tokio::test(start_paused = true)]
async fn failures_count_once_per_turn_and_the_limit_ends_the_run() {
    let failing = || vec![call(0, "bad", "{}"), call(1, "bad", "{}"), call(2, "bad", "{}")];
    let (result, ..) = play(vec![failing(), failing(), vec![]], limits()).await;
    assert_eq!(
        (result.status, result.failure_reason, result.failed_turns),
        (RunStatus::Failed, Some(FailureReason::ToolFailureLimit), 2)
    );
    assert_eq!(result.tool_calls.len(), 6);
}

#[tokio::test(start_paused = true)]
async fn the_budget_runs_the_first_calls_then_ends() {
    let turn = vec![
        call(0, "nap", r#"{"n": 1}"#),
        call(1, "nap", r#"{"n": 2}"#),
        call(2, "nap", r#"{"n": 3}"#),
    ];
    let (result, ..) = play(
        vec![turn],
        Limits {
            tool_call_budget: 2,
            ..limits()
        },
    )
    .await;
    assert_eq!(result.failure_reason, Some(FailureReason::ToolBudgetExhausted));
    assert_eq!(
        result
            .tool_calls
            .iter()
            .map(|c| c.arguments_json.as_str())
            .collect::<Vec<_>>(),
        [r#"{"n": 1}"#, r#"{"n": 2}"#]
    );
}

#[tokio::test(start_paused = true)]
async fn an_error_mid_stream_keeps_held_back_text() {
    let turn = vec![
        Ok(LlmEvent::TextDelta("visible <tool_".into())),
        Err(LlmError::Protocol("the LLM stream broke off".into())),
    ];
    let (result, ..) = play(vec![turn], limits()).await;
    assert_eq!(
        (result.status, result.failure_reason),
        (RunStatus::Failed, Some(FailureReason::LlmError))
    );
    assert_eq!(result.text, "visible <tool_", "held-back text is output too");
}

#[tokio::test(start_paused = true)]
async fn text_arriving_at_once_is_one_delta_and_a_loop_is_cut_at_the_repeated_line() {
    let line = "the same line again\n";
    let turn = vec![
        Ok(LlmEvent::TextDelta(line.repeat(10))),
        Ok(LlmEvent::TextDelta("never shown".into())),
    ];
    let (result, events, ..) = play(vec![turn], limits()).await;
    assert_eq!(result.failure_reason, Some(FailureReason::RepeatedLineLoop));
    assert_eq!(
        result.text,
        line.repeat(8),
        "output stops at the eighth repetition (the threshold)"
    );
    let deltas = events
        .iter()
        .filter(|e| matches!(e.event, Event::TextDelta { .. }))
        .count();
    assert_eq!(deltas, 1, "chunks already there are shown as one delta");
}

#[tokio::test(start_paused = true)]
async fn the_turn_guard_holds_whatever_max_turns_says() {
    let forever: Vec<_> = (0..200).map(|_| vec![call(0, "nap", "{}")]).collect();
    let (result, ..) = play(
        forever,
        Limits {
            max_turns: 1000,
            tool_call_budget: 10_000,
            ..limits()
        },
    )
    .await;
    assert_eq!(
        (result.failure_reason, result.turns),
        (Some(FailureReason::MaxTurnsExceeded), HARD_MAX_TURNS)
    );
}

fn text(t: &str) -> Result<LlmEvent, LlmError> {
    Ok(LlmEvent::TextDelta(t.into()))
}

fn usage(prompt_tokens: u64, completion_tokens: u64) -> Result<LlmEvent, LlmError> {
    Ok(LlmEvent::Usage(Usage {
        prompt_tokens,
        completion_tokens,
        cached_prompt_tokens: 0,
    }))
}

/// Limits that let a run go on for 100 turns of one call each.
fn many_turns() -> Limits {
    Limits {
        max_turns: 100,
        tool_call_budget: 100,
        ..limits()
    }
}

/// A fenced directive cut off after its first key (held back); `\u{7b}` is `{`.
const HELD_CALL: &str = "Here is the call:\n```json\n\u{7b}\"name\": \"nap\", ";
/// A `<tool_call>` directive cut off after its first key.
const OPEN_DIRECTIVE: &str = "<tool_call>\u{7b}\"name\"";

#[tokio::test(start_paused = true)]
async fn a_cancel_mid_code_block_keeps_the_held_text_and_the_usage() {
    let turn = vec![text(HELD_CALL), usage(7, 3)];
    let outside = Outside {
        hang: true,
        cancel_after: Some(Duration::from_secs(1)),
        ..Outside::default()
    };
    let (result, batches, ..) = play_with(vec![turn], limits(), outside).await;
    assert_eq!(result.status, RunStatus::Canceled);
    assert_eq!(result.text, HELD_CALL);
    assert_eq!(streamed(&batches), (result.text.clone(), true));
    assert_eq!(result.usage.prompt_tokens, 7, "the interrupted turn's usage counts");
}

/// A turn whose call naps `ms`, then one the model would answer with.
fn a_nap_then_an_answer(ms: u64) -> Vec<Vec<Result<LlmEvent, LlmError>>> {
    vec![
        vec![text("Napping.\n"), call(0, "nap", &format!("{{\"ms\": {ms}}}"))],
        vec![text("Rested.")],
    ]
}

#[tokio::test(start_paused = true)]
async fn a_cancel_after_the_turn_lets_its_call_finish_and_asks_the_model_no_more() {
    let outside = Outside {
        cancel_after: Some(Duration::from_secs(1)),
        cancel_mode: CancelMode::AfterTurn,
        ..Outside::default()
    };
    let (result, batches, script, _) = play_with(a_nap_then_an_answer(3000), limits(), outside).await;
    assert_eq!(result.status, RunStatus::Canceled);
    assert_eq!(result.failure_detail, "canceled by the test");
    assert_eq!(result.text, "Napping.\n");
    assert_eq!(result.tool_calls.len(), 1);
    assert!(
        result.tool_calls[0].ok,
        "the turn's call ran to its end: {:?}",
        result.tool_calls
    );
    assert_eq!(script.requests.lock().unwrap().len(), 1, "no new model request");
    assert_eq!(streamed(&batches), (result.text.clone(), true));
}

#[tokio::test(start_paused = true)]
async fn an_immediate_cancel_after_a_cancel_after_the_turn_wins() {
    let outside = Outside {
        cancel_after: Some(Duration::from_secs(1)),
        cancel_mode: CancelMode::AfterTurn,
        cancel_at_once_after: Some(Duration::from_secs(2)),
        ..Outside::default()
    };
    let (result, _, script, _) = play_with(a_nap_then_an_answer(60_000), limits(), outside).await;
    assert_eq!(result.status, RunStatus::Canceled);
    assert_eq!(result.failure_detail, "canceled at once by the test");
    assert!(
        result.tool_calls.iter().all(|c| !c.ok),
        "the call in flight was abandoned, not waited for: {:?}",
        result.tool_calls
    );
    assert_eq!(script.requests.lock().unwrap().len(), 1);
}

#[tokio::test(start_paused = true)]
async fn a_cancel_after_a_turn_that_ends_the_run_lets_it_complete() {
    let outside = Outside {
        cancel_after: Some(Duration::from_millis(10)),
        cancel_mode: CancelMode::AfterTurn,
        pace: Some(Duration::from_millis(100)),
        ..Outside::default()
    };
    let turn = vec![text("All "), text("done.")];
    let (result, ..) = play_with(vec![turn], limits(), outside).await;
    assert_eq!(
        (result.status, result.text.as_str()),
        (RunStatus::Completed, "All done.")
    );
}

fn user(text: &str) -> UserMessage {
    UserMessage {
        content: text.to_owned(),
        name: None,
    }
}

/// The text of the newest message of a request, when it is a user message.
fn last_user_text(request: &ChatRequest) -> Option<&str> {
    match request.messages.last() {
        Some(Message::User { content, .. }) => Some(content),
        _ => None,
    }
}

/// The `message_added` events: their turn and text.
fn messages_added(events: &[NumberedEvent]) -> Vec<(u32, &str)> {
    events
        .iter()
        .filter_map(|e| match &e.event {
            Event::MessageAdded { turn, content, .. } => Some((*turn, content.as_str())),
            _ => None,
        })
        .collect()
}

/// Steering: a message sent while the turn's call runs joins the conversation after the call's
/// result (after the turn's status note, as one user message), so the next request holds it at
/// its end and starts with the one before byte for byte.
#[tokio::test(start_paused = true)]
async fn a_message_sent_while_a_call_runs_joins_the_next_request_after_its_result() {
    let outside = Outside {
        messages: vec![(Duration::from_secs(1), "Also check the weather in Oslo.")],
        ..Outside::default()
    };
    let (result, batches, script, _) = play_with(a_nap_then_an_answer(3000), limits(), outside).await;
    assert_eq!(result.status, RunStatus::Completed, "{result:?}");
    let events: Vec<NumberedEvent> = batches.into_iter().flatten().collect();
    assert_eq!(messages_added(&events), [(2, "Also check the weather in Oslo.")]);
    let turn_one_ended = events
        .iter()
        .position(|e| matches!(e.event, Event::TurnFinished { turn: 1, .. }));
    let added = events
        .iter()
        .position(|e| matches!(e.event, Event::MessageAdded { .. }));
    assert!(turn_one_ended < added, "announced after turn 1 ended");
    let requests = script.requests.lock().unwrap();
    assert_eq!(requests.len(), 2);
    let last = last_user_text(&requests[1]).unwrap_or_default();
    assert!(last.ends_with("Also check the weather in Oslo."), "{last:?}");
    assert!(
        matches!(
            requests[1].messages[requests[1].messages.len() - 2],
            Message::Tool { .. }
        ),
        "after the call's result"
    );
    assert_eq!(
        requests[0].messages[..],
        requests[1].messages[..requests[0].messages.len()],
        "the first request is a prefix of the second"
    );
}

/// A message that comes while the model answers without calling a tool gives the run one more
/// turn, which holds the answer and then the message.
#[tokio::test(start_paused = true)]
async fn a_message_sent_while_the_model_answers_takes_one_more_turn() {
    let outside = Outside {
        messages: vec![(Duration::from_millis(150), "Shorter, please.")],
        pace: Some(Duration::from_millis(100)),
        ..Outside::default()
    };
    let turns = vec![vec![text("A long "), text("answer.")], vec![text("Short.")]];
    let (result, events, script) = {
        let (result, batches, script, _) = play_with(turns, limits(), outside).await;
        (result, batches.into_iter().flatten().collect::<Vec<_>>(), script)
    };
    assert_eq!(result.status, RunStatus::Completed);
    assert_eq!(result.text, "A long answer.Short.");
    assert_eq!(result.turns, 2);
    assert_eq!(messages_added(&events), [(2, "Shorter, please.")]);
    let requests = script.requests.lock().unwrap();
    let answer = &requests[1].messages[requests[1].messages.len() - 2];
    assert!(
        matches!(answer, Message::Assistant { content, tool_calls, .. } if content == "A long answer." && tool_calls.is_empty()),
        "{answer:?}"
    );
    assert!(last_user_text(&requests[1]).is_some_and(|t| t.ends_with("Shorter, please.")));
}

/// A run that answered with nothing waiting takes no more messages; one in its last turn takes
/// none either (no boundary is left), and the message that came before that turn joined it.
#[tokio::test(start_paused = true)]
async fn the_inbox_closes_when_the_run_answers_and_in_its_last_turn() {
    let answered = Outside::default();
    let inbox = answered.inbox.clone();
    let (result, ..) = play_with(vec![vec![text("Done.")]], limits(), answered).await;
    assert_eq!(result.status, RunStatus::Completed);
    assert_eq!(inbox.send(user("late")), Err(Refused::Closed(Closed::Answered)));

    let two_turns = Limits {
        max_turns: 2,
        ..limits()
    };
    let last = Outside {
        messages: vec![(Duration::from_secs(1), "in time")],
        ..Outside::default()
    };
    let inbox = last.inbox.clone();
    let (result, batches, ..) = play_with(a_nap_then_an_answer(3000), two_turns, last).await;
    assert_eq!(result.status, RunStatus::Completed);
    let events: Vec<NumberedEvent> = batches.into_iter().flatten().collect();
    assert_eq!(messages_added(&events), [(2, "in time")]);
    assert_eq!(inbox.send(user("too late")), Err(Refused::Closed(Closed::LastTurn)));
}

/// A run on a thread: the model sees the thread's messages after the system messages and before
/// the request's; as the run ends, its request messages and turns join the thread and it lets
/// the thread go.
#[tokio::test(start_paused = true)]
async fn a_run_on_a_thread_sees_its_history_and_adds_its_messages_as_it_ends() {
    use crate::domain::ports::ThreadStore;
    use crate::domain::thread::{RunThread, Thread, ThreadLimits};
    let store = Arc::new(crate::store::memory::MemoryThreads::new(8, Duration::from_secs(3600)));
    let bounds = ThreadLimits {
        max_runs: 8,
        max_bytes: 1 << 20,
        max_queue: 2,
    };
    let keeper = Arc::new(crate::threads::Keeper::new(
        store.clone(),
        bounds,
        Duration::from_secs(1),
    ));
    let mut held = Thread::new("t", "", shared::sync::unix_ms());
    held.live = Some("r".into());
    assert!(store.write(held, 0).await.unwrap());
    let answer = Message::Assistant {
        content: "earlier answer".into(),
        tool_calls: Vec::new(),
        reasoning: None,
    };
    let earlier = vec![user_message("earlier question"), answer];
    let outside = Outside {
        thread: Some(RunThread {
            thread_id: "t".into(),
            history: earlier.clone(),
            ..RunThread::default()
        }),
        threads: Some(keeper),
        ..Outside::default()
    };
    let (result, _, script, _) = play_with(a_nap_then_an_answer(10), limits(), outside).await;
    assert_eq!((result.status, result.thread_id.as_str()), (RunStatus::Completed, "t"));
    let first = script.requests.lock().unwrap()[0].messages.clone();
    assert_eq!(first[1..3], earlier[..], "after the BIOS, before the request's");
    assert_eq!(first[3], user_message("go"));
    let (thread, _) = store.read("t").await.unwrap().unwrap();
    assert_eq!(thread.live, None, "the run let the thread go");
    let kept: Vec<&Message> = thread.messages().collect();
    assert_eq!(kept[0], &user_message("go"), "its request's messages, then its turns");
    assert!(matches!(kept.last(), Some(Message::Assistant { content, .. }) if content == "Rested."));
    assert_eq!(thread.runs[0].run_id, "r");
}

fn user_message(text: &str) -> Message {
    Message::User {
        content: text.into(),
        name: None,
    }
}

/// A message that waits when the run's replica stops is in the checkpoints of the turn's calls:
/// the replica that resumes the run has it join at the turn's end.
#[tokio::test(start_paused = true)]
async fn a_waiting_message_is_kept_in_the_checkpoint_and_joins_on_resume() {
    let journal = Arc::new(Journal::default());
    let outside = Outside {
        journal: Some(Arc::clone(&journal)),
        messages: vec![(Duration::from_millis(5), "kept")],
        ..Outside::default()
    };
    let (ended, ..) = play_with(two_naps_then_an_answer(), limits(), outside).await;
    assert_eq!(ended.status, RunStatus::Completed, "{ended:?}");
    let one_done = first(journal.checkpoints(), "after one call, with the message", |c| {
        c.calls.as_ref().is_some_and(|calls| calls.finished.len() == 1) && !c.steering.waiting.is_empty()
    });
    let seq = one_done.seq;
    let (result, events, script, _) = resume_at(one_done, seq).await;
    assert_eq!(result.status, RunStatus::Completed, "{result:?}");
    assert_eq!(messages_added(&events), [(2, "kept")]);
    let requests = script.requests.lock().unwrap();
    assert!(last_user_text(&requests[0]).is_some_and(|t| t.ends_with("kept")));
}

#[tokio::test(start_paused = true)]
async fn the_deadline_keeps_held_text_and_code_blocks_stream_before_it() {
    let turn = vec![text("```rust\nfn main() {}\n```\n"), text(OPEN_DIRECTIVE)];
    let outside = Outside {
        hang: true,
        ..Outside::default()
    };
    let limits = Limits {
        run_timeout: Duration::from_secs(3),
        ..limits()
    };
    let (result, batches, ..) = play_with(vec![turn], limits, outside).await;
    assert_eq!(
        (result.status, result.failure_reason),
        (RunStatus::Failed, Some(FailureReason::DeadlineExceeded))
    );
    assert_eq!(result.text, format!("```rust\nfn main() {{}}\n```\n{OPEN_DIRECTIVE}"));
    let (text, no_gaps) = streamed(&batches);
    assert!(no_gaps && text == result.text);
    let first = batches.iter().flatten().find_map(|e| match &e.event {
        Event::TextDelta { text, .. } => Some(text.clone()),
        _ => None,
    });
    assert_eq!(
        first.as_deref(),
        Some("```rust\nfn main() {}\n```\n"),
        "the code block streamed at once"
    );
}

/// A deadline already past when a run goes on (a parked run woken by it) ends the run, even
/// when its loop is done at once: the deadline's timer alone fires only once the runtime's clock
/// next moves, and a resumed run could take a whole turn before that.
#[tokio::test]
async fn a_deadline_already_past_wins_over_a_loop_that_is_done() {
    let mut spec = spec(limits());
    spec.deadline = Deadline::new(Instant::now(), Duration::ZERO, None, Duration::ZERO);
    let ends = Ends {
        cancel: &Cancel::default(),
        caller: None,
        handoff: &Handoff::default(),
        persister: None,
    };
    let end = race(std::future::ready(End::Completed), &spec, ends).await;
    assert!(matches!(end, End::Failed(FailureReason::DeadlineExceeded, _)));
}

#[tokio::test(start_paused = true)]
async fn usage_of_a_turn_that_breaks_off_counts() {
    let turn = vec![
        text("partial"),
        usage(11, 5),
        Err(LlmError::Protocol("the LLM stream broke off".into())),
    ];
    let (result, ..) = play(vec![turn], limits()).await;
    assert_eq!(result.failure_reason, Some(FailureReason::LlmError));
    assert_eq!((result.usage.prompt_tokens, result.usage.completion_tokens), (11, 5));
}

#[tokio::test(start_paused = true)]
async fn a_model_looping_in_its_reasoning_is_stopped() {
    let thinking = |n: usize| Ok(LlmEvent::ReasoningDelta("Wait, let me reconsider.\n".repeat(n)));
    let (result, ..) = play(vec![vec![thinking(7), text("ok")]], limits()).await;
    assert_eq!(
        result.status,
        RunStatus::Completed,
        "7 repetitions: under the threshold of 8"
    );
    let (result, ..) = play(vec![vec![thinking(8), text("never")]], limits()).await;
    assert_eq!(result.failure_reason, Some(FailureReason::RepeatedLineLoop));
    assert!(result.failure_detail.contains("reasoning"), "{}", result.failure_detail);
    assert_eq!(result.text, "", "reasoning is not output");
    assert_eq!(
        result.reasoning,
        "Wait, let me reconsider.\n".repeat(8),
        "kept up to the repeated line"
    );
}

fn reasoning(t: &str) -> Result<LlmEvent, LlmError> {
    Ok(LlmEvent::ReasoningDelta(t.into()))
}

/// A turn reasoning before its call, then one reasoning before its answer.
fn reasoning_turns() -> Vec<Vec<Result<LlmEvent, LlmError>>> {
    vec![
        vec![
            reasoning("I need a nap. "),
            reasoning("One will do."),
            call(0, "nap", r#"{"ms": 1}"#),
        ],
        vec![reasoning("Rested."), text("slept")],
    ]
}

fn with_reasoning(max_reasoning_bytes: usize, send_reasoning: bool) -> Outside {
    Outside {
        output: OutputBounds {
            max_reasoning_bytes,
            ..(&crate::Config::default().runs.output).into()
        },
        send_reasoning,
        ..Outside::default()
    }
}

/// Reasoning events' text, and their turns.
fn streamed_reasoning(batches: &[EventBatch]) -> (String, Vec<u32>) {
    batches
        .iter()
        .flatten()
        .filter_map(|e| match &e.event {
            Event::ReasoningDelta { text, turn } => Some((text.as_str(), *turn)),
            _ => None,
        })
        .fold((String::new(), Vec::new()), |(mut all, mut turns), (text, turn)| {
            all.push_str(text);
            turns.push(turn);
            (all, turns)
        })
}

#[tokio::test(start_paused = true)]
async fn reasoning_is_streamed_and_kept_apart_from_the_text_up_to_its_cap() {
    let all = "I need a nap. One will do.Rested.";
    let (result, batches, script, _) = play_with(reasoning_turns(), limits(), with_reasoning(all.len(), false)).await;
    assert_eq!((result.status, result.text.as_str()), (RunStatus::Completed, "slept"));
    assert_eq!((result.reasoning.as_str(), result.reasoning_truncated), (all, false));
    // Deltas already there are one event, as text is.
    assert_eq!(streamed_reasoning(&batches), (all.to_owned(), vec![1, 2]));
    let second = script.requests.lock().unwrap()[1].clone();
    assert!(
        matches!(&second.messages[2], Message::Assistant { reasoning: None, .. }),
        "not sent back unless configured: {:?}",
        second.messages[2]
    );

    // One byte under: the run goes on, its reasoning cut and flagged.
    let (result, batches, ..) = play_with(reasoning_turns(), limits(), with_reasoning(all.len() - 1, false)).await;
    assert_eq!((result.status, result.text.as_str()), (RunStatus::Completed, "slept"));
    assert_eq!(
        (result.reasoning.as_str(), result.reasoning_truncated),
        (&all[..all.len() - 1], true)
    );
    assert_eq!(streamed_reasoning(&batches).0, result.reasoning);

    // Nothing kept at all.
    let (result, batches, ..) = play_with(reasoning_turns(), limits(), with_reasoning(0, false)).await;
    assert_eq!(
        (result.status, result.reasoning.as_str(), result.reasoning_truncated),
        (RunStatus::Completed, "", true)
    );
    assert_eq!(streamed_reasoning(&batches).1, Vec::<u32>::new());
}

#[tokio::test(start_paused = true)]
async fn reasoning_goes_back_to_the_model_when_configured_within_its_cap() {
    let (result, _, script, _) = play_with(reasoning_turns(), limits(), with_reasoning(1024, true)).await;
    assert_eq!(result.status, RunStatus::Completed);
    let second = script.requests.lock().unwrap()[1].clone();
    let Message::Assistant {
        reasoning, tool_calls, ..
    } = &second.messages[2]
    else {
        panic!("{:?}", second.messages[2]);
    };
    assert_eq!(
        (reasoning.as_deref(), tool_calls.len()),
        (Some("I need a nap. One will do."), 1)
    );

    let (_, _, script, _) = play_with(reasoning_turns(), limits(), with_reasoning(6, true)).await;
    let second = script.requests.lock().unwrap()[1].clone();
    assert!(
        matches!(&second.messages[2], Message::Assistant { reasoning: Some(r), .. } if r == "I need"),
        "{:?}",
        second.messages[2]
    );
}

#[tokio::test(start_paused = true)]
async fn large_tool_results_and_arguments_are_cut_for_the_model_and_in_their_events() {
    let big = format!(r#"{{"pad": "{}"}}"#, "x".repeat(5000));
    let (result, batches, script, _) = play_batched(vec![vec![call(0, "nap", &big)]], limits()).await;
    assert_eq!(result.status, RunStatus::Completed);
    let second = script.requests.lock().unwrap()[1].clone();
    let Some(Message::Tool { content, .. }) = second.messages.iter().rfind(|m| matches!(m, Message::Tool { .. }))
    else {
        panic!("{:?}", second.messages)
    };
    assert!(content.len() < 1100, "{} bytes fed back", content.len());
    assert!(content.ends_with(&format!(
        "[result cut: {} of {} bytes left out]",
        big.len() - 1024,
        big.len()
    )));
    let finished = batches.iter().flatten().find_map(|e| match &e.event {
        Event::ToolCallFinished {
            content_json,
            content_truncated,
            ..
        } => Some((content_json.clone().unwrap_or_default().len(), *content_truncated)),
        _ => None,
    });
    assert_eq!(finished, Some((1024, true)));
    // The arguments: cut in their event, whole in the run's record.
    let started = batches.iter().flatten().find_map(|e| match &e.event {
        Event::ToolCallStarted {
            arguments_json,
            arguments_truncated,
            ..
        } => Some((arguments_json.len(), *arguments_truncated)),
        _ => None,
    });
    assert_eq!(started, Some((1024, true)));
    assert_eq!(result.tool_calls[0].arguments_json, big);
}

#[tokio::test(start_paused = true)]
async fn long_tool_error_messages_are_cut_everywhere_the_run_keeps_them() {
    let message = "e".repeat(5000);
    let args = serde_json::json!({ "message": message }).to_string();
    let (result, batches, script, _) = play_batched(vec![vec![call(0, "bad", &args)]], limits()).await;
    let marker = format!("\n[message cut: {} of 5000 bytes left out]", 5000 - 1024);
    let kept = format!("{}{marker}", &message[..1024]);
    // The model's tool message, and the run's record.
    let second = script.requests.lock().unwrap()[1].clone();
    let Some(Message::Tool { content, .. }) = second.messages.iter().rfind(|m| matches!(m, Message::Tool { .. }))
    else {
        panic!("{:?}", second.messages)
    };
    let fed_back: serde_json::Value = serde_json::from_str(content).unwrap();
    assert_eq!(fed_back["error"]["message"], kept.as_str());
    let record = result.tool_calls[0].error.clone().unwrap();
    assert_eq!(record.message, kept);
    // The event: at most max_event_bytes (1024 here) of it.
    let event_message = batches.iter().flatten().find_map(|e| match &e.event {
        Event::ToolCallFinished { error: Some(e), .. } => Some(e.message.clone()),
        _ => None,
    });
    assert_eq!(event_message.as_deref(), Some(&message[..1024]));
    // A message within the bound is kept whole.
    let short = serde_json::json!({ "message": "e".repeat(1024) }).to_string();
    let (result, ..) = play_batched(vec![vec![call(0, "bad", &short)]], limits()).await;
    assert_eq!(result.tool_calls[0].error.clone().unwrap().message.len(), 1024);
}

#[tokio::test(start_paused = true)]
async fn long_text_is_split_over_events_of_the_largest_size() {
    let long = "é".repeat(1500);
    let (result, batches, ..) = play_batched(vec![vec![text(&long)]], limits()).await;
    let deltas: Vec<usize> = batches
        .iter()
        .flatten()
        .filter_map(|e| match &e.event {
            Event::TextDelta { text, .. } => Some(text.len()),
            _ => None,
        })
        .collect();
    assert_eq!(
        deltas,
        [1024, 1024, 952],
        "split on char boundaries, at most 1024 bytes each"
    );
    assert_eq!(streamed(&batches), (result.text, true));
}

#[tokio::test(start_paused = true)]
async fn a_caller_that_stops_reading_is_given_up_and_frees_the_run() {
    let turns = (0..50)
        .map(|i| vec![text(&format!("line {i}\n")), call(0, "nap", "{}")])
        .collect();
    let outside = Outside {
        buffer: 1,
        read_every: None,
        attached: true,
        emit: EmitSettings {
            send_timeout: Duration::from_secs(2),
            ..EMIT
        },
        ..Outside::default()
    };
    let limits = many_turns();
    let started = Instant::now();
    let (result, ..) = play_with(turns, limits, outside).await;
    assert_eq!(result.status, RunStatus::Canceled);
    assert!(
        result.failure_detail.contains("stopped reading"),
        "{}",
        result.failure_detail
    );
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "ended by the send timeout, not the deadline"
    );
}

#[tokio::test(start_paused = true)]
async fn a_cancel_during_a_slow_read_leaves_no_gap_in_seq() {
    let turns = (0..20)
        .map(|i| vec![text(&format!("t{i} ")), call(0, "nap", "{}")])
        .collect();
    let outside = Outside {
        buffer: 1,
        read_every: Some(Duration::from_millis(300)),
        cancel_after: Some(Duration::from_millis(1000)),
        ..Outside::default()
    };
    let (result, batches, ..) = play_with(turns, many_turns(), outside).await;
    assert_eq!(result.status, RunStatus::Canceled);
    let (text, no_gaps) = streamed(&batches);
    assert!(
        no_gaps,
        "{:?}",
        batches.iter().flatten().map(|e| e.seq).collect::<Vec<_>>()
    );
    assert_eq!(text, result.text);
    assert!(matches!(
        batches.last().and_then(|b| b.last()).map(|e| &e.event),
        Some(Event::RunFinished(_))
    ));
}

fn bounded(max_calls_per_turn: usize, max_argument_bytes: usize, max_output_bytes: usize) -> Outside {
    Outside {
        output: OutputBounds {
            max_calls_per_turn,
            max_argument_bytes,
            max_output_bytes,
            ..(&crate::Config::default().runs.output).into()
        },
        ..Outside::default()
    }
}

async fn play_bounded(turns: Vec<Vec<Result<LlmEvent, LlmError>>>, outside: Outside) -> (RunResult, usize) {
    let (result, _, _, tools) = play_with(turns, limits(), outside).await;
    (result, tools.peak.load(Ordering::SeqCst))
}

#[tokio::test(start_paused = true)]
async fn calls_per_turn_on_both_sides_of_the_limit() {
    let naps = |n: u32| (0..n).map(|i| call(i, "nap", r#"{"ms": 1}"#)).collect::<Vec<_>>();
    let (result, ran) = play_bounded(vec![naps(2), vec![text("done")]], bounded(2, 1024, 4096)).await;
    assert_eq!(
        (result.status, result.tool_calls.len(), ran),
        (RunStatus::Completed, 2, 2)
    );

    let mut turn = vec![text("fanning out\n")];
    turn.extend(naps(3));
    let (result, ran) = play_bounded(vec![turn], bounded(2, 1024, 4096)).await;
    assert_eq!(
        (result.status, result.failure_reason, ran),
        (RunStatus::Failed, Some(FailureReason::OutputLimit), 0)
    );
    assert!(
        result.failure_detail.contains("more than 2 tool calls"),
        "{}",
        result.failure_detail
    );
    assert_eq!(result.text, "fanning out\n", "the text before is kept");
}

#[tokio::test(start_paused = true)]
async fn argument_bytes_on_both_sides_of_the_limit() {
    let at_limit = format!(r#"{{"s": "{}"}}"#, "x".repeat(64 - 9));
    let over = format!(r#"{{"s": "{}"}}"#, "x".repeat(65 - 9));
    assert_eq!((at_limit.len(), over.len()), (64, 65));
    let (result, ran) = play_bounded(
        vec![vec![call(0, "nap", &at_limit)], vec![text("done")]],
        bounded(8, 64, 4096),
    )
    .await;
    assert_eq!(
        (result.status, ran),
        (RunStatus::Completed, 1),
        "{}",
        result.failure_detail
    );
    // Over the limit: a bad call, as arguments that are not JSON are (this spec's policy
    // is FAIL; with FEED_BACK the error goes back to the model).
    let (result, ran) = play_bounded(vec![vec![call(0, "nap", &over)]], bounded(8, 64, 4096)).await;
    assert_eq!(
        (result.status, result.failure_reason, ran),
        (RunStatus::Failed, Some(FailureReason::ToolParseError), 0)
    );
    assert!(
        result
            .failure_detail
            .contains("65 bytes, over this server's limit of 64"),
        "{}",
        result.failure_detail
    );
}

#[tokio::test(start_paused = true)]
async fn output_bytes_on_both_sides_of_the_limit_and_while_held() {
    let (result, _) = play_bounded(vec![vec![text(&"a".repeat(100))]], bounded(8, 64, 100)).await;
    assert_eq!((result.status, result.text.len()), (RunStatus::Completed, 100));

    let (result, _) = play_bounded(
        vec![vec![text(&"a".repeat(60)), text(&"b".repeat(60))]],
        bounded(8, 64, 100),
    )
    .await;
    assert_eq!(
        (result.status, result.failure_reason),
        (RunStatus::Failed, Some(FailureReason::OutputLimit))
    );
    assert_eq!(result.text, format!("{}{}", "a".repeat(60), "b".repeat(40)));

    // A directive that never closes is held, not shown; it counts all the same.
    let open = format!("Here:\n```json\n{}", "c".repeat(200));
    let (result, _) = play_bounded(vec![vec![text(&open)]], bounded(8, 64, 100)).await;
    assert_eq!(result.failure_reason, Some(FailureReason::OutputLimit));
    assert_eq!(result.text, open[..100], "what fits of the held text is kept");
}

// Durable runs: the checkpoints a run saves, and a run resumed from each kind of safe point.

/// A run journal in memory: keeps every checkpoint saved, in order, with how far the run's log
/// (when it watches one) had kept the events then.
#[derive(Default)]
struct Journal {
    saved: Mutex<Vec<Vec<u8>>>,
    /// Saves refused before the journal takes any.
    refuse_saves: std::sync::atomic::AtomicUsize,
    /// Every save after the first is refused.
    refuse_after_first: bool,
    log: Option<tokio::sync::watch::Receiver<crate::domain::ports::Settled>>,
    kept_at_save: Mutex<Vec<u64>>,
    /// The store's lease terms (a store other replicas read); none: the run never lapses.
    lease: Option<crate::domain::LeaseTerms>,
    /// The save of this index (0: the first) takes this long before the store takes it.
    slow_save: Option<(usize, Duration)>,
}

/// The memory store with the lease terms of a store other replicas read.
struct Leased {
    inner: crate::store::memory::MemoryStore,
    terms: crate::domain::LeaseTerms,
}

impl crate::domain::ports::ResultStore for Leased {
    fn put(&self, result: RunResult) -> BoxFuture<'static, Result<(), crate::domain::ports::StoreError>> {
        self.inner.put(result)
    }
    fn claim(
        &self,
        result: RunResult,
    ) -> BoxFuture<'static, Result<crate::domain::ports::Claim, crate::domain::ports::StoreError>> {
        self.inner.claim(result)
    }
    fn get(&self, run_id: &str) -> BoxFuture<'static, Result<Option<RunResult>, crate::domain::ports::StoreError>> {
        self.inner.get(run_id)
    }
    fn lease(&self) -> Option<crate::domain::LeaseTerms> {
        Some(self.terms)
    }
}

/// An event log that keeps each batch appended 30 ms later (a publish and its acknowledgement).
struct SlowLog {
    settled: tokio::sync::watch::Sender<crate::domain::ports::Settled>,
}

impl crate::domain::ports::LogWriter for SlowLog {
    fn append(&mut self, events: &[NumberedEvent]) {
        let (settled, last) = (self.settled.clone(), events.last().map_or(0, |e| e.seq));
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(30)).await;
            settled.send_modify(|s| s.kept_through = s.kept_through.max(last));
        });
    }
    fn settled(&self) -> Option<tokio::sync::watch::Receiver<crate::domain::ports::Settled>> {
        Some(self.settled.subscribe())
    }
}

impl Journal {
    fn checkpoints(&self) -> Vec<Checkpoint> {
        let saved = self.saved.lock().unwrap();
        saved
            .iter()
            .map(|bytes| serde_json::from_slice(bytes).unwrap())
            .collect()
    }
}

impl crate::domain::ports::RunJournal for Journal {
    fn save(
        &self,
        _result: RunResult,
        _deadline_unix_ms: u64,
        checkpoint: Vec<u8>,
    ) -> BoxFuture<'static, Result<(), crate::domain::ports::StoreError>> {
        let refuse = self.refuse_saves.fetch_update(
            std::sync::atomic::Ordering::SeqCst,
            std::sync::atomic::Ordering::SeqCst,
            |n| n.checked_sub(1),
        );
        if refuse.is_ok() || (self.refuse_after_first && !self.saved.lock().unwrap().is_empty()) {
            let refused = crate::domain::ports::StoreError::Unavailable {
                operation: "checkpoint put",
                key: "r".into(),
                reason: "refused by the test".into(),
            };
            return futures::future::ready(Err(refused)).boxed();
        }
        let index = {
            let mut saved = self.saved.lock().unwrap();
            saved.push(checkpoint);
            saved.len() - 1
        };
        if let Some(log) = &self.log {
            self.kept_at_save.lock().unwrap().push(log.borrow().kept_through);
        }
        match self.slow_save {
            Some((slow, took)) if slow == index => tokio::time::sleep(took).map(Ok).boxed(),
            _ => futures::future::ready(Ok(())).boxed(),
        }
    }
    fn claim_resumable(
        &self,
        result: RunResult,
        deadline_unix_ms: u64,
        checkpoint: Vec<u8>,
    ) -> BoxFuture<'static, Result<crate::domain::ports::Claim, crate::domain::ports::StoreError>> {
        let saved = self.save(result, deadline_unix_ms, checkpoint);
        async move { saved.await.map(|()| crate::domain::ports::Claim::Claimed) }.boxed()
    }
    fn forget(&self, _run_id: &str) -> BoxFuture<'static, Result<(), crate::domain::ports::StoreError>> {
        futures::future::ready(Ok(())).boxed()
    }
    fn orphans(&self) -> BoxFuture<'static, Result<Vec<String>, crate::domain::ports::StoreError>> {
        futures::future::ready(Ok(Vec::new())).boxed()
    }
    fn take_over(
        &self,
        _run_id: &str,
    ) -> BoxFuture<'static, Result<Option<crate::domain::ports::Claimed>, crate::domain::ports::StoreError>> {
        futures::future::ready(Ok(None)).boxed()
    }
    fn hand_over(&self, _run_id: &str) -> BoxFuture<'static, Result<(), crate::domain::ports::StoreError>> {
        futures::future::ready(Ok(())).boxed()
    }
    fn handovers(&self) -> BoxFuture<'static, BoxStream<'static, ()>> {
        futures::future::ready(futures::stream::empty().boxed()).boxed()
    }
    fn cancel_elsewhere(
        &self,
        _run_id: &str,
        _reason: &str,
        _mode: crate::domain::CancelMode,
    ) -> BoxFuture<'static, Result<Option<crate::domain::ports::RemoteCancel>, crate::domain::ports::StoreError>> {
        futures::future::ready(Ok(None)).boxed()
    }
    fn cancel_asks(&self) -> BoxFuture<'static, BoxStream<'static, crate::domain::ports::CancelAsk>> {
        futures::future::ready(futures::stream::empty().boxed()).boxed()
    }
}

fn durable(state: &SharedState, journal: Arc<Journal>) -> Persister {
    let memory = crate::store::memory::MemoryStore::new(16, Duration::from_secs(60));
    let store: Arc<dyn crate::domain::ports::ResultStore> = match journal.lease {
        Some(terms) => Arc::new(Leased { inner: memory, terms }),
        None => Arc::new(memory),
    };
    let timeout = Duration::from_secs(1);
    let backlog = crate::run::backlog::Backlog::new(Arc::clone(&store), 16, timeout, timeout);
    Persister::new(store, Arc::clone(state), timeout, backlog).with_journal(Some(journal))
}

/// Turn 1 says a word and calls `nap` twice (`id0` finishes first), turn 2 answers.
fn two_naps_then_an_answer() -> Vec<Vec<Result<LlmEvent, LlmError>>> {
    vec![
        vec![
            text("checking "),
            call(0, "nap", r#"{"ms": 10}"#),
            call(1, "nap", r#"{"ms": 50}"#),
        ],
        vec![text("all done")],
    ]
}

/// The run played whole and durable: its result, events and checkpoints.
async fn whole_durable_run() -> (RunResult, Vec<NumberedEvent>, Vec<Checkpoint>) {
    durable_run_claimed(false).await
}

/// [`whole_durable_run`], its id claimed with its start checkpoint when `claim_resumable`.
async fn durable_run_claimed(claim_resumable: bool) -> (RunResult, Vec<NumberedEvent>, Vec<Checkpoint>) {
    let journal = Arc::new(Journal::default());
    let outside = Outside {
        journal: Some(Arc::clone(&journal)),
        claim_resumable,
        ..Outside::default()
    };
    let (result, batches, _, _) = play_with(two_naps_then_an_answer(), limits(), outside).await;
    assert_eq!(result.status, RunStatus::Completed, "{result:?}");
    (result, batches.into_iter().flatten().collect(), journal.checkpoints())
}

/// Resumes from `checkpoint` with the log holding events through `logged`; the model plays
/// only turn 2.
async fn resume_at(checkpoint: Checkpoint, logged: u64) -> (RunResult, Vec<NumberedEvent>, Arc<Script>, Arc<Tools>) {
    let outside = Outside {
        journal: Some(Arc::default()),
        resumed: Some(Resumed { checkpoint, logged }),
        ..Outside::default()
    };
    let turn2 = two_naps_then_an_answer().split_off(1);
    let (result, batches, script, tools) = play_with(turn2, limits(), outside).await;
    (result, batches.into_iter().flatten().collect(), script, tools)
}

/// The first of `checkpoints` that `pick` matches.
fn first(checkpoints: Vec<Checkpoint>, what: &str, pick: impl Fn(&Checkpoint) -> bool) -> Checkpoint {
    match checkpoints.into_iter().find(|c| pick(c)) {
        Some(checkpoint) => checkpoint,
        None => panic!("no checkpoint {what}"),
    }
}

fn gap_free_from(events: &[NumberedEvent], first: u64) -> bool {
    events.iter().zip(first..).all(|(e, n)| e.seq == n)
}

#[tokio::test(start_paused = true)]
async fn a_run_asked_to_hand_over_does_so_at_its_next_safe_point() {
    let journal = Arc::new(Journal::default());
    let outside = Outside {
        journal: Some(Arc::clone(&journal)),
        hand_over: true,
        ..Outside::default()
    };
    let (result, _, script, tools) = play_with(two_naps_then_an_answer(), limits(), outside).await;
    assert_eq!(result.status, RunStatus::Running, "handed over, not ended: {result:?}");
    let checkpoints = journal.checkpoints();
    assert_eq!(checkpoints.len(), 1, "handed over at its first safe point");
    assert!(checkpoints[0].calls.is_none() && checkpoints[0].progress.turns_done == 0);
    assert!(
        script.requests.lock().unwrap().is_empty(),
        "the model was not asked here"
    );
    assert!(
        tools.started.lock().unwrap().is_empty(),
        "no call ran on the replica handing over"
    );
}

/// A checkpoint the store does not take stops the run at that safe point: what it would reveal
/// (the calls' announcement) never leaves, no call runs, and the run resumes from its last good
/// checkpoint on whichever replica claims it next.
#[tokio::test(start_paused = true)]
async fn a_checkpoint_the_store_refuses_stops_the_run_before_anything_it_holds_leaves() {
    let journal = Arc::new(Journal {
        refuse_after_first: true,
        ..Journal::default()
    });
    let outside = Outside {
        journal: Some(Arc::clone(&journal)),
        ..Outside::default()
    };
    let (result, events, script, tools) = play_with(two_naps_then_an_answer(), limits(), outside).await;
    stopped_before_its_calls(&result, &events, &tools);
    assert_eq!(journal.checkpoints().len(), 1, "only the turn's start was saved");
    assert_eq!(script.requests.lock().unwrap().len(), 1, "turn 1 was asked for");
}

/// A durable run whose park the store refuses stops here, ended nowhere: its log writer went
/// with the park, so waiting in place would let its checkpoints run ahead of its log. The
/// replica that takes it next resumes it from its last checkpoint; no call ran.
#[tokio::test(start_paused = true)]
async fn a_durable_run_the_store_will_not_park_stops_here_for_another_replica() {
    let journal = Arc::new(Journal::default());
    let outside = Outside {
        journal: Some(Arc::clone(&journal)),
        approval: crate::domain::approval::ApprovalRules {
            tools: ["nap".to_owned()].into(),
            timeout: Duration::from_secs(60),
            ..Default::default()
        },
        approvals: Arc::new(crate::store::memory::approvals::HookedLot {
            refuse_park: true,
            ..crate::store::memory::approvals::HookedLot::new()
        }),
        ..Outside::default()
    };
    let (result, batches, script, tools) = play_with(two_naps_then_an_answer(), limits(), outside).await;
    assert_eq!(result.status, RunStatus::Running, "stopped here, not ended: {result:?}");
    assert!(tools.started.lock().unwrap().is_empty(), "no call ran");
    let events: Vec<&NumberedEvent> = batches.iter().flatten().collect();
    assert!(
        events
            .iter()
            .any(|e| matches!(e.event, Event::ApprovalRequested { .. })),
        "the calls waited for approval: {events:?}"
    );
    assert!(!events.iter().any(|e| e.finished().is_some()), "no run_finished");
    assert_eq!(script.requests.lock().unwrap().len(), 1, "no turn after the first");
    let last = journal.checkpoints().pop().unwrap();
    assert!(
        last.calls.is_some(),
        "the last checkpoint holds the turn's waiting calls"
    );
}

/// The run stopped here (it moves) before its turn's calls: it did not end, no call ran, and the
/// calls were never announced from here.
fn stopped_before_its_calls(result: &RunResult, events: &[EventBatch], tools: &Tools) {
    assert_eq!(result.status, RunStatus::Running, "stopped here, not ended: {result:?}");
    assert!(tools.started.lock().unwrap().is_empty(), "no call ran");
    let events: Vec<&NumberedEvent> = events.iter().flatten().collect();
    assert!(
        !events.iter().any(|e| matches!(e.event, Event::ToolCallStarted { .. })),
        "the calls were never announced: {events:?}"
    );
    assert!(!events.iter().any(|e| e.finished().is_some()), "no run_finished");
}

/// An owner whose lease ran out while its checkpoint was being saved (a save slower than the
/// lease less its margin, as a paused or cut-off replica sees it) acts no more once the save
/// returns: the store took the checkpoint, but nothing it holds leaves from here (not the calls'
/// announcement) and no call runs; another replica resumes the run from that checkpoint.
#[tokio::test(start_paused = true)]
async fn an_owner_whose_lease_ran_out_during_a_save_sends_and_runs_nothing_after_it() {
    let journal = Arc::new(Journal {
        // The save returns within the store timeout (1 s), after the lease less its margin.
        lease: Some(crate::domain::LeaseTerms {
            length: Duration::from_millis(600),
            margin: Duration::from_millis(200),
            fence_grace: Duration::ZERO,
        }),
        slow_save: Some((1, Duration::from_millis(500))),
        ..Journal::default()
    });
    let outside = Outside {
        journal: Some(Arc::clone(&journal)),
        ..Outside::default()
    };
    let (result, events, _, tools) = play_with(two_naps_then_an_answer(), limits(), outside).await;
    stopped_before_its_calls(&result, &events, &tools);
    assert_eq!(
        journal.checkpoints().len(),
        2,
        "the turn's start and its calls were saved"
    );
}

#[tokio::test(start_paused = true)]
async fn a_durable_run_is_checkpointed_at_each_safe_point() {
    let (_, events, checkpoints) = whole_durable_run().await;
    let at = |c: &Checkpoint| match &c.calls {
        None => format!("turn end {}", c.progress.turns_done),
        Some(calls) => format!("calls, {} finished", calls.finished.len()),
    };
    assert_eq!(
        checkpoints.iter().map(at).collect::<Vec<_>>(),
        [
            "turn end 0",
            "calls, 0 finished",
            "calls, 1 finished",
            "calls, 2 finished",
            "turn end 1"
        ],
        "the last turn ends the run: its result is written instead"
    );
    assert!(checkpoints.windows(2).all(|w| w[0].seq <= w[1].seq));
    assert!(checkpoints.iter().all(|c| c.seq < events.len() as u64));
}

/// A durable run's id is claimed with `Checkpoint::at_start`, and its first safe point then saves
/// nothing: the two must be the same checkpoint (a run resumed from the claim's goes on exactly
/// as from the first safe point's).
#[tokio::test(start_paused = true)]
async fn the_start_checkpoint_of_the_claim_is_the_first_safe_points() {
    let (_, _, checkpoints) = whole_durable_run().await;
    // The deadline aside (a Unix time, taken when serialized), and the call ids given out in
    // order (a set).
    let without_deadline = |c: &Checkpoint| {
        let mut c = serde_json::to_value(c).unwrap();
        c["spec"]["deadline"] = serde_json::Value::Null;
        if let Some(ids) = c["call_ids"].as_array_mut() {
            ids.sort_by_key(|id| id.to_string());
        }
        c
    };
    let at_start = Checkpoint::at_start(&spec(limits()), RunResult::running("r"));
    assert_eq!(without_deadline(&at_start), without_deadline(&checkpoints[0]));

    // Claimed with it, the run saves it once: at its claim, not again before its first turn.
    let (_, _, claimed) = durable_run_claimed(true).await;
    let claimed: Vec<serde_json::Value> = claimed.iter().map(without_deadline).collect();
    let played: Vec<serde_json::Value> = checkpoints.iter().map(without_deadline).collect();
    assert_eq!(
        claimed, played,
        "the same checkpoints, the first one saved by the claim"
    );
}

#[tokio::test(start_paused = true)]
async fn a_resumed_turn_keeps_its_finished_calls_in_the_checkpoints_that_follow() {
    let (_, _, checkpoints) = whole_durable_run().await;
    let one_done = first(checkpoints, "after one call", |c| {
        c.calls.as_ref().is_some_and(|calls| calls.finished.len() == 1)
    });
    let journal = Arc::new(Journal::default());
    let seq = one_done.seq;
    let outside = Outside {
        journal: Some(Arc::clone(&journal)),
        resumed: Some(Resumed {
            checkpoint: one_done,
            logged: seq,
        }),
        ..Outside::default()
    };
    play_with(two_naps_then_an_answer().split_off(1), limits(), outside).await;
    let finished: Vec<Vec<usize>> = journal
        .checkpoints()
        .iter()
        .filter_map(|c| c.calls.as_ref())
        .map(|calls| calls.finished.iter().map(|f| f.index).collect())
        .collect();
    assert_eq!(finished.last(), Some(&vec![0, 1]), "{finished:?}");
}

/// A cancel that lets the turn finish is kept in the checkpoints that follow it: a replica that
/// resumes the run from one finishes the turn's calls and ends it there, asking the model nothing.
#[tokio::test(start_paused = true)]
async fn a_cancel_after_the_turn_is_kept_in_the_checkpoint_and_honoured_on_resume() {
    let journal = Arc::new(Journal::default());
    let outside = Outside {
        journal: Some(Arc::clone(&journal)),
        cancel_after: Some(Duration::from_millis(5)),
        cancel_mode: CancelMode::AfterTurn,
        ..Outside::default()
    };
    let (ended, ..) = play_with(two_naps_then_an_answer(), limits(), outside).await;
    assert_eq!(ended.status, RunStatus::Canceled, "{ended:?}");
    let one_done = first(journal.checkpoints(), "after one call, with the cancel", |c| {
        c.calls.as_ref().is_some_and(|calls| calls.finished.len() == 1) && c.cancel_after_turn.is_some()
    });
    let seq = one_done.seq;
    let (result, _, script, tools) = resume_at(one_done, seq).await;
    assert_eq!(*tools.started.lock().unwrap(), ["id1"], "the turn's other call runs");
    assert_eq!(result.status, RunStatus::Canceled, "{result:?}");
    assert_eq!(result.failure_detail, "canceled by the test");
    assert!(result.tool_calls.iter().all(|c| c.ok), "{:?}", result.tool_calls);
    assert!(
        script.requests.lock().unwrap().is_empty(),
        "the model is not asked again"
    );
}

#[tokio::test(start_paused = true)]
async fn a_run_resumed_after_one_call_finished_runs_only_the_other() {
    let (whole, _, checkpoints) = whole_durable_run().await;
    let one_done = first(checkpoints, "after one call", |c| {
        c.calls.as_ref().is_some_and(|calls| calls.finished.len() == 1)
    });
    let seq = one_done.seq;
    let (result, events, script, tools) = resume_at(one_done, seq).await;
    assert_eq!(
        *tools.started.lock().unwrap(),
        ["id1"],
        "only the call in flight runs again"
    );
    assert_eq!(result.status, RunStatus::Completed, "{result:?}");
    assert_eq!(result.text, whole.text);
    let ids = |r: &RunResult| r.tool_calls.iter().map(|c| c.call_id.clone()).collect::<Vec<_>>();
    assert_eq!(ids(&result), ids(&whole));
    assert_eq!(script.requests.lock().unwrap().len(), 1, "turn 1 is not asked again");
    let second = script.requests.lock().unwrap()[0].clone();
    let tool_messages = second
        .messages
        .iter()
        .filter(|m| matches!(m, Message::Tool { .. }))
        .count();
    assert_eq!(tool_messages, 2, "both results go back to the model");
    assert!(gap_free_from(&events, seq + 1), "{events:?}");
}

#[tokio::test(start_paused = true)]
async fn a_run_resumed_with_its_log_ahead_restarts_the_turn_that_was_streaming() {
    let (whole, _, checkpoints) = whole_durable_run().await;
    let turn_end = first(checkpoints, "at the end of turn 1", |c| {
        c.calls.is_none() && c.progress.turns_done == 1
    });
    // The log holds two events of turn 2 the checkpoint does not account for.
    let logged = turn_end.seq + 2;
    let (result, events, script, tools) = resume_at(turn_end, logged).await;
    assert_eq!(
        events.first().map(|e| (e.seq, &e.event)),
        Some((
            logged + 1,
            &Event::TurnRestarted {
                turn: 2,
                attempt: 2,
                reason: "the orchestrator replica running the run stopped while the model was streaming".into()
            }
        ))
    );
    assert!(gap_free_from(&events, logged + 1), "{events:?}");
    assert!(tools.started.lock().unwrap().is_empty(), "turn 1's calls are done");
    assert_eq!(script.requests.lock().unwrap().len(), 1);
    assert_eq!(
        result.text, whole.text,
        "the restarted turn's first attempt is not in the result"
    );
    assert_eq!(result.status, RunStatus::Completed);
}

#[tokio::test(start_paused = true)]
async fn a_run_resumed_before_its_announcement_reached_the_log_sends_it_with_the_same_numbers() {
    let (_, whole_events, checkpoints) = whole_durable_run().await;
    let assembled = first(checkpoints, "of the assembled calls", |c| {
        c.calls.as_ref().is_some_and(|calls| calls.finished.is_empty())
    });
    let outbox = assembled.outbox.clone();
    assert!(
        outbox.iter().any(|e| matches!(e.event, Event::ToolCallStarted { .. })),
        "the announcement waits in the outbox: {outbox:?}"
    );
    assert_eq!(outbox, whole_events[outbox[0].seq as usize - 1..][..outbox.len()]);
    let logged = outbox[0].seq - 1;
    let (result, events, _, tools) = resume_at(assembled, logged).await;
    assert_eq!(events[..outbox.len()], outbox[..], "re-sent as numbered before");
    assert!(gap_free_from(&events, logged + 1));
    let mut started = tools.started.lock().unwrap().clone();
    started.sort();
    assert_eq!(started, ["id0", "id1"], "both calls run, with the same call ids");
    assert_eq!(result.status, RunStatus::Completed);
}

/// A checkpoint never says an event was sent that the log does not keep yet: the calls'
/// announcement is still on its way to the log when the first call finishes (the log takes 30 ms,
/// the call 10 ms), and the call's checkpoint waits for it. Otherwise a replica resuming from it
/// would leave the announcement out of the log for good.
#[tokio::test(start_paused = true)]
async fn a_call_checkpoint_waits_until_the_log_keeps_the_announcement() {
    let (settled, watched) = tokio::sync::watch::channel(crate::domain::ports::Settled::default());
    let journal = Arc::new(Journal {
        log: Some(watched),
        ..Journal::default()
    });
    let outside = Outside {
        journal: Some(Arc::clone(&journal)),
        log: Some(Box::new(SlowLog { settled })),
        ..Outside::default()
    };
    let (result, _, _, _) = play_with(two_naps_then_an_answer(), limits(), outside).await;
    assert_eq!(result.status, RunStatus::Completed);
    let kept = journal.kept_at_save.lock().unwrap().clone();
    let checkpoints = journal.checkpoints();
    assert_eq!(kept.len(), checkpoints.len());
    for (checkpoint, kept) in checkpoints.iter().zip(kept) {
        let sent_through = checkpoint.outbox.first().map_or(checkpoint.seq, |e| e.seq - 1);
        assert!(
            sent_through <= kept,
            "a checkpoint says events through {sent_through} were sent; the log kept {kept}"
        );
    }
}

/// An event log that keeps every batch at once, except one carrying the run's end.
struct EndlessLog {
    settled: tokio::sync::watch::Sender<crate::domain::ports::Settled>,
}

impl crate::domain::ports::LogWriter for EndlessLog {
    fn append(&mut self, events: &[NumberedEvent]) {
        if events.iter().any(|e| e.finished().is_some()) {
            return;
        }
        let last = events.last().map_or(0, |e| e.seq);
        self.settled.send_modify(|s| s.kept_through = s.kept_through.max(last));
    }
    fn settled(&self) -> Option<tokio::sync::watch::Receiver<crate::domain::ports::Settled>> {
        Some(self.settled.subscribe())
    }
}

/// A durable run whose end its log does not keep (its replica cut off from NATS as it ended)
/// stores no result from here and sends its caller no `run_finished`: the record stays the last
/// checkpoint's, and whoever takes the run over stores the end if the log got it after all, or
/// resumes the run. Otherwise the result would be stored while the log lacked its end for good,
/// and every follower would be told the events were lost.
#[tokio::test(start_paused = true)]
async fn a_run_whose_end_the_log_does_not_keep_stores_no_result_here() {
    let (settled, _) = tokio::sync::watch::channel(crate::domain::ports::Settled::default());
    let journal = Arc::new(Journal::default());
    let outside = Outside {
        journal: Some(Arc::clone(&journal)),
        log: Some(Box::new(EndlessLog { settled })),
        ..Outside::default()
    };
    let (_, events, _, _) = play_with(two_naps_then_an_answer(), limits(), outside).await;
    assert!(
        !events.iter().flatten().any(|e| e.finished().is_some()),
        "no run_finished reached the caller"
    );
    let last = journal.checkpoints().pop().map(|c| c.result.status);
    assert_eq!(last, Some(RunStatus::Running), "the last checkpoint is a live run's");
}

/// An event log that keeps the run's first batch (`run_started`) and loses the rest: the
/// stream lost its leader for longer than the writer retries, while the store answers.
struct LosingLog {
    settled: tokio::sync::watch::Sender<crate::domain::ports::Settled>,
}

impl crate::domain::ports::LogWriter for LosingLog {
    fn append(&mut self, events: &[NumberedEvent]) {
        let last = events.last().map_or(0, |e| e.seq);
        self.settled.send_modify(|s| match last {
            1 => s.kept_through = 1,
            _ => s.broken = true,
        });
    }
    fn settled(&self) -> Option<tokio::sync::watch::Receiver<crate::domain::ports::Settled>> {
        Some(self.settled.subscribe())
    }
}

/// A safe point whose log lost events sent since the last one saves no checkpoint: one would
/// count them as sent, and the replica taking the run over would number on past a gap in the
/// log for good (the simulation over the ports found it: a log of seqs 37..42 only). The run
/// stops here, ended nowhere, its last checkpoint the one before the loss; no call runs.
#[tokio::test(start_paused = true)]
async fn a_safe_point_after_the_log_lost_events_saves_nothing_and_stops_here() {
    let (settled, _) = tokio::sync::watch::channel(crate::domain::ports::Settled::default());
    let journal = Arc::new(Journal::default());
    let outside = Outside {
        journal: Some(Arc::clone(&journal)),
        claim_resumable: true,
        log: Some(Box::new(LosingLog { settled })),
        ..Outside::default()
    };
    let (result, _, _, tools) = play_with(two_naps_then_an_answer(), limits(), outside).await;
    assert_eq!(result.status, RunStatus::Running, "stopped here, not ended: {result:?}");
    assert!(tools.started.lock().unwrap().is_empty(), "no call ran");
    let checkpoints = journal.checkpoints();
    assert_eq!(checkpoints.len(), 1, "only the start was saved");
    assert_eq!(checkpoints[0].seq, 1, "the start checkpoint: run_started only");
}

// Coalesced streaming.

/// 40 tokens 10 ms apart, then a call, then an answer: played with `interval`, the text events
/// of turn 1, the whole stream, and the ticks turn 1's reader woke on.
async fn paced_run(interval: Duration) -> (Vec<String>, Vec<NumberedEvent>, RunResult, u64) {
    let mut turn1: Vec<_> = (0..40).map(|i| text(&format!("t{i} "))).collect();
    turn1.push(call(0, "nap", r#"{"ms": 1}"#));
    let outside = Outside {
        pace: Some(Duration::from_millis(10)),
        stream_interval: interval,
        ..Outside::default()
    };
    let (result, batches, script, _) = play_with(vec![turn1, vec![text("done")]], limits(), outside).await;
    let ticks = script.requests.lock().unwrap()[0].pace.ticks();
    let events: Vec<NumberedEvent> = batches.into_iter().flatten().collect();
    let texts = events
        .iter()
        .filter_map(|e| match &e.event {
            Event::TextDelta { text, turn: 1 } => Some(text.clone()),
            _ => None,
        })
        .collect();
    (texts, events, result, ticks)
}

/// With a 50 ms interval the first delta goes at once and the rest come a tick's worth at a time
/// (about 5 tokens per event instead of 1); the text, the seq numbering and the call are as
/// without it.
#[tokio::test(start_paused = true)]
async fn a_stream_interval_gathers_the_text_of_each_tick_into_one_event() {
    let (each, each_events, each_result, _) = paced_run(Duration::ZERO).await;
    let (gathered, events, result, ticks) = paced_run(Duration::from_millis(50)).await;
    assert!((8..=12).contains(&ticks), "{ticks} ticks");
    assert_eq!(each.len(), 40, "one event per token without an interval");
    assert_eq!(
        gathered.first().map(String::as_str),
        Some("t0 "),
        "the first delta at once"
    );
    assert!(
        (8..=12).contains(&gathered.len()),
        "400 ms of tokens in 50 ms ticks: {gathered:?}"
    );
    assert_eq!(gathered.concat(), each.concat());
    assert_eq!(result.text, each_result.text);
    assert!(events.iter().zip(1..).all(|(e, n)| e.seq == n), "gap-free");
    let kinds = |events: &[NumberedEvent]| {
        events
            .iter()
            .filter(|e| !matches!(e.event, Event::TextDelta { .. }))
            .map(|e| std::mem::discriminant(&e.event))
            .collect::<Vec<_>>()
    };
    assert_eq!(kinds(&events), kinds(&each_events), "every other event as without it");
}

/// A model slower than the interval (a token every 10 ms, ticks every 5 ms): once a tick finds
/// nothing, its tokens go as they come, and the run stops waking on ticks in between; the text
/// events are the same as without an interval.
#[tokio::test(start_paused = true)]
async fn a_model_slower_than_the_interval_is_read_as_it_comes() {
    let (each, ..) = paced_run(Duration::ZERO).await;
    let (texts, events, result, ticks) = paced_run(Duration::from_millis(5)).await;
    assert_eq!(texts, each, "one event per token, as without an interval");
    assert!(ticks <= 2, "woke on {ticks} ticks for 40 tokens");
    assert_eq!(result.status, RunStatus::Completed);
    assert!(events.iter().zip(1..).all(|(e, n)| e.seq == n), "gap-free");
}

/// The end of the messages in a request's body: what a model server's prefix cache can keep of it.
fn prompt_end(body: &[u8]) -> usize {
    let marker = br#"],"stream":true"#;
    body.windows(marker.len())
        .rposition(|w| w == marker)
        .map_or(body.len(), |at| at)
}

/// Each request's body starts with the one before it, byte for byte, up to the end of its
/// messages.
fn assert_each_request_extends_the_last(requests: &[ChatRequest]) {
    let bodies: Vec<Vec<u8>> = requests.iter().map(crate::llm::client::request_body).collect();
    for (n, pair) in bodies.windows(2).enumerate() {
        let kept = &pair[0][..prompt_end(&pair[0])];
        assert!(
            pair[1].starts_with(kept),
            "request {} does not start with request {}:\n{}\n---\n{}",
            n + 2,
            n + 1,
            String::from_utf8_lossy(kept),
            String::from_utf8_lossy(&pair[1])
        );
    }
}

#[tokio::test(start_paused = true)]
async fn each_turns_request_extends_the_last_through_results_failures_fallback_and_feedback() {
    let turns = vec![
        // Tool results, one of them a failure.
        vec![
            text("two at once "),
            call(0, "nap", r#"{"ms": 5}"#),
            call(1, "bad", "{}"),
        ],
        // A call written in the text.
        vec![text(
            r#"<tool_call>{"name": "nap", "arguments": {"ms": 1}}</tool_call>"#,
        )],
        // A bad call answered with an error (parse policy FEED_BACK), and an exit call.
        vec![call(0, "nope", "{}"), call(1, "done", "{}")],
        vec![text("done")],
    ];
    let outside = Outside {
        parse_policy: ParsePolicy::FeedBack,
        ..Outside::default()
    };
    let limits = Limits {
        max_tool_failures: 3,
        ..limits()
    };
    let (result, _, script, _) = play_with(turns, limits, outside).await;
    assert_eq!(result.status, RunStatus::Completed, "{result:?}");
    let requests = script.requests.lock().unwrap().clone();
    assert_eq!(requests.len(), 4);
    assert_each_request_extends_the_last(&requests);
    // The BIOS is the same every turn; what changed is in the status note after the newest
    // messages.
    assert!(requests.windows(2).all(|w| w[0].messages[0] == w[1].messages[0]));
    let Some(Message::User { content: note, .. }) = requests[3].messages.last() else {
        panic!("{:?}", requests[3].messages)
    };
    assert!(
        note.contains("Turn 4 of at most 8")
            && note.contains("7 normal call(s) left")
            && note.contains("1 more turn(s)"),
        "{note}"
    );
}

/// The requests of a durable run played whole, and its checkpoints.
async fn durable_requests() -> (Vec<ChatRequest>, Vec<Checkpoint>) {
    let journal = Arc::new(Journal::default());
    let outside = Outside {
        journal: Some(Arc::clone(&journal)),
        ..Outside::default()
    };
    let (result, _, script, _) = play_with(two_naps_then_an_answer(), limits(), outside).await;
    assert_eq!(result.status, RunStatus::Completed, "{result:?}");
    let requests = script.requests.lock().unwrap().clone();
    (requests, journal.checkpoints())
}

#[tokio::test(start_paused = true)]
async fn a_resumed_or_restarted_turn_sends_what_the_run_would_have_sent_here() {
    let (whole, checkpoints) = durable_requests().await;
    assert_each_request_extends_the_last(&whole);
    let (_, again) = durable_requests().await;
    let one_done = first(again, "after one call", |c| {
        c.calls.as_ref().is_some_and(|calls| calls.finished.len() == 1)
    });
    let turn_end = first(checkpoints, "at the end of turn 1", |c| {
        c.calls.is_none() && c.progress.turns_done == 1
    });
    let seq = one_done.seq;
    let (_, _, resumed, _) = resume_at(one_done, seq).await;
    let logged = turn_end.seq + 2;
    let (_, _, restarted, _) = resume_at(turn_end, logged).await;
    for (how, script) in [("resumed among its calls", resumed), ("restarted", restarted)] {
        let sent = script.requests.lock().unwrap().clone();
        assert_eq!(sent.len(), 1, "{how}");
        assert_eq!(
            crate::llm::client::request_body(&sent[0]),
            crate::llm::client::request_body(&whole[1]),
            "turn 2 {how} is the same request"
        );
    }
}

fn cut(endpoint: &str) -> Result<LlmEvent, LlmError> {
    Err(LlmError::Cut {
        endpoint: endpoint.into(),
        error: Box::new(LlmError::Protocol("the stream broke off".into())),
    })
}

#[tokio::test(start_paused = true)]
async fn a_stream_cut_by_one_endpoint_restarts_the_turn_on_another_taking_its_text_back() {
    let turns = vec![
        vec![text("first attempt, "), reasoning("thinking "), cut("http://a/v1")],
        vec![text("second "), call(0, "nap", r#"{"ms": 1}"#)],
        vec![text("done")],
    ];
    let (result, events, script, _) = play(turns, limits()).await;
    assert_eq!(result.status, RunStatus::Completed, "{result:?}");
    assert_eq!(result.text, "second done");
    assert_eq!(result.reasoning, "");
    assert_eq!(result.turns, 2);
    let restarted: Vec<&Event> = events
        .iter()
        .map(|e| &e.event)
        .filter(|e| matches!(e, Event::TurnRestarted { .. }))
        .collect();
    let [
        Event::TurnRestarted {
            turn: 1,
            attempt: 2,
            reason,
        },
    ] = restarted.as_slice()
    else {
        panic!("{restarted:?}")
    };
    assert!(reason.contains("http://a/v1"), "{reason}");
    // The attempt after the cut asks the same, away from the endpoint that cut it.
    let requests = script.requests.lock().unwrap().clone();
    assert_eq!(requests[1].messages, requests[0].messages);
    assert_eq!(
        (requests[0].avoid.as_deref(), requests[1].avoid.as_deref()),
        (None, Some("http://a/v1"))
    );
    assert_eq!(requests[2].avoid, None);
}

#[tokio::test(start_paused = true)]
async fn turn_restarts_on_both_sides_of_their_limit() {
    // The loop's deps allow two restarts a turn: the third cut ends the run with its text.
    let cuts = |n: usize| {
        let mut turns: Vec<Vec<Result<LlmEvent, LlmError>>> = (0..n)
            .map(|i| vec![text(&format!("try {i} ")), cut("http://a/v1")])
            .collect();
        turns.push(vec![text("answer")]);
        turns
    };
    let (result, ..) = play(cuts(2), limits()).await;
    assert_eq!((result.status, result.text.as_str()), (RunStatus::Completed, "answer"));
    let (result, ..) = play(cuts(3), limits()).await;
    assert_eq!(
        (result.status, result.failure_reason),
        (RunStatus::Failed, Some(FailureReason::LlmError)),
        "{result:?}"
    );
    assert_eq!(result.text, "try 2 ", "the last attempt's text is kept");
    assert!(
        result.failure_detail.contains("http://a/v1"),
        "{}",
        result.failure_detail
    );
}

/// A piece of call `index`'s arguments, as servers stream them after the first fragment.
fn fragment(index: u32, arguments: &str) -> Result<LlmEvent, LlmError> {
    Ok(LlmEvent::ToolCallFragment {
        index: Some(index),
        id: None,
        name: None,
        arguments: Some(arguments.into()),
    })
}

/// A turn whose first call (a 500 ms nap) is complete at 0.4 s, while the model writes the
/// second call's arguments until 1.2 s; then an answer. Events come 200 ms apart.
fn slow_first_tool() -> Vec<Vec<Result<LlmEvent, LlmError>>> {
    vec![
        vec![
            call(0, "nap", r#"{"ms": 500}"#),
            call(1, "nap", r#"{"ms":"#),
            fragment(1, " 10"),
            fragment(1, ", \"pad\": "),
            fragment(1, "\"x\""),
            fragment(1, "}"),
        ],
        vec![text("rested")],
    ]
}

async fn timed(
    outside: Outside,
    turns: Vec<Vec<Result<LlmEvent, LlmError>>>,
    limits: Limits,
) -> (RunResult, Duration, Arc<Tools>) {
    let started = Instant::now();
    let (result, _, _, tools) = play_with(turns, limits, outside).await;
    (result, started.elapsed(), tools)
}

fn paced(eager: bool) -> Outside {
    Outside {
        eager,
        pace: Some(Duration::from_millis(200)),
        ..Outside::default()
    }
}

#[tokio::test(start_paused = true)]
async fn a_call_complete_in_the_stream_starts_while_the_model_writes_the_next() {
    let (at_end, at_end_took, _) = timed(paced(false), slow_first_tool(), limits()).await;
    let (early, early_took, tools) = timed(paced(true), slow_first_tool(), limits()).await;
    for result in [&at_end, &early] {
        assert_eq!(result.status, RunStatus::Completed, "{result:?}");
        assert_eq!(result.tool_calls.len(), 2);
    }
    // The same calls, ids and arguments, in the model's order.
    let calls = |r: &RunResult| {
        r.tool_calls
            .iter()
            .map(|c| (c.call_id.clone(), c.arguments_json.clone(), c.ok))
            .collect::<Vec<_>>()
    };
    assert_eq!(calls(&early), calls(&at_end));
    assert_eq!(*tools.started.lock().unwrap(), ["id0", "id1"]);
    // The first nap ran from 0.4 s, not from the stream's end at 1.2 s: the turn ends with the
    // stream (plus the second nap), not 0.5 s after it.
    let saved = at_end_took.saturating_sub(early_took);
    assert!(
        saved >= Duration::from_millis(400) && saved <= Duration::from_millis(500),
        "started at the end {at_end_took:?}, early {early_took:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn calls_start_early_only_within_the_budget_in_call_order() {
    let turns = vec![vec![
        call(0, "nap", r#"{"ms": 100}"#),
        call(1, "nap", r#"{"ms": 100}"#),
        call(2, "nap", r#"{"ms": 100}"#),
    ]];
    let limits = Limits {
        tool_call_budget: 1,
        ..limits()
    };
    let (result, _, tools) = timed(paced(true), turns, limits).await;
    assert_eq!(
        (result.status, result.failure_reason),
        (RunStatus::Failed, Some(FailureReason::ToolBudgetExhausted))
    );
    assert_eq!(
        *tools.started.lock().unwrap(),
        ["id0"],
        "only the first fits the budget"
    );
    assert_eq!(result.tool_calls.len(), 1);
}

#[tokio::test(start_paused = true)]
async fn a_turn_that_fails_on_a_later_bad_call_still_records_the_call_that_ran() {
    let turns = vec![vec![call(0, "nap", r#"{"ms": 100}"#), call(1, "nope", "{}")]];
    let (result, _, tools) = timed(paced(true), turns, limits()).await;
    assert_eq!(
        (result.status, result.failure_reason),
        (RunStatus::Failed, Some(FailureReason::ToolParseError)),
        "{result:?}"
    );
    assert_eq!(*tools.started.lock().unwrap(), ["id0"]);
    let recorded: Vec<(&str, bool)> = result.tool_calls.iter().map(|c| (c.call_id.as_str(), c.ok)).collect();
    assert_eq!(recorded, [("id0", true)]);
}

#[tokio::test(start_paused = true)]
async fn calls_that_are_not_run_anyway_are_not_started_early() {
    // An exit call, a call needing a bad argument object, an unknown tool: none starts early.
    let turns = vec![
        vec![
            call(0, "done", "{}"),
            call(1, "nap", "[1]"),
            call(2, "nap", r#"{"ms": 1}"#),
        ],
        vec![text("ok")],
    ];
    let outside = Outside {
        parse_policy: ParsePolicy::FeedBack,
        ..paced(true)
    };
    let (result, _, tools) = timed(outside, turns, limits()).await;
    assert_eq!(result.status, RunStatus::Completed, "{result:?}");
    assert_eq!(
        *tools.started.lock().unwrap(),
        ["id2"],
        "only the normal call, at the turn's end"
    );
    assert_eq!(result.signals.len(), 1);
}

/// A durable run of [`slow_first_tool`] with text before its calls: its checkpoints.
async fn durable_early_run() -> (RunResult, Vec<Checkpoint>) {
    let mut turns = slow_first_tool();
    turns[0].insert(0, text("checking "));
    let journal = Arc::new(Journal::default());
    let outside = Outside {
        journal: Some(Arc::clone(&journal)),
        ..paced(true)
    };
    let (result, _, _, _) = play_with(turns, limits(), outside).await;
    (result, journal.checkpoints())
}

/// The checkpoint saved before the first call started early.
fn cut_short(checkpoints: Vec<Checkpoint>) -> Checkpoint {
    first(checkpoints, "of a call started early", |c| {
        c.calls.as_ref().is_some_and(|calls| calls.cut_short.is_some())
    })
}

#[tokio::test(start_paused = true)]
async fn a_durable_run_checkpoints_a_call_before_it_starts_early() {
    let (result, checkpoints) = durable_early_run().await;
    assert_eq!(result.status, RunStatus::Completed, "{result:?}");
    assert_eq!(result.text, "checking rested");
    let saved = cut_short(checkpoints);
    let calls = saved.calls.as_ref().unwrap();
    let ids: Vec<&str> = calls.partition.calls.iter().map(|c| c.id.as_str()).collect();
    assert_eq!(ids, ["id0"], "the calls started so far");
    assert_eq!(calls.turn.text, "checking ");
    assert!(
        saved
            .outbox
            .iter()
            .any(|e| matches!(&e.event, Event::ToolCallStarted { call_id, .. } if call_id == "id0")),
        "its announcement leaves after the checkpoint holding it: {:?}",
        saved.outbox
    );
}

#[tokio::test(start_paused = true)]
async fn a_run_resumed_from_a_call_started_early_goes_on_with_it() {
    // The log holds nothing past the checkpoint: the turn keeps its text.
    let saved = cut_short(durable_early_run().await.1);
    let seq = saved.seq;
    let (result, events, script, tools) = resume_at(saved, seq).await;
    assert_eq!(result.status, RunStatus::Completed, "{result:?}");
    assert_eq!(
        *tools.started.lock().unwrap(),
        ["id0"],
        "the started call runs again, same id"
    );
    assert_eq!(result.text, "checking all done");
    assert!(!events.iter().any(|e| matches!(e.event, Event::TurnRestarted { .. })));
    let request = script.requests.lock().unwrap()[0].clone();
    let assistant = request.messages.iter().find_map(|m| match m {
        Message::Assistant {
            content, tool_calls, ..
        } => Some((content.clone(), tool_calls.len())),
        _ => None,
    });
    assert_eq!(assistant, Some(("checking ".to_owned(), 1)));

    // The log holds text streamed after it: the turn's text is void, its call goes on.
    let saved = cut_short(durable_early_run().await.1);
    let logged = saved.seq + 3;
    let (result, events, script, tools) = resume_at(saved, logged).await;
    assert_eq!(result.status, RunStatus::Completed, "{result:?}");
    assert_eq!(*tools.started.lock().unwrap(), ["id0"]);
    assert_eq!(result.text, "all done");
    let restarted = events.iter().find_map(|e| match &e.event {
        Event::TurnRestarted { turn: 1, reason, .. } => Some(reason.clone()),
        _ => None,
    });
    assert!(
        restarted
            .as_deref()
            .is_some_and(|r| r.contains("goes on with the 1 call(s)")),
        "{restarted:?}"
    );
    assert!(gap_free_from(&events, logged + 1), "{events:?}");
    let request = script.requests.lock().unwrap()[0].clone();
    let tool_messages = request
        .messages
        .iter()
        .filter(|m| matches!(m, Message::Tool { .. }))
        .count();
    assert_eq!(tool_messages, 1, "the turn is its started call");
}

/// The `max_tokens` each model request asked for, in order.
fn asked_max_tokens(script: &Script) -> Vec<Option<u32>> {
    script
        .requests
        .lock()
        .unwrap()
        .iter()
        .map(|r| r.params.max_tokens)
        .collect()
}

/// A run's token budget: each request asks for at most what is left, and the turn that goes
/// over it is the last, its tool results kept, the run FAILED `TOKEN_BUDGET`.
#[tokio::test(start_paused = true)]
async fn the_turn_that_spends_the_token_budget_is_the_last() {
    let turn = || vec![text("working"), call(0, "nap", r#"{"ms": 1}"#), usage(30, 20)];
    let budget = Limits {
        max_total_tokens: 120,
        ..many_turns()
    };
    let (result, _, script, _) = play(vec![turn(), turn(), turn(), turn()], budget).await;
    assert_eq!(
        (result.status, result.failure_reason, result.turns),
        (RunStatus::Failed, Some(FailureReason::TokenBudget), 3)
    );
    assert_eq!(result.tool_calls.len(), 3, "the last turn's call ran and is kept");
    assert!(
        result.failure_detail.contains("150 tokens") && result.failure_detail.contains("120"),
        "{}",
        result.failure_detail
    );
    let asked = asked_max_tokens(&script);
    assert_eq!(asked, [Some(120), Some(70), Some(20)]);
}

/// A budget that is never reached changes nothing: a large one sets no `max_tokens`.
#[tokio::test(start_paused = true)]
async fn a_budget_not_reached_changes_nothing() {
    let turns = vec![
        vec![text("working"), call(0, "nap", r#"{"ms": 1}"#), usage(30, 20)],
        vec![text("done"), usage(10, 5)],
    ];
    let (result, _, script, _) = play(
        turns,
        Limits {
            max_total_tokens: 1_000_000,
            ..limits()
        },
    )
    .await;
    assert_eq!((result.status, result.usage.prompt_tokens), (RunStatus::Completed, 40));
    let asked = asked_max_tokens(&script);
    assert_eq!(asked, [None, None]);
}

/// A usage book that refuses the adds whose numbers (from 1) it is given, as a store cut off
/// would, and keeps the others.
struct RefusingBook {
    book: crate::store::memory::MemoryUsage,
    refuse: Vec<usize>,
    adds: Mutex<usize>,
}

impl RefusingBook {
    fn refusing(refuse: Vec<usize>) -> Arc<Self> {
        Arc::new(Self {
            book: crate::store::memory::MemoryUsage::new(Duration::from_secs(3600)),
            refuse,
            adds: Mutex::default(),
        })
    }

    /// The tokens the book holds for the test's caller.
    async fn tokens(&self) -> u64 {
        use crate::domain::ports::UsageBook as _;
        let windows = self.book.read(&spec(limits()).principal, 0, u64::MAX).await.unwrap();
        windows.iter().map(|(_, tally)| tally.tokens()).sum()
    }
}

impl crate::domain::ports::UsageBook for RefusingBook {
    fn add(
        &self,
        principal: &str,
        window: u64,
        spend: crate::domain::usage::Tally,
    ) -> futures::future::BoxFuture<'static, Result<crate::domain::usage::Tally, crate::domain::ports::StoreError>>
    {
        let number = {
            let mut adds = self.adds.lock().unwrap();
            *adds += 1;
            *adds
        };
        if self.refuse.contains(&number) {
            let refused = crate::domain::ports::StoreError::Unavailable {
                operation: "usage add",
                key: principal.to_owned(),
                reason: "cut off".to_owned(),
            };
            return Box::pin(std::future::ready(Err(refused)));
        }
        self.book.add(principal, window, spend)
    }

    fn read(
        &self,
        principal: &str,
        from: u64,
        to: u64,
    ) -> futures::future::BoxFuture<
        'static,
        Result<Vec<(u64, crate::domain::usage::Tally)>, crate::domain::ports::StoreError>,
    > {
        self.book.read(principal, from, to)
    }
}

/// Three turns that spend 50, 50 and 15 tokens.
fn three_spending_turns() -> Vec<Vec<Result<LlmEvent, LlmError>>> {
    vec![
        vec![text("working"), call(0, "nap", r#"{"ms": 1}"#), usage(30, 20)],
        vec![text("working"), call(0, "nap", r#"{"ms": 1}"#), usage(30, 20)],
        vec![text("done"), usage(10, 5)],
    ]
}

/// A turn's spend the book refused (the store cut off) is booked by the next add: the book
/// ends holding every token the run spent.
#[tokio::test(start_paused = true)]
async fn a_turns_spend_the_book_refused_is_booked_by_the_next_add() {
    let book = RefusingBook::refusing(vec![1]);
    let outside = Outside {
        usage: book.clone(),
        ..Outside::default()
    };
    let (result, _, _, _) = play_with(three_spending_turns(), many_turns(), outside).await;
    assert_eq!(result.status, RunStatus::Completed, "{result:?}");
    assert_eq!(result.usage.prompt_tokens + result.usage.completion_tokens, 115);
    assert_eq!(
        book.tokens().await,
        115,
        "the refused turn's 50 tokens came with the next add"
    );
}

/// A durable run whose end the book refused is not shown ended: the replica that takes it over
/// books its spend and ends it (no end is shown whose spend the book may lack).
#[tokio::test(start_paused = true)]
async fn a_durable_runs_end_waits_for_its_spend_to_be_booked() {
    let book = RefusingBook::refusing(vec![3, 4]);
    let outside = Outside {
        usage: book.clone(),
        journal: Some(Arc::default()),
        ..Outside::default()
    };
    let (result, batches, _, _) = play_with(three_spending_turns(), many_turns(), outside).await;
    let events: Vec<NumberedEvent> = batches.into_iter().flatten().collect();
    assert_eq!(result.turns, 3, "{result:?}");
    assert!(
        events.iter().all(|e| e.finished().is_none()),
        "no end is shown: {events:?}"
    );
    assert_eq!(book.tokens().await, 100, "the first two turns are booked");
}

/// The question the `ask` tool asks.
fn confirm_question() -> crate::domain::input::Questions {
    crate::domain::input::Questions {
        request_state: "order=7".into(),
        requests: vec![crate::domain::input::InputRequest {
            key: "confirm".into(),
            mode: crate::domain::input::InputMode::Form,
            message: "Refund 5?".into(),
            schema: serde_json::json!({"type": "object", "properties": {"confirm": {"type": "boolean"}}}),
            url: String::new(),
        }],
    }
}

/// A turn whose one call becomes a task `args` describe, then one the model would answer with.
fn a_task_then_an_answer(args: &str) -> Vec<Vec<Result<LlmEvent, LlmError>>> {
    vec![vec![text("Crunching."), call(0, "nap", args)], vec![text("Done.")]]
}

fn progress(events: &[NumberedEvent]) -> Vec<String> {
    events
        .iter()
        .filter_map(|e| match &e.event {
            Event::ToolCallProgress { message, .. } => Some(message.clone()),
            _ => None,
        })
        .collect()
}

/// A call that became a task is polled until the task ends: each new word of its server is
/// streamed, never fed to the model, and the task's result is the call's.
#[tokio::test]
async fn a_task_is_polled_until_it_ends_and_its_result_is_the_calls() {
    let (result, events, script, tools) = play(a_task_then_an_answer(r#"{"task_polls": 3}"#), limits()).await;
    assert_eq!(result.status, RunStatus::Completed, "{result:?}");
    assert_eq!(
        progress(&events),
        [
            "task task-id0 is working: poll 0",
            "task task-id0 is working: poll 1",
            "task task-id0 is working: poll 2"
        ]
    );
    assert!(result.tool_calls[0].ok, "{result:?}");
    assert_eq!(tools.polls.lock().unwrap()["id0"], 3);
    let second = serde_json::to_string(&script.requests.lock().unwrap()[1].messages).unwrap();
    assert!(second.contains(r#"{\"polls\":3}"#), "{second}");
    assert!(!second.contains("poll 2"), "progress never reaches the model: {second}");
}

/// A task still working past its ttl fails its call, fed back like any failure; the run goes on.
#[tokio::test]
async fn a_task_past_its_ttl_fails_its_call() {
    let (result, _, _, tools) = play(a_task_then_an_answer(r#"{"task_polls": 1000, "ttl_ms": 1}"#), limits()).await;
    assert_eq!(result.status, RunStatus::Completed, "{result:?}");
    let error = result.tool_calls[0].error.clone().unwrap();
    assert_eq!(error.code, "FAILED");
    assert!(error.message.contains("ttlMs"), "{error:?}");
    assert_eq!(result.failed_turns, 1);
    assert!(tools.canceled_tasks.lock().unwrap().is_empty());
}

/// A run canceled while it follows a task asks the server to cancel it: at once (the run ends
/// there), or after the turn (the poll cancels it, and the turn ends with the task's outcome).
#[tokio::test]
async fn a_run_canceled_while_it_follows_a_task_cancels_the_task() {
    for mode in [CancelMode::Immediate, CancelMode::AfterTurn] {
        let outside = Outside {
            cancel_after: Some(Duration::from_millis(300)),
            cancel_mode: mode,
            ..Outside::default()
        };
        let (result, _, _, tools) =
            play_with(a_task_then_an_answer(r#"{"task_polls": 100000}"#), limits(), outside).await;
        assert_eq!(result.status, RunStatus::Canceled, "{mode:?}: {result:?}");
        assert_eq!(*tools.canceled_tasks.lock().unwrap(), ["id0"], "{mode:?}");
        if mode == CancelMode::AfterTurn {
            assert_eq!(result.tool_calls[0].error.as_ref().unwrap().code, "CANCELED");
        }
    }
}
