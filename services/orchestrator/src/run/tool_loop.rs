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

use futures::future::join_all;
use futures::{FutureExt, StreamExt};
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use super::bios::{BiosContext, render};
use super::fallback::Resolution;
use super::loop_detector::{DetectorConfig, LoopDetector};
use super::turn::TurnCollector;
use super::{
    Delivery, Event, EventBatch, FailureReason, HARD_MAX_TURNS, NumberedEvent, ParsePolicy, RunResult, RunSpec,
    RunStatus, Signal, ToolCallError, ToolCallRecord, ToolExecutor, ToolInvocation,
};
use crate::llm::{ChatModel, ChatRequest, LlmError, Message, ToolCall, ToolDefinition};
use crate::signals::SignalTopic;
use crate::store::Persister;
use crate::telemetry::{InFlight, metric, reason_label, status_label};

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
///
/// Events the loop produces together (a turn's signals and tool-call starts, its tool-call
/// results and end) are [queued](Self::queue) and sent as one batch, which reaches the caller
/// in one HTTP/2 write instead of one write (and one wake-up of each side) per event. Every
/// [`send`](Self::send) first sends what is queued, and the loop [flushes](Self::flush) before
/// it waits for the model or the tools, so nothing queued waits on them.
pub struct Emitter {
    tx: Option<mpsc::Sender<EventBatch>>,
    seq: u64,
    /// Numbered, not yet sent.
    queued: EventBatch,
    state: SharedState,
}

impl Emitter {
    /// An emitter writing to `tx` (`None`: nobody listens, e.g. a detached run whose caller left).
    pub fn new(tx: Option<mpsc::Sender<EventBatch>>, state: SharedState) -> Self {
        Self {
            tx,
            seq: 0,
            queued: Vec::new(),
            state,
        }
    }

    /// Numbers `event` and queues it behind the events already queued.
    pub fn queue(&mut self, event: Event) {
        self.seq += 1;
        self.queued.push(NumberedEvent { seq: self.seq, event });
    }

    /// Sends what is queued, as one batch.
    pub async fn flush(&mut self) {
        if self.queued.is_empty() {
            return;
        }
        let batch = std::mem::take(&mut self.queued);
        if let Some(tx) = &self.tx
            && tx.send(batch).await.is_err()
        {
            self.tx = None;
        }
    }

