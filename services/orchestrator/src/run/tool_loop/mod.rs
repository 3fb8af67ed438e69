//! The tool loop of one run (docs/architecture.md, "The rules of the loop").
//!
//! [`run`] drives turns until the model stops calling normal tools or a limit ends the run;
//! cancellation, the caller going away and the run's deadline end it at once. Each rule of a turn
//! is one method of `Driver`, in the order they apply:
//! `chat_request` (the BIOS and the conversation),
//! `stream_completion` (text to the caller and the repeated-line
//! detector), `take_calls` (structured calls, else fallback directives),
//! `sort_calls` (normal / exit / bad), `publish_signals`,
//! `apply_parse_policy`, `spend_budget`,
//! `dispatch` (concurrently, with `join_all`),
//! `report_results`, `count_failures` (once
//! per turn) and `append_to_conversation`. Whatever was produced
//! before the end is kept.
//!
//! The loop's files: this one (the run from start to end, and the driver's state), `rules.rs`
//! (`Driver::turn` and the rules of a turn), `completion.rs` (the streamed completion: text,
//! reasoning and usage as they arrive), `eager.rs` (tools started while the model still
//! writes), `output.rs` (accounting of the run's output against its bounds), `durable.rs`
//! (checkpoints at safe points, and resuming from one), `approvals.rs` (calls that wait for a
//! person's decision, parking and going on), `tasks.rs` (calls their servers run as tasks,
//! followed until they end) with `pending.rs` (such calls as the turn holds them), `spend.rs`
//! (the token budgets: a turn's prompt counted and its tokens held before it is asked),
//! `call_progress.rs` (what calls still running report, sent as they run), and `tests/` (the
//! rules, without a network).

mod approvals;
mod call_progress;
mod completion;
mod durable;
mod eager;
mod output;
mod pending;
mod rules;
mod spend;
mod tasks;
#[cfg(test)]
pub(crate) mod tests;

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use shared::sync::lock;
use tokio::sync::mpsc;
use tokio::time::Instant;
use tracing::Instrument;

pub use self::durable::{Checkpoint, Progress, Resumed, SegmentRef, Segmented};
pub use self::tasks::TaskSettings;

use self::completion::Completion;
use self::durable::TurnCalls;
use self::rules::IdAllocator;
use super::live::{AdmittedRun, Cancel, Emitter, HandOver, SharedState};
use super::loop_detector::LoopDetector;
use super::steering::{Closed, Inbox};
use crate::domain::chat::{Message, ToolDefinition, Usage};
use crate::domain::model::ChatModel;
use crate::domain::ports::{SignalTopic, ToolExecutor};
use crate::domain::{
    Event, EventBatch, FailureReason, HARD_MAX_TURNS, LoopDetection, OutputBounds, RunResult, RunSpec, RunStatus,
    ToolCallError,
};
use crate::run::persist::Persister;
use crate::telemetry::{self, InFlight, metric};

/// What the loop needs from the outside world.
#[derive(Clone)]
pub struct LoopDeps {
    /// The LLM.
    pub model: Arc<dyn ChatModel>,
    /// Where normal calls run.
    pub tools: Arc<dyn ToolExecutor>,
    /// Where signals go.
    pub signals: Arc<dyn SignalTopic>,
    /// Repeated-line detector settings.
    pub detector: LoopDetection,
    /// Record tool arguments and results on spans, truncated to this many bytes (off: `None`;
    /// they may hold secrets).
    pub trace_payloads: Option<usize>,
    /// Largest tool result fed back to the model; longer ones are cut.
    pub max_tool_result_bytes: usize,
    /// What the model may produce: calls per turn, argument bytes, output and reasoning bytes.
    pub output: OutputBounds,
    /// Put each turn's reasoning back in its assistant message (servers whose templates need it).
    pub send_reasoning: bool,
    /// Longest wait at a safe point for the event log to hold the events sent (durable runs).
    pub log_settle_timeout: Duration,
    /// Where runs wait for decisions on their calls.
    pub approvals: Arc<dyn crate::domain::ports::ApprovalStore>,
    /// Times a turn starts again on another model endpoint after one cut its stream.
    pub max_turn_restarts: u32,
    /// Times one call may ask questions before it fails (`--max-input-rounds`).
    pub max_input_rounds: u32,
    /// How the loop follows its tools' tasks.
    pub tasks: TaskSettings,
    /// Where a run on a thread adds its messages as it ends (`None`: runs name no thread).
    pub threads: Option<Arc<crate::threads::Keeper>>,
    /// Where each principal's spend adds up (each turn's tokens, each run's calls and time).
    pub usage: Arc<dyn crate::domain::ports::UsageBook>,
    /// How long one add to it may take.
    pub store_timeout: Duration,
}

