//! The rules both approval lots apply to a `DecideToolCalls` request: who may decide, each call
//! named once and still waiting, an edit valid against the tool's schema, nothing recorded when
//! one decision is refused.

use std::collections::BTreeMap;

use crate::domain::approval::{ApprovalDecision, DecideError, Decision, PendingApproval, check_decision};
use crate::domain::ports::Decider;

/// Records `decisions` of `decider` in the `calls` of run `run_id` (owned by `owner`, its calls'
/// schemas `schemas` by call id): all of them, or none when one is refused.
pub(crate) fn record_decisions(
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
