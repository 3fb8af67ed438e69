//! What the orchestrator reports: span names and attributes (OpenTelemetry GenAI semantic
//! conventions) and Prometheus metrics. Spans: `invoke_agent` for a run, `chat {model}` for each
//! turn, `execute_tool {name}` (kind client) for each tool call, and a `signal` event on the run
//! span for each exit call.

use crate::run::{FailureReason, RunStatus};

/// Metric names (Prometheus conventions: base units, `_total` counters, `_seconds` durations).
pub mod metric {
    /// Counter: finished runs, by `status` and `reason`.
    pub const RUNS: &str = "orchestrator_runs_total";
    /// Histogram: run wall time, by `status`.
    pub const RUN_DURATION: &str = "orchestrator_run_duration_seconds";
    /// Gauge: runs in flight.
    pub const RUNS_IN_FLIGHT: &str = "orchestrator_runs_in_flight";
    /// Histogram: turn wall time (completion plus tool calls).
    pub const TURN_DURATION: &str = "orchestrator_turn_duration_seconds";
    /// Histogram: time from sending a completion request to its first token.
    pub const TIME_TO_FIRST_TOKEN: &str = "orchestrator_time_to_first_token_seconds";
    /// Counter: tool calls, by `tool` and `outcome` (`ok` or the error code).
    pub const TOOL_CALLS: &str = "orchestrator_tool_calls_total";
    /// Histogram: tool call wall time, by `tool`.
    pub const TOOL_CALL_DURATION: &str = "orchestrator_tool_call_duration_seconds";
    /// Gauge: tool calls in flight.
    pub const TOOL_CALLS_IN_FLIGHT: &str = "orchestrator_tool_calls_in_flight";
    /// Counter: signals published.
    pub const SIGNALS_PUBLISHED: &str = "orchestrator_signals_published_total";
    /// Counter: signals that could not be delivered to the topic.
    pub const SIGNALS_FAILED: &str = "orchestrator_signals_failed_total";
    /// Counter: LLM requests retried before the first byte, by `reason`.
    pub const LLM_RETRIES: &str = "orchestrator_llm_retries_total";
    /// Counter: tool calls retried because no runner ran them, by `reason`.
    pub const TOOL_CALL_RETRIES: &str = "orchestrator_tool_call_retries_total";
    /// Gauge: tool-runner endpoints calls are balanced over.
    pub const TOOL_RUNNER_ENDPOINTS: &str = "orchestrator_tool_runner_endpoints";
}

/// Registers every metric with its help text (and zero values), so `/metrics` lists them all.
pub fn describe() {
    use metrics::{Unit, describe_counter, describe_gauge, describe_histogram};
    describe_counter!(metric::RUNS, "Finished runs by status and failure reason.");
    describe_histogram!(metric::RUN_DURATION, Unit::Seconds, "Run wall time by status.");
    describe_gauge!(metric::RUNS_IN_FLIGHT, "Runs in flight.");
    describe_histogram!(
        metric::TURN_DURATION,
        Unit::Seconds,
        "Turn wall time: the completion and its tool calls."
    );
    describe_histogram!(
        metric::TIME_TO_FIRST_TOKEN,
        Unit::Seconds,
        "Time from a completion request to its first token."
    );
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
        metric::LLM_RETRIES,
        "LLM requests retried before the first byte, by reason."
    );
    describe_counter!(
        metric::TOOL_CALL_RETRIES,
        "Tool calls retried because no runner ran them, by reason."
    );
    describe_gauge!(
        metric::TOOL_RUNNER_ENDPOINTS,
        "Tool-runner endpoints calls are balanced over."
    );
    metrics::gauge!(metric::RUNS_IN_FLIGHT).set(0.0);
    metrics::gauge!(metric::TOOL_CALLS_IN_FLIGHT).set(0.0);
    metrics::counter!(metric::SIGNALS_PUBLISHED).absolute(0);
    metrics::counter!(metric::SIGNALS_FAILED).absolute(0);
}

/// `status` label value.
pub fn status_label(status: RunStatus) -> &'static str {
    match status {
        RunStatus::Running => "running",
        RunStatus::Completed => "completed",
        RunStatus::Failed => "failed",
        RunStatus::Canceled => "canceled",
    }
}

/// `reason` label value (and `error.type` on spans).
pub fn reason_label(reason: Option<FailureReason>) -> &'static str {
    match reason {
        None => "none",
        Some(FailureReason::ToolParseError) => "tool_parse_error",
        Some(FailureReason::ToolExecutionError) => "tool_execution_error",
        Some(FailureReason::ToolBudgetExhausted) => "tool_budget_exhausted",
        Some(FailureReason::ToolFailureLimit) => "tool_failure_limit",
        Some(FailureReason::RepeatedLineLoop) => "repeated_line_loop",
        Some(FailureReason::MaxTurnsExceeded) => "max_turns_exceeded",
        Some(FailureReason::LlmError) => "llm_error",
        Some(FailureReason::LlmStreamStalled) => "llm_stream_stalled",
        Some(FailureReason::DeadlineExceeded) => "deadline_exceeded",
        Some(FailureReason::UnknownError) => "unknown_error",
    }
}

/// At most `max` bytes of `text` (on a character boundary), for span attributes.
pub fn truncate(text: &str, max: usize) -> &str {
    let mut end = text.len().min(max);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

/// Keeps a gauge incremented while alive.
pub struct InFlight(&'static str);

impl InFlight {
    /// Increments `gauge` until dropped.
    pub fn new(gauge: &'static str) -> Self {
        metrics::gauge!(gauge).increment(1.0);
        Self(gauge)
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        metrics::gauge!(self.0).decrement(1.0);
    }
}