/// How the loop ended.
enum End {
    Completed,
    Failed(FailureReason, String),
    Canceled(String),
    /// Released at a drain for another replica to resume (durable runs).
    HandedOver,
    /// Another replica took the run over: this one stops without writing anything of it.
    TakenOver,
    /// The run waits for approvals, parked in the approval store: it resumes once decided.
    Parked,
}

impl End {
    fn failed(reason: FailureReason, detail: impl Into<String>) -> Self {
        Self::Failed(reason, detail.into())
    }
}

/// A rule's outcome: `Err` ends the run here, with that end.
type Step<T> = Result<T, End>;

/// Runs the loop to its end. Every terminal path keeps the output: text still held back is
/// released and the usage of an interrupted turn counted before the end is settled. The final
/// result is stored before the `run_finished` event is sent (within the event send timeout), so
/// `GetRun` answers as soon as the stream ends; the run's slot is freed in between, so delivering
/// the last event to a slow caller holds no slot. A durable run that moves to another replica
/// ends here without a result; its state so far (RUNNING) is returned.
pub fn run(run: AdmittedRun, deps: LoopDeps) -> impl Future<Output = RunResult> + Send + 'static {
    drive_run(run, deps, None)
}

/// Resumes a run taken over from another replica at its checkpoint (see [`durable`]), then as
/// [`run`].
pub fn resume(run: AdmittedRun, resumed: Resumed, deps: LoopDeps) -> impl Future<Output = RunResult> + Send + 'static {
    drive_run(run, deps, Some(Box::new(resumed)))
}

/// The run's future. A held run's memory is mostly this future, so it holds each part once: the
/// run is taken apart before the future is made (an `async fn` would keep its argument besides
/// the parts), and the loop's own future is boxed (moved into the race with what ends a run, it
/// would take its room twice).
fn drive_run(
    run: AdmittedRun,
    deps: LoopDeps,
    resumed: Option<Box<Resumed>>,
) -> impl Future<Output = RunResult> + Send + 'static {
    let AdmittedRun {
        spec,
        state,
        mut emitter,
        cancel,
        caller,
        persister,
        slot,
        hand_over,
        inbox,
    } = run;
    async move {
        let deps = &deps;
        let started = Instant::now();
        let _in_flight = InFlight::new(metric::RUNS_IN_FLIGHT);
        if let Some(resumed) = &resumed {
            // Numbered on from its checkpoint before anything can end it (a cancel or a deadline
            // that passed while it waited ends it before its turn goes on).
            let c = &resumed.checkpoint;
            emitter.continue_from(resumed.logged, c.seq, c.outbox.clone());
        } else {
            // Sent with the first model request.
            emitter.queue(run_started(&spec));
        }
        if let Some(thread) = &spec.thread {
            lock(&state).thread_id.clone_from(&thread.thread_id);
        }
        let (end, conversation, booked) = {
            let mut driver = Driver::new(
                &spec,
                deps,
                &state,
                &mut emitter,
                persister.clone(),
                hand_over.clone(),
                (cancel.clone(), inbox),
            );
            let ends = Ends {
                cancel: &cancel,
                caller: caller.as_ref(),
                hand_over: &hand_over,
                persister: persister.as_ref(),
            };
            if let Some(resumed) = &resumed {
                driver.followed = tasks::Followed::of(resumed.checkpoint.calls.as_ref());
            }
            // A resumed run takes its state from its checkpoint before anything can end it: a
            // cancel that ends it before its turn goes on ends it with what the checkpoint held
            // (its output, its conversation, the spend its caller's book holds already).
            let resumed = resumed.map(|r| driver.restore(*r));
            let end = race(Box::pin(driver.drive(resumed)), &spec, ends).await;
            if !matches!(end, End::HandedOver | End::TakenOver | End::Parked) {
                driver.cancel_followed_tasks().await;
            }
            if !matches!(end, End::Completed | End::HandedOver | End::TakenOver | End::Parked) {
                driver.keep_interrupted_turn(true);
            }
            let booked = (driver.progress.booked, driver.held.take());
            (end, std::mem::take(&mut driver.conversation), booked)
        };
        // The run's end is a future of its own, made once the loop is done: its state (the
        // result, the thread's messages) is not part of every held run's future.
        let ending = Ending {
            end,
            conversation,
            booked,
            spec: &spec,
            deps,
            state: &state,
            emitter: &mut emitter,
            cancel: &cancel,
            persister: persister.as_ref(),
            slot,
            started,
        };
        Box::pin(conclude(ending)).await
    }
}

