//! What the orchestrator reports: span names and attributes (OpenTelemetry GenAI semantic
//! conventions) and Prometheus metrics. Spans: `invoke_agent` for a run, `chat {model}` for each
//! turn, `execute_tool {name}` (kind client) for each tool call, and a `signal` event on the run
//! span for each exit call.

use std::time::Duration;

use tracing::Span;
use tracing::field::Empty;

pub(crate) use shared::metrics::InFlight;
use shared::telemetry::truncate;

use crate::domain::approval::ApprovalDecision;
use crate::domain::{FailureReason, RunResult, RunStatus, ToolCallError};

/// Metric names (Prometheus conventions: base units, `_total` counters, `_seconds` durations).
pub(crate) mod metric {
    /// Counter: finished runs, by `status` and `reason`.
    pub(crate) const RUNS: &str = "orchestrator_runs_total";
    /// Histogram: run wall time, by `status`.
    pub(crate) const RUN_DURATION: &str = "orchestrator_run_duration_seconds";
    /// Gauge: runs in flight.
    pub(crate) const RUNS_IN_FLIGHT: &str = "orchestrator_runs_in_flight";
    /// Counter: tokens of runs that ended, by `principal` and `kind` (`prompt`, `cached`,
    /// `completion`).
    pub(crate) const PRINCIPAL_TOKENS: &str = "orchestrator_principal_tokens_total";
    /// Gauge: runs waiting for a run slot on this replica.
    pub(crate) const RUNS_QUEUED: &str = "orchestrator_runs_queued";
    /// Histogram: turn wall time (completion plus tool calls).
    pub(crate) const TURN_DURATION: &str = "orchestrator_turn_duration_seconds";
    /// Histogram: time from sending a completion request to its first token.
    pub(crate) const TIME_TO_FIRST_TOKEN: &str = "orchestrator_time_to_first_token_seconds";
    /// Counter: tool calls, by `tool` and `outcome` (`ok` or the error code).
    pub(crate) const TOOL_CALLS: &str = "orchestrator_tool_calls_total";
    /// Histogram: tool call wall time, by `tool`.
    pub(crate) const TOOL_CALL_DURATION: &str = "orchestrator_tool_call_duration_seconds";
    /// Gauge: tool calls in flight.
    pub(crate) const TOOL_CALLS_IN_FLIGHT: &str = "orchestrator_tool_calls_in_flight";
    /// Counter: signals published.
    pub(crate) const SIGNALS_PUBLISHED: &str = "orchestrator_signals_published_total";
    /// Counter: signals that could not be delivered to the topic.
    pub(crate) const SIGNALS_FAILED: &str = "orchestrator_signals_failed_total";
    /// Counter: LLM requests retried before the first byte, by `reason`.
    pub(crate) const LLM_RETRIES: &str = "orchestrator_llm_retries_total";
    /// Counter: completions by model `endpoint` and `outcome` (`ok`, or how it failed).
    pub(crate) const LLM_REQUESTS: &str = "orchestrator_llm_requests_total";
    /// Gauge: completions in flight, by model `endpoint`.
    pub(crate) const LLM_IN_FLIGHT: &str = "orchestrator_llm_in_flight";
    /// Counter: model endpoints ejected after failures in a row, by `endpoint`.
    pub(crate) const LLM_EJECTIONS: &str = "orchestrator_llm_ejections_total";
    /// Counter: prompt tokens, by model `endpoint`.
    pub(crate) const LLM_PROMPT_TOKENS: &str = "orchestrator_llm_prompt_tokens_total";
    /// Counter: prompt tokens the model server had cached, by `endpoint`.
    pub(crate) const LLM_CACHED_PROMPT_TOKENS: &str = "orchestrator_llm_cached_prompt_tokens_total";
    /// Counter: turns started again, by `why` (`model_endpoint`: an endpoint cut the stream).
    pub(crate) const TURNS_RESTARTED: &str = "orchestrator_turns_restarted_total";
    /// Gauge: model endpoints in the fleet.
    pub(crate) const LLM_ENDPOINTS: &str = "orchestrator_llm_endpoints";
    /// Counter: tool calls retried because no runner ran them, by `reason`.
    pub(crate) const TOOL_CALL_RETRIES: &str = "orchestrator_tool_call_retries_total";
    /// Counter: tool calls a runner refused as a replaced owner's (the run is in a newer epoch):
    /// each stopped this replica acting for its run.
    pub(crate) const TOOL_CALLS_SUPERSEDED: &str = "orchestrator_tool_calls_superseded_total";
    /// Gauge: tool-runner endpoints calls are balanced over.
    pub(crate) const TOOL_RUNNER_ENDPOINTS: &str = "orchestrator_tool_runner_endpoints";
    /// Counter: callers whose event stream was dropped because they stopped reading.
    pub(crate) const CALLER_STALLS: &str = "orchestrator_caller_stalls_total";
    /// Counter: tool results cut before they were fed back to the model.
    pub(crate) const TOOL_RESULTS_CUT: &str = "orchestrator_tool_results_cut_total";
    /// Gauge: finished results waiting for the store to take them.
    pub(crate) const STORE_BACKLOG: &str = "orchestrator_store_backlog";
    /// Counter: finished results dropped from a full store backlog (never stored).
    pub(crate) const STORE_BACKLOG_DROPPED: &str = "orchestrator_store_backlog_dropped_total";
    /// Counter: event batches a run's event log did not keep (its backend was unavailable or
    /// slower than the run); a re-attaching caller sees the gap as an error.
    pub(crate) const EVENT_LOG_DROPPED: &str = "orchestrator_event_log_dropped_total";
    /// Counter: callers re-attached to a run (`AttachRun`).
    pub(crate) const ATTACHES: &str = "orchestrator_attaches_total";
    /// Counter: checkpoints of live runs saved (NATS store).
    pub(crate) const CHECKPOINTS: &str = "orchestrator_checkpoints_total";
    /// Histogram: bytes of one checkpoint.
    pub(crate) const CHECKPOINT_BYTES: &str = "orchestrator_checkpoint_bytes";
    /// Counter: runs moved between replicas, by `how` (`taken_over`: resumed here after their
    /// replica stopped; `handed_over`: released here at a drain; `fenced`, `expired`, `unsaved`:
    /// this replica stopped acting for them, see `domain::Stop`).
    pub(crate) const RUNS_MOVED: &str = "orchestrator_runs_moved_total";
    /// Requests refused for their credentials, by code.
    pub(crate) const AUTH_REFUSED: &str = "orchestrator_auth_refused_total";
    /// Counter: tool calls that waited for a person's approval.
    pub(crate) const APPROVALS_REQUESTED: &str = "orchestrator_approvals_requested_total";
    /// Counter: tool calls that asked a person questions (each round counts).
    pub(crate) const INPUT_REQUESTED: &str = "orchestrator_tool_input_requested_total";
    /// Counter: approval decisions acted on, by `outcome` (approved, edited, rejected, timed_out,
    /// answered).
    pub(crate) const APPROVAL_DECISIONS: &str = "orchestrator_approval_decisions_total";
    /// Gauge: runs parked waiting for approvals (they hold no run slot).
    pub(crate) const RUNS_AWAITING_APPROVAL: &str = "orchestrator_runs_awaiting_approval";
    /// Counter: console sign-ins by `outcome` (ok, refused, limited).
    pub(crate) const CONSOLE_SIGN_INS: &str = "orchestrator_console_sign_ins_total";
    /// Counter: webhook delivery attempts and drops by `outcome` (delivered, pending: failed and
    /// to be retried, failed: given up, dropped, canceled).
    pub(crate) const WEBHOOK_DELIVERIES: &str = "orchestrator_webhook_deliveries_total";
}

