//! The conversation with the model as the orchestrator sees it, whatever server runs the model:
//! messages, tool calls, tool definitions and token usage.

use serde_json::Value;

/// One message of the conversation sent to the model.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub enum Message {
    /// A system message (the BIOS, the caller's system message).
    System(String),
    /// A user message.
    User {
        /// Text.
        content: String,
        /// Optional participant name.
        name: Option<String>,
    },
    /// An assistant message, possibly with tool calls.
    Assistant {
        /// Text (may be empty).
        content: String,
        /// Tool calls it made.
        tool_calls: Vec<ToolCall>,
        /// The turn's reasoning, sent back as `reasoning_content` (only with `--llm-send-reasoning`).
        reasoning: Option<String>,
    },
    /// A tool result answering `tool_call_id`.
    Tool {
        /// The call answered.
        tool_call_id: String,
        /// The result (JSON text).
        content: String,
    },
}

/// How a status note starts (the orchestrator's note on the run's state as a turn begins, a user
/// message after the newest), so the model — and a person reading a transcript — knows who wrote
/// it.
pub const STATUS_MARK: &str = "[orchestrator status]";

/// Drops a status note that ends `messages` (a note for a turn that did not run: the run ended
/// between turns), whole or as the last paragraph of the newest user message it joined.
pub fn drop_trailing_note(messages: &mut Vec<Message>) {
    let Some(Message::User { content, .. }) = messages.last_mut() else {
        return;
    };
    if content.starts_with(STATUS_MARK) {
        messages.pop();
    } else if let Some(at) = content.rfind(&format!("\n\n{STATUS_MARK}")) {
        content.truncate(at);
    }
}

/// Puts a user message after the newest message of `conversation`, in a form every chat
/// template takes: a message of its own, or, when the newest message already is a user message,
/// a paragraph added to it (some templates refuse two user messages in a row; the name of a
/// message added so is not kept).
pub fn append_user(conversation: &mut Vec<Message>, text: &str, name: Option<String>) {
    if let Some(Message::User { content, .. }) = conversation.last_mut() {
        content.push_str("\n\n");
        content.push_str(text);
        return;
    }
    conversation.push(Message::User {
        content: text.to_owned(),
        name,
    });
}

/// A whole tool call, as the model made it.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ToolCall {
    /// Call id (generated when the server sent none).
    pub id: String,
    /// Tool name.
    pub name: String,
    /// Arguments as the model wrote them.
    pub arguments: String,
}

/// A tool offered to the model.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ToolDefinition {
    /// Name.
    pub name: String,
    /// Description for the model.
    pub description: String,
    /// JSON Schema of the arguments, shared by every run that offers the tool (a schema can be
    /// kilobytes, and thousands of runs may be live at once).
    pub parameters: std::sync::Arc<Value>,
}

/// Token usage of one completion.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Usage {
    /// Prompt tokens.
    pub prompt_tokens: u64,
    /// Completion tokens.
    pub completion_tokens: u64,
    /// Prompt tokens the server took from its prefix cache instead of prefilling them (as it
    /// reports them; 0 when it does not).
    #[serde(default)]
    pub cached_prompt_tokens: u64,
}

impl Usage {
    /// Adds `other`'s tokens to these.
    pub fn add(&mut self, other: Usage) {
        self.prompt_tokens += other.prompt_tokens;
        self.completion_tokens += other.completion_tokens;
        self.cached_prompt_tokens += other.cached_prompt_tokens;
    }

    /// The tokens of these not in `earlier` (a count taken before them).
    pub fn since(&self, earlier: &Usage) -> Usage {
        Usage {
            prompt_tokens: self.prompt_tokens.saturating_sub(earlier.prompt_tokens),
            completion_tokens: self.completion_tokens.saturating_sub(earlier.completion_tokens),
            cached_prompt_tokens: self.cached_prompt_tokens.saturating_sub(earlier.cached_prompt_tokens),
        }
    }
}
