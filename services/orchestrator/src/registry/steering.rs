//! `SendMessage`: a message for a run live here goes into its inbox; one for a run live on
//! another replica (NATS store) is sent to that replica, which answers for the runs it holds.

use shared::auth::Principal;

use super::{Runs, sees};
use crate::domain::RunStatus;
use crate::domain::ports::{RemoteSteer, StoreError, within};
use crate::domain::steering::{Refused, UserMessage};

/// Outcome of a message sent to a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SteeringOutcome {
    /// The run took it: this many messages wait for its next turn boundary.
    Accepted(u32),
    /// The live run refused it.
    Refused(Refused),
    /// The run had already ended with this status.
    Finished(RunStatus),
    /// No such run (or another caller's).
    NotFound,
    /// The run is live on another replica that did not answer (it is moving between replicas).
    Unanswered,
}

impl From<RemoteSteer> for SteeringOutcome {
    fn from(answer: RemoteSteer) -> Self {
        match answer {
            RemoteSteer::Accepted(waiting) => Self::Accepted(waiting),
            RemoteSteer::Refused(refused) => Self::Refused(refused),
            RemoteSteer::Finished(status) => Self::Finished(status),
        }
    }
}

impl Runs {
    /// Sends `message` to a run of `caller`: live here, parked waiting for approvals (refused),
    /// or (shared store) live on another replica, which is asked to take it; `Err` when the
    /// store, asked about a run not live here, cannot be read.
    pub(crate) async fn send_message(
        &self,
        run_id: &str,
        caller: &Principal,
        message: UserMessage,
    ) -> Result<SteeringOutcome, StoreError> {
        if let Some(outcome) = self.steer_here(run_id, caller, &message) {
            return Ok(outcome);
        }
        if self.parked_here(run_id).is_some_and(|p| sees(caller, &p.principal)) {
            return Ok(SteeringOutcome::Refused(Refused::AwaitingApproval));
        }
        Ok(match self.stored(run_id).await? {
            Some(result) if !sees(caller, &result.principal) => SteeringOutcome::NotFound,
            Some(result) if result.status.is_parked() => SteeringOutcome::Refused(Refused::AwaitingApproval),
            Some(result) if !result.status.is_live() => SteeringOutcome::Finished(result.status),
            Some(_) => self.steer_elsewhere(run_id, message).await,
            None => SteeringOutcome::NotFound,
        })
    }

    /// Puts `message` in the inbox of `run_id` when it is live on this replica and `caller` may
    /// see it; `None` when it is not here (or is leaving: being handed over, so its next replica
    /// answers).
    pub(crate) fn steer_here(
        &self,
        run_id: &str,
        caller: &Principal,
        message: &UserMessage,
    ) -> Option<SteeringOutcome> {
        let live = self.lock();
        let live = live.get(run_id).filter(|l| sees(caller, &l.principal))?;
        // Under the state lock, as a cancel: an ended run takes nothing.
        let state = shared::sync::lock(&live.state);
        if !state.status.is_live() {
            return Some(SteeringOutcome::Finished(state.status));
        }
        if state.status.is_parked() {
            return Some(SteeringOutcome::Refused(Refused::AwaitingApproval));
        }
        if live.hand_over.at_safe_point.is_cancelled() || live.hand_over.now.is_cancelled() {
            return None;
        }
        Some(match live.inbox.send(message.clone()) {
            Ok(waiting) => SteeringOutcome::Accepted(waiting),
            Err(refused) => SteeringOutcome::Refused(refused),
        })
    }

    /// Sends `message` to the replica running `run_id` (shared store).
    async fn steer_elsewhere(&self, run_id: &str, message: UserMessage) -> SteeringOutcome {
        let Some(journal) = &self.journal else {
            return SteeringOutcome::NotFound;
        };
        match within(self.store_timeout, journal.steer_elsewhere(run_id, message)).await {
            Ok(Some(answer)) => answer.into(),
            Ok(None) => SteeringOutcome::Unanswered,
            Err(e) => {
                tracing::warn!(run_id = %run_id, "sending a message to the run's replica failed: {e}");
                SteeringOutcome::Unanswered
            }
        }
    }
}