/// What the run's end needs once the loop is done.
struct Ending<'a> {
    end: End,
    /// The run's turns, which join its thread.
    conversation: Vec<Message>,
    /// The run's tokens its caller's usage book holds already, and the tokens held for a turn
    /// the run did not book (given back as it ends).
    booked: (Usage, Option<spend::Hold>),
    spec: &'a RunSpec,
    deps: &'a LoopDeps,
    state: &'a SharedState,
    emitter: &'a mut Emitter,
    cancel: &'a Cancel,
    persister: Option<&'a Persister>,
    slot: Option<Box<dyn Send>>,
    started: Instant,
}

/// The run's end: a run that moved or parked leaves as it is; any other is settled (a cancel
/// that came first wins), its messages join its thread, its result is stored, and then
/// `run_finished` goes to the caller, the run's slot freed in between.
async fn conclude(ending: Ending<'_>) -> RunResult {
    let Ending {
        end,
        conversation,
        booked,
        spec,
        deps,
        state,
        emitter,
        cancel,
        persister,
        slot,
        started,
    } = ending;
    match end {
        End::Parked => return lock(state).clone(),
        End::HandedOver | End::TakenOver => {
            return moved(end, persister, emitter, deps.log_settle_timeout, state).await;
        }
        _ => {}
    }
    // A wait opened in this turn ends with the run: at once for a run of this replica alone, and
    // for a durable one once its log holds its end (closed before, an end the log then refused
    // would leave the next owner resuming a run whose wait, and the cancel it held, are gone).
    let wait_open = !lock(state).pending_approvals.is_empty();
    let durable = persister.filter(|p| p.durable());
    if wait_open && durable.is_none() {
        deps.approvals.close(&spec.run_id, 0).await;
    }
    let result = settle(state, end, cancel);
    telemetry::record_run_end(&result, started.elapsed());
    if !tally_run_end(deps, &result, &booked).await
        && let Some(persister) = durable
    {
        // Its end is not shown before its spend is booked: the replica that takes it over
        // resumes it from its last checkpoint and books what this one could not.
        let why = "the run's spend did not reach its caller's usage book";
        return end_unsaved(why, persister, emitter, deps.log_settle_timeout, state).await;
    }
    emitter.queue(Event::RunFinished(Box::new(result.clone())));
    if let Some(persister) = durable {
        // A durable run's log holds its end before anything else shows it: a replica that takes
        // the run over in between finds the end there and stores it, so the log is whole; an end
        // the log refused (a replaced owner's) changes nothing anywhere.
        emitter.log_queued();
        if !emitter.settler(deps.log_settle_timeout).wait().await {
            let why = "the run's end did not reach its event log";
            return end_unsaved(why, persister, emitter, deps.log_settle_timeout, state).await;
        }
        if wait_open {
            deps.approvals.close(&spec.run_id, persister.ownership().epoch()).await;
        }
    }
    // The thread holds the run's messages before its caller hears of its end, so the next run on
    // the thread (which the caller may start at once) finds it free and sees them. It joins once:
    // the thread keeps one copy of a run, whoever adds it.
    if let (Some(thread), Some(threads)) = (&spec.thread, &deps.threads) {
        threads.end_run(spec, thread, conversation, result.status).await;
    }
    if let Some(persister) = persister {
        // The result is stored before the stream ends, so GetRun (on any replica) finds it.
        persister.write_final().await;
        close_older_waits(spec, deps, persister).await;
    }
    // The slot counts running work: it is free before the last event is delivered, which a
    // caller that reads nothing holds up to the event send timeout.
    drop(slot);
    emitter.flush().await;
    result
}

