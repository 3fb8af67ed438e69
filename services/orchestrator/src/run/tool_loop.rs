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

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use futures::future::join_all;
use futures::stream::{BoxStream, Fuse};
use futures::{FutureExt, StreamExt};
use shared::sync::lock;
use tokio::sync::mpsc;
use tokio::time::Instant;
use tracing::Instrument;

use super::bios::{BiosContext, render};
use super::fallback::Resolution;
use super::live::{AdmittedRun, Cancel, Emitter, SharedState};
use super::loop_detector::{DetectorConfig, LoopDetector};
use super::turn::{TurnCollector, TurnOutput};
use crate::domain::OutputBounds;
use crate::domain::ports::{OnDelivery, SignalTopic};
use crate::domain::ports::{ToolExecutor, ToolInvocation};
use crate::domain::{
    Delivery, Event, EventBatch, FailureReason, HARD_MAX_TURNS, ParsePolicy, RunResult, RunSpec, RunStatus, Signal,
    ToolCallError, ToolCallRecord,
};
use crate::llm::{ChatModel, ChatRequest, LlmError, LlmEvent, Message, ToolCall, ToolDefinition, Usage};
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
    pub detector: DetectorConfig,
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
/// `GetRun` answers as soon as the stream ends; the run's slot is freed after both.
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
    emitter.send(Event::RunFinished(result.clone())).await;
    drop(slot);
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

    /// One turn: every rule in order; `Err` when the run ends with it.
    async fn turn(&mut self, number: u32) -> Step<()> {
        lock(self.state).turns = number;
        let mut turn = Turn {
            number,
            text: String::new(),
            usage: Usage::default(),
            reasoning: String::new(),
        };
        let budget_before = self.budget_left();
        let request = self.chat_request(number);
        let output = self.stream_completion(request, &mut turn).await?;
        let calls = self.take_calls(output, &mut turn).await?;
        self.within_output_for_calls(&calls)?;
        let partition = self.partition(calls);
        self.publish_signals(&partition, number);
        self.count_recorded_bytes();
        self.apply_parse_policy(&partition, &turn, budget_before)?;
        let spend = self.spend_budget(&partition);
        if spend.executed.is_empty() && partition.bad.is_empty() {
            self.finish_turn(&turn, spend.left);
            return Err(self.budget_end(&spend, &partition).unwrap_or(End::Completed));
        }
        let outcomes = self.dispatch(&partition, &spend.executed, number).await;
        let any_failed = !partition.bad.is_empty() || outcomes.iter().any(|o| o.result.is_err());
        let fed_back = self.report_results(&partition, outcomes, number);
        self.count_recorded_bytes();
        self.count_failures(any_failed);
        self.append_to_conversation(&mut turn, fed_back);
        self.finish_turn(&turn, spend.left);
        self.check_failure_limit()?;
        match self.budget_end(&spend, &partition) {
            Some(end) => Err(end),
            None => Ok(()),
        }
    }

    /// The request of a turn: the BIOS (regenerated), the caller's system message and messages,
    /// then the turns so far.
    fn chat_request(&self, turn: u32) -> ChatRequest {
        let (spec, limits) = (self.spec, self.spec.limits);
        let bios = render(&BiosContext {
            turn,
            max_turns: self.max_turns,
            normal_tools: &spec.normal_tools,
            exit_tools: &spec.exit_tools,
            budget_remaining: self.budget_left(),
            failures_remaining: limits.max_tool_failures.saturating_sub(self.failed_turns),
        });
        let mut messages = Vec::with_capacity(2 + spec.messages.len() + self.conversation.len());
        messages.push(Message::System(bios));
        if !spec.system.is_empty() {
            messages.push(Message::System(spec.system.clone()));
        }
        messages.extend(spec.messages.iter().cloned());
        messages.extend(self.conversation.iter().cloned());
        ChatRequest {
            model: spec.model.clone(),
            messages,
            tools: self.tools.clone(),
            params: spec.params.for_turn(turn),
        }
    }

    /// Streams the completion: visible text goes to the caller and the repeated-line detector as
    /// it arrives, reasoning to a detector of its own. A stream error keeps every byte: text held
    /// back for directive parsing is output too, and the usage reported so far counts.
    async fn stream_completion(&mut self, request: ChatRequest, turn: &mut Turn) -> Step<TurnOutput> {
        self.emitter.flush().await;
        let requested = Instant::now();
        let stream = self.deps.model.stream(request).await.map_err(llm_failure)?;
        let collector = TurnCollector::new(self.deps.output.max_calls_per_turn, self.deps.output.max_argument_bytes);
        self.completion = Some(Completion::new(stream, collector, requested));
        while let Some(batch) = self.next_batch().await {
            self.reason(turn, &batch.reasoning).await?;
            self.show(turn, &batch.text).await?;
            self.within_output_while_held()?;
            if let Some(e) = batch.error {
                self.keep_interrupted_turn(true);
                return Err(llm_failure(e));
            }
        }
        let output = self
            .completion
            .take()
            .map_or_else(|| TurnCollector::default().finish(), Completion::finish);
        self.record_usage(&output, turn);
        Ok(output)
    }

    async fn next_batch(&mut self) -> Option<Batch> {
        self.completion.as_mut()?.next_batch().await
    }

    /// A turn the run ends in the middle of: the usage it reported counts, and its held text
    /// is released (queued, sent before `run_finished`, seen by the repeated-line detector)
    /// unless the run ends because that text loops.
    fn keep_interrupted_turn(&mut self, release_text: bool) {
        let Some(mut completion) = self.completion.take() else {
            return;
        };
        if release_text {
            let mut held = completion.collector.release_held();
            held.truncate(shared::text::truncate(&held, self.output_room()).len());
            self.detector.feed(&held);
            let turn = lock(self.state).turns;
            self.emitter.queue(Event::TextDelta { text: held, turn });
        }
        if let Some(usage) = completion.collector.usage() {
            let mut state = lock(self.state);
            state.usage.prompt_tokens += usage.prompt_tokens;
            state.usage.completion_tokens += usage.completion_tokens;
        }
    }

    /// Reasoning goes to a repeated-line detector of its own: a line repeated too often ends the
    /// run `REPEATED_LINE_LOOP`, as in text, with the reasoning kept up to that line.
    async fn reason(&mut self, turn: &mut Turn, reasoning: &str) -> Step<()> {
        if reasoning.is_empty() {
            return Ok(());
        }
        let tripped = self.reasoning_detector.feed(reasoning);
        let seen = tripped.as_ref().map_or(reasoning, |(_, end)| &reasoning[..*end]);
        self.keep_reasoning(turn, seen).await;
        match tripped {
            None => Ok(()),
            Some((line, _)) => {
                self.keep_interrupted_turn(false);
                Err(End::Failed(
                    FailureReason::RepeatedLineLoop,
                    format!(
                        "the model repeated the line {:?} too often in its reasoning",
                        shared::text::excerpt(&line)
                    ),
                ))
            }
        }
    }

    /// Reasoning is streamed and kept in the result up to `max_reasoning_bytes` per run; past
    /// them the result is flagged truncated and the run goes on (reasoning is not output). With
    /// `send_reasoning`, the turn keeps its own reasoning, up to the same bound, to send back.
    async fn keep_reasoning(&mut self, turn: &mut Turn, reasoning: &str) {
        let max = self.deps.output.max_reasoning_bytes;
        let kept = {
            let mut state = lock(self.state);
            let kept = shared::text::truncate(reasoning, max.saturating_sub(state.reasoning.len()));
            state.reasoning_truncated |= kept.len() < reasoning.len();
            kept
        };
        self.emitter.reasoning(kept, turn.number).await;
        if self.deps.send_reasoning {
            let room = max.saturating_sub(turn.reasoning.len());
            turn.reasoning.push_str(shared::text::truncate(reasoning, room));
        }
    }

    /// Adds a finished completion's usage and finish reason to the turn, the run and the span.
    fn record_usage(&self, output: &TurnOutput, turn: &mut Turn) {
        turn.usage = output.usage;
        let chat_span = tracing::Span::current();
        chat_span.record("gen_ai.usage.input_tokens", output.usage.prompt_tokens);
        chat_span.record("gen_ai.usage.output_tokens", output.usage.completion_tokens);
        if let Some(reason) = &output.finish_reason {
            chat_span.record("gen_ai.response.finish_reasons", reason.as_str());
        }
        let mut state = lock(self.state);
        state.usage.prompt_tokens += output.usage.prompt_tokens;
        state.usage.completion_tokens += output.usage.completion_tokens;
        if let Some(reason) = &output.finish_reason {
            state.finish_reason.clone_from(reason);
        }
    }

    /// Takes the turn's calls: the structured ones, or else the directives written in the text
    /// (stripped from what is shown). A directive naming an unknown tool, or a malformed one,
    /// ends the run `TOOL_PARSE_ERROR` with the text shown as written.
    async fn take_calls(&mut self, output: TurnOutput, turn: &mut Turn) -> Step<Vec<ModelCall>> {
        match output.resolution {
            Resolution::Text(text) => {
                self.show(turn, &text).await?;
                self.within_calls_per_turn(output.too_many_calls)?;
                Ok(output
                    .structured
                    .into_iter()
                    .map(|c| ModelCall {
                        id: self.ids.take(c.id),
                        name: c.name,
                        arguments: c.arguments,
                        argument_bytes: c.argument_bytes,
                    })
                    .collect())
            }
            Resolution::Calls { calls, stripped, raw } => {
                if let Some(unknown) = calls.iter().find(|c| !self.offers(&c.name)) {
                    let detail = format!("the text calls an unknown tool {:?}", unknown.name);
                    self.emitter.text(&raw, turn.number).await;
                    return Err(End::Failed(FailureReason::ToolParseError, detail));
                }
                self.show(turn, &stripped).await?;
                self.within_calls_per_turn(calls.len() > self.deps.output.max_calls_per_turn)?;
                Ok(calls
                    .into_iter()
                    .map(|c| ModelCall {
                        id: self.ids.take(None),
                        argument_bytes: c.arguments.len(),
                        name: c.name,
                        arguments: c.arguments,
                    })
                    .collect())
            }
            Resolution::Malformed { detail, raw } => {
                self.emitter.text(&raw, turn.number).await;
                Err(End::Failed(FailureReason::ToolParseError, detail))
            }
        }
    }

    /// More calls in one turn than `--max-calls-per-turn` end the run `OUTPUT_LIMIT`; none of
    /// them runs.
    fn within_calls_per_turn(&self, too_many: bool) -> Step<()> {
        if !too_many {
            return Ok(());
        }
        let max = self.deps.output.max_calls_per_turn;
        Err(End::failed(
            FailureReason::OutputLimit,
            format!("the model made more than {max} tool calls in one turn, this server's limit; none of them ran"),
        ))
    }

    /// Sorts the calls into normal, exit and bad (an unknown tool, arguments over the size limit,
    /// or arguments that are not a JSON object).
    fn partition(&self, calls: Vec<ModelCall>) -> Partition {
        let mut partition = Partition {
            normal: Vec::new(),
            exit: Vec::new(),
            bad: Vec::new(),
            calls: Vec::new(),
        };
        for (i, call) in calls.iter().enumerate() {
            if self.exit_names.contains(call.name.as_str()) {
                partition.exit.push(i);
            } else if !self.normal_names.contains(call.name.as_str()) {
                let message = format!("there is no tool named {:?} in this run", call.name);
                partition.bad.push((i, ToolCallError::new("NOT_FOUND", message)));
            } else if call.argument_bytes > self.deps.output.max_argument_bytes {
                let message = format!(
                    "the arguments of {} are {} bytes, over this server's limit of {}; pass less (e.g. a reference instead of the content)",
                    call.name, call.argument_bytes, self.deps.output.max_argument_bytes
                );
                partition
                    .bad
                    .push((i, ToolCallError::new("INVALID_ARGUMENTS", message)));
            } else if !is_json_object(&call.arguments) {
                let message = format!(
                    "the arguments of {} are not a JSON object: {}",
                    call.name,
                    shared::text::excerpt(&call.arguments)
                );
                partition
                    .bad
                    .push((i, ToolCallError::new("INVALID_ARGUMENTS", message)));
            } else {
                partition.normal.push(i);
            }
        }
        partition.calls = calls;
        partition
    }

    /// Exit calls become signals at once: recorded in the result, published on the signal topic
    /// and queued as events. They cost nothing and are not fed back to the model.
    fn publish_signals(&mut self, partition: &Partition, turn: u32) {
        for &i in &partition.exit {
            let call = &partition.calls[i];
            let signal = Signal {
                run_id: self.spec.run_id.clone(),
                call_id: call.id.clone(),
                tool_name: call.name.clone(),
                arguments_valid: is_json_object(&call.arguments),
                arguments_json: call.arguments.clone(),
                turn,
                emitted_at_unix_ms: shared::sync::unix_ms(),
                metadata: self.spec.metadata.clone(),
                delivery: Delivery::Pending,
                principal: self.spec.principal.clone(),
            };
            lock(self.state).signals.push(signal.clone());
            self.deps.signals.publish(&signal, self.on_delivery(&signal.call_id));
            // The event carries the delivery as known now (the in-memory topic confirms at once).
            let signal = lock(self.state)
                .signals
                .iter()
                .find(|s| s.call_id == signal.call_id)
                .cloned()
                .unwrap_or(signal);
            metrics::counter!(metric::SIGNALS_PUBLISHED).increment(1);
            tracing::info!(
                parent: &self.run_span,
                gen_ai.tool.name = %signal.tool_name,
                gen_ai.tool.call.id = %signal.call_id,
                orchestrator.signal.arguments_valid = signal.arguments_valid,
                orchestrator.turn = turn,
                "signal"
            );
            self.emitter.queue(Event::Signal(signal));
        }
    }

    /// What the topic's delivery report does: updates the signal in the run's state, and the
    /// stored result (at once for a finished run; a live one is written at its next turn boundary
    /// or at its end).
    fn on_delivery(&self, call_id: &str) -> OnDelivery {
        let (state, persister, call_id) = (Arc::clone(self.state), self.persister.clone(), call_id.to_owned());
        Box::new(move |delivery: Delivery| {
            let finished = {
                let mut state = lock(&state);
                if let Some(s) = state.signals.iter_mut().find(|s| s.call_id == call_id) {
                    s.delivery = delivery;
                }
                state.status != RunStatus::Running
            };
            match persister {
                Some(persister) if finished => persister.write_final_soon(),
                Some(persister) => persister.checkpoint(),
                None => {}
            }
        })
    }

    /// With the parse policy FAIL (the default), a bad call ends the run `TOOL_PARSE_ERROR`; with
    /// FEED_BACK it is answered with an error tool message and counts as a failed call.
    fn apply_parse_policy(&mut self, partition: &Partition, turn: &Turn, budget_left: u32) -> Step<()> {
        match (partition.bad.first(), self.spec.parse_policy) {
            (Some((_, error)), ParsePolicy::Fail) => {
                self.finish_turn(turn, budget_left);
                Err(End::Failed(FailureReason::ToolParseError, error.message.clone()))
            }
            _ => Ok(()),
        }
    }

    /// Each executed normal call costs 1: when the turn asks for more than is left, the first
    /// ones (model order) run and the run ends after the turn.
    fn spend_budget(&mut self, partition: &Partition) -> Spend {
        let remaining = self.budget_left() as usize;
        let executed: Vec<usize> = partition.normal.iter().copied().take(remaining).collect();
        self.used_budget += u32::try_from(executed.len()).unwrap_or(u32::MAX);
        Spend {
            exhausted: partition.normal.len() > remaining,
            executed,
            left: self.budget_left(),
        }
    }

    fn budget_left(&self) -> u32 {
        self.spec.limits.tool_call_budget.saturating_sub(self.used_budget)
    }

    /// `TOOL_BUDGET_EXHAUSTED` when the turn asked for more calls than were left.
    fn budget_end(&self, spend: &Spend, partition: &Partition) -> Option<End> {
        spend.exhausted.then(|| {
            End::Failed(
                FailureReason::ToolBudgetExhausted,
                format!(
                    "the tool-call budget of {} ran out (the last turn asked for {} call(s))",
                    self.spec.limits.tool_call_budget,
                    partition.normal.len()
                ),
            )
        })
    }

    /// Runs the executed calls concurrently (`join_all`) on the tool-runners, each within the
    /// smaller of the run's tool timeout and the time left in the run. A failed call does not
    /// fail the run: its error is its outcome.
    async fn dispatch(&mut self, partition: &Partition, executed: &[usize], turn: u32) -> Vec<CallOutcome> {
        for &i in executed.iter().chain(partition.bad.iter().map(|(i, _)| i)) {
            let call = &partition.calls[i];
            self.emitter.queue(Event::ToolCallStarted {
                call_id: call.id.clone(),
                name: call.name.clone(),
                arguments_json: call.arguments.clone(),
                turn,
                arguments_truncated: false,
            });
        }
        self.emitter.flush().await;
        let timeout = self
            .spec
            .limits
            .tool_timeout
            .min(self.spec.deadline.at.saturating_duration_since(Instant::now()));
        join_all(executed.iter().map(|&i| self.execute(i, &partition.calls[i], timeout))).await
    }

    /// One call on a tool-runner, in its `execute_tool` span.
    fn execute(&self, index: usize, call: &ModelCall, timeout: Duration) -> impl Future<Output = CallOutcome> + use<> {
        let payloads = self.deps.trace_payloads;
        let span = telemetry::execute_tool_span(&call.name, &call.id, &call.arguments, payloads);
        let invocation = ToolInvocation {
            run_id: self.spec.run_id.clone(),
            call_id: call.id.clone(),
            name: call.name.clone(),
            arguments_json: call.arguments.clone(),
            metadata: self.spec.metadata.clone(),
            principal: self.spec.principal.clone(),
            timeout,
        };
        let tool = call.name.clone();
        let future = span.in_scope(|| self.deps.tools.execute(invocation));
        async move {
            let _in_flight = InFlight::new(metric::TOOL_CALLS_IN_FLIGHT);
            let started = Instant::now();
            let result = tokio::time::timeout(timeout, future).await.unwrap_or_else(|_| {
                Err(ToolCallError::new(
                    "TIMEOUT",
                    format!("no result within {}", humantime::format_duration(timeout)),
                ))
            });
            let elapsed = started.elapsed();
            telemetry::record_tool_call(&tool, &result, elapsed, payloads);
            CallOutcome { index, result, elapsed }
        }
        .instrument(span)
    }

    /// Records every outcome (bad calls included, with their error) in the result and as events,
    /// in the model's order, and returns what is fed back: the assistant's calls and one tool
    /// message each.
    fn report_results(
        &mut self,
        partition: &Partition,
        mut outcomes: Vec<CallOutcome>,
        turn: u32,
    ) -> Vec<(ToolCall, Message)> {
        outcomes.extend(partition.bad.iter().map(|(index, error)| CallOutcome {
            index: *index,
            result: Err(error.clone()),
            elapsed: Duration::ZERO,
        }));
        outcomes.sort_by_key(|o| o.index);
        let mut fed_back = Vec::with_capacity(outcomes.len());
        for CallOutcome { index, result, elapsed } in outcomes {
            let result = result.map_err(|error| self.bounded_error(error));
            let call = &partition.calls[index];
            let duration_ms = u64::try_from(elapsed.as_millis()).unwrap_or(u64::MAX);
            lock(self.state).tool_calls.push(ToolCallRecord {
                call_id: call.id.clone(),
                name: call.name.clone(),
                arguments_json: call.arguments.clone(),
                ok: result.is_ok(),
                error: result.as_ref().err().cloned(),
                duration_ms,
                turn,
            });
            let content = match &result {
                Ok(json) => self.fed_back_result(json),
                Err(error) => error.to_tool_message(),
            };
            self.emitter.queue(Event::ToolCallFinished {
                call_id: call.id.clone(),
                name: call.name.clone(),
                content_json: result.as_ref().ok().cloned(),
                content_truncated: false,
                error: result.err(),
                duration_ms,
            });
            let assistant_call = ToolCall {
                id: call.id.clone(),
                name: call.name.clone(),
                arguments: call.arguments.clone(),
            };
            let tool_message = Message::Tool {
                tool_call_id: call.id.clone(),
                content,
            };
            fed_back.push((assistant_call, tool_message));
        }
        fed_back
    }

    /// A tool result as the model sees it: at most `max_tool_result_bytes`, cut with a note saying
    /// how much was left out.
    fn fed_back_result(&self, json: &str) -> String {
        counted_cut(json, self.deps.max_tool_result_bytes, "result").unwrap_or_else(|| json.to_owned())
    }

    /// A tool error as the run keeps it (its record, its event, the model's tool message): the
    /// message at most `max_tool_result_bytes`, cut with a note saying how much was left out (a
    /// runner passes on a command's stderr or an MCP server's error text).
    fn bounded_error(&self, mut error: ToolCallError) -> ToolCallError {
        if let Some(cut) = counted_cut(&error.message, self.deps.max_tool_result_bytes, "message") {
            error.message = cut;
        }
        error
    }

    /// Failures count once per turn, however many of its calls failed.
    fn count_failures(&mut self, any_failed: bool) {
        if any_failed {
            self.failed_turns += 1;
            lock(self.state).failed_turns = self.failed_turns;
        }
    }

    /// `TOOL_FAILURE_LIMIT` once the failing turns exceed `max_tool_failures`.
    fn check_failure_limit(&self) -> Step<()> {
        let max = self.spec.limits.max_tool_failures;
        if self.failed_turns > max {
            return Err(End::Failed(
                FailureReason::ToolFailureLimit,
                format!(
                    "{} turn(s) had failing tool calls; at most {max} are tolerated",
                    self.failed_turns
                ),
            ));
        }
        Ok(())
    }

    /// One assistant message with the turn's text and its normal calls only, then one tool
    /// message per call, in the model's order.
    fn append_to_conversation(&mut self, turn: &mut Turn, fed_back: Vec<(ToolCall, Message)>) {
        let (tool_calls, tool_messages): (Vec<ToolCall>, Vec<Message>) = fed_back.into_iter().unzip();
        self.conversation.push(Message::Assistant {
            content: std::mem::take(&mut turn.text),
            tool_calls,
            reasoning: Some(std::mem::take(&mut turn.reasoning)).filter(|r| !r.is_empty()),
        });
        self.conversation.extend(tool_messages);
    }

    /// Queues the turn's end (sent with the next model request, or with the run's end).
    fn finish_turn(&mut self, turn: &Turn, budget_left: u32) {
        self.emitter.queue(Event::TurnFinished {
            turn: turn.number,
            usage: turn.usage,
            tool_call_budget_remaining: budget_left,
            failed_turns: self.failed_turns,
        });
    }

    /// Shows visible text and feeds the repeated-line detector; when it trips, the text is shown
    /// up to the end of the repeated line and the run ends `REPEATED_LINE_LOOP`.
    async fn show(&mut self, turn: &mut Turn, text: &str) -> Step<()> {
        if text.is_empty() {
            return Ok(());
        }
        let tripped = self.detector.feed(text);
        let mut shown = tripped.as_ref().map_or(text, |(_, end)| &text[..*end]);
        let over = shown.len() > self.output_room();
        if over {
            shown = shared::text::truncate(shown, self.output_room());
        }
        self.emitter.text(shown, turn.number).await;
        turn.text.push_str(shown);
        if over {
            self.keep_interrupted_turn(false);
            return Err(self.output_limit("its text"));
        }
        match tripped {
            None => Ok(()),
            Some((line, _)) => {
                self.keep_interrupted_turn(false);
                Err(End::Failed(
                    FailureReason::RepeatedLineLoop,
                    format!(
                        "the model repeated the line {:?} too often",
                        shared::text::excerpt(&line)
                    ),
                ))
            }
        }
    }

    /// Counts the arguments and errors of the calls and signals recorded so far (after a turn
    /// recorded some).
    fn count_recorded_bytes(&mut self) {
        let state = lock(self.state);
        let calls: usize = state
            .tool_calls
            .iter()
            .map(|c| c.arguments_json.len() + c.error.as_ref().map_or(0, |e| e.message.len()))
            .sum();
        let signals: usize = state.signals.iter().map(|s| s.arguments_json.len()).sum();
        self.recorded_bytes = calls + signals;
    }

    /// Bytes of the run's output so far: its text and the arguments and errors of its calls and
    /// signals (what its result carries).
    fn output_bytes(&self) -> usize {
        lock(self.state).text.len() + self.recorded_bytes
    }

    /// Bytes the run may still output.
    fn output_room(&self) -> usize {
        self.deps.output.max_output_bytes.saturating_sub(self.output_bytes())
    }

    fn output_limit(&self, what: &str) -> End {
        End::failed(
            FailureReason::OutputLimit,
            format!(
                "the run's output reached this server's limit of {} bytes with {what}; the output up to it is kept",
                self.deps.output.max_output_bytes
            ),
        )
    }

    /// Text held back as a possible directive counts against the output limit too: past it,
    /// what fits is released and the run ends `OUTPUT_LIMIT`.
    fn within_output_while_held(&mut self) -> Step<()> {
        let held = self.completion.as_ref().map_or(0, |c| c.collector.held_text().len());
        if held <= self.output_room() {
            return Ok(());
        }
        self.keep_interrupted_turn(true);
        Err(self.output_limit("its text"))
    }

    /// The arguments of a turn's calls must fit in what the run may still output; otherwise the
    /// run ends `OUTPUT_LIMIT` and none of them runs.
    fn within_output_for_calls(&self, calls: &[ModelCall]) -> Step<()> {
        let bytes: usize = calls.iter().map(|c| c.arguments.len()).sum();
        if bytes <= self.output_room() {
            return Ok(());
        }
        Err(self.output_limit(&format!("the {bytes} bytes of arguments of this turn's tool calls")))
    }

    fn offers(&self, name: &str) -> bool {
        self.normal_names.contains(name) || self.exit_names.contains(name)
    }
}

