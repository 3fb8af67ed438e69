//! Approvals (docs/architecture.md, "Approvals"): which normal calls of a run wait for a person's
//! decision, the decisions, and the rules a decision must pass. A call that asks questions
//! (`input.rs`) waits the same way: its answers are its decision.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

/// Which calls of a run wait for approval, and what happens while they wait.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ApprovalRules {
    /// The normal tools whose calls wait (the runners', the server's and the request's).
    pub tools: BTreeSet<String>,
    /// How long a call may wait.
    pub timeout: Duration,
    /// What an expired wait does.
    pub on_timeout: OnTimeout,
    /// The run's deadline stops while it waits.
    pub pause_deadline: bool,
}

impl ApprovalRules {
    /// Whether calls of `tool` wait for approval.
    pub fn needs(&self, tool: &str) -> bool {
        self.tools.contains(tool)
    }
}

/// What an approval timeout does.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum OnTimeout {
    /// The calls still undecided are rejected ("approval timed out"), and the run goes on.
    #[default]
    Reject,
    /// The run ends `APPROVAL_TIMEOUT`.
    FailRun,
}

/// A call waiting for a decision (what `GetRun` and `ListPendingApprovals` show).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PendingApproval {
    /// The run.
    pub run_id: String,
    /// The call.
    pub call_id: String,
    /// Its tool.
    pub name: String,
    /// Its arguments as the model wrote them.
    pub arguments_json: String,
    /// Its turn.
    pub turn: u32,
    /// Unix ms.
    pub requested_at_unix_ms: u64,
    /// Unix ms: the wait ends then.
    pub expires_at_unix_ms: u64,
    /// The run's owner.
    pub principal: String,
    /// Set once decided.
    pub decision: Option<ApprovalDecision>,
    /// Set when the call asks questions (its answers decide it; an approval does not).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub questions: Option<super::input::Questions>,
    /// What a person deciding the call reads of its run besides the call.
    #[serde(default)]
    pub context: CallContext,
    /// The call was approved, ran, and is in doubt (its runner went away before its outcome was
    /// kept): approving it runs it again although it may have taken effect.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub in_doubt: bool,
}

/// What a person deciding a call needs of its run to decide well, kept with the call so every
/// listing of it shows it without reading the run.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct CallContext {
    /// What the run was asked (`RunSpec::prompt`).
    pub prompt: String,
    /// The run's labels.
    pub labels: BTreeMap<String, String>,
    /// The end of what the model said in the call's turn before its calls.
    pub said_before: String,
}

/// Whether a wait of `calls` is decided: every call is. A wait with no call for a person (a run
/// that parked to follow a task) is decided by nobody: it goes on when woken.
pub fn wait_decided(calls: &[PendingApproval]) -> bool {
    !calls.is_empty() && calls.iter().all(|c| c.decision.is_some())
}

/// Whether two waits are of the same calls, so the one opened again keeps the other's
/// decisions. A call that asks again (its next questions) is a new wait: its answers to the
/// last ones are not kept.
pub fn same_calls(a: &[PendingApproval], b: &[PendingApproval]) -> bool {
    a.len() == b.len()
        && a.iter()
            .zip(b)
            .all(|(x, y)| x.call_id == y.call_id && x.questions == y.questions)
}

/// Decides each of `calls` still undecided past its expiry at `now_unix_ms` as expired (a
/// timeout, or `cancel` to its questions); whether any was.
pub fn expire_calls(calls: &mut [PendingApproval], now_unix_ms: u64) -> bool {
    let mut expired = false;
    for call in calls.iter_mut() {
        expired |= expire(
            &mut call.decision,
            call.expires_at_unix_ms,
            call.questions.as_ref(),
            now_unix_ms,
        );
    }
    expired
}

/// The expiry rule of one pending approval, wherever it is kept (a store's `PendingApproval`, a
/// turn's checkpoint): undecided at `now_unix_ms`, past `expires_at_unix_ms`, it is decided as
/// expired — a timeout (it does not run), or for `questions`, `cancel` to each (it is tried
/// again with them). Whether it was.
pub fn expire(
    decision: &mut Option<ApprovalDecision>,
    expires_at_unix_ms: u64,
    questions: Option<&super::input::Questions>,
    now_unix_ms: u64,
) -> bool {
    if decision.is_some() || expires_at_unix_ms > now_unix_ms {
        return false;
    }
    *decision = Some(match questions {
        Some(questions) => ApprovalDecision::unanswered(questions, now_unix_ms),
        None => ApprovalDecision::timed_out(now_unix_ms),
    });
    true
}