/// Once a durable run's end is stored by this owner (a fenced write: no newer owner can hold the
/// run), closes any wait under its id: one a replaced owner opened for a question in a turn the
/// checkpoint this owner resumed from did not keep (the call ran again here and did not ask)
/// would otherwise leave a person asked about a run that is over. Before the end is stored it
/// is not safe: a replaced owner ending the run in its own memory would close the wait the new
/// owner resumed with.
async fn close_older_waits(spec: &RunSpec, deps: &LoopDeps, persister: &Persister) {
    if persister.durable() && persister.ownership().ended() {
        deps.approvals.close(&spec.run_id, persister.ownership().epoch()).await;
    }
}

/// Adds the run's end to its caller's spend this hour: the run, its calls, its time and the
/// tokens not `booked` turn by turn, giving back the tokens `held` for a turn it did not book;
/// whether the book took it.
async fn tally_run_end(deps: &LoopDeps, result: &RunResult, (booked, held): &(Usage, Option<spend::Hold>)) -> bool {
    let now = shared::sync::unix_ms();
    let window = crate::domain::usage::window_of(now);
    let mut tally = crate::domain::usage::Tally {
        tool_calls: u64::try_from(result.tool_calls.len()).unwrap_or(u64::MAX),
        runs: 1,
        run_ms: now.saturating_sub(result.created_at_ms),
        ..crate::domain::usage::Tally::of_tokens(&result.usage.since(booked))
    };
    if let Some(held) = held {
        tally.held_tokens += spend::give_back(deps, &result.principal, *held, window).await;
    }
    let add = crate::domain::usage::Add::of_run(tally, &result.run_id, result.usage, true);
    let add = deps.usage.add(&result.principal, window, add);
    match crate::domain::ports::within(deps.store_timeout, add).await {
        Ok(_) => true,
        Err(e) => {
            tracing::warn!(principal = %result.principal, "the run's end was not added to the caller's usage: {e}");
            false
        }
    }
}

/// A durable run whose end could not be kept as it must be (`why`: its event log did not keep
/// it, this replica being cut off from NATS or paused as it ended; or its spend was not booked):
/// its result is not stored from here, or the log would lack the end for good. The run stops
/// here as if its checkpoint had not been saved; the replica that takes it over stores the end
/// if it reached the log after all, or else resumes from the last checkpoint.
async fn end_unsaved(
    why: &str,
    persister: &Persister,
    emitter: &mut Emitter,
    settle_timeout: Duration,
    state: &SharedState,
) -> RunResult {
    persister.ownership().stop(crate::domain::Stop::Unsaved(why.to_owned()));
    moved(End::TakenOver, Some(persister), emitter, settle_timeout, state).await
}