    /// Sends one event (after what is queued).
    pub async fn send(&mut self, event: Event) {
        self.queue(event);
        self.flush().await;
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
    caller_gone: Option<mpsc::Sender<EventBatch>>,
    persister: Option<Persister>,
) -> RunResult {
    let started = Instant::now();
    let _in_flight = InFlight::new(metric::RUNS_IN_FLIGHT);
    let deadline = started + spec.limits.run_timeout;
    // Sent with the first model request.
    emitter.queue(Event::RunStarted {
        model: spec.model.clone(),
        normal_tools: spec.normal_tools.iter().map(|t| t.name.clone()).collect(),
        exit_tools: spec.exit_tools.iter().map(|t| t.name.clone()).collect(),
        limits: spec.limits,
    });
    let end = {
        let drive = drive(&spec, &deps, &state, &mut emitter, deadline, persister.clone());
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
    let (status, reason) = (status_label(result.status), reason_label(result.failure_reason));
    metrics::counter!(metric::RUNS, "status" => status, "reason" => reason).increment(1);
    metrics::histogram!(metric::RUN_DURATION, "status" => status).record(started.elapsed().as_secs_f64());
    let span = tracing::Span::current();
    span.record("orchestrator.run.status", status);
    span.record("orchestrator.run.turns", result.turns);
    span.record("orchestrator.run.failed_turns", result.failed_turns);
    span.record("orchestrator.run.signals", result.signals.len());
    span.record("gen_ai.usage.input_tokens", result.usage.prompt_tokens);
    span.record("gen_ai.usage.output_tokens", result.usage.completion_tokens);
    if result.status == RunStatus::Failed {
        span.record("orchestrator.run.failure_reason", reason);
        span.record("error.type", reason);
        span.record("otel.status_code", "ERROR");
        span.record("otel.status_description", result.failure_detail.as_str());
    }
    // The result is stored before the stream ends, so GetRun (on any replica) finds it.
    if let Some(persister) = &persister {
        persister.write().await;
    }
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

async fn drive(
    spec: &RunSpec,
    deps: &LoopDeps,
    state: &SharedState,
    emitter: &mut Emitter,
    deadline: Instant,
    persister: Option<Persister>,
) -> End {
    let mut driver = Driver {
        normal_names: spec.normal_tools.iter().map(|t| t.name.as_str()).collect(),
        exit_names: spec.exit_tools.iter().map(|t| t.name.as_str()).collect(),
        tools: spec.normal_tools.iter().chain(&spec.exit_tools).cloned().collect(),
        max_turns: spec.limits.max_turns.min(HARD_MAX_TURNS),
        conversation: Vec::new(),
        detector: LoopDetector::new(deps.detector),
        ids: IdAllocator::default(),
        used_budget: 0,
        failed_turns: 0,
        run_span: tracing::Span::current(),
        persister,
        spec,
        deps,
        state,
        emitter,
        deadline,
    };
    for turn in 1u32.. {
        if turn > driver.max_turns {
            return End::Failed(
                FailureReason::MaxTurnsExceeded,
                format!("the model still called tools after {} turn(s)", driver.max_turns),
            );
        }
        let span = tracing::info_span!(
            "chat",
            otel.name = %format!("chat {}", spec.model),
            otel.kind = "client",
            gen_ai.operation.name = "chat",
            gen_ai.provider.name = "openai",
            gen_ai.request.model = %spec.model,
            gen_ai.usage.input_tokens = tracing::field::Empty,
            gen_ai.usage.output_tokens = tracing::field::Empty,
            gen_ai.response.finish_reasons = tracing::field::Empty,
            gen_ai.response.time_to_first_token = tracing::field::Empty,
            orchestrator.turn = turn,
            error.type = tracing::field::Empty,
            otel.status_code = tracing::field::Empty,
        );
        let started = Instant::now();
        let end = driver.turn(turn).instrument(span).await;
        metrics::histogram!(metric::TURN_DURATION).record(started.elapsed().as_secs_f64());
        if let Some(end) = end {
            return end;
        }
        // Live runs are visible to GetRun on every replica, updated at turn boundaries.
        if let Some(persister) = &driver.persister {
            persister.checkpoint();
        }
    }
    End::Failed(FailureReason::UnknownError, "the turn counter overflowed".to_owned())
}

/// The state of the loop across turns.
struct Driver<'a> {
    spec: &'a RunSpec,
    deps: &'a LoopDeps,
    state: &'a SharedState,
    emitter: &'a mut Emitter,
    deadline: Instant,
    normal_names: HashSet<&'a str>,
    exit_names: HashSet<&'a str>,
    /// Normal and exit tools, as offered to the model.
    tools: Vec<ToolDefinition>,
    max_turns: u32,
    /// Assistant and tool messages of the turns so far (exit calls excluded).
    conversation: Vec<Message>,
    detector: LoopDetector,
    ids: IdAllocator,
    used_budget: u32,
    failed_turns: u32,
    /// The run's span (`invoke_agent`), for signal events.
    run_span: tracing::Span,
    /// Writes the run's state to the result store (checkpoints, late signal deliveries).
    persister: Option<Persister>,
}

impl Driver<'_> {
    /// One turn; `Some` when the run ends.
    async fn turn(&mut self, turn: u32) -> Option<End> {
        let (spec, deps, state, deadline) = (self.spec, self.deps, self.state, self.deadline);
        let (limits, max_turns) = (spec.limits, self.max_turns);
        let (normal_names, exit_names) = (&self.normal_names, &self.exit_names);
        let emitter = &mut *self.emitter;
        let run_span = self.run_span.clone();
        lock(state).turns = turn;
        let remaining = limits.tool_call_budget.saturating_sub(self.used_budget);
        let bios = render(&BiosContext {
            turn,
            max_turns,
            normal_tools: &spec.normal_tools,
            exit_tools: &spec.exit_tools,
            budget_remaining: remaining,
            failures_remaining: limits.max_tool_failures.saturating_sub(self.failed_turns),
        });
        let mut messages = Vec::with_capacity(2 + spec.messages.len() + self.conversation.len());
        messages.push(Message::System(bios));
        if !spec.system.is_empty() {
            messages.push(Message::System(spec.system.clone()));
        }
        messages.extend(spec.messages.iter().cloned());
        messages.extend(self.conversation.iter().cloned());
        let request = ChatRequest {
            model: spec.model.clone(),
            messages,
            tools: self.tools.clone(),
            params: spec.params.clone(),
        };

        // Stream the completion.
        emitter.flush().await;
        let requested = Instant::now();
        // Fused: the batching below may see the end before the loop does.
        let mut stream = match deps.model.stream(request).await {
            Ok(stream) => stream.fuse(),
            Err(e) => return Some(llm_failure(e)),
        };
        let mut collector = TurnCollector::default();
        let mut turn_text = String::new();
        let mut first_token = true;
        let mut pending_error = None;
        'stream: while let Some(item) = stream.next().await {
            // Take every event that is already here, and show their text as one delta: token by
            // token while the model is slower than the orchestrator, in batches when it is not.
            let mut batch = String::new();
            let mut next = Some(item);
            while let Some(item) = next.take() {
                match item {
                    Ok(event) => {
                        if first_token && is_token(&event) {
                            first_token = false;
                            let ttft = requested.elapsed().as_secs_f64();
                            tracing::Span::current().record("gen_ai.response.time_to_first_token", ttft);
                            metrics::histogram!(metric::TIME_TO_FIRST_TOKEN).record(ttft);
                        }
                        if let Some(text) = collector.push(event) {
                            batch.push_str(&text);
                        }
                    }
                    Err(e) => pending_error = Some(e),
                }
                if pending_error.is_none() {
                    next = stream.next().now_or_never().flatten();
                }
            }
            if let Some(end) = show(emitter, &mut self.detector, &mut turn_text, &batch, turn).await {
                return Some(end);
            }
            if pending_error.is_some() {
                break 'stream;
            }
        }
        if let Some(e) = pending_error {
            // Keep every byte: text held back for directive parsing is output too.
            let held = collector.held_text().to_owned();
            emitter.text(&held, turn).await;
            return Some(llm_failure(e));
        }
        drop(stream);
        let output = collector.finish();
        let chat_span = tracing::Span::current();
        chat_span.record("gen_ai.usage.input_tokens", output.usage.prompt_tokens);
        chat_span.record("gen_ai.usage.output_tokens", output.usage.completion_tokens);
        if let Some(reason) = &output.finish_reason {
            chat_span.record("gen_ai.response.finish_reasons", reason.as_str());
        }
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
                if let Some(end) = show(emitter, &mut self.detector, &mut turn_text, &text, turn).await {
                    return Some(end);
                }
                output
                    .structured
                    .into_iter()
                    .map(|c| ModelCall {
                        id: self.ids.take(c.id),
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
                    return Some(End::Failed(FailureReason::ToolParseError, detail));
                }
                if let Some(end) = show(emitter, &mut self.detector, &mut turn_text, &stripped, turn).await {
                    return Some(end);
                }
                calls
                    .into_iter()
                    .map(|c| ModelCall {
                        id: self.ids.take(None),
                        name: c.name,
                        arguments: c.arguments,
                    })
                    .collect()
            }
            Resolution::Malformed { detail, raw } => {
                emitter.text(&raw, turn).await;
                return Some(End::Failed(FailureReason::ToolParseError, detail));
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
                delivery: Delivery::Pending,
            };
            lock(state).signals.push(signal.clone());
            let on_delivery = {
                let (state, persister, call_id) = (Arc::clone(state), self.persister.clone(), signal.call_id.clone());
                Box::new(move |delivery: Delivery| {
                    let finished = {
                        let mut state = lock(&state);
                        if let Some(s) = state.signals.iter_mut().find(|s| s.call_id == call_id) {
                            s.delivery = delivery;
                        }
                        state.status != RunStatus::Running
                    };
                    // A finished run's stored result must learn the outcome; a live one is
                    // written at its next turn boundary or at its end.
                    if let Some(persister) = persister {
                        if finished {
                            persister.write_soon()
                        } else {
                            persister.checkpoint()
                        }
                    }
                })
            };
            deps.signals.publish(&signal, on_delivery);
            // The event carries the delivery as known now (the in-memory topic confirms at once).
            let signal = lock(state)
                .signals
                .iter()
                .find(|s| s.call_id == signal.call_id)
                .cloned()
                .unwrap_or(signal);
            metrics::counter!(metric::SIGNALS_PUBLISHED).increment(1);
            tracing::info!(
                parent: &run_span,
                gen_ai.tool.name = %signal.tool_name,
                gen_ai.tool.call.id = %signal.call_id,
                orchestrator.signal.arguments_valid = signal.arguments_valid,
                orchestrator.turn = turn,
                "signal"
            );
            emitter.queue(Event::Signal(signal));
        }

