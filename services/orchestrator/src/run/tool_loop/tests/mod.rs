//! The loop without a network: a scripted model and an in-process tool executor (here), and
//! the tests of each rule file of `tool_loop/` in a file of the same name: `rules` (a turn's
//! rules, cancels, deadlines, budgets), `completion` (reasoning, pacing, request prefixes, turn
//! restarts), `output` (the output bounds), `steering` (messages to a live run, threads),
//! `durable` (checkpoints, hand-over, resuming), `eager` (eager dispatch), `tasks` (calls run as
//! tasks).
//!
//! Every test runs on tokio's paused clock (but one that needs the clock to stand still, which
//! sleeps nowhere): the sleeps of the scripted model, tools, log and callers are the scenario's
//! time, which the clock jumps over, never a wait for a condition.

mod completion;
mod durable;
mod eager;
mod output;
mod rules;
mod steering;
mod tasks;

use self::durable::{Journal, durable, first, gap_free_from, resume_at, two_naps_then_an_answer};
use self::rules::a_nap_then_an_answer;
use self::steering::user;
use self::tasks::confirm_question;

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

use crate::domain::chat::{Message, ToolDefinition, Usage};
use crate::domain::model::{ChatModel, ChatRequest, LlmError, LlmEvent};
use crate::domain::ports::{ToolExecutor, ToolInvocation, ToolOutput};
use crate::domain::{
    CancelMode, Deadline, Event, EventBatch, FailureReason, Limits, LoopDetection, NumberedEvent, OutputBounds,
    ParsePolicy, RunResult, RunSpec, RunStatus, ToolCallError,
};
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
                        // Stays: the scripted world's time (the model's pace), on the tests' paused clock: not a wait.
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
            // Stays: the scripted world's time (a tool's duration), on the tests' paused clock: not a wait.
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
        agent: None,
        request_digests: Default::default(),
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
    /// Which calls wait for a person, and the approval store they wait in.
    approval: crate::domain::approval::ApprovalRules,
    approvals: Arc<dyn crate::domain::ports::ApprovalStore>,
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
            approvals: Arc::new(crate::store::memory::MemoryApprovals::new(16)),
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
            max_follow: Duration::from_secs(24 * 3600),
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
        hand_over: Default::default(),
        inbox: outside.inbox.clone(),
    };
    for (after, text) in outside.messages {
        let inbox = outside.inbox.clone();
        tokio::spawn(async move {
            // Stays: the scripted world's time (when the message is sent), on the tests' paused clock: not a wait.
            tokio::time::sleep(after).await;
            let _ = inbox.send(user(text));
        });
    }
    if outside.hand_over {
        admitted.hand_over.at_safe_point.cancel();
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
            // Stays: the scripted world's time (when the cancel comes), on the tests' paused clock: not a wait.
            tokio::time::sleep(after).await;
            cancel.cancel_with(mode, "canceled by the test");
        });
    }
    if let Some(after) = outside.cancel_at_once_after {
        tokio::spawn(async move {
            // Stays: the scripted world's time (when the cancel comes), on the tests' paused clock: not a wait.
            tokio::time::sleep(after).await;
            cancel.cancel("canceled at once by the test");
        });
    }
    let reader = tokio::spawn(async move {
        let mut batches = Vec::new();
        if let Some(every) = outside.read_every {
            loop {
                // Stays: the scripted world's time (a slow reader's pace), on the tests' paused clock: not a wait.
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