/// The run's first event: what it runs with.
fn run_started(spec: &RunSpec) -> Event {
    Event::RunStarted {
        model: spec.model.clone(),
        normal_tools: spec.normal_tools.iter().map(|t| t.name.clone()).collect(),
        exit_tools: spec.exit_tools.iter().map(|t| t.name.clone()).collect(),
        limits: spec.limits,
        thread: spec.thread.as_deref().map(crate::domain::thread::RunThread::start),
        queued_ms: spec.queued_ms,
    }
}

/// A run that moved to another replica: a handed-over one logs what it queued (the next owner
/// continues from the log's true end) and is released in the store (its last checkpoint
/// stands); one this replica stopped acting for (taken over, its lease run out, a checkpoint not
/// saved) sends nothing more, and one whose checkpoint was not saved is given back in the store. The caller's stream ends without
/// `run_finished`, which tells it to re-attach.
async fn moved(
    end: End,
    persister: Option<&Persister>,
    emitter: &mut Emitter,
    settle_timeout: Duration,
    state: &SharedState,
) -> RunResult {
    let how = match (end, persister) {
        (End::HandedOver, Some(persister)) => {
            if persister.ownership().holds() {
                emitter.log_queued();
                emitter.settler(settle_timeout).wait().await;
            }
            persister.hand_over().await;
            "handed_over"
        }
        (_, Some(persister)) => {
            persister.give_back().await;
            persister.ownership().why().map_or("fenced", crate::domain::Stop::label)
        }
        (_, None) => "fenced",
    };
    metrics::counter!(metric::RUNS_MOVED, "how" => how).increment(1);
    tracing::info!(how, "the run moved to another replica");
    lock(state).clone()
}

/// What ends a run from outside, besides its deadline.
struct Ends<'a> {
    cancel: &'a Cancel,
    caller: Option<&'a mpsc::Sender<EventBatch>>,
    hand_over: &'a HandOver,
    persister: Option<&'a Persister>,
}

/// The loop against what ends a run from outside: its deadline, a cancel, the caller going away.
/// The deadline is looked at first, so a caller whose own deadline passed reads as
/// `DEADLINE_EXCEEDED`, not as gone.
async fn race(drive: impl Future<Output = End>, spec: &RunSpec, ends: Ends<'_>) -> End {
    // A deadline already past (a parked run woken by it) ends the run before it does anything:
    // the timer below fires only once the runtime's clock next moves, and a resumed run may
    // have taken a whole turn by then.
    if Instant::now() >= spec.deadline.at {
        return deadline_end(spec);
    }
    let caller_gone = async {
        match ends.caller {
            Some(tx) => tx.closed().await,
            None => std::future::pending().await,
        }
    };
    let taken_over = async {
        match ends.persister {
            Some(persister) => persister.taken_over().await,
            None => std::future::pending().await,
        }
    };
    let durable = ends.persister.is_some_and(Persister::durable);
    tokio::select! {
        biased;
        () = taken_over => End::TakenOver,
        () = ends.hand_over.now.cancelled(), if durable => End::HandedOver,
        () = tokio::time::sleep_until(spec.deadline.at) => deadline_end(spec),
        reason = ends.cancel.cancelled() => End::Canceled(reason),
        () = caller_gone => {
            if Instant::now() + CALLER_DEADLINE_SLACK >= spec.deadline.at && spec.deadline.set_by_caller {
                deadline_end(spec)
            } else {
                End::Canceled("the caller went away".to_owned())
            }
        }
        end = drive => end,
    }
}

/// A caller that leaves this close to its own deadline left because of it.
const CALLER_DEADLINE_SLACK: Duration = Duration::from_millis(50);

fn deadline_end(spec: &RunSpec) -> End {
    let detail = if spec.deadline.set_by_caller {
        "the caller's deadline passed (the run ends just before it, so the caller gets this result)".to_owned()
    } else {
        format!(
            "the run did not finish within {}",
            humantime::format_duration(spec.limits.run_timeout)
        )
    };
    End::failed(FailureReason::DeadlineExceeded, detail)
}