/// Events of a completion that are already here, taken together.
struct Batch {
    /// Their visible text, shown as one delta: token by token while the model is slower than the
    /// orchestrator, in batches when it is not.
    text: String,
    /// Their reasoning text.
    reasoning: String,
    /// The stream broke off after them.
    error: Option<LlmError>,
}

/// A completion as it streams in, read in [`Batch`]es.
struct Completion {
    /// Fused: a batch may see the end before the loop does.
    stream: Fuse<BoxStream<'static, Result<LlmEvent, LlmError>>>,
    collector: TurnCollector,
    requested: Instant,
    first_token: bool,
}

impl Completion {
    fn new(
        stream: BoxStream<'static, Result<LlmEvent, LlmError>>,
        collector: TurnCollector,
        requested: Instant,
    ) -> Self {
        Self {
            stream: stream.fuse(),
            collector,
            requested,
            first_token: true,
        }
    }

    /// Waits for the next event, then takes every one that is already here; `None` at the end.
    async fn next_batch(&mut self) -> Option<Batch> {
        let mut next = Some(self.stream.next().await?);
        let mut batch = Batch {
            text: String::new(),
            reasoning: String::new(),
            error: None,
        };
        while let Some(item) = next.take() {
            match item {
                Ok(event) => self.take(event, &mut batch),
                Err(e) => {
                    batch.error = Some(e);
                    break;
                }
            }
            next = self.stream.next().now_or_never().flatten();
        }
        Some(batch)
    }

