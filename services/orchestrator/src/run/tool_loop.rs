//! The tool loop of one run (DESIGN §4.1).
//!
//! Each turn: regenerate the BIOS, stream a completion, forward visible text (through the
//! fallback hold-back and the repeated-line detector), take the tool calls (structured, else
//! fallback directives), partition them into normal / exit / bad, publish exit calls as signals,
//! execute the normal ones concurrently (`join_all`) within the budget, feed results and errors
//! back, count a turn with any failure once, and go again — until the model stops calling normal
//! tools or a limit ends the run. Cancellation, the client going away and the run deadline end
//! the run at once; whatever was produced before is kept.

use std::collections::HashSet;
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use futures::StreamExt;
use futures::future::join_all;
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::bios::{BiosContext, render};
use super::fallback::Resolution;
use super::loop_detector::{DetectorConfig, LoopDetector};
use super::turn::TurnCollector;
use super::{
    Event, FailureReason, HARD_MAX_TURNS, NumberedEvent, ParsePolicy, RunResult, RunSpec, RunStatus, Signal,
    ToolCallError, ToolCallRecord, ToolExecutor, ToolInvocation,
};
use crate::llm::{ChatModel, ChatRequest, LlmError, Message, ToolCall, ToolDefinition};
use crate::signals::SignalTopic;

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
}

/// Cancels a run, saying why.
#[derive(Clone, Debug, Default)]
pub struct Cancel {
    token: CancellationToken,
    reason: Arc<OnceLock<String>>,
}

impl Cancel {
    /// Cancels the run (the first reason given wins).
    pub fn cancel(&self, reason: &str) {
        let _ = self.reason.set(reason.to_owned());
        self.token.cancel();
    }

    /// Whether the run was canceled.
    pub fn is_canceled(&self) -> bool {
        self.token.is_cancelled()
    }

    async fn cancelled(&self) -> String {
        self.token.cancelled().await;
        self.reason.get().cloned().unwrap_or_else(|| "canceled".to_owned())
    }
}

/// The live state of a run, shared with `GetRun`.
pub type SharedState = Arc<Mutex<RunResult>>;

fn lock(state: &SharedState) -> std::sync::MutexGuard<'_, RunResult> {
    // A panic while holding the lock cannot leave a RunResult half-written in a harmful way.
    state.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Numbers events and sends them to the caller's stream (a bounded channel: a slow reader slows
/// its own run). Text is added to the run's state only once its event is sent, so the streamed
/// text always equals the result's text.
pub struct Emitter {
    tx: Option<mpsc::Sender<NumberedEvent>>,
    seq: u64,
    state: SharedState,
}

impl Emitter {
    /// An emitter writing to `tx` (`None`: nobody listens, e.g. a detached run whose caller left).
    pub fn new(tx: Option<mpsc::Sender<NumberedEvent>>, state: SharedState) -> Self {
        Self { tx, seq: 0, state }
    }

    /// Sends one event.
    pub async fn send(&mut self, event: Event) {
        let seq = self.seq + 1;
        if let Some(tx) = &self.tx
            && tx.send(NumberedEvent { seq, event }).await.is_err()
        {
            self.tx = None;
        }
        self.seq = seq;
    }

    async fn text(&mut self, text: &str, turn: u32) {
        if text.is_empty() {
            return;
        }
        self.send(Event::TextDelta {
            text: text.to_owned(),
            turn,
        })
        .await;
        lock(&self.state).text.push_str(text);
    }
}

/// How the loop ended.
enum End {
    Completed,
    Failed(FailureReason, String),
    Canceled(String),
}