        let bad: Vec<usize> = (0..calls.len())
            .filter(|&i| matches!(dispositions[i], Disposition::Bad(_)))
            .collect();
        let first_bad = dispositions.iter().find_map(|d| match d {
            Disposition::Bad(error) => Some(error),
            _ => None,
        });
        if let (Some(error), ParsePolicy::Fail) = (first_bad, spec.parse_policy) {
            finish_turn(emitter, turn, output.usage, remaining, self.failed_turns);
            return Some(End::Failed(FailureReason::ToolParseError, error.message.clone()));
        }

        // Budget: execute the first `remaining` normal calls (model order).
        let normal: Vec<usize> = (0..calls.len())
            .filter(|&i| matches!(dispositions[i], Disposition::Normal))
            .collect();
        let exhausted = normal.len() > remaining as usize;
        let executed: Vec<usize> = normal.iter().copied().take(remaining as usize).collect();
        self.used_budget += executed.len() as u32;
        let budget_left = limits.tool_call_budget.saturating_sub(self.used_budget);

        if executed.is_empty() && bad.is_empty() {
            finish_turn(emitter, turn, output.usage, budget_left, self.failed_turns);
            if exhausted {
                return Some(End::Failed(
                    FailureReason::ToolBudgetExhausted,
                    budget_detail(limits.tool_call_budget, normal.len()),
                ));
            }
            return Some(End::Completed);
        }