/// What was decided about a call, by whom and when (kept in the call's record).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ApprovalDecision {
    /// The outcome.
    pub outcome: ApprovalOutcome,
    /// Who decided ([`TIMEOUT_PRINCIPAL`] for a timeout).
    pub principal: String,
    /// Unix ms.
    pub decided_at_unix_ms: u64,
    /// A rejection's message (fed back to the model).
    pub message: String,
    /// For an edit: the arguments the model wrote.
    pub original_arguments_json: String,
    /// For an edit: the arguments the call runs with.
    #[serde(default)]
    pub edited_arguments_json: String,
    /// For answered questions: the answers the call is tried again with.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub answers: Vec<super::input::InputAnswer>,
}

/// Who "decides" a call nobody decided in time.
pub const TIMEOUT_PRINCIPAL: &str = "orchestrator";

/// The outcome of an approval. Its metric label is its name in snake case.
#[derive(Debug, Clone, Copy, PartialEq, Eq, strum::IntoStaticStr, serde::Serialize, serde::Deserialize)]
#[strum(serialize_all = "snake_case")]
pub enum ApprovalOutcome {
    /// Run as written.
    Approved,
    /// Run with edited arguments.
    Edited,
    /// Not run; the model is told why.
    Rejected,
    /// Nobody decided in time.
    TimedOut,
    /// The call's questions were answered (by a person, or `cancel` when they expired).
    Answered,
}

impl ApprovalDecision {
    /// Whether the call runs.
    pub fn runs(&self) -> bool {
        matches!(
            self.outcome,
            ApprovalOutcome::Approved | ApprovalOutcome::Edited | ApprovalOutcome::Answered
        )
    }

    /// The decision of questions nobody answered before they expired: `cancel` to each.
    pub fn unanswered(questions: &super::input::Questions, now_unix_ms: u64) -> Self {
        Self {
            outcome: ApprovalOutcome::Answered,
            principal: TIMEOUT_PRINCIPAL.to_owned(),
            decided_at_unix_ms: now_unix_ms,
            message: "nobody answered the tool's questions in time: each was answered cancel".to_owned(),
            original_arguments_json: String::new(),
            edited_arguments_json: String::new(),
            answers: questions.canceled(),
        }
    }

    /// The decision of a call nobody decided within its timeout.
    pub fn timed_out(now_unix_ms: u64) -> Self {
        Self {
            outcome: ApprovalOutcome::TimedOut,
            principal: TIMEOUT_PRINCIPAL.to_owned(),
            decided_at_unix_ms: now_unix_ms,
            message: "approval timed out: nobody approved the call in time, and it did not run".to_owned(),
            original_arguments_json: String::new(),
            edited_arguments_json: String::new(),
            answers: Vec::new(),
        }
    }
}

/// A decision as asked for (`DecideToolCalls`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decision {
    /// The call.
    pub call_id: String,
    /// What is decided.
    pub kind: DecisionKind,
    /// For answers: the round of questions they answer ([`super::input::Questions::round`]);
    /// none: whichever round the call asks now.
    pub round: Option<String>,
}

/// The kinds of decision. What a person typed (a reason, edited arguments, answers) never shows
/// in its `Debug` form, so no log line carries it.
#[derive(Clone, PartialEq, Eq)]
pub enum DecisionKind {
    /// Run as written.
    Approve,
    /// Do not run; this message goes to the model (empty: a default naming who rejected).
    Reject(String),
    /// Run with these arguments.
    Edit(String),
    /// The answers to the call's questions (`AnswerToolInput`).
    Answer(Vec<super::input::InputAnswer>),
}

impl DecisionKind {
    /// Its name, for logs and metrics.
    pub fn name(&self) -> &'static str {
        match self {
            Self::Approve => "approve",
            Self::Reject(_) => "reject",
            Self::Edit(_) => "edit",
            Self::Answer(_) => "answer",
        }
    }
}

impl std::fmt::Debug for DecisionKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Approve => f.write_str("Approve"),
            Self::Reject(reason) => write!(f, "Reject(<{} bytes>)", reason.len()),
            Self::Edit(arguments) => write!(f, "Edit(<{} bytes>)", arguments.len()),
            Self::Answer(answers) => write!(f, "Answer(<{} answers>)", answers.len()),
        }
    }
}