/// Writes the end into the run's state and returns the final result.
fn settle(state: &SharedState, end: End, cancel: &Cancel) -> RunResult {
    let mut state = lock(state);
    // A cancel that came in before the end was settled wins: CancelRun told its caller the run
    // is canceled (it checks under this lock).
    let end = match end {
        End::Canceled(_) => end,
        _ if cancel.is_canceled() => End::Canceled(cancel.reason()),
        _ => end,
    };
    match end {
        End::Completed => state.status = RunStatus::Completed,
        End::Failed(reason, detail) => {
            state.status = RunStatus::Failed;
            state.failure_reason = Some(reason);
            state.failure_detail = detail;
        }
        End::Canceled(detail) => {
            state.status = RunStatus::Canceled;
            state.failure_detail = detail;
        }
        End::HandedOver | End::TakenOver | End::Parked => {}
    }
    // An ended run waits for nothing.
    state.pending_approvals.clear();
    state.updated_at_ms = shared::sync::unix_ms();
    state.clone()
}

/// A call the model made this turn, with its final id.
#[derive(Clone, serde::Serialize, serde::Deserialize)]
struct ModelCall {
    id: String,
    name: String,
    arguments: String,
    /// Bytes of arguments the model sent (more than `arguments` holds when they were cut).
    argument_bytes: usize,
}

/// One turn as it goes.
#[derive(Clone, serde::Serialize, serde::Deserialize)]
struct Turn {
    /// 1-based.
    number: u32,
    /// The visible text of this turn (the assistant message fed back with its calls).
    text: String,
    /// Tokens reported for this turn.
    usage: Usage,
    /// The turn's reasoning, kept only to be sent back (`send_reasoning`).
    reasoning: String,
}

/// A turn's calls sorted by where they go; each list keeps the model's order.
#[derive(Clone, serde::Serialize, serde::Deserialize)]
struct SortedCalls {
    calls: Vec<ModelCall>,
    normal: Vec<usize>,
    exit: Vec<usize>,
    /// Calls of unknown tools or with arguments that are not a JSON object, with the error.
    bad: Vec<(usize, ToolCallError)>,
}

/// What the budget allows of a turn's normal calls.
#[derive(Clone, serde::Serialize, serde::Deserialize)]
struct Spend {
    /// The calls executed: the first ones, as many as the budget had left.
    executed: Vec<usize>,
    /// Some calls were left out: the run ends `TOOL_BUDGET_EXHAUSTED` after this turn.
    exhausted: bool,
    /// Budget left after this turn.
    left: u32,
}

/// What one call came back with (kept in a checkpoint once it finished).
#[derive(Clone, serde::Serialize, serde::Deserialize)]
struct CallOutcome {
    /// Position in the turn's calls.
    index: usize,
    result: Result<String, ToolCallError>,
    elapsed: Duration,
    /// Not run: a person rejected it (or nobody decided in time). Not a failure of the turn.
    #[serde(default)]
    rejected: bool,
    /// Recorded and announced (`tool_call_finished`) already: while its turn waited for a
    /// decision.
    #[serde(default)]
    reported: bool,
    /// The call did not finish: it asks a person these questions (its `result` is empty).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    asked: Option<crate::domain::input::Questions>,
    /// The call did not finish: its server runs it as this task, still working (its `result`
    /// is empty).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    task: Option<crate::domain::task::ToolTask>,
}