/// Registers every metric with its help text (and zero values), so `/metrics` lists them all.
pub(crate) fn describe() {
    describe_runs();
    describe_model();
    describe_tools();
    describe_durability();
    start_at_zero();
}

/// Runs, callers and turns.
fn describe_runs() {
    use metrics::{Unit, describe_counter, describe_gauge, describe_histogram};
    describe_counter!(
        metric::RUNS,
        "Finished runs by status, failure reason and principal (empty without authentication)."
    );
    describe_counter!(
        metric::AUTH_REFUSED,
        "Requests refused for their credentials, by code (unauthenticated, permission_denied)."
    );
    describe_histogram!(metric::RUN_DURATION, Unit::Seconds, "Run wall time by status.");
    describe_gauge!(metric::RUNS_IN_FLIGHT, "Runs in flight.");
    describe_histogram!(
        metric::TURN_DURATION,
        Unit::Seconds,
        "Turn wall time: the completion and its tool calls."
    );
}

/// The model fleet and its completions.
fn describe_model() {
    use metrics::{Unit, describe_counter, describe_gauge, describe_histogram};
    describe_histogram!(
        metric::TIME_TO_FIRST_TOKEN,
        Unit::Seconds,
        "Time from a completion request to its first token."
    );
    describe_counter!(
        metric::LLM_RETRIES,
        "LLM requests retried before the first byte, by reason."
    );
    describe_counter!(
        metric::LLM_REQUESTS,
        "Completions by model endpoint and outcome (ok, connect, server_error, rate_limited, no_response, no_event, cut)."
    );
    describe_gauge!(metric::LLM_IN_FLIGHT, "Completions in flight, by model endpoint.");
    describe_counter!(
        metric::LLM_EJECTIONS,
        "Model endpoints ejected after failures in a row, by endpoint."
    );
    describe_counter!(metric::LLM_PROMPT_TOKENS, "Prompt tokens, by model endpoint.");
    describe_counter!(
        metric::LLM_CACHED_PROMPT_TOKENS,
        "Prompt tokens the model server took from its prefix cache, by endpoint."
    );
    describe_gauge!(metric::LLM_ENDPOINTS, "Model endpoints in the fleet.");
    describe_counter!(
        metric::TURNS_RESTARTED,
        "Turns started again on another model endpoint after one cut the stream."
    );
}

