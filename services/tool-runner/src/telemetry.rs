//! What the tool-runner reports: the `execute_tool {name}` span (kind server, continuing the
//! caller's trace) and Prometheus metrics.

/// Metric names (Prometheus conventions).
pub mod metric {
    /// Counter: executions by `tool` and `outcome` (`ok` or the error code).
    pub const EXECUTIONS: &str = "tool_runner_executions_total";
    /// Histogram: execution wall time, by `tool`.
    pub const EXECUTION_DURATION: &str = "tool_runner_execution_duration_seconds";
    /// Gauge: executions in flight.
    pub const IN_FLIGHT: &str = "tool_runner_executions_in_flight";
    /// Counter: calls refused before running, by `reason` (`concurrency_limit`, `draining`,
    /// `stale_epoch`: a replaced orchestrator replica's; `run_store`: its fence unreadable).
    pub const REJECTED: &str = "tool_runner_rejected_total";
    /// Requests refused for their credentials, by code.
    pub const AUTH_REFUSED: &str = "tool_runner_auth_refused_total";
}

/// Registers every metric with its help text (and zero values).
pub fn describe() {
    use metrics::{Unit, describe_counter, describe_gauge, describe_histogram};
    describe_counter!(
        metric::EXECUTIONS,
        "Tool executions by tool and outcome (ok or the error code)."
    );
    describe_histogram!(
        metric::EXECUTION_DURATION,
        Unit::Seconds,
        "Tool execution wall time by tool."
    );
    describe_gauge!(metric::IN_FLIGHT, "Tool executions in flight.");
    describe_counter!(metric::REJECTED, "RunTool calls refused before running, by reason.");
    describe_counter!(
        metric::AUTH_REFUSED,
        "Requests refused for their credentials, by code (unauthenticated, permission_denied)."
    );
    metrics::gauge!(metric::IN_FLIGHT).set(0.0);
    for reason in ["concurrency_limit", "draining", "stale_epoch", "run_store"] {
        metrics::counter!(metric::REJECTED, "reason" => reason).absolute(0);
    }
}