    /// Passes one event to the collector (time to first token is measured on the first one
    /// carrying output); text that can be shown now is added to `shown`.
    fn take(&mut self, event: LlmEvent, batch: &mut Batch) {
        if self.first_token && is_token(&event) {
            self.first_token = false;
            let ttft = self.requested.elapsed().as_secs_f64();
            tracing::Span::current().record("gen_ai.response.time_to_first_token", ttft);
            metrics::histogram!(metric::TIME_TO_FIRST_TOKEN).record(ttft);
        }
        if let LlmEvent::ReasoningDelta(reasoning) = &event {
            batch.reasoning.push_str(reasoning);
        }
        if let Some(text) = self.collector.push(event) {
            batch.text.push_str(&text);
        }
    }

    /// Ends the stream and says what the turn produced.
    fn finish(self) -> TurnOutput {
        drop(self.stream);
        self.collector.finish()
    }
}

/// Whether an event carries generated output (for time to first token).
fn is_token(event: &LlmEvent) -> bool {
    matches!(
        event,
        LlmEvent::TextDelta(_) | LlmEvent::ReasoningDelta(_) | LlmEvent::ToolCallFragment { .. }
    )
}

fn llm_failure(e: LlmError) -> End {
    let span = tracing::Span::current();
    let stalled = matches!(e, LlmError::Stalled(_));
    span.record("error.type", if stalled { "llm_stream_stalled" } else { "llm_error" });
    span.record("otel.status_code", "ERROR");
    let reason = if stalled {
        FailureReason::LlmStreamStalled
    } else {
        FailureReason::LlmError
    };
    End::Failed(reason, e.to_string())
}