/// Tool calls, tool-runners and signals.
fn describe_tools() {
    use metrics::{Unit, describe_counter, describe_gauge, describe_histogram};
    describe_counter!(
        metric::TOOL_CALLS,
        "Tool calls by tool and outcome (ok or the error code)."
    );
    describe_histogram!(
        metric::TOOL_CALL_DURATION,
        Unit::Seconds,
        "Tool call wall time by tool."
    );
    describe_gauge!(metric::TOOL_CALLS_IN_FLIGHT, "Tool calls in flight.");
    describe_counter!(metric::SIGNALS_PUBLISHED, "Signals (exit-tool calls) published.");
    describe_counter!(metric::SIGNALS_FAILED, "Signals that could not be delivered.");
    describe_counter!(
        metric::TOOL_CALL_RETRIES,
        "Tool calls retried because no runner ran them, by reason."
    );
    describe_counter!(
        metric::TOOL_CALLS_SUPERSEDED,
        "Tool calls a runner refused as a replaced owner's; each stopped this replica acting for the run."
    );
    describe_gauge!(
        metric::TOOL_RUNNER_ENDPOINTS,
        "Tool-runner endpoints calls are balanced over."
    );
    describe_counter!(
        metric::CALLER_STALLS,
        "Callers whose event stream was dropped because they stopped reading it."
    );
    describe_counter!(
        metric::TOOL_RESULTS_CUT,
        "Tool results and tool error messages cut to --max-tool-result-bytes before they were fed back to the model."
    );
}

/// The result store, event logs, checkpoints, approvals and runs moving between replicas.
fn describe_durability() {
    use metrics::{describe_counter, describe_gauge};
    describe_gauge!(
        metric::STORE_BACKLOG,
        "Finished results waiting for the result store to take them (it was unavailable)."
    );
    describe_counter!(
        metric::STORE_BACKLOG_DROPPED,
        "Finished results dropped from a full store backlog, never stored."
    );
    describe_counter!(
        metric::EVENT_LOG_DROPPED,
        "Event batches a run's event log did not keep (its backend was unavailable or slower than the run)."
    );
    describe_counter!(
        metric::ATTACHES,
        "Callers re-attached to a run's event stream (AttachRun)."
    );
    describe_counter!(metric::CHECKPOINTS, "Checkpoints of live runs saved (NATS store).");
    describe_counter!(
        metric::APPROVALS_REQUESTED,
        "Tool calls that waited for a person's approval."
    );
    describe_counter!(
        metric::INPUT_REQUESTED,
        "Tool calls that asked a person questions before they could finish (each round counts)."
    );
    describe_counter!(
        metric::APPROVAL_DECISIONS,
        "Approval decisions acted on, by outcome (approved, edited, rejected, timed_out, answered)."
    );
    describe_gauge!(
        metric::RUNS_AWAITING_APPROVAL,
        "Runs parked waiting for approvals (they hold no run slot)."
    );
    describe_counter!(
        metric::CONSOLE_SIGN_INS,
        "Console sign-ins by outcome (ok, refused: bad credentials, limited: too many from one address)."
    );
    describe_counter!(
        metric::WEBHOOK_DELIVERIES,
        "Webhook delivery attempts by outcome (delivered; pending: failed, tried again later; failed: given up; canceled: the webhook was deleted), and deliveries dropped (dropped: the webhook had as many waiting as it may)."
    );
    metrics::describe_histogram!(
        metric::CHECKPOINT_BYTES,
        metrics::Unit::Bytes,
        "Bytes of one checkpoint of a live run."
    );
    describe_counter!(
        metric::RUNS_MOVED,
        "Runs moved between replicas, by how: taken_over (resumed here), handed_over (released here at a drain), fenced (a write was refused: another replica took it), expired (its lease ran out here unrenewed), unsaved (a checkpoint the store did not take)."
    );
}