/// Runs the loop to its end. `store` receives the final result before the `run_finished` event is
/// sent, so `GetRun` answers as soon as the stream ends.
pub async fn run(
    spec: RunSpec,
    deps: LoopDeps,
    state: SharedState,
    mut emitter: Emitter,
    cancel: Cancel,
    caller_gone: Option<mpsc::Sender<NumberedEvent>>,
    store: impl FnOnce(&RunResult) + Send,
) -> RunResult {
    let deadline = Instant::now() + spec.limits.run_timeout;
    emitter
        .send(Event::RunStarted {
            model: spec.model.clone(),
            normal_tools: spec.normal_tools.iter().map(|t| t.name.clone()).collect(),
            exit_tools: spec.exit_tools.iter().map(|t| t.name.clone()).collect(),
            limits: spec.limits,
        })
        .await;
    let end = {
        let drive = drive(&spec, &deps, &state, &mut emitter, deadline);
        let gone = async {
            match &caller_gone {
                Some(tx) => tx.closed().await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            end = drive => end,
            reason = cancel.cancelled() => End::Canceled(reason),
            () = tokio::time::sleep_until(deadline) => End::Failed(
                FailureReason::DeadlineExceeded,
                format!("the run did not finish within {}", humantime::format_duration(spec.limits.run_timeout)),
            ),
            () = gone => End::Canceled("the caller went away".to_owned()),
        }
    };
    let result = {
        let mut state = lock(&state);
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
    };
    tracing::info!(
        status = ?result.status,
        reason = ?result.failure_reason,
        turns = result.turns,
        tool_calls = result.tool_calls.len(),
        signals = result.signals.len(),
        "run finished{}",
        if result.failure_detail.is_empty() { String::new() } else { format!(": {}", result.failure_detail) }
    );
    store(&result);
    emitter.send(Event::RunFinished(result.clone())).await;
    result
}

/// A call the model made this turn, with its final id.
struct ModelCall {
    id: String,
    name: String,
    arguments: String,
}

/// Where a call of this turn goes.
enum Disposition {
    Normal,
    Exit,
    Bad(ToolCallError),
}

async fn drive(spec: &RunSpec, deps: &LoopDeps, state: &SharedState, emitter: &mut Emitter, deadline: Instant) -> End {
    let normal_names: HashSet<&str> = spec.normal_tools.iter().map(|t| t.name.as_str()).collect();
    let exit_names: HashSet<&str> = spec.exit_tools.iter().map(|t| t.name.as_str()).collect();
    let tools: Vec<ToolDefinition> = spec.normal_tools.iter().chain(&spec.exit_tools).cloned().collect();
    let limits = spec.limits;
    let max_turns = limits.max_turns.min(HARD_MAX_TURNS);
    let mut conversation: Vec<Message> = Vec::new();
    let mut detector = LoopDetector::new(deps.detector);
    let mut ids = IdAllocator::default();
    let mut used_budget = 0u32;
    let mut failed_turns = 0u32;

    for turn in 1u32.. {
        if turn > max_turns {
            return End::Failed(
                FailureReason::MaxTurnsExceeded,
                format!("the model still called tools after {max_turns} turn(s)"),
            );
        }
        lock(state).turns = turn;
        let remaining = limits.tool_call_budget.saturating_sub(used_budget);
        let bios = render(&BiosContext {
            turn,
            max_turns,
            normal_tools: &spec.normal_tools,
            exit_tools: &spec.exit_tools,
            budget_remaining: remaining,
            failures_remaining: limits.max_tool_failures.saturating_sub(failed_turns),
        });
        let mut messages = Vec::with_capacity(2 + spec.messages.len() + conversation.len());
        messages.push(Message::System(bios));
        if !spec.system.is_empty() {
            messages.push(Message::System(spec.system.clone()));
        }
        messages.extend(spec.messages.iter().cloned());
        messages.extend(conversation.iter().cloned());
        let request = ChatRequest {
            model: spec.model.clone(),
            messages,
            tools: tools.clone(),
            params: spec.params.clone(),
        };

        // Stream the completion.
        let mut stream = match deps.model.stream(request).await {
            Ok(stream) => stream,
            Err(e) => return llm_failure(e),
        };
        let mut collector = TurnCollector::default();
        let mut turn_text = String::new();
        while let Some(item) = stream.next().await {
            match item {
                Ok(event) => {
                    if let Some(text) = collector.push(event)
                        && let Some(end) = show(emitter, &mut detector, &mut turn_text, &text, turn).await
                    {
                        return end;
                    }
                }
                Err(e) => {
                    // Keep every byte: text held back for directive parsing is output too.
                    let held = collector.held_text().to_owned();
                    emitter.text(&held, turn).await;
                    return llm_failure(e);
                }
            }
        }
        drop(stream);
        let output = collector.finish();
        {
            let mut state = lock(state);
            state.usage.prompt_tokens += output.usage.prompt_tokens;
            state.usage.completion_tokens += output.usage.completion_tokens;
            if let Some(reason) = &output.finish_reason {
                state.finish_reason.clone_from(reason);
            }
        }

        // Take the calls: structured first, else directives written in the text.
        let calls: Vec<ModelCall> = match output.resolution {
            Resolution::Text(text) => {
                if let Some(end) = show(emitter, &mut detector, &mut turn_text, &text, turn).await {
                    return end;
                }
                output
                    .structured
                    .into_iter()
                    .map(|c| ModelCall {
                        id: ids.take(c.id),
                        name: c.name,
                        arguments: c.arguments,
                    })
                    .collect()
            }
            Resolution::Calls { calls, stripped, raw } => {
                if let Some(unknown) = calls
                    .iter()
                    .find(|c| !normal_names.contains(c.name.as_str()) && !exit_names.contains(c.name.as_str()))
                {
                    let detail = format!("the text calls an unknown tool {:?}", unknown.name);
                    emitter.text(&raw, turn).await;
                    return End::Failed(FailureReason::ToolParseError, detail);
                }
                if let Some(end) = show(emitter, &mut detector, &mut turn_text, &stripped, turn).await {
                    return end;
                }
                calls
                    .into_iter()
                    .map(|c| ModelCall {
                        id: ids.take(None),
                        name: c.name,
                        arguments: c.arguments,
                    })
                    .collect()
            }
            Resolution::Malformed { detail, raw } => {
                emitter.text(&raw, turn).await;
                return End::Failed(FailureReason::ToolParseError, detail);
            }
        };

        // Partition.
        let dispositions: Vec<Disposition> = calls
            .iter()
            .map(|call| {
                if exit_names.contains(call.name.as_str()) {
                    Disposition::Exit
                } else if !normal_names.contains(call.name.as_str()) {
                    Disposition::Bad(ToolCallError::new(
                        "NOT_FOUND",
                        format!("there is no tool named {:?} in this run", call.name),
                    ))
                } else if !is_json_object(&call.arguments) {
                    Disposition::Bad(ToolCallError::new(
                        "INVALID_ARGUMENTS",
                        format!(
                            "the arguments of {} are not a JSON object: {}",
                            call.name,
                            crate::llm::sse::excerpt(&call.arguments)
                        ),
                    ))
                } else {
                    Disposition::Normal
                }
            })
            .collect();

        // Exit calls become signals at once; they cost nothing and are not fed back.
        for (call, _) in calls
            .iter()
            .zip(&dispositions)
            .filter(|(_, d)| matches!(d, Disposition::Exit))
        {
            let signal = Signal {
                run_id: spec.run_id.clone(),
                call_id: call.id.clone(),
                tool_name: call.name.clone(),
                arguments_valid: is_json_object(&call.arguments),
                arguments_json: call.arguments.clone(),
                turn,
                emitted_at_unix_ms: unix_ms(),
                metadata: spec.metadata.clone(),
            };
            lock(state).signals.push(signal.clone());
            deps.signals.publish(&signal);
            emitter.send(Event::Signal(signal)).await;
        }

        let bad: Vec<usize> = (0..calls.len())
            .filter(|&i| matches!(dispositions[i], Disposition::Bad(_)))
            .collect();
        let first_bad = dispositions.iter().find_map(|d| match d {
            Disposition::Bad(error) => Some(error),
            _ => None,
        });
        if let (Some(error), ParsePolicy::Fail) = (first_bad, spec.parse_policy) {
            finish_turn(emitter, turn, output.usage, remaining, failed_turns).await;
            return End::Failed(FailureReason::ToolParseError, error.message.clone());
        }

        // Budget: execute the first `remaining` normal calls (model order).
        let normal: Vec<usize> = (0..calls.len())
            .filter(|&i| matches!(dispositions[i], Disposition::Normal))
            .collect();
        let exhausted = normal.len() > remaining as usize;
        let executed: Vec<usize> = normal.iter().copied().take(remaining as usize).collect();
        used_budget += executed.len() as u32;

        if executed.is_empty() && bad.is_empty() {
            finish_turn(
                emitter,
                turn,
                output.usage,
                limits.tool_call_budget.saturating_sub(used_budget),
                failed_turns,
            )
            .await;
            if exhausted {
                return End::Failed(
                    FailureReason::ToolBudgetExhausted,
                    budget_detail(limits.tool_call_budget, normal.len()),
                );
            }
            return End::Completed;
        }

        // Dispatch concurrently.
        for &i in executed.iter().chain(&bad) {
            let call = &calls[i];
            emitter
                .send(Event::ToolCallStarted {
                    call_id: call.id.clone(),
                    name: call.name.clone(),
                    arguments_json: call.arguments.clone(),
                    turn,
                })
                .await;
        }
        let tool_timeout = limits
            .tool_timeout
            .min(deadline.saturating_duration_since(Instant::now()));
        let outcomes = join_all(executed.iter().map(|&i| {
            let call = &calls[i];
            let invocation = ToolInvocation {
                run_id: spec.run_id.clone(),
                call_id: call.id.clone(),
                name: call.name.clone(),
                arguments_json: call.arguments.clone(),
                metadata: spec.metadata.clone(),
                timeout: tool_timeout,
            };
            let future = deps.tools.execute(invocation);
            async move {
                let started = Instant::now();
                let result = match tokio::time::timeout(tool_timeout, future).await {
                    Ok(result) => result,
                    Err(_) => Err(ToolCallError::new(
                        "TIMEOUT",
                        format!("no result within {}", humantime::format_duration(tool_timeout)),
                    )),
                };
                (i, result, started.elapsed())
            }
        }))
        .await;

        // Record, report and feed back, in the model's order.
        let mut results: Vec<(usize, Result<String, ToolCallError>, Duration)> = outcomes;
        for &i in &bad {
            if let Disposition::Bad(error) = &dispositions[i] {
                results.push((i, Err(error.clone()), Duration::ZERO));
            }
        }
        results.sort_by_key(|(i, _, _)| *i);
        let any_failed = results.iter().any(|(_, r, _)| r.is_err());
        let mut assistant_calls = Vec::with_capacity(results.len());
        let mut tool_messages = Vec::with_capacity(results.len());
        for (i, result, elapsed) in results {
            let call = &calls[i];
            let duration_ms = u64::try_from(elapsed.as_millis()).unwrap_or(u64::MAX);
            lock(state).tool_calls.push(ToolCallRecord {
                call_id: call.id.clone(),
                name: call.name.clone(),
                arguments_json: call.arguments.clone(),
                ok: result.is_ok(),
                error: result.as_ref().err().cloned(),
                duration_ms,
                turn,
            });
            let content = match &result {
                Ok(json) => json.clone(),
                Err(error) => error.to_tool_message(),
            };
            emitter
                .send(Event::ToolCallFinished {
                    call_id: call.id.clone(),
                    name: call.name.clone(),
                    content_json: result.as_ref().ok().cloned(),
                    error: result.err(),
                    duration_ms,
                })
                .await;
            assistant_calls.push(ToolCall {
                id: call.id.clone(),
                name: call.name.clone(),
                arguments: call.arguments.clone(),
            });
            tool_messages.push(Message::Tool {
                tool_call_id: call.id.clone(),
                content,
            });
        }

        // Failures count once per turn, however many calls failed.
        if any_failed {
            failed_turns += 1;
            lock(state).failed_turns = failed_turns;
        }
        conversation.push(Message::Assistant {
            content: std::mem::take(&mut turn_text),
            tool_calls: assistant_calls,
        });
        conversation.extend(tool_messages);
        finish_turn(
            emitter,
            turn,
            output.usage,
            limits.tool_call_budget.saturating_sub(used_budget),
            failed_turns,
        )
        .await;

        if failed_turns > limits.max_tool_failures {
            return End::Failed(
                FailureReason::ToolFailureLimit,
                format!(
                    "{failed_turns} turn(s) had failing tool calls; at most {} are tolerated",
                    limits.max_tool_failures
                ),
            );
        }
        if exhausted {
            return End::Failed(
                FailureReason::ToolBudgetExhausted,
                budget_detail(limits.tool_call_budget, normal.len()),
            );
        }
    }
    End::Failed(FailureReason::UnknownError, "the turn counter overflowed".to_owned())
}

fn budget_detail(budget: u32, asked: usize) -> String {
    format!("the tool-call budget of {budget} ran out (the last turn asked for {asked} call(s))")
}

/// Shows visible text and feeds the loop detector; `Some` when the detector trips.
async fn show(
    emitter: &mut Emitter,
    detector: &mut LoopDetector,
    turn_text: &mut String,
    text: &str,
    turn: u32,
) -> Option<End> {
    if text.is_empty() {
        return None;
    }
    emitter.text(text, turn).await;
    turn_text.push_str(text);
    detector.feed(text).map(|line| {
        End::Failed(
            FailureReason::RepeatedLineLoop,
            format!(
                "the model repeated the line {:?} too often",
                crate::llm::sse::excerpt(&line)
            ),
        )
    })
}

async fn finish_turn(emitter: &mut Emitter, turn: u32, usage: crate::llm::Usage, remaining: u32, failed_turns: u32) {
    emitter
        .send(Event::TurnFinished {
            turn,
            usage,
            tool_call_budget_remaining: remaining,
            failed_turns,
        })
        .await;
}

fn llm_failure(e: LlmError) -> End {
    match e {
        LlmError::Stalled(_) => End::Failed(FailureReason::LlmStreamStalled, e.to_string()),
        _ => End::Failed(FailureReason::LlmError, e.to_string()),
    }
}

fn is_json_object(text: &str) -> bool {
    serde_json::from_str::<serde_json::Value>(text).is_ok_and(|v| v.is_object())
}

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
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