fn is_json_object(text: &str) -> bool {
    serde_json::from_str::<serde_json::Value>(text).is_ok_and(|v| v.is_object())
}

/// Gives every call of the run a unique id: the model's when it sent one that is new, else a
/// generated one (the model sees the same id in the tool message).
#[derive(Default)]
struct IdAllocator {
    used: HashSet<String>,
    generated: u32,
}

impl IdAllocator {
    fn take(&mut self, id: Option<String>) -> String {
        if let Some(id) = id.filter(|id| !self.used.contains(id)) {
            self.used.insert(id.clone());
            return id;
        }
        loop {
            self.generated += 1;
            let id = format!("call_{}", self.generated);
            if self.used.insert(id.clone()) {
                return id;
            }
        }
    }
}

/// [`shared::text::cut_with_note`], counted in the metrics when it cuts.
fn counted_cut(text: &str, max: usize, what: &str) -> Option<String> {
    let cut = shared::text::cut_with_note(text, max, what);
    if cut.is_some() {
        metrics::counter!(metric::TOOL_RESULTS_CUT).increment(1);
    }
    cut
}

#[cfg(test)]
mod tests {
    //! The loop without a network: a scripted model and an in-process tool executor.

    use std::collections::VecDeque;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use std::sync::Mutex;

    use futures::future::BoxFuture;
    use tokio::sync::mpsc;