/// The series that exist before anything happened, at zero.
fn start_at_zero() {
    metrics::counter!(metric::CHECKPOINTS).absolute(0);
    metrics::counter!(metric::TURNS_RESTARTED, "why" => "model_endpoint").absolute(0);
    metrics::counter!(metric::EVENT_LOG_DROPPED).absolute(0);
    metrics::counter!(metric::ATTACHES).absolute(0);
    metrics::counter!(metric::APPROVALS_REQUESTED).absolute(0);
    metrics::counter!(metric::INPUT_REQUESTED).absolute(0);
    for &outcome in crate::domain::approval::ApprovalOutcome::ALL {
        let outcome: &'static str = outcome.into();
        metrics::counter!(metric::APPROVAL_DECISIONS, "outcome" => outcome).absolute(0);
    }
    metrics::gauge!(metric::RUNS_AWAITING_APPROVAL).set(0.0);
    metrics::gauge!(metric::RUNS_IN_FLIGHT).set(0.0);
    metrics::gauge!(metric::TOOL_CALLS_IN_FLIGHT).set(0.0);
    metrics::gauge!(metric::STORE_BACKLOG).set(0.0);
    metrics::counter!(metric::STORE_BACKLOG_DROPPED).absolute(0);
    metrics::counter!(metric::CALLER_STALLS).absolute(0);
    metrics::counter!(metric::TOOL_RESULTS_CUT).absolute(0);
    metrics::counter!(metric::SIGNALS_PUBLISHED).absolute(0);
    metrics::counter!(metric::SIGNALS_FAILED).absolute(0);
}

/// The `invoke_agent` span of a run (kind server: the caller's `Orchestrate`). Its outcome fields
/// are filled by [`record_run_end`].
pub(crate) fn invoke_agent_span(model: &str, run_id: &str, principal: &str) -> Span {
    tracing::info_span!(
        "invoke_agent",
        otel.name = "invoke_agent orchestrator",
        otel.kind = "server",
        gen_ai.operation.name = "invoke_agent",
        gen_ai.agent.name = "orchestrator",
        gen_ai.provider.name = "openai",
        gen_ai.request.model = %model,
        gen_ai.conversation.id = %run_id,
        orchestrator.run.id = %run_id,
        enduser.id = %principal,
        orchestrator.run.status = Empty,
        orchestrator.run.failure_reason = Empty,
        orchestrator.run.turns = Empty,
        orchestrator.run.failed_turns = Empty,
        orchestrator.run.signals = Empty,
        gen_ai.usage.input_tokens = Empty,
        gen_ai.usage.output_tokens = Empty,
        error.type = Empty,
        otel.status_code = Empty,
        otel.status_description = Empty,
    )
}

/// The `chat {model}` span of one turn (kind client: the completion request).
pub(crate) fn chat_span(model: &str, turn: u32) -> Span {
    tracing::info_span!(
        "chat",
        otel.name = %format!("chat {model}"),
        otel.kind = "client",
        gen_ai.operation.name = "chat",
        gen_ai.provider.name = "openai",
        gen_ai.request.model = %model,
        gen_ai.usage.input_tokens = Empty,
        gen_ai.usage.output_tokens = Empty,
        gen_ai.usage.cache_read.input_tokens = Empty,
        gen_ai.response.finish_reasons = Empty,
        gen_ai.response.time_to_first_token = Empty,
        orchestrator.turn = turn,
        error.type = Empty,
        otel.status_code = Empty,
    )
}

