//! Pending approvals, a person's decisions and a tool's questions and their answers: as
//! `ListPendingApprovals`, `GetRun` and the events show them, and as the stores keep them.

use proto::orchestrator::v1 as pb;

use crate::Error;
use crate::domain::approval::{ApprovalDecision, ApprovalOutcome, CallContext, PendingApproval};
use crate::domain::input::{InputAction, InputAnswer, InputMode, InputRequest, Questions};

impl From<&ApprovalDecision> for pb::ApprovalDecision {
    fn from(d: &ApprovalDecision) -> Self {
        Self {
            outcome: pb::ApprovalOutcome::from(d.outcome).into(),
            principal: d.principal.clone(),
            decided_at_unix_ms: d.decided_at_unix_ms,
            message: d.message.clone(),
            original_arguments_json: d.original_arguments_json.clone(),
            edited_arguments_json: d.edited_arguments_json.clone(),
            answers: d.answers.iter().map(pb::ToolInputAnswer::from).collect(),
        }
    }
}

impl From<&InputAnswer> for pb::ToolInputAnswer {
    fn from(a: &InputAnswer) -> Self {
        let action = match a.action {
            InputAction::Accept => pb::InputAction::Accept,
            InputAction::Decline => pb::InputAction::Decline,
            InputAction::Cancel => pb::InputAction::Cancel,
        };
        Self {
            key: a.key.clone(),
            action: action.into(),
            content_json: a.content.as_ref().map(ToString::to_string).unwrap_or_default(),
        }
    }
}

impl TryFrom<pb::ToolInputAnswer> for InputAnswer {
    type Error = String;

    /// An answer as asked for: a known action, content that is JSON.
    fn try_from(a: pb::ToolInputAnswer) -> Result<Self, String> {
        let action = match pb::InputAction::try_from(a.action) {
            Ok(pb::InputAction::Accept) => InputAction::Accept,
            Ok(pb::InputAction::Decline) => InputAction::Decline,
            Ok(pb::InputAction::Cancel) => InputAction::Cancel,
            _ => {
                return Err(format!(
                    "the answer to question {:?} has no action (accept, decline or cancel)",
                    a.key
                ));
            }
        };
        let content = match a.content_json.trim() {
            "" => None,
            json => Some(
                serde_json::from_str(json)
                    .map_err(|e| format!("the content for question {:?} is not JSON: {e}", a.key))?,
            ),
        };
        Ok(Self {
            key: a.key,
            action,
            content,
        })
    }
}

impl From<&InputRequest> for pb::ToolInputRequest {
    fn from(r: &InputRequest) -> Self {
        Self {
            key: r.key.clone(),
            mode: r.mode.as_str().to_owned(),
            message: r.message.clone(),
            schema_json: if r.schema.is_null() {
                String::new()
            } else {
                r.schema.to_string()
            },
            url: r.url.clone(),
        }
    }
}

/// A question as a runner (or a stored record) gives it; `None` for a mode this version does
/// not know.
pub(crate) fn input_request(
    key: String,
    mode: &str,
    message: String,
    schema_json: &str,
    url: String,
) -> Option<InputRequest> {
    Some(InputRequest {
        key,
        mode: InputMode::named(mode)?,
        message,
        schema: serde_json::from_str(schema_json).unwrap_or(serde_json::Value::Null),
        url,
    })
}

pub(super) fn input_request_of(r: pb::ToolInputRequest) -> Option<InputRequest> {
    input_request(r.key, &r.mode, r.message, &r.schema_json, r.url)
}

impl TryFrom<pb::ApprovalDecision> for ApprovalDecision {
    type Error = Error;

    fn try_from(d: pb::ApprovalDecision) -> Result<Self, Error> {
        Ok(Self {
            outcome: ApprovalOutcome::from_wire(d.outcome)?,
            principal: d.principal,
            decided_at_unix_ms: d.decided_at_unix_ms,
            message: d.message,
            original_arguments_json: d.original_arguments_json,
            edited_arguments_json: d.edited_arguments_json,
            answers: d
                .answers
                .into_iter()
                .filter_map(|a| InputAnswer::try_from(a).ok())
                .collect(),
        })
    }
}

impl From<&PendingApproval> for pb::PendingApproval {
    fn from(p: &PendingApproval) -> Self {
        Self {
            run_id: p.run_id.clone(),
            call_id: p.call_id.clone(),
            name: p.name.clone(),
            arguments_json: p.arguments_json.clone(),
            turn: p.turn,
            requested_at_unix_ms: p.requested_at_unix_ms,
            expires_at_unix_ms: p.expires_at_unix_ms,
            principal: p.principal.clone(),
            decision: p.decision.as_ref().map(pb::ApprovalDecision::from),
            // The questions' state is the tool's, opaque: it is not shown, only its round.
            input_requests: p
                .questions
                .iter()
                .flat_map(|q| q.requests.iter().map(pb::ToolInputRequest::from))
                .collect(),
            input_round: p.questions.as_ref().map(Questions::round).unwrap_or_default(),
            in_doubt: p.in_doubt,
            prompt: p.context.prompt.clone(),
            labels: p.context.labels.clone().into_iter().collect(),
            said_before: p.context.said_before.clone(),
        }
    }
}

impl TryFrom<pb::PendingApproval> for PendingApproval {
    type Error = Error;

    fn try_from(p: pb::PendingApproval) -> Result<Self, Error> {
        let requests: Vec<InputRequest> = p.input_requests.into_iter().filter_map(input_request_of).collect();
        Ok(Self {
            questions: (!requests.is_empty()).then(|| Questions {
                request_state: String::new(),
                requests,
            }),
            decision: p.decision.map(ApprovalDecision::try_from).transpose()?,
            run_id: p.run_id,
            call_id: p.call_id,
            name: p.name,
            arguments_json: p.arguments_json,
            turn: p.turn,
            requested_at_unix_ms: p.requested_at_unix_ms,
            expires_at_unix_ms: p.expires_at_unix_ms,
            principal: p.principal,
            in_doubt: p.in_doubt,
            context: CallContext {
                prompt: p.prompt,
                labels: p.labels.into_iter().collect(),
                said_before: p.said_before,
            },
        })
    }
}