    use super::*;
    use crate::domain::Deadline;
    use crate::domain::Limits;
    use crate::domain::{EventBatch, NumberedEvent};
    use crate::run::live::{Cancel, EmitSettings};
    use crate::signals::memory::MemoryTopic;

    /// Plays one list of events per turn and records the requests.
    struct Script {
        turns: Mutex<VecDeque<Vec<Result<LlmEvent, LlmError>>>>,
        requests: Mutex<Vec<ChatRequest>>,
        /// The last turn's stream stays open after its events.
        hang: bool,
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
            let stream = futures::stream::iter(turn);
            let stream = if self.hang && last {
                stream.chain(futures::stream::pending()).boxed()
            } else {
                stream.boxed()
            };
            futures::future::ready(Ok(stream)).boxed()
        }
    }

    /// Sleeps `ms` from the arguments, fails tools named `bad`, and counts calls in flight.
    #[derive(Default)]
    struct Tools {
        in_flight: AtomicUsize,
        peak: AtomicUsize,
    }

    impl ToolExecutor for Arc<Tools> {
        fn execute(&self, call: ToolInvocation) -> BoxFuture<'static, Result<String, ToolCallError>> {
            let this = Arc::clone(self);
            async move {
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
                Ok(call.arguments_json)
            }
            .boxed()
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
            parameters: serde_json::json!({"type": "object"}),
        }
    }

    fn spec(limits: Limits) -> RunSpec {
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
            parse_policy: ParsePolicy::Fail,
            deadline: Deadline::new(Instant::now(), limits.run_timeout, None, Duration::ZERO),
            principal: String::new(),
        }
    }

    const EMIT: EmitSettings = EmitSettings {
        send_timeout: Duration::from_secs(30),
        max_event_bytes: 1024,
    };

    fn limits() -> Limits {
        Limits {
            max_turns: 8,
            tool_call_budget: 10,
            max_tool_failures: 1,
            tool_timeout: Duration::from_secs(5),
            run_timeout: Duration::from_secs(30),
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
        emit: EmitSettings,
        /// The caller's stream: its buffer, and the pause before each read (`None`: never reads
        /// until the run is over).
        buffer: usize,
        read_every: Option<Duration>,
        /// The caller is attached: it stopping to read cancels the run.
        attached: bool,
        output: OutputBounds,
        send_reasoning: bool,
    }

    impl Default for Outside {
        fn default() -> Self {
            Self {
                hang: false,
                cancel_after: None,
                emit: EMIT,
                buffer: 1024,
                read_every: Some(Duration::ZERO),
                attached: false,
                output: (&crate::Config::default().runs.output).into(),
                send_reasoning: false,
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
        });
        let tools = Arc::new(Tools::default());
        let deps = LoopDeps {
            model: script.clone(),
            tools: Arc::new(Arc::clone(&tools)),
            signals: Arc::new(MemoryTopic::new(16)),
            detector: DetectorConfig {
                window: 64,
                threshold: 8,
            },
            trace_payloads: None,
            max_tool_result_bytes: 1024,
            output: outside.output,
            send_reasoning: outside.send_reasoning,
        };
        let state: SharedState = Arc::new(Mutex::new(RunResult::running("r")));
        let (tx, mut rx) = mpsc::channel(outside.buffer);
        let cancel = Cancel::default();
        let on_stall = outside.attached.then(|| cancel.clone());
        let admitted = AdmittedRun {
            spec: spec(limits),
            emitter: Emitter::new(Some(tx), Arc::clone(&state), outside.emit, on_stall),
            state,
            cancel: cancel.clone(),
            caller: None,
            persister: None,
            slot: None,
        };
        if let Some(after) = outside.cancel_after {
            tokio::spawn(async move {
                tokio::time::sleep(after).await;
                cancel.cancel("canceled by the test");
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
        let result = run(admitted, &deps).await;
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
                completion_tokens: 2
            }
        );
        // The second request: the BIOS shows the spent budget; the exit call is not in the conversation.
        let second = script.requests.lock().unwrap()[1].clone();
        let Message::System(bios) = &second.messages[0] else {
            panic!("BIOS first")
        };
        assert!(
            bios.contains("turn 2 of at most 8") && bios.contains("7 normal call(s) left"),
            "{bios}"
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
        let (result, batches, script, _) =
            play_with(reasoning_turns(), limits(), with_reasoning(all.len(), false)).await;
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
        let Some(Message::Tool { content, .. }) = second.messages.last() else {
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
        let Some(Message::Tool { content, .. }) = second.messages.last() else {
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
}