/// The state of the loop across turns.
struct Driver<'a> {
    spec: &'a RunSpec,
    deps: &'a LoopDeps,
    state: &'a SharedState,
    emitter: &'a mut Emitter,
    /// What the model is offered, and which of its calls are run and which are signals.
    offer: Offer<'a>,
    max_turns: u32,
    /// Assistant and tool messages of the turns so far (exit calls excluded).
    conversation: Vec<Message>,
    /// What of `conversation` the journal keeps (a durable run's checkpoints name it).
    segmented: durable::Segmented,
    /// The loop detector's rule over the text and over the reasoning.
    loops: Loops,
    /// The completion streaming now, kept here so a run that ends mid-turn keeps its held text
    /// and usage.
    completion: Option<Completion>,
    ids: IdAllocator,
    /// How far the run got, against its limits (what a checkpoint carries over).
    progress: Progress,
    /// The run's span (`invoke_agent`), for signal events.
    run_span: tracing::Span,
    /// Writes the run's state to the result store (checkpoints, late signal deliveries).
    persister: Option<Persister>,
    /// Set when a draining replica asks the run to hand over at its next safe point.
    hand_over: tokio_util::sync::CancellationToken,
    /// The run's cancel: read at each turn's end for a cancel that let the turn finish.
    cancel: Cancel,
    /// Messages sent to the run, taken at each turn's end.
    inbox: Inbox,
    /// The current turn's calls started while the model still wrote.
    eager: eager::Eager,
    /// The tokens held in the caller's hour for the turn under way, until it books what it
    /// spent.
    held: Option<spend::Hold>,
    /// The caller's hour as the turn's booking left it, judged against its budget once the
    /// turn's calls have run.
    hour_booked: Option<(u64, crate::domain::usage::Tally)>,
    /// The tasks the current turn's calls became, to cancel if the run ends before them.
    followed: tasks::Followed,
    /// The progress the turn's calls reported and the loop has not sent yet.
    call_progress: call_progress::CallProgress,
    /// The run's requests serialized up to their newest message: each turn's request adds to it.
    prefix: crate::domain::model::RequestPrefix,
}

/// The tools a run offers the model: the definitions sent with every turn, and the names that
/// sort its calls into normal ones (run on the tool-runners) and exit ones (signals).
struct Offer<'a> {
    tools: Arc<[ToolDefinition]>,
    normal: HashSet<&'a str>,
    exit: HashSet<&'a str>,
}

impl<'a> Offer<'a> {
    fn of(spec: &'a RunSpec) -> Self {
        Self {
            tools: spec.normal_tools.iter().chain(&spec.exit_tools).cloned().collect(),
            normal: spec.normal_tools.iter().map(|t| t.name.as_str()).collect(),
            exit: spec.exit_tools.iter().map(|t| t.name.as_str()).collect(),
        }
    }
}

/// The loop detector's rule, over the model's text and over its reasoning (not shown, but it
/// can loop too).
struct Loops {
    text: LoopDetector,
    reasoning: LoopDetector,
}

impl<'a> Driver<'a> {
    fn new(
        spec: &'a RunSpec,
        deps: &'a LoopDeps,
        state: &'a SharedState,
        emitter: &'a mut Emitter,
        persister: Option<Persister>,
        hand_over: HandOver,
        (cancel, inbox): (Cancel, Inbox),
    ) -> Self {
        Self {
            offer: Offer::of(spec),
            max_turns: spec.limits.max_turns.min(HARD_MAX_TURNS),
            conversation: Vec::new(),
            segmented: durable::Segmented::default(),
            loops: Loops {
                text: LoopDetector::new(deps.detector),
                reasoning: LoopDetector::new(deps.detector),
            },
            completion: None,
            ids: IdAllocator::default(),
            progress: Progress::default(),
            run_span: tracing::Span::current(),
            persister,
            hand_over: hand_over.at_safe_point,
            cancel,
            inbox,
            eager: eager::Eager::default(),
            held: None,
            hour_booked: None,
            followed: tasks::Followed::default(),
            call_progress: call_progress::CallProgress::default(),
            prefix: crate::domain::model::RequestPrefix::default(),
            spec,
            deps,
            state,
            emitter,
        }
    }

