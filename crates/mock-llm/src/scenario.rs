//! Scenarios: what the stand-in model answers, turn by turn.
//!
//! The turn is chosen from the request itself (the number of assistant messages already in the
//! conversation), so one server serves any number of concurrent runs without per-run state. The
//! scenario is chosen by the request's `model` name, falling back to the default scenario.

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// A scripted conversation.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Scenario {
    /// Turn 1, 2, … (one per chat completion request of a run).
    pub turns: Vec<Turn>,
    /// Past the last turn: play the last turn again (true) or answer a short text (false).
    #[serde(default)]
    pub repeat_last: bool,
    /// Delay before the first chunk of every turn (time to first token), in ms.
    #[serde(default)]
    pub ttft_ms: u64,
    /// Delay between chunks, in ms.
    #[serde(default)]
    pub token_delay_ms: u64,
    /// Prefill time of each prompt token not in the prefix cache, in µs, added to the time to
    /// first token (chat completions only).
    #[serde(default)]
    pub prefill_us_per_token: u64,
}

/// One completion.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Turn {
    /// HTTP statuses answered to the first attempts of this turn (then it streams normally).
    #[serde(default)]
    pub fail_first: Vec<u16>,
    /// What to stream, in order.
    #[serde(default)]
    pub steps: Vec<Step>,
    /// `finish_reason` of the last chunk; default `tool_calls` when the turn has calls, else `stop`.
    #[serde(default)]
    pub finish_reason: Option<String>,
    /// `[prompt_tokens, completion_tokens]` reported in a final usage chunk; default estimated.
    #[serde(default)]
    pub usage: Option<[u64; 2]>,
    /// Whether to end with `data: [DONE]` (default true; replays send exactly what was recorded).
    #[serde(default = "yes")]
    pub done: bool,
}

fn yes() -> bool {
    true
}

/// One step of a turn.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum Step {
    /// Visible text, streamed in pieces of `chunk_chars` characters (default: word by word).
    Text {
        /// The text.
        text: String,
        /// Characters per chunk.
        #[serde(default)]
        chunk_chars: Option<usize>,
    },
    /// Reasoning text (`reasoning_content`).
    Reasoning {
        /// The text.
        text: String,
    },
    /// A structured tool call; consecutive calls in a turn are parallel calls (index 0, 1, …).
    ToolCall {
        /// Tool name.
        name: String,
        /// Arguments: a JSON value (sent serialized) or, as a string, sent exactly as written
        /// (so invalid JSON can be scripted).
        arguments: Value,
        /// Call id; default `call_<turn>_<index>`.
        #[serde(default)]
        id: Option<String>,
        /// How many fragments the arguments are split into (default 3).
        #[serde(default)]
        fragments: Option<usize>,
    },
    /// A pause.
    Delay {
        /// How long, in ms.
        ms: u64,
    },
    /// Abort the connection mid-stream (no `[DONE]`, broken chunked encoding).
    Cut,
    /// Stop sending but keep the connection open.
    Stall,
    /// Raw SSE bytes, sent as they are (fixture replay).
    Raw {
        /// The bytes.
        sse: String,
    },
    /// An error object inside a chunk.
    Error {
        /// The error message.
        message: String,
    },
}

impl Turn {
    /// A turn that only streams `text`.
    pub fn text(text: &str) -> Self {
        Self {
            steps: vec![Step::Text {
                text: text.to_owned(),
                chunk_chars: None,
            }],
            ..Self::default()
        }
    }

    /// A turn that replays a recorded SSE body exactly.
    pub fn replay(sse: &str) -> Self {
        Self {
            steps: vec![Step::Raw { sse: sse.to_owned() }],
            done: false,
            ..Self::default()
        }
    }

    /// Adds a step.
    #[must_use]
    pub fn then(mut self, step: Step) -> Self {
        self.steps.push(step);
        self
    }
}

impl Step {
    /// A tool call with JSON arguments.
    pub fn call(name: &str, arguments: Value) -> Self {
        Self::ToolCall {
            name: name.to_owned(),
            arguments,
            id: None,
            fragments: None,
        }
    }

    /// Text.
    pub fn text(text: &str) -> Self {
        Self::Text {
            text: text.to_owned(),
            chunk_chars: None,
        }
    }
}

impl Scenario {
    /// A scenario of `turns`.
    pub fn new(turns: Vec<Turn>) -> Self {
        Self {
            turns,
            ..Self::default()
        }
    }

    /// The built-in demo: turn 1 reasons briefly and calls three tool-runner built-ins in
    /// parallel, turn 2 answers and files a report through the `submit_report` exit tool.
    pub fn demo() -> Self {
        Self::new(vec![
            Turn::default()
                .then(Step::Reasoning {
                    text: "Three independent lookups: no call needs another's result, so one turn can ask for all of them."
                        .into(),
                })
                .then(Step::text(
                    "I'll gather three things at once: a calculation, the time, and a short wait.\n",
                ))
                .then(Step::call("calculate", serde_json::json!({"expression": "(1234 * 5678) / 2"})))
                .then(Step::call("time_now", serde_json::json!({})))
                .then(Step::call("sleep", serde_json::json!({"ms": 300}))),
            Turn::text(
                "All three tools answered. (1234 × 5678) / 2 = 3503326, I have the current time, \
                 and the 300 ms wait ran alongside the others rather than after them.\n\
                 I'm filing the report now.",
            )
            .then(Step::call(
                "submit_report",
                serde_json::json!({"title": "Parallel tool check", "summary": "calculate, time_now and sleep all succeeded in one turn."}),
            )),
        ])
    }

    /// The turn for a request whose conversation already holds `assistant_messages` answers.
    pub fn turn(&self, assistant_messages: usize) -> Option<&Turn> {
        match self.turns.get(assistant_messages) {
            Some(turn) => Some(turn),
            None if self.repeat_last => self.turns.last(),
            None => None,
        }
    }
}
