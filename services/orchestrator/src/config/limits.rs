//! Per-run limits: the default of each and the ceiling a request may not pass.

use std::time::Duration;

use clap::Args;
use shared::config::{Bound, Bounded, bound, parse_duration};

use super::{DAY, ms, secs};
use crate::domain::{HARD_MAX_TURNS, Limits};

/// Per-run limits: the default used when a request sets none, and the ceiling a request may not
/// pass.
#[derive(Debug, Clone, Copy, Args)]
#[command(next_help_heading = "Run limits")]
pub struct LimitSettings {
    /// Default max turns per run.
    #[arg(long, env = "ORCHESTRATOR_MAX_TURNS", default_value_t = 16)]
    pub max_turns: u32,
    /// Most turns a request may ask for (cap 128).
    #[arg(long, env = "ORCHESTRATOR_MAX_TURNS_CEILING", default_value_t = HARD_MAX_TURNS)]
    pub max_turns_ceiling: u32,
    /// Default tool-call budget per run.
    #[arg(long, env = "ORCHESTRATOR_TOOL_CALL_BUDGET", default_value_t = 64)]
    pub tool_call_budget: u32,
    /// Largest budget a request may ask for (cap 100000).
    #[arg(long, env = "ORCHESTRATOR_TOOL_CALL_BUDGET_CEILING", default_value_t = 1000)]
    pub tool_call_budget_ceiling: u32,
    /// Default failing turns tolerated per run.
    #[arg(long, env = "ORCHESTRATOR_MAX_TOOL_FAILURES", default_value_t = 3)]
    pub max_tool_failures: u32,
    /// Most failing turns a request may allow (cap 10000).
    #[arg(long, env = "ORCHESTRATOR_MAX_TOOL_FAILURES_CEILING", default_value_t = 100)]
    pub max_tool_failures_ceiling: u32,
    /// Default timeout of one tool call.
    #[arg(long, env = "ORCHESTRATOR_TOOL_TIMEOUT", default_value = "60s", value_parser = parse_duration)]
    pub tool_timeout: Duration,
    /// Longest tool timeout a request may ask for (cap 1h).
    #[arg(long, env = "ORCHESTRATOR_TOOL_TIMEOUT_CEILING", default_value = "10m", value_parser = parse_duration)]
    pub tool_timeout_ceiling: Duration,
    /// Default deadline of a run.
    #[arg(long, env = "ORCHESTRATOR_RUN_TIMEOUT", default_value = "10m", value_parser = parse_duration)]
    pub run_timeout: Duration,
    /// Longest run deadline a request may ask for (cap 24h).
    #[arg(long, env = "ORCHESTRATOR_RUN_TIMEOUT_CEILING", default_value = "1h", value_parser = parse_duration)]
    pub run_timeout_ceiling: Duration,
    /// Default longest wait of a tool call for a person's approval (limits.approval_timeout_ms).
    #[arg(long, env = "ORCHESTRATOR_APPROVAL_TIMEOUT", default_value = "1h", value_parser = parse_duration)]
    pub approval_timeout: Duration,
    /// Longest approval wait a request may ask for (cap 7d).
    #[arg(long, env = "ORCHESTRATOR_APPROVAL_TIMEOUT_CEILING", default_value = "24h", value_parser = parse_duration)]
    pub approval_timeout_ceiling: Duration,
    /// Default longest wait of a tool's questions for answers (limits.input_timeout_ms); past it
    /// each is answered cancel.
    #[arg(long, env = "ORCHESTRATOR_INPUT_TIMEOUT", default_value = "1h", value_parser = parse_duration)]
    pub input_timeout: Duration,
    /// Longest answer wait a request may ask for (cap 7d).
    #[arg(long, env = "ORCHESTRATOR_INPUT_TIMEOUT_CEILING", default_value = "24h", value_parser = parse_duration)]
    pub input_timeout_ceiling: Duration,
    /// Default tokens (prompt and completion over all turns) a run may spend
    /// (limits.max_total_tokens); the turn that goes over it is the run's last.
    #[arg(long, env = "ORCHESTRATOR_MAX_TOTAL_TOKENS", default_value_t = 10_000_000)]
    pub max_total_tokens: u64,
    /// Most tokens a request may let its run spend (cap 1000000000000).
    #[arg(long, env = "ORCHESTRATOR_MAX_TOTAL_TOKENS_CEILING", default_value_t = 10_000_000)]
    pub max_total_tokens_ceiling: u64,
}

impl LimitSettings {
    /// The limits of a run whose request sets none.
    pub fn defaults(&self) -> Limits {
        Limits {
            max_turns: self.max_turns,
            tool_call_budget: self.tool_call_budget,
            max_tool_failures: self.max_tool_failures,
            tool_timeout: self.tool_timeout,
            run_timeout: self.run_timeout,
            approval_timeout: self.approval_timeout,
            max_total_tokens: self.max_total_tokens,
            input_timeout: self.input_timeout,
        }
    }

    /// The most a request may ask for.
    pub fn ceilings(&self) -> Limits {
        Limits {
            max_turns: self.max_turns_ceiling,
            tool_call_budget: self.tool_call_budget_ceiling,
            max_tool_failures: self.max_tool_failures_ceiling,
            tool_timeout: self.tool_timeout_ceiling,
            run_timeout: self.run_timeout_ceiling,
            approval_timeout: self.approval_timeout_ceiling,
            max_total_tokens: self.max_total_tokens_ceiling,
            input_timeout: self.input_timeout_ceiling,
        }
    }
}

impl Bounded for LimitSettings {
    /// Each ceiling has a cap; each default lies below its ceiling.
    fn bounds(&self) -> Vec<Bound> {
        vec![
            bound("max_turns_ceiling", self.max_turns_ceiling, 1u32, HARD_MAX_TURNS),
            bound("max_turns", self.max_turns, 1u32, self.max_turns_ceiling),
            bound(
                "tool_call_budget_ceiling",
                self.tool_call_budget_ceiling,
                0u32,
                100_000u32,
            ),
            bound(
                "tool_call_budget",
                self.tool_call_budget,
                0u32,
                self.tool_call_budget_ceiling,
            ),
            bound(
                "max_tool_failures_ceiling",
                self.max_tool_failures_ceiling,
                0u32,
                10_000u32,
            ),
            bound(
                "max_tool_failures",
                self.max_tool_failures,
                0u32,
                self.max_tool_failures_ceiling,
            ),
            bound("tool_timeout_ceiling", self.tool_timeout_ceiling, ms(1), secs(3600)),
            bound("tool_timeout", self.tool_timeout, ms(1), self.tool_timeout_ceiling),
            bound("run_timeout_ceiling", self.run_timeout_ceiling, ms(1), DAY),
            bound("run_timeout", self.run_timeout, ms(1), self.run_timeout_ceiling),
            bound(
                "approval_timeout_ceiling",
                self.approval_timeout_ceiling,
                ms(1),
                7 * DAY,
            ),
            bound(
                "approval_timeout",
                self.approval_timeout,
                ms(1),
                self.approval_timeout_ceiling,
            ),
            bound("input_timeout_ceiling", self.input_timeout_ceiling, ms(1), 7 * DAY),
            bound("input_timeout", self.input_timeout, ms(1), self.input_timeout_ceiling),
            bound(
                "max_total_tokens_ceiling",
                self.max_total_tokens_ceiling,
                1u64,
                1_000_000_000_000u64,
            ),
            bound(
                "max_total_tokens",
                self.max_total_tokens,
                1u64,
                self.max_total_tokens_ceiling,
            ),
        ]
    }
}