/// Why a decision is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecideError {
    /// No run the caller may see waits under this id.
    #[error("no run {0:?} waits for a person (unknown, finished, or it waits for nothing)")]
    NotFound(String),
    /// The run's owner asks, on a server where only approvers decide.
    #[error(
        "principal {caller:?} may not decide the calls of its own run {run_id:?}: this server lets only principals with the approver role decide (--approvals-need-approver)"
    )]
    NotAllowed {
        /// Who asked.
        caller: String,
        /// The run.
        run_id: String,
    },
    /// The call was decided already.
    #[error(
        "call {call_id:?} was decided already: {outcome} by {} at {}",
        who(principal),
        rfc3339(*.decided_at_unix_ms),
        outcome = <&str>::from(.outcome)
    )]
    AlreadyDecided {
        /// The call.
        call_id: String,
        /// The first decision.
        outcome: ApprovalOutcome,
        /// Its principal.
        principal: String,
        /// Its time.
        decided_at_unix_ms: u64,
    },
    /// The call's wait ended (`approval_timeout_ms`) before this decision was taken.
    #[error(
        "call {call_id:?} ({name}) can no longer be decided: its wait expired at {} (the run's approval_timeout_ms), {late_ms} ms before this decision",
        rfc3339(*.expired_at_unix_ms)
    )]
    Expired {
        /// The call.
        call_id: String,
        /// Its tool.
        name: String,
        /// When its wait ended (Unix ms).
        expired_at_unix_ms: u64,
        /// How late the decision came.
        late_ms: u64,
    },
    /// The run does not wait for this call.
    #[error("run {run_id:?} has no call {call_id:?} waiting for approval")]
    NotPending {
        /// The run.
        run_id: String,
        /// The call.
        call_id: String,
    },
    /// The answers are for a round of questions the call no longer asks: it asked again since
    /// (its run moved to another replica, which tried the call again).
    #[error(
        "the answers to call {call_id:?} are for round {answered} of its questions, and it asks round {asked} now: read its questions again and answer those"
    )]
    OtherRound {
        /// The call.
        call_id: String,
        /// The round answered.
        answered: String,
        /// The round asked now.
        asked: String,
    },
    /// An edit's arguments are not what the tool accepts, or a decision is malformed.
    #[error("{0}")]
    Invalid(String),
    /// The store of waiting runs cannot be reached.
    #[error("{0}")]
    Unavailable(String),
}

impl ApprovalRules {
    /// When a call asked for approval at `now_unix_ms` stops waiting: after the rules' timeout,
    /// or at the run's deadline (`deadline_unix_ms`) when that comes first — what a person is
    /// told, so no wait is shown longer than the run will last.
    pub fn expires_at(&self, now_unix_ms: u64, deadline_unix_ms: u64) -> u64 {
        self.wait_ends(now_unix_ms, self.timeout, deadline_unix_ms)
    }

    /// When a wait for a person begun at `now_unix_ms` ends: after `timeout`, or at the run's
    /// deadline when that comes first — unless the deadline pauses while a person decides.
    pub fn wait_ends(&self, now_unix_ms: u64, timeout: std::time::Duration, deadline_unix_ms: u64) -> u64 {
        let timeout = u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX);
        let ends = now_unix_ms.saturating_add(timeout);
        if self.pause_deadline {
            ends
        } else {
            ends.min(deadline_unix_ms)
        }
    }
}

