//! Logs and traces.

use clap::Args;
use shared::config::{Bound, Bounded, bound};
use shared::telemetry::LogFormat;

use super::KIB;

/// Logs and traces.
#[derive(Debug, Clone, Args)]
#[command(next_help_heading = "Telemetry")]
pub struct TelemetrySettings {
    /// Log format: text or json.
    #[arg(long, env = "ORCHESTRATOR_LOG_FORMAT", default_value = "text")]
    pub log_format: LogFormat,
    /// Record tool arguments and results on spans (off by default: they may hold secrets).
    #[arg(long, env = "ORCHESTRATOR_TRACE_TOOL_PAYLOADS")]
    pub trace_tool_payloads: bool,
    /// Size cap of each recorded payload, in bytes (cap 64 KiB).
    #[arg(long, env = "ORCHESTRATOR_TRACE_PAYLOAD_MAX_BYTES", default_value_t = KIB)]
    pub trace_payload_max_bytes: usize,
}

impl TelemetrySettings {
    /// How many bytes of tool payloads spans record; `None`: none.
    pub fn trace_payloads(&self) -> Option<usize> {
        self.trace_tool_payloads.then_some(self.trace_payload_max_bytes)
    }
}

impl Bounded for TelemetrySettings {
    fn bounds(&self) -> Vec<Bound> {
        let size = bound(
            "trace_payload_max_bytes",
            self.trace_payload_max_bytes,
            1usize,
            64 * KIB,
        );
        self.trace_tool_payloads.then_some(size).into_iter().collect()
    }
}
