//! `DecideToolCalls` requests as domain decisions: each names a call and one kind of decision,
//! with what that kind needs (a rejection's message is bounded; an edit's arguments are checked
//! against the tool's schema later, by the approval store). `AnswerToolInput` requests as the
//! decision of one call: its answers (their content is checked against the questions' schemas
//! by the approval store too).

use proto::orchestrator::v1 as pb;

use super::invalid;
use crate::Error;
use crate::domain::approval::{Decision, DecisionKind, MAX_REJECTION_BYTES};
use crate::domain::input::InputAnswer;

/// Most decisions in one request.
pub(crate) const MAX_DECISIONS: usize = 1024;

/// Most bytes of one answer's content.
pub(crate) const MAX_ANSWER_BYTES: usize = 64 * 1024;

/// Most bytes of a round's name (the server's are 16).
const MAX_ROUND_BYTES: usize = 64;

impl TryFrom<pb::AnswerToolInputRequest> for DecideRequest {
    type Error = Error;

    fn try_from(r: pb::AnswerToolInputRequest) -> Result<Self, Error> {
        super::named_id("run_id", r.run_id.clone())?;
        if r.call_id.is_empty() {
            return Err(invalid("call_id is empty: name the call whose questions are answered"));
        }
        if r.answers.is_empty() || r.answers.len() > crate::domain::input::MAX_QUESTIONS {
            return Err(invalid(format!(
                "answers has {} entries; a call's 1 to {} questions are answered in one request",
                r.answers.len(),
                crate::domain::input::MAX_QUESTIONS
            )));
        }
        let mut answers = Vec::with_capacity(r.answers.len());
        for (i, answer) in r.answers.into_iter().enumerate() {
            if answer.content_json.len() > MAX_ANSWER_BYTES {
                return Err(invalid(format!(
                    "answers[{i}].content_json is {} bytes; at most {MAX_ANSWER_BYTES}",
                    answer.content_json.len()
                )));
            }
            answers.push(InputAnswer::try_from(answer).map_err(|e| invalid(format!("answers[{i}]: {e}")))?);
        }
        if r.round.len() > MAX_ROUND_BYTES {
            return Err(invalid(format!(
                "round is {} bytes; a round (ToolInputRequested.round) is at most {MAX_ROUND_BYTES}",
                r.round.len()
            )));
        }
        Ok(Self {
            run_id: r.run_id,
            decisions: vec![Decision {
                call_id: r.call_id,
                kind: DecisionKind::Answer(answers),
                round: (!r.round.is_empty()).then_some(r.round),
            }],
        })
    }
}

/// A checked `DecideToolCallsRequest`: the run and its decisions.
pub(crate) struct DecideRequest {
    /// The run.
    pub run_id: String,
    /// The decisions, in the request's order.
    pub decisions: Vec<Decision>,
}

impl TryFrom<pb::DecideToolCallsRequest> for DecideRequest {
    type Error = Error;

    fn try_from(r: pb::DecideToolCallsRequest) -> Result<Self, Error> {
        super::named_id("run_id", r.run_id.clone())?;
        if r.decisions.is_empty() {
            return Err(invalid("decisions is empty: name at least one call"));
        }
        if r.decisions.len() > MAX_DECISIONS {
            return Err(invalid(format!(
                "decisions has {} entries; at most {MAX_DECISIONS} are accepted",
                r.decisions.len()
            )));
        }
        let decisions = r
            .decisions
            .into_iter()
            .enumerate()
            .map(|(i, d)| decision(i, d))
            .collect::<Result<_, _>>()?;
        Ok(Self {
            run_id: r.run_id,
            decisions,
        })
    }
}

fn decision(i: usize, d: pb::ToolCallDecision) -> Result<Decision, Error> {
    if d.call_id.is_empty() {
        return Err(invalid(format!("decisions[{i}].call_id is empty")));
    }
    let kind = match pb::DecisionKind::try_from(d.kind) {
        Ok(pb::DecisionKind::Approve) => DecisionKind::Approve,
        Ok(pb::DecisionKind::Reject) if d.message.len() > MAX_REJECTION_BYTES => {
            return Err(invalid(format!(
                "decisions[{i}].message is {} bytes; at most {MAX_REJECTION_BYTES} are fed back to the model",
                d.message.len()
            )));
        }
        Ok(pb::DecisionKind::Reject) => DecisionKind::Reject(d.message),
        Ok(pb::DecisionKind::ApproveEdited) if d.arguments_json.trim().is_empty() => {
            return Err(invalid(format!(
                "decisions[{i}] is APPROVE_EDITED without arguments_json"
            )));
        }
        Ok(pb::DecisionKind::ApproveEdited) => DecisionKind::Edit(d.arguments_json),
        Ok(pb::DecisionKind::Unspecified) | Err(_) => {
            return Err(invalid(format!(
                "decisions[{i}].kind {} is not APPROVE, REJECT or APPROVE_EDITED",
                d.kind
            )));
        }
    };
    Ok(Decision {
        call_id: d.call_id,
        kind,
        round: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(decisions: Vec<pb::ToolCallDecision>) -> pb::DecideToolCallsRequest {
        pb::DecideToolCallsRequest {
            run_id: "r".into(),
            decisions,
        }
    }

    fn one(kind: pb::DecisionKind, message: &str, arguments: &str) -> pb::ToolCallDecision {
        pb::ToolCallDecision {
            call_id: "c".into(),
            kind: kind.into(),
            message: message.into(),
            arguments_json: arguments.into(),
        }
    }

    #[test]
    fn each_kind_with_what_it_needs() {
        let ok = DecideRequest::try_from(request(vec![
            one(pb::DecisionKind::Approve, "", ""),
            one(pb::DecisionKind::Reject, "no", ""),
            one(pb::DecisionKind::ApproveEdited, "", "{}"),
        ]))
        .unwrap();
        assert_eq!(
            ok.decisions.into_iter().map(|d| d.kind).collect::<Vec<_>>(),
            vec![
                DecisionKind::Approve,
                DecisionKind::Reject("no".into()),
                DecisionKind::Edit("{}".into())
            ]
        );
        let refused = |d: pb::DecideToolCallsRequest| DecideRequest::try_from(d).err().map(|e| e.to_string());
        assert!(refused(request(vec![])).unwrap().contains("empty"));
        assert!(
            refused(request(vec![one(pb::DecisionKind::Unspecified, "", "")]))
                .unwrap()
                .contains("kind 0")
        );
        assert!(
            refused(request(vec![one(pb::DecisionKind::ApproveEdited, "", " ")]))
                .unwrap()
                .contains("without arguments_json")
        );
        let long = "x".repeat(MAX_REJECTION_BYTES + 1);
        assert!(
            refused(request(vec![one(pb::DecisionKind::Reject, &long, "")]))
                .unwrap()
                .contains("at most 4096")
        );
        assert!(refused(request(vec![one(pb::DecisionKind::Reject, &long[1..], "")])).is_none());
        let many = vec![one(pb::DecisionKind::Approve, "", ""); MAX_DECISIONS + 1];
        assert!(refused(request(many)).unwrap().contains("at most 1024"));
    }
}