/// Checks one decision against the call it decides and turns it into the recorded decision.
/// An edit must be a JSON object `schema` accepts.
pub fn check_decision(
    decision: &Decision,
    call: &PendingApproval,
    schema: &serde_json::Value,
    by: &str,
    now_unix_ms: u64,
) -> Result<ApprovalDecision, DecideError> {
    if let Some(first) = &call.decision {
        return Err(DecideError::AlreadyDecided {
            call_id: call.call_id.clone(),
            outcome: first.outcome,
            principal: first.principal.clone(),
            decided_at_unix_ms: first.decided_at_unix_ms,
        });
    }
    if now_unix_ms >= call.expires_at_unix_ms {
        return Err(DecideError::Expired {
            call_id: call.call_id.clone(),
            name: call.name.clone(),
            expired_at_unix_ms: call.expires_at_unix_ms,
            late_ms: now_unix_ms - call.expires_at_unix_ms,
        });
    }
    let mut recorded = ApprovalDecision {
        outcome: ApprovalOutcome::Approved,
        principal: by.to_owned(),
        decided_at_unix_ms: now_unix_ms,
        message: String::new(),
        original_arguments_json: String::new(),
        edited_arguments_json: String::new(),
        answers: Vec::new(),
    };
    match (&decision.kind, &call.questions) {
        (DecisionKind::Answer(_), None) => {
            return Err(DecideError::Invalid(format!(
                "call {:?} ({}) waits for approval, not for answers: decide it (DecideToolCalls, `orchestrator decide`)",
                call.call_id, call.name
            )));
        }
        (DecisionKind::Approve | DecisionKind::Reject(_) | DecisionKind::Edit(_), Some(_)) => {
            return Err(DecideError::Invalid(format!(
                "call {:?} ({}) asks questions: answer them with AnswerToolInput",
                call.call_id, call.name
            )));
        }
        _ => {}
    }
    match &decision.kind {
        DecisionKind::Approve => {}
        DecisionKind::Reject(message) => {
            recorded.outcome = ApprovalOutcome::Rejected;
            recorded.message = if message.trim().is_empty() {
                format!("rejected by {}", if by.is_empty() { "a person" } else { by })
            } else {
                message.clone()
            };
        }
        DecisionKind::Edit(arguments) => {
            shared::tools::check_arguments(schema, arguments).map_err(|e| {
                DecideError::Invalid(format!(
                    "the edited arguments of call {:?} ({}) are refused: {e}; the call still waits",
                    call.call_id, call.name
                ))
            })?;
            recorded.outcome = ApprovalOutcome::Edited;
            recorded.original_arguments_json.clone_from(&call.arguments_json);
            recorded.edited_arguments_json.clone_from(arguments);
        }
        DecisionKind::Answer(answers) => {
            let questions = call.questions.as_ref().map_or_else(Default::default, Clone::clone);
            if let Some(answered) = &decision.round {
                let asked = questions.round();
                if *answered != asked {
                    return Err(DecideError::OtherRound {
                        call_id: call.call_id.clone(),
                        answered: answered.clone(),
                        asked,
                    });
                }
            }
            questions.check(answers).map_err(|e| {
                DecideError::Invalid(format!(
                    "the answers to call {:?} ({}) are refused: {e}; its questions still wait",
                    call.call_id, call.name
                ))
            })?;
            recorded.outcome = ApprovalOutcome::Answered;
            recorded.answers.clone_from(answers);
        }
    }
    Ok(recorded)
}

/// Who asks to decide, as the approval store checks it.
#[derive(Debug, Clone)]
pub struct Decider {
    /// The caller's principal.
    pub name: String,
    /// The caller of a server without authentication: it sees every run, as it sees everything.
    pub anonymous: bool,
    /// It holds the approver role: it decides every run's calls.
    pub approver: bool,
    /// The server lets only approvers decide (`--approvals-need-approver`), so an owner cannot
    /// approve its own calls.
    pub approver_required: bool,
}

impl Decider {
    /// Whether it may see that a run of `owner` waits: another caller's run is as unknown to it
    /// as a run that does not exist.
    pub fn may_see(&self, owner: &str) -> bool {
        self.anonymous || self.approver || self.name == owner
    }

    /// Whether it may decide the calls of a run of `owner`.
    pub fn may_decide(&self, owner: &str) -> bool {
        self.approver || (!self.approver_required && self.may_see(owner))
    }
}

/// Records `decisions` of `decider` in the `calls` of run `run_id` (owned by `owner`, its calls'
/// schemas `schemas` by call id): all of them, or none when one is refused.
pub fn record_decisions(
    run_id: &str,
    owner: &str,
    calls: &mut [PendingApproval],
    schemas: &BTreeMap<String, serde_json::Value>,
    decider: &Decider,
    decisions: &[Decision],
) -> Result<(), DecideError> {
    if !decider.may_see(owner) {
        return Err(DecideError::NotFound(run_id.to_owned()));
    }
    if !decider.may_decide(owner) {
        return Err(DecideError::NotAllowed {
            caller: decider.name.clone(),
            run_id: run_id.to_owned(),
        });
    }
    for (index, decision) in decide_calls(run_id, calls, |id| schemas.get(id), decider, decisions)? {
        calls[index].decision = Some(decision);
    }
    Ok(())
}