        // Dispatch concurrently.
        for &i in executed.iter().chain(&bad) {
            let call = &calls[i];
            emitter.queue(Event::ToolCallStarted {
                call_id: call.id.clone(),
                name: call.name.clone(),
                arguments_json: call.arguments.clone(),
                turn,
            });
        }
        emitter.flush().await;
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
            let span = tracing::info_span!(
                "execute_tool",
                otel.name = %format!("execute_tool {}", call.name),
                otel.kind = "client",
                gen_ai.operation.name = "execute_tool",
                gen_ai.tool.name = %call.name,
                gen_ai.tool.call.id = %call.id,
                gen_ai.tool.type = "function",
                gen_ai.tool.call.arguments = tracing::field::Empty,
                gen_ai.tool.call.result = tracing::field::Empty,
                error.type = tracing::field::Empty,
                otel.status_code = tracing::field::Empty,
            );
            if let Some(max) = deps.trace_payloads {
                span.record(
                    "gen_ai.tool.call.arguments",
                    crate::telemetry::truncate(&call.arguments, max),
                );
            }
            let tool = call.name.clone();
            let future = span.in_scope(|| deps.tools.execute(invocation));
            let trace_payloads = deps.trace_payloads;
            async move {
                let _in_flight = InFlight::new(metric::TOOL_CALLS_IN_FLIGHT);
                let started = Instant::now();
                let result = match tokio::time::timeout(tool_timeout, future).await {
                    Ok(result) => result,
                    Err(_) => Err(ToolCallError::new(
                        "TIMEOUT",
                        format!("no result within {}", humantime::format_duration(tool_timeout)),
                    )),
                };
                let elapsed = started.elapsed();
                let span = tracing::Span::current();
                let outcome = match &result {
                    Ok(content) => {
                        if let Some(max) = trace_payloads {
                            span.record("gen_ai.tool.call.result", crate::telemetry::truncate(content, max));
                        }
                        "ok".to_owned()
                    }
                    Err(error) => {
                        span.record("error.type", error.code.as_str());
                        span.record("otel.status_code", "ERROR");
                        error.code.clone()
                    }
                };
                metrics::counter!(metric::TOOL_CALLS, "tool" => tool.clone(), "outcome" => outcome).increment(1);
                metrics::histogram!(metric::TOOL_CALL_DURATION, "tool" => tool).record(elapsed.as_secs_f64());
                (i, result, elapsed)
            }
            .instrument(span)
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
            emitter.queue(Event::ToolCallFinished {
                call_id: call.id.clone(),
                name: call.name.clone(),
                content_json: result.as_ref().ok().cloned(),
                error: result.err(),
                duration_ms,
            });
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
            self.failed_turns += 1;
            lock(state).failed_turns = self.failed_turns;
        }
        self.conversation.push(Message::Assistant {
            content: std::mem::take(&mut turn_text),
            tool_calls: assistant_calls,
        });
        self.conversation.extend(tool_messages);
        finish_turn(emitter, turn, output.usage, budget_left, self.failed_turns);

        if self.failed_turns > limits.max_tool_failures {
            return Some(End::Failed(
                FailureReason::ToolFailureLimit,
                format!(
                    "{} turn(s) had failing tool calls; at most {} are tolerated",
                    self.failed_turns, limits.max_tool_failures
                ),
            ));
        }
        if exhausted {
            return Some(End::Failed(
                FailureReason::ToolBudgetExhausted,
                budget_detail(limits.tool_call_budget, normal.len()),
            ));
        }
        None
    }
}