/// The `execute_tool {name}` span of one call (kind client: the call to a tool-runner). The
/// arguments are recorded only when `payloads` allows it, cut to that many bytes.
pub(crate) fn execute_tool_span(name: &str, call_id: &str, arguments: &str, payloads: Option<usize>) -> Span {
    let span = tracing::info_span!(
        "execute_tool",
        otel.name = %format!("execute_tool {name}"),
        otel.kind = "client",
        gen_ai.operation.name = "execute_tool",
        gen_ai.tool.name = %name,
        gen_ai.tool.call.id = %call_id,
        gen_ai.tool.type = "function",
        gen_ai.tool.call.arguments = Empty,
        gen_ai.tool.call.result = Empty,
        orchestrator.approval.outcome = Empty,
        orchestrator.approval.principal = Empty,
        orchestrator.approval.decided_at_unix_ms = Empty,
        error.type = Empty,
        otel.status_code = Empty,
    );
    if let Some(max) = payloads {
        span.record("gen_ai.tool.call.arguments", truncate(arguments, max));
    }
    span
}

/// Records on a call's `execute_tool` span the decision that let it run: who approved it, when,
/// and whether the arguments were edited.
pub(crate) fn record_approval(span: &Span, decision: &ApprovalDecision) {
    let outcome: &'static str = decision.outcome.into();
    span.record("orchestrator.approval.outcome", outcome);
    span.record("orchestrator.approval.principal", decision.principal.as_str());
    span.record("orchestrator.approval.decided_at_unix_ms", decision.decided_at_unix_ms);
}

/// Records a tool call's outcome on the current (`execute_tool`) span and in the metrics.
pub(crate) fn record_tool_call(
    tool: &str,
    result: &Result<String, ToolCallError>,
    elapsed: Duration,
    payloads: Option<usize>,
) {
    let span = Span::current();
    let outcome = match result {
        Ok(content) => {
            if let Some(max) = payloads {
                span.record("gen_ai.tool.call.result", truncate(content, max));
            }
            "ok".to_owned()
        }
        Err(error) => {
            span.record("error.type", error.code.as_str());
            span.record("otel.status_code", "ERROR");
            error.code.clone()
        }
    };
    metrics::counter!(metric::TOOL_CALLS, "tool" => tool.to_owned(), "outcome" => outcome).increment(1);
    metrics::histogram!(metric::TOOL_CALL_DURATION, "tool" => tool.to_owned()).record(elapsed.as_secs_f64());
}

/// Records a finished run on the current (`invoke_agent`) span, in the metrics and in the log.
pub(crate) fn record_run_end(result: &RunResult, elapsed: Duration) {
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
    // Principals come from the tokens file or the client CA, so the label stays bounded.
    let principal = result.principal.clone();
    metrics::counter!(metric::RUNS, "status" => status, "reason" => reason, "principal" => principal.clone())
        .increment(1);
    for (kind, tokens) in [
        ("prompt", result.usage.prompt_tokens),
        ("cached", result.usage.cached_prompt_tokens),
        ("completion", result.usage.completion_tokens),
    ] {
        metrics::counter!(metric::PRINCIPAL_TOKENS, "principal" => principal.clone(), "kind" => kind).increment(tokens);
    }
    metrics::histogram!(metric::RUN_DURATION, "status" => status).record(elapsed.as_secs_f64());
    let span = Span::current();
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
}

/// `status` label value.
pub(crate) fn status_label(status: RunStatus) -> &'static str {
    status.into()
}

/// `reason` label value (and `error.type` on spans): `none` when the run did not fail.
pub(crate) fn reason_label(reason: Option<FailureReason>) -> &'static str {
    reason.map_or("none", Into::into)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_are_the_names_in_snake_case() {
        assert_eq!(status_label(RunStatus::Completed), "completed");
        assert_eq!(
            reason_label(Some(FailureReason::LlmStreamStalled)),
            "llm_stream_stalled"
        );
        assert_eq!(reason_label(Some(FailureReason::ToolParseError)), "tool_parse_error");
        assert_eq!(reason_label(None), "none");
    }
}
