//! One turn: consumes a completion's [`LlmEvent`]s, passes visible text through the
//! [`TextGate`], assembles structured tool calls, and at the end says what the turn produced.

use crate::domain::assembly::{AssembledCall, Assembler};
use crate::domain::chat::Usage;
use crate::domain::model::LlmEvent;

use super::fallback::Resolution;
use super::hold_back::TextGate;

/// Collects one streamed completion.
#[derive(Debug, Default)]
pub struct TurnCollector {
    gate: TextGate,
    assembler: Assembler,
    usage: Option<Usage>,
    finish_reason: Option<String>,
}

/// What a finished turn produced.
#[derive(Debug)]
pub struct TurnOutput {
    /// Structured tool calls, in order (empty when the model wrote none).
    pub structured: Vec<AssembledCall>,
    /// How the held-back text resolves (fallback directives when there are no structured calls).
    pub resolution: Resolution,
    /// Usage reported for the turn.
    pub usage: Usage,
    /// The model's finish_reason, if it sent one.
    pub finish_reason: Option<String>,
    /// The model started more structured calls than the collector keeps.
    pub too_many_calls: bool,
}

impl TurnCollector {
    /// A collector keeping at most `max_calls` structured calls and `max_argument_bytes` of each
    /// one's arguments.
    pub fn new(max_calls: usize, max_argument_bytes: usize) -> Self {
        Self {
            assembler: Assembler::new(max_calls, max_argument_bytes),
            ..Self::default()
        }
    }

    /// Takes one event; returns text that can be shown now.
    pub fn push(&mut self, event: LlmEvent) -> Option<String> {
        match event {
            LlmEvent::TextDelta(text) => Some(self.gate.push(&text)).filter(|t| !t.is_empty()),
            // Reasoning is taken by the loop as it streams (kept up to its own bound).
            LlmEvent::ReasoningDelta(_) => None,
            LlmEvent::ToolCallFragment {
                index,
                id,
                name,
                arguments,
            } => {
                self.assembler.push(index, id, name, arguments);
                None
            }
            LlmEvent::Usage(usage) => {
                self.usage = Some(usage);
                None
            }
            LlmEvent::Finish(reason) => {
                self.finish_reason = Some(reason);
                None
            }
            LlmEvent::Done => None,
        }
    }

    /// Text the model wrote that is still held back (released as-is when the turn fails).
    pub fn held_text(&self) -> &str {
        self.gate.held()
    }

    /// Releases the held text as it is: the turn ends without resolving it.
    pub fn release_held(&mut self) -> String {
        self.gate.release_all()
    }

    /// How many structured calls are complete so far (a later one began).
    pub fn complete_calls(&self) -> usize {
        self.assembler.complete()
    }

    /// Structured call `position` as assembled so far.
    pub fn call(&self, position: usize) -> Option<AssembledCall> {
        self.assembler.snapshot(position)
    }

    /// The usage reported so far, if any.
    pub fn usage(&self) -> Option<Usage> {
        self.usage
    }

    /// Ends the turn.
    pub fn finish(self) -> TurnOutput {
        let too_many_calls = self.assembler.too_many();
        let structured = self.assembler.finish();
        let resolution = self.gate.finish(!structured.is_empty());
        TurnOutput {
            structured,
            resolution,
            usage: self.usage.unwrap_or_default(),
            finish_reason: self.finish_reason,
            too_many_calls,
        }
    }
}
