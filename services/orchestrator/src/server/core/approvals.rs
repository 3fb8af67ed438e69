//! The decisions a person takes as `Core` answers for them (`DecideToolCalls`,
//! `AnswerToolInput`, `ListPendingApprovals`): recorded in the approval store by its rules
//! (`domain::approval`), and a refusal said with what the run is doing now — who decided a call
//! decided already and when, and whether the run still waits.

use shared::auth::Principal;

use super::Core;
use crate::Error;
use crate::domain::approval::{DecideError, Decider, Decision, PendingApproval};
use crate::domain::{RunResult, RunStatus};

/// Most pending approvals listed at once.
const MAX_LISTED_APPROVALS: usize = 1000;

impl Core {
    /// Records `decisions` of `caller` on the run's calls waiting for approval: the run's status
    /// after them and the calls still waiting.
    pub(crate) async fn decide(
        &self,
        run_id: &str,
        decisions: &[Decision],
        caller: &Principal,
    ) -> Result<(RunStatus, Vec<PendingApproval>), Error> {
        let decided = self
            .deps
            .approvals
            .decide(run_id, &self.decider(caller), decisions)
            .await;
        let calls = match decided {
            Ok(calls) => calls,
            Err(refused) => return Err(self.decision_refused(run_id, decisions, caller, refused).await),
        };
        for decision in decisions {
            tracing::info!(run_id = %run_id, gen_ai.tool.call.id = %decision.call_id, principal = %caller.name, kind = decision.kind.name(), "tool call decided");
        }
        let still_pending: Vec<PendingApproval> = calls.into_iter().filter(|c| c.decision.is_none()).collect();
        // Read as the server: an approver may decide runs it may not read.
        let status = match self.runs.get(run_id, &Principal::anonymous()).await {
            Ok(Some(run)) if !still_pending.is_empty() && run.status.is_parked() => {
                RunStatus::parked_for(&still_pending)
            }
            _ => RunStatus::Running,
        };
        Ok((status, still_pending))
    }

    /// The calls waiting for a decision `caller` may take (of `run_id`, or of every run), at most
    /// `limit` (0: the most listed at once); whether more wait.
    pub(crate) async fn pending(
        &self,
        caller: &Principal,
        run_id: Option<&str>,
        limit: usize,
    ) -> Result<(Vec<PendingApproval>, bool), Error> {
        let limit = match limit {
            0 => MAX_LISTED_APPROVALS,
            n => n.min(MAX_LISTED_APPROVALS),
        };
        Ok(self
            .deps
            .approvals
            .pending(&self.decider(caller), run_id, limit)
            .await?)
    }

    /// The caller as the approval store checks it.
    pub(super) fn decider(&self, caller: &Principal) -> Decider {
        Decider {
            name: caller.name.clone(),
            anonymous: caller.is_anonymous(),
            approver: caller.has_role(shared::auth::APPROVER),
            approver_required: self.config.runs.approvals_need_approver,
        }
    }

    /// A refused decision, said with what the run does now: a call decided already names who
    /// decided and when, and whether the run still waits; a run that waits for no decision any
    /// more (its calls were decided and it went on, or it ended) says so, naming the earlier
    /// decision when its record holds it (`FAILED_PRECONDITION`, not `NOT_FOUND`).
    async fn decision_refused(
        &self,
        run_id: &str,
        decisions: &[Decision],
        caller: &Principal,
        refused: DecideError,
    ) -> Error {
        let decider = self.decider(caller);
        let run = match self.runs.get(run_id, &Principal::anonymous()).await {
            Ok(Some(run)) if decider.may_see(&run.principal) => Some(run),
            _ => None,
        };
        match (refused, run) {
            (already @ DecideError::AlreadyDecided { .. }, _) => {
                Error::NotNow(format!("{already}; {}", self.still_waits(run_id).await))
            }
            (DecideError::NotFound(_), Some(run)) => Error::NotNow(went_on(&run, decisions)),
            (refused, _) => Error::Decide(refused),
        }
    }

    /// Whether run `run_id` still waits for decisions, as a person reads it.
    async fn still_waits(&self, run_id: &str) -> String {
        let waiting = match self.deps.approvals.parked_calls(run_id).await {
            Ok(Some(waiting)) if waiting.canceled.is_none() => {
                waiting.calls.iter().filter(|c| c.decision.is_none()).count()
            }
            _ => 0,
        };
        match waiting {
            0 => format!("run {run_id:?} waits for no other call"),
            n => format!("run {run_id:?} still waits for {n} call(s)"),
        }
    }
}

/// What a decision on `run`, which waits for none, is told: the earlier decision of a call it
/// names when the run's record holds it, and the run's status.
fn went_on(run: &RunResult, decisions: &[Decision]) -> String {
    let earlier = decisions.iter().find_map(|d| {
        let record = run.tool_calls.iter().find(|c| c.call_id == d.call_id)?;
        let first = record.approval.as_ref()?;
        Some(DecideError::AlreadyDecided {
            call_id: record.call_id.clone(),
            outcome: first.outcome,
            principal: first.principal.clone(),
            decided_at_unix_ms: first.decided_at_unix_ms,
        })
    });
    let status = run.status.name();
    match earlier {
        Some(earlier) => format!("{earlier}; run {:?} waits for no decision now ({status})", run.run_id),
        None => format!(
            "run {:?} waits for no decision now ({status}): its calls were decided, or it asked for none",
            run.run_id
        ),
    }
}
