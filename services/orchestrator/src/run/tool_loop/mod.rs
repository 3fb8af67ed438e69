//! The tool loop of one run (docs/architecture.md, "The rules of the loop").
//!
//! [`run`] drives turns until the model stops calling normal tools or a limit ends the run;
//! cancellation, the caller going away and the run's deadline end it at once. Each rule of a turn
//! is one method of `Driver`, in the order they apply:
//! `chat_request` (the BIOS and the conversation),
//! `stream_completion` (text to the caller and the repeated-line
//! detector), `take_calls` (structured calls, else fallback directives),
//! `partition` (normal / exit / bad), `publish_signals`,
//! `apply_parse_policy`, `spend_budget`,
//! `dispatch` (concurrently, with `join_all`),
//! `report_results`, `count_failures` (once
//! per turn) and `append_to_conversation`. Whatever was produced
//! before the end is kept.
//!
//! The loop is in four files: this one (the run from start to end, and the driver's state),
//! [`rules`] (`Driver::turn` and the rules of a turn), [`completion`] (the streamed completion:
//! text, reasoning and usage as they arrive) and [`output`] (accounting of the run's output
//! against its bounds).

mod completion;
mod output;
mod rules;
#[cfg(test)]
mod tests;

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use shared::sync::lock;
use tokio::sync::mpsc;
use tokio::time::Instant;
use tracing::Instrument;

use self::completion::Completion;
use self::rules::IdAllocator;
use super::live::{AdmittedRun, Cancel, Emitter, SharedState};
use super::loop_detector::LoopDetector;
use crate::domain::ports::{SignalTopic, ToolExecutor};
use crate::domain::{
    Event, EventBatch, FailureReason, HARD_MAX_TURNS, LoopDetection, OutputBounds, RunResult, RunSpec, RunStatus,
    ToolCallError,
};
use crate::llm::{ChatModel, Message, ToolDefinition, Usage};
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
}

