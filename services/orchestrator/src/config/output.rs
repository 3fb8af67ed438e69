//! What the model may produce in one run (the loop gets it as [`crate::domain::OutputBounds`]).

use clap::Args;
use shared::config::{Bound, Bounded, bound};

use super::{KIB, MIB};

/// What the model may produce in one run: past these, a run ends `OUTPUT_LIMIT` (or the call
/// fails) instead of growing the orchestrator's memory and its callers' messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Args)]
pub struct OutputSettings {
    /// Tool calls the model may make in one turn; more end the run OUTPUT_LIMIT, none of them
    /// run (1..=1024).
    #[arg(long, env = "ORCHESTRATOR_MAX_CALLS_PER_TURN", default_value_t = 128)]
    pub max_calls_per_turn: usize,
    /// Largest arguments of one tool call, in bytes; a longer call fails INVALID_ARGUMENTS (fed
    /// back to the model) and only this much of it is kept (64..=16 MiB).
    #[arg(long = "max-argument-bytes", env = "ORCHESTRATOR_MAX_ARGUMENT_BYTES", default_value_t = MIB)]
    pub max_argument_bytes: usize,
    /// Largest output of one run, in bytes: its text and the arguments and errors of its calls
    /// and signals; a run going over ends OUTPUT_LIMIT with the output up to it. Keeps every
    /// result (run_finished, GetRun) under gRPC's usual 4 MiB receive limit (1 KiB..=64 MiB).
    #[arg(long, env = "ORCHESTRATOR_MAX_OUTPUT_BYTES", default_value_t = 2 * MIB)]
    pub max_output_bytes: usize,
    /// Reasoning kept of one run, in bytes (reasoning_delta events and the result's reasoning;
    /// with --llm-send-reasoning, also what is sent back per turn). Past it the model's reasoning
    /// is still watched for repeated lines but no longer kept, and the result says so; the run
    /// goes on (0..=64 MiB).
    #[arg(long, env = "ORCHESTRATOR_MAX_REASONING_BYTES", default_value_t = 512 * KIB)]
    pub max_reasoning_bytes: usize,
}

impl Bounded for OutputSettings {
    fn bounds(&self) -> Vec<Bound> {
        vec![
            bound("max_calls_per_turn", self.max_calls_per_turn, 1usize, 1024usize),
            bound("max_argument_bytes", self.max_argument_bytes, 64usize, 16 * MIB),
            bound("max_output_bytes", self.max_output_bytes, KIB, 64 * MIB),
            bound("max_reasoning_bytes", self.max_reasoning_bytes, 0usize, 64 * MIB),
        ]
    }
}

impl From<&OutputSettings> for crate::domain::OutputBounds {
    fn from(s: &OutputSettings) -> Self {
        Self {
            max_calls_per_turn: s.max_calls_per_turn,
            max_argument_bytes: s.max_argument_bytes,
            max_output_bytes: s.max_output_bytes,
            max_reasoning_bytes: s.max_reasoning_bytes,
        }
    }
}