/// Checks `decisions` of `decider` against the run's `calls` (each named once, each waiting, an
/// edit accepted by `schema_of` its call); the decisions to record, by call position. All or
/// none: the first refused one is the error.
fn decide_calls<'a>(
    run_id: &str,
    calls: &[PendingApproval],
    schema_of: impl Fn(&str) -> Option<&'a serde_json::Value>,
    decider: &Decider,
    decisions: &[Decision],
) -> Result<Vec<(usize, ApprovalDecision)>, DecideError> {
    let now = shared::sync::unix_ms();
    let mut recorded: Vec<(usize, ApprovalDecision)> = Vec::with_capacity(decisions.len());
    for decision in decisions {
        let index = calls
            .iter()
            .position(|c| c.call_id == decision.call_id)
            .ok_or_else(|| DecideError::NotPending {
                run_id: run_id.to_owned(),
                call_id: decision.call_id.clone(),
            })?;
        if recorded.iter().any(|(i, _)| *i == index) {
            return Err(DecideError::Invalid(format!(
                "call {:?} is named twice in one request",
                decision.call_id
            )));
        }
        let any_object = serde_json::json!({"type": "object"});
        let schema = schema_of(&decision.call_id).unwrap_or(&any_object);
        recorded.push((
            index,
            check_decision(decision, &calls[index], schema, &decider.name, now)?,
        ));
    }
    Ok(recorded)
}

/// A Unix time in ms as a person reads it: RFC 3339 in UTC, to the second.
fn rfc3339(unix_ms: u64) -> String {
    let at = std::time::UNIX_EPOCH + Duration::from_millis(unix_ms);
    humantime::format_rfc3339_seconds(at).to_string()
}

/// Who decided, as a person reads it.
fn who(principal: &str) -> String {
    match principal {
        "" => "a caller of a server without authentication".to_owned(),
        TIMEOUT_PRINCIPAL => "the orchestrator (nobody decided before the call's wait expired)".to_owned(),
        name => format!("{name:?}"),
    }
}

