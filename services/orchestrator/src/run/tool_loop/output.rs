//! Output accounting: the bytes a run has produced (text, arguments and errors of its calls and
//! signals) against its bounds, so a run ends `OUTPUT_LIMIT` with its output up to the bound.

use shared::sync::lock;

use super::*;
use crate::domain::FailureReason;

impl Driver<'_> {
    /// Counts the arguments and errors of the calls and signals recorded so far (after a turn
    /// recorded some).
    pub(super) fn count_recorded_bytes(&mut self) {
        let state = lock(self.state);
        let calls: usize = state
            .tool_calls
            .iter()
            .map(|c| c.arguments_json.len() + c.error.as_ref().map_or(0, |e| e.message.len()))
            .sum();
        let signals: usize = state.signals.iter().map(|s| s.arguments_json.len()).sum();
        self.progress.recorded_bytes = calls + signals;
    }

    /// Bytes of the run's output so far: its text and the arguments and errors of its calls and
    /// signals (what its result carries).
    pub(super) fn output_bytes(&self) -> usize {
        lock(self.state).text.len() + self.progress.recorded_bytes
    }

    /// Bytes the run may still output.
    pub(super) fn output_room(&self) -> usize {
        self.deps.output.max_output_bytes.saturating_sub(self.output_bytes())
    }

    pub(super) fn output_limit(&self, what: &str) -> End {
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
    pub(super) fn within_output_while_held(&mut self) -> Step<()> {
        let held = self.completion.as_ref().map_or(0, |c| c.collector.held_text().len());
        if held <= self.output_room() {
            return Ok(());
        }
        self.keep_interrupted_turn(true);
        Err(self.output_limit("its text"))
    }

    /// The arguments of a turn's calls must fit in what the run may still output; otherwise the
    /// run ends `OUTPUT_LIMIT` and none of them runs.
    pub(super) fn within_output_for_calls(&self, calls: &[ModelCall]) -> Step<()> {
        let bytes: usize = calls.iter().map(|c| c.arguments.len()).sum();
        if bytes <= self.output_room() {
            return Ok(());
        }
        Err(self.output_limit(&format!("the {bytes} bytes of arguments of this turn's tool calls")))
    }
}