    /// Turns until one ends the run; `max_turns` (never above the hard guard) bounds them. A
    /// resumed run (`Some`: its state restored from its checkpoint, with the calls of the turn
    /// it was in) first finishes that turn.
    async fn drive(&mut self, resumed: Option<Option<TurnCalls>>) -> End {
        let first = match resumed {
            // Boxed: only a resumed run holds it, and every run would carry its size.
            Some(calls) => Box::pin(self.resume_turn(calls))
                .await
                .and_then(|()| self.stop_after_the_turn()),
            // A durable run is resumable from its start: a replica stopping in its first turn
            // loses nothing but that turn's attempt.
            None => match (self.take_messages(0), self.durable()) {
                // A message taken before the first turn is not in the checkpoint the run's id
                // was claimed with.
                (true, Some(_)) => self.safe_point(None).await,
                (false, Some(_)) => self.start().await,
                (_, None) => Ok(()),
            },
        };
        if let Err(end) = first {
            return end;
        }
        for number in self.progress.turns_done + 1..=self.max_turns {
            let span = telemetry::chat_span(&self.spec.model, number);
            let started = Instant::now();
            let step = self.turn(number).instrument(span).await;
            metrics::histogram!(metric::TURN_DURATION).record(started.elapsed().as_secs_f64());
            let within = self.within_hour();
            if let Err(end) = step.and(within).and_then(|()| self.within_token_budget()) {
                return end;
            }
            if let Err(end) = self.end_turn(number).await {
                return end;
            }
            if let Err(end) = self.stop_after_the_turn() {
                return end;
            }
        }
        End::failed(
            FailureReason::MaxTurnsExceeded,
            format!("the model still called tools after {} turn(s)", self.max_turns),
        )
    }

    /// Steering: the messages sent to the run join the conversation at the boundary after turn
    /// `ended` (0: before the first), after its tool results and status note, each announced
    /// by `message_added`. When the next turn is the run's last, the inbox closes in the same
    /// step: no later boundary could take a message. Whether any joined.
    fn take_messages(&mut self, ended: u32) -> bool {
        let next = ended + 1;
        let close = (next >= self.max_turns).then_some(Closed::LastTurn);
        let messages = self.inbox.take(close);
        let any = !messages.is_empty();
        for message in messages {
            crate::domain::chat::append_user(&mut self.conversation, &message.content, message.name.clone());
            self.emitter.queue(Event::MessageAdded {
                turn: next,
                content: message.content,
                name: message.name,
            });
        }
        any
    }

    /// The model answered without calling a tool: whether messages sent to the run wait for
    /// one more turn (when none does, the inbox closes in the same step and the run ends).
    fn messages_wait(&self, number: u32) -> bool {
        number < self.max_turns && self.inbox.close_unless_waiting()
    }

    /// A cancel that let the turn finish ends the run once the turn has ended.
    fn stop_after_the_turn(&self) -> Step<()> {
        match self.cancel.after_turn() {
            Some(reason) => Err(End::Canceled(reason)),
            None => Ok(()),
        }
    }

    /// A resumed run's first step: the rest of the turn it was among the calls of, or a safe
    /// point that checkpoints and sends what the log lacks (the next turn starts after it).
    async fn resume_turn(&mut self, calls: Option<TurnCalls>) -> Step<()> {
        match calls {
            Some(calls) => {
                let number = calls.turn.number;
                self.tools_half(calls, false).await?;
                self.end_turn(number).await
            }
            None => self.safe_point(None).await,
        }
    }

    /// Safe point (c): the turn ended; the messages sent to the run meanwhile join the
    /// conversation (unless the run is canceled once the turn ends). A durable run saves its checkpoint, which also shows its output so far to
    /// GetRun on every replica (a local store's registry shows live runs).
    async fn end_turn(&mut self, number: u32) -> Step<()> {
        (self.progress.turns_done, self.progress.attempt) = (number, 1);
        // A run canceled once this turn ends has no next turn for a message to join.
        if self.cancel.after_turn().is_none() {
            self.take_messages(number);
        }
        match self.durable() {
            Some(_) => self.safe_point(None).await,
            None => Ok(()),
        }
    }
}
