//! The events of a run's stream, in the order the caller receives them.

use super::chat::Usage;
use super::result::{RunResult, Signal, ToolCallError};
use super::spec::Limits;

/// One event of a run's stream (numbered by the emitter).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub enum Event {
    /// The run started.
    RunStarted {
        /// Model.
        model: String,
        /// Normal tool names.
        normal_tools: Vec<String>,
        /// Exit tool names.
        exit_tools: Vec<String>,
        /// Limits in force.
        limits: Limits,
        /// The thread it continues, and how much of it the model sees.
        thread: Option<super::thread::ThreadStart>,
        /// How long it waited for a run slot before it started.
        queued_ms: u64,
    },
    /// Visible text.
    TextDelta {
        /// Text.
        text: String,
        /// Turn.
        turn: u32,
    },
    /// Reasoning text, kept apart from the output.
    ReasoningDelta {
        /// Reasoning.
        text: String,
        /// Turn.
        turn: u32,
    },
    /// A normal call was dispatched.
    ToolCallStarted {
        /// Call id.
        call_id: String,
        /// Tool.
        name: String,
        /// Arguments.
        arguments_json: String,
        /// Turn.
        turn: u32,
        /// The arguments were cut to fit one event.
        arguments_truncated: bool,
    },
    /// A normal call finished.
    ToolCallFinished {
        /// Call id.
        call_id: String,
        /// Tool.
        name: String,
        /// Result JSON when ok.
        content_json: Option<String>,
        /// The result was longer than one event may carry and is cut here.
        content_truncated: bool,
        /// Error when not ok.
        error: Option<ToolCallError>,
        /// Wall time.
        duration_ms: u64,
    },
    /// An exit call.
    Signal(Signal),
    /// A turn ended.
    TurnFinished {
        /// Turn.
        turn: u32,
        /// Usage of this turn.
        usage: Usage,
        /// Budget left.
        tool_call_budget_remaining: u32,
        /// Failing turns so far.
        failed_turns: u32,
    },
    /// The turn starts again on another replica after its model stream was cut: the text and
    /// reasoning of `turn` sent before this event no longer count.
    TurnRestarted {
        /// The turn.
        turn: u32,
        /// Its attempt now (2 for the first restart).
        attempt: u32,
        /// Why.
        reason: String,
    },
    /// A normal call waits for a person's decision before it runs.
    ApprovalRequested {
        /// Call id.
        call_id: String,
        /// Tool.
        name: String,
        /// Arguments.
        arguments_json: String,
        /// Turn.
        turn: u32,
        /// Unix ms: the wait ends then.
        expires_at_unix_ms: u64,
        /// The arguments were cut to fit one event.
        arguments_truncated: bool,
        /// The call ran once and is in doubt: a person decides whether it runs again.
        in_doubt: bool,
    },
    /// A call asks a person questions before it can finish; the run waits for the answers.
    ToolInputRequested {
        /// Call id.
        call_id: String,
        /// Tool.
        name: String,
        /// Turn.
        turn: u32,
        /// Unix ms: the questions expire then.
        expires_at_unix_ms: u64,
        /// The questions.
        requests: Vec<super::input::InputRequest>,
        /// Their round ([`super::input::Questions::round`]), which answers name.
        round: String,
    },
    /// A call still running says how it gets on (a task's status, as its server says it).
    ToolCallProgress {
        /// Call id.
        call_id: String,
        /// Tool.
        name: String,
        /// Turn.
        turn: u32,
        /// How far it got, in the tool's units (0: not said).
        progress: f64,
        /// How far it has to go in all (0: not known).
        total: f64,
        /// What the tool says, for a person.
        message: String,
    },
    /// A call that waited for a person was decided (or its wait expired), as the run acts on it.
    CallDecided {
        /// Call id.
        call_id: String,
        /// Tool.
        name: String,
        /// Turn.
        turn: u32,
        /// What was decided, by whom and when.
        decision: super::approval::ApprovalDecision,
        /// How long the call waited for it.
        waited_ms: u64,
    },
    /// A user message sent to the live run (`SendMessage`) joined its conversation.
    MessageAdded {
        /// The turn whose model request first holds it.
        turn: u32,
        /// Its text.
        content: String,
        /// Its participant name, if any.
        name: Option<String>,
    },
    /// The run ended (always last). Boxed: the result is the largest event by far, and every
    /// event queued, batched or logged takes the size of the largest.
    RunFinished(Box<RunResult>),
}

/// An event with its position in the stream.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct NumberedEvent {
    /// 1, 2, 3 … without gaps.
    pub seq: u64,
    /// The event.
    pub event: Event,
}

impl NumberedEvent {
    /// About how many bytes the event holds: its text, arguments and results, plus a fixed
    /// overhead (what an event log counts against its bound).
    pub fn weight(&self) -> usize {
        const OVERHEAD: usize = 64;
        OVERHEAD
            + match &self.event {
                Event::TextDelta { text, .. } | Event::ReasoningDelta { text, .. } => text.len(),
                Event::ToolCallStarted { arguments_json, .. } | Event::ApprovalRequested { arguments_json, .. } => {
                    arguments_json.len()
                }
                Event::ToolCallFinished {
                    content_json, error, ..
                } => content_json.as_ref().map_or(0, String::len) + error.as_ref().map_or(0, |e| e.message.len()),
                Event::Signal(signal) => signal.arguments_json.len(),
                Event::RunFinished(result) => result.text.len() + result.reasoning.len(),
                Event::RunStarted { .. } | Event::TurnFinished { .. } => 0,
                Event::TurnRestarted { reason, .. } => reason.len(),
                Event::MessageAdded { content, .. } => content.len(),
                Event::ToolCallProgress { message, .. } => message.len(),
                Event::CallDecided { decision, .. } => {
                    decision.message.len()
                        + decision.original_arguments_json.len()
                        + decision.edited_arguments_json.len()
                }
                Event::ToolInputRequested { requests, .. } => requests
                    .iter()
                    .map(|r| r.message.len() + r.url.len() + r.schema.to_string().len())
                    .sum(),
            }
    }

    /// Whether this is the run's last event.
    pub fn is_last(&self) -> bool {
        matches!(self.event, Event::RunFinished(_))
    }

    /// The run's result, when this is `run_finished`.
    pub fn finished(&self) -> Option<&super::RunResult> {
        match &self.event {
            Event::RunFinished(result) => Some(result),
            _ => None,
        }
    }
}

/// Events sent to the caller's stream together (they leave in one write).
pub type EventBatch = Vec<NumberedEvent>;
