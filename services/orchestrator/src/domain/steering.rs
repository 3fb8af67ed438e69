//! Steering a live run: the user message sent to it (`SendMessage`), and why a run refuses one.

use super::chat::Message;

/// A user message sent to a live run (`SendMessage`): it joins the conversation at the run's
/// next turn boundary.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct UserMessage {
    /// Text.
    pub content: String,
    /// Optional participant name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

impl From<UserMessage> for Message {
    fn from(m: UserMessage) -> Self {
        Self::User {
            content: m.content,
            name: m.name,
        }
    }
}

/// Why a run takes no more messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Closed {
    /// The model answered without calling a tool and nothing waited: the run is completing.
    Answered,
    /// The run is in its last turn: no boundary is left.
    LastTurn,
}

/// Why a live run did not accept a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Refused {
    /// No boundary is left to take it at.
    Closed(Closed),
    /// The run was sent as many messages as it may be (`--max-steering-messages`).
    Full(u32),
    /// The run waits for approvals: no turn of it ends before a person decides.
    AwaitingApproval,
}
