//! `SendMessage` requests: the run and the user message for it.

use proto::orchestrator::v1 as pb;

use super::invalid;
use crate::Error;
use crate::domain::steering::UserMessage;

/// A `SendMessage` request, checked.
#[derive(Debug)]
pub(crate) struct SteeringRequest {
    pub run_id: String,
    pub message: UserMessage,
}

impl TryFrom<pb::SendMessageRequest> for SteeringRequest {
    type Error = Error;

    fn try_from(request: pb::SendMessageRequest) -> Result<Self, Error> {
        let run_id = super::named_id("run_id", request.run_id)?;
        let Some(message) = request.message else {
            return Err(invalid(
                "message is required: a ChatMessage with role \"user\" and content",
            ));
        };
        if !matches!(message.role.as_str(), "" | "user") {
            return Err(invalid(format!(
                "message.role is {:?}; a run is sent user messages only (role \"user\", or empty)",
                message.role
            )));
        }
        if message.content.trim().is_empty() {
            return Err(invalid("message.content is empty"));
        }
        if !message.tool_call_id.is_empty() || !message.tool_calls.is_empty() {
            return Err(invalid("a user message carries no tool_call_id or tool_calls"));
        }
        Ok(Self {
            run_id,
            message: UserMessage {
                content: message.content,
                name: Some(message.name).filter(|n| !n.is_empty()),
            },
        })
    }
}

impl SteeringRequest {
    /// The request, when its text is at most `max_bytes` long (`--max-steering-message-bytes`).
    pub(crate) fn within(self, max_bytes: usize) -> Result<Self, Error> {
        let bytes = self.message.content.len();
        if bytes > max_bytes {
            return Err(invalid(format!(
                "message.content is {bytes} bytes; this server takes at most {max_bytes} (--max-steering-message-bytes)"
            )));
        }
        Ok(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(role: &str, content: &str) -> pb::SendMessageRequest {
        pb::SendMessageRequest {
            run_id: "r".into(),
            message: Some(pb::ChatMessage {
                role: role.into(),
                content: content.into(),
                ..Default::default()
            }),
        }
    }

    fn refusal(request: pb::SendMessageRequest) -> String {
        SteeringRequest::try_from(request)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default()
    }

    #[test]
    fn a_user_message_with_text_is_taken_and_anything_else_refused_naming_the_field() {
        assert!(SteeringRequest::try_from(request("user", "also check B")).is_ok());
        assert!(SteeringRequest::try_from(request("", "role unset means user")).is_ok());
        assert!(refusal(request("assistant", "x")).contains("message.role"));
        assert!(refusal(request("user", "  ")).contains("message.content"));
        assert!(
            refusal(pb::SendMessageRequest {
                run_id: "r".into(),
                message: None
            })
            .contains("message is required")
        );
        assert!(
            refusal(pb::SendMessageRequest {
                run_id: String::new(),
                ..request("user", "x")
            })
            .contains("run_id")
        );
    }

    #[test]
    fn the_text_is_bounded_on_both_sides_of_the_limit() {
        let at = SteeringRequest::try_from(request("user", &"x".repeat(8))).unwrap();
        assert!(at.within(8).is_ok());
        let over = SteeringRequest::try_from(request("user", &"x".repeat(9))).unwrap();
        let refused = over.within(8).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(refused.contains("--max-steering-message-bytes"), "{refused}");
    }
}