fn budget_detail(budget: u32, asked: usize) -> String {
    format!("the tool-call budget of {budget} ran out (the last turn asked for {asked} call(s))")
}

/// Shows visible text and feeds the loop detector; `Some` when the detector trips (the text is
/// then shown up to the end of the repeated line).
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
    let tripped = detector.feed(text);
    let shown = tripped.as_ref().map_or(text, |(_, end)| &text[..*end]);
    emitter.text(shown, turn).await;
    turn_text.push_str(shown);
    tripped.map(|(line, _)| {
        End::Failed(
            FailureReason::RepeatedLineLoop,
            format!(
                "the model repeated the line {:?} too often",
                crate::llm::sse::excerpt(&line)
            ),
        )
    })
}

/// Queues the turn's end (sent with the next model request, or with the run's end).
fn finish_turn(emitter: &mut Emitter, turn: u32, usage: crate::llm::Usage, remaining: u32, failed_turns: u32) {
    emitter.queue(Event::TurnFinished {
        turn,
        usage,
        tool_call_budget_remaining: remaining,
        failed_turns,
    });
}

/// Whether an event carries generated output (for time to first token).
fn is_token(event: &crate::llm::LlmEvent) -> bool {
    use crate::llm::LlmEvent as E;
    matches!(
        event,
        E::TextDelta(_) | E::ReasoningDelta(_) | E::ToolCallFragment { .. }
    )
}

fn llm_failure(e: LlmError) -> End {
    let span = tracing::Span::current();
    span.record(
        "error.type",
        if matches!(e, LlmError::Stalled(_)) {
            "llm_stream_stalled"
        } else {
            "llm_error"
        },
    );
    span.record("otel.status_code", "ERROR");
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

#[cfg(test)]
mod tests {
    //! The loop without a network: a scripted model and an in-process tool executor.

    use std::collections::VecDeque;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use futures::FutureExt;
    use futures::future::BoxFuture;
    use futures::stream::BoxStream;

    use super::*;
    use crate::llm::{LlmEvent, Usage};
    use crate::run::{Limits, RunSpec};
    use crate::signals::memory::MemoryTopic;

    /// Plays one list of events per turn and records the requests.
    struct Script {
        turns: Mutex<VecDeque<Vec<Result<LlmEvent, LlmError>>>>,
        requests: Mutex<Vec<ChatRequest>>,
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
            futures::future::ready(Ok(futures::stream::iter(turn).boxed())).boxed()
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
                    return Err(ToolCallError::new("FAILED", "bad tool"));
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
        }
    }

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
        let script = Arc::new(Script {
            turns: Mutex::new(turns.into()),
            requests: Mutex::default(),
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
        };
        let state: SharedState = Arc::new(Mutex::new(RunResult::running("r")));
        let (tx, mut rx) = mpsc::channel(1024);
        let emitter = Emitter::new(Some(tx), Arc::clone(&state));
        let result = run(spec(limits), deps, state, emitter, Cancel::default(), None, None).await;
        let mut batches = Vec::new();
        while let Ok(batch) = rx.try_recv() {
            batches.push(batch);
        }
        (result, batches, script, tools)
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
        let second = &script.requests.lock().unwrap()[1];
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
}