/// The largest rejection message kept (it is fed back to the model).
pub const MAX_REJECTION_BYTES: usize = 4096;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_wait_ends_with_the_run_unless_its_deadline_pauses() {
        let rules = ApprovalRules {
            timeout: Duration::from_secs(3600),
            ..ApprovalRules::default()
        };
        assert_eq!(
            rules.expires_at(1_000, 41_000),
            41_000,
            "the run's deadline comes first"
        );
        assert_eq!(rules.expires_at(1_000, u64::MAX), 3_601_000, "the timeout comes first");
        let paused = ApprovalRules {
            pause_deadline: true,
            ..rules
        };
        assert_eq!(
            paused.expires_at(1_000, 41_000),
            3_601_000,
            "a paused deadline does not bound the wait"
        );
    }

    fn pending() -> PendingApproval {
        PendingApproval {
            run_id: "r".into(),
            call_id: "c1".into(),
            name: "refund".into(),
            arguments_json: r#"{"amount": 5}"#.into(),
            turn: 1,
            requested_at_unix_ms: 1,
            expires_at_unix_ms: 8,
            principal: "alice".into(),
            decision: None,
            questions: None,
            in_doubt: false,
            context: Default::default(),
        }
    }

    fn schema() -> serde_json::Value {
        serde_json::json!({"type": "object", "properties": {"amount": {"type": "integer", "maximum": 10}}, "required": ["amount"]})
    }

    fn decide(kind: DecisionKind) -> Decision {
        Decision {
            call_id: "c1".into(),
            kind,
            round: None,
        }
    }

    /// A call asked again (its run moved and tried it again) asks a new round: an answer naming
    /// the round before is refused, not taken for the new one; one naming the round asked now,
    /// or none, is taken.
    #[test]
    fn an_answer_to_a_round_the_call_no_longer_asks_is_refused() {
        use crate::domain::input::{InputAction, InputAnswer, InputMode, InputRequest, Questions};
        let round = |state: &str| Questions {
            request_state: state.into(),
            requests: vec![InputRequest {
                key: "go".into(),
                mode: InputMode::Form,
                message: "Go on?".into(),
                schema: serde_json::json!({"type": "object", "properties": {"go": {"type": "boolean"}}}),
                url: String::new(),
            }],
        };
        let (first, second) = (round("asked-1"), round("asked-2"));
        assert_ne!(first.round(), second.round(), "each ask is a round of its own");
        assert_eq!(
            first.round(),
            round("asked-1").round(),
            "a round is named the same on every replica"
        );
        assert_eq!(first.round().len(), 16);
        let asking = PendingApproval {
            questions: Some(second.clone()),
            ..pending()
        };
        let answer = |round: Option<String>| Decision {
            call_id: "c1".into(),
            kind: DecisionKind::Answer(vec![InputAnswer {
                key: "go".into(),
                action: InputAction::Accept,
                content: Some(serde_json::json!({"go": true})),
            }]),
            round,
        };
        let late = check_decision(&answer(Some(first.round())), &asking, &schema(), "bob", 7).unwrap_err();
        assert!(
            matches!(&late, DecideError::OtherRound { answered, asked, .. } if *answered == first.round() && *asked == second.round()),
            "{late}"
        );
        assert!(late.to_string().contains("read its questions again"), "{late}");
        for taken in [Some(second.round()), None] {
            let recorded = check_decision(&answer(taken), &asking, &schema(), "bob", 7).unwrap();
            assert_eq!(recorded.outcome, ApprovalOutcome::Answered);
        }
    }

    #[test]
    fn approve_reject_and_edit_are_recorded_with_who_and_when() {
        let approved = check_decision(&decide(DecisionKind::Approve), &pending(), &schema(), "bob", 7).unwrap();
        assert_eq!(
            (
                approved.outcome,
                approved.principal.as_str(),
                approved.decided_at_unix_ms
            ),
            (ApprovalOutcome::Approved, "bob", 7)
        );
        assert!(approved.runs());
        let rejected = check_decision(
            &decide(DecisionKind::Reject(String::new())),
            &pending(),
            &schema(),
            "bob",
            7,
        )
        .unwrap();
        assert_eq!(rejected.message, "rejected by bob");
        assert!(!rejected.runs());
        assert_eq!(crate::domain::ToolCallError::refused(&rejected).code, "REJECTED");
        let edited = check_decision(
            &decide(DecisionKind::Edit(r#"{"amount": 3}"#.into())),
            &pending(),
            &schema(),
            "bob",
            7,
        )
        .unwrap();
        assert_eq!(edited.outcome, ApprovalOutcome::Edited);
        assert_eq!(edited.original_arguments_json, r#"{"amount": 5}"#);
        assert_eq!(edited.edited_arguments_json, r#"{"amount": 3}"#);
    }

    #[test]
    fn an_edit_the_schema_refuses_and_a_second_decision_are_refused() {
        for bad in [r#"{"amount": 11}"#, r#"{"amount": "x"}"#, "[1]", "not json", "{}"] {
            let refused = check_decision(&decide(DecisionKind::Edit(bad.into())), &pending(), &schema(), "bob", 7);
            assert!(matches!(refused, Err(DecideError::Invalid(_))), "{bad}: {refused:?}");
        }
        let mut decided = pending();
        decided.decision = Some(ApprovalDecision::timed_out(5));
        let again = check_decision(&decide(DecisionKind::Approve), &decided, &schema(), "bob", 7).unwrap_err();
        let told = again.to_string();
        assert!(
            told.contains(
                "timed_out by the orchestrator (nobody decided before the call's wait expired) at 1970-01-01T00:00:00Z"
            ),
            "{told}"
        );
        decided.decision = Some(ApprovalDecision {
            principal: "ana".into(),
            ..ApprovalDecision::timed_out(1_795_771_235_920)
        });
        let told = check_decision(&decide(DecisionKind::Approve), &decided, &schema(), "bob", 7)
            .unwrap_err()
            .to_string();
        assert!(
            told.contains("by \"ana\" at 2026-11-27T"),
            "a time a person reads: {told}"
        );
    }

    #[test]
    fn a_decision_at_or_after_the_expiry_is_refused_naming_it() {
        for late in [8, 9, 5000] {
            let refused =
                check_decision(&decide(DecisionKind::Approve), &pending(), &schema(), "bob", late).unwrap_err();
            assert!(
                matches!(refused, DecideError::Expired { late_ms, .. } if late_ms == late - 8),
                "{refused:?}"
            );
            let message = refused.to_string();
            assert!(message.contains("expired at 1970-01-01T00:00:00Z"), "{message}");
            assert!(message.contains("approval_timeout_ms"), "{message}");
        }
        assert!(check_decision(&decide(DecisionKind::Approve), &pending(), &schema(), "bob", 7).is_ok());
    }
}