/// How the loop ended.
enum End {
    Completed,
    Failed(FailureReason, String),
    Canceled(String),
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
/// the last event to a slow caller holds no slot.
pub async fn run(run: AdmittedRun, deps: &LoopDeps) -> RunResult {
    let AdmittedRun {
        spec,
        state,
        mut emitter,
        cancel,
        caller,
        persister,
        slot,
    } = run;
    let started = Instant::now();
    let _in_flight = InFlight::new(metric::RUNS_IN_FLIGHT);
    // Sent with the first model request.
    emitter.queue(Event::RunStarted {
        model: spec.model.clone(),
        normal_tools: spec.normal_tools.iter().map(|t| t.name.clone()).collect(),
        exit_tools: spec.exit_tools.iter().map(|t| t.name.clone()).collect(),
        limits: spec.limits,
    });
    let end = {
        let mut driver = Driver::new(&spec, deps, &state, &mut emitter, persister.clone());
        let end = race(driver.drive(), &spec, &cancel, caller.as_ref()).await;
        if !matches!(end, End::Completed) {
            driver.keep_interrupted_turn(true);
        }
        end
    };
    let result = settle(&state, end, &cancel);
    telemetry::record_run_end(&result, started.elapsed());
    // The result is stored before the stream ends, so GetRun (on any replica) finds it.
    if let Some(persister) = &persister {
        persister.write_final().await;
    }
    // The slot counts running work: it is free before the last event is delivered, which a
    // caller that reads nothing holds up to the event send timeout.
    drop(slot);
    emitter.send(Event::RunFinished(result.clone())).await;
    result
}

/// The loop against what ends a run from outside: its deadline, a cancel, the caller going away.
/// The deadline is looked at first, so a caller whose own deadline passed reads as
/// `DEADLINE_EXCEEDED`, not as gone.
async fn race(
    drive: impl Future<Output = End>,
    spec: &RunSpec,
    cancel: &Cancel,
    caller: Option<&mpsc::Sender<EventBatch>>,
) -> End {
    let caller_gone = async {
        match caller {
            Some(tx) => tx.closed().await,
            None => std::future::pending().await,
        }
    };
    tokio::select! {
        biased;
        () = tokio::time::sleep_until(spec.deadline.at) => deadline_end(spec),
        reason = cancel.cancelled() => End::Canceled(reason),
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
    }
    state.clone()
}

/// A call the model made this turn, with its final id.
struct ModelCall {
    id: String,
    name: String,
    arguments: String,
    /// Bytes of arguments the model sent (more than `arguments` holds when they were cut).
    argument_bytes: usize,
}

/// One turn as it goes.
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
struct Partition {
    calls: Vec<ModelCall>,
    normal: Vec<usize>,
    exit: Vec<usize>,
    /// Calls of unknown tools or with arguments that are not a JSON object, with the error.
    bad: Vec<(usize, ToolCallError)>,
}

/// What the budget allows of a turn's normal calls.
struct Spend {
    /// The calls executed: the first ones, as many as the budget had left.
    executed: Vec<usize>,
    /// Some calls were left out: the run ends `TOOL_BUDGET_EXHAUSTED` after this turn.
    exhausted: bool,
    /// Budget left after this turn.
    left: u32,
}

/// What one call came back with.
struct CallOutcome {
    /// Position in the turn's calls.
    index: usize,
    result: Result<String, ToolCallError>,
    elapsed: Duration,
}

/// The state of the loop across turns.
struct Driver<'a> {
    spec: &'a RunSpec,
    deps: &'a LoopDeps,
    state: &'a SharedState,
    emitter: &'a mut Emitter,
    normal_names: HashSet<&'a str>,
    exit_names: HashSet<&'a str>,
    /// Normal and exit tools, as offered to the model.
    tools: Vec<ToolDefinition>,
    max_turns: u32,
    /// Assistant and tool messages of the turns so far (exit calls excluded).
    conversation: Vec<Message>,
    detector: LoopDetector,
    /// The same rule over the model's reasoning, which is not shown but can loop too.
    reasoning_detector: LoopDetector,
    /// The completion streaming now, kept here so a run that ends mid-turn keeps its held text
    /// and usage.
    completion: Option<Completion>,
    /// Bytes of the arguments and errors of the calls and signals recorded so far, counted at
    /// the turn boundaries where they change, not on every batch of text.
    recorded_bytes: usize,
    ids: IdAllocator,
    used_budget: u32,
    failed_turns: u32,
    /// The run's span (`invoke_agent`), for signal events.
    run_span: tracing::Span,
    /// Writes the run's state to the result store (checkpoints, late signal deliveries).
    persister: Option<Persister>,
}

impl<'a> Driver<'a> {
    fn new(
        spec: &'a RunSpec,
        deps: &'a LoopDeps,
        state: &'a SharedState,
        emitter: &'a mut Emitter,
        persister: Option<Persister>,
    ) -> Self {
        Self {
            normal_names: spec.normal_tools.iter().map(|t| t.name.as_str()).collect(),
            exit_names: spec.exit_tools.iter().map(|t| t.name.as_str()).collect(),
            tools: spec.normal_tools.iter().chain(&spec.exit_tools).cloned().collect(),
            max_turns: spec.limits.max_turns.min(HARD_MAX_TURNS),
            conversation: Vec::new(),
            detector: LoopDetector::new(deps.detector),
            reasoning_detector: LoopDetector::new(deps.detector),
            completion: None,
            recorded_bytes: 0,
            ids: IdAllocator::default(),
            used_budget: 0,
            failed_turns: 0,
            run_span: tracing::Span::current(),
            persister,
            spec,
            deps,
            state,
            emitter,
        }
    }

    /// Turns until one ends the run; `max_turns` (never above the hard guard) bounds them.
    async fn drive(&mut self) -> End {
        for number in 1..=self.max_turns {
            let span = telemetry::chat_span(&self.spec.model, number);
            let started = Instant::now();
            let step = self.turn(number).instrument(span).await;
            metrics::histogram!(metric::TURN_DURATION).record(started.elapsed().as_secs_f64());
            if let Err(end) = step {
                return end;
            }
            // Live runs are visible to GetRun on every replica, updated at turn boundaries.
            if let Some(persister) = &self.persister {
                persister.checkpoint();
            }
        }
        End::failed(
            FailureReason::MaxTurnsExceeded,
            format!("the model still called tools after {} turn(s)", self.max_turns),
        )
    }
}
