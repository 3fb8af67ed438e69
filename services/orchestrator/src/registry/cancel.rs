//! `CancelRun`: a run live here is canceled here; one live on another replica (NATS store) is
//! asked of that replica, which answers for the runs it holds.

use shared::auth::Principal;

use super::{Runs, sees};
use crate::domain::ports::{RemoteCancel, StoreError, within};
use crate::domain::{CancelMode, RunStatus};

/// How often a cancel looks for a run that is moving between its slot and the approval store.
const MOVING_LOOKS: usize = 50;

/// How often a cancel looks whether a run parking here has parked.
const PARKING_LOOK: std::time::Duration = std::time::Duration::from_millis(5);

/// Outcome of a cancel request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CancelOutcome {
    /// A live run was canceled.
    Canceled,
    /// A live run ends once its turn in progress has ended.
    EndsAfterTurn,
    /// The run had already finished with this status.
    AlreadyFinished(RunStatus),
    /// No such run here.
    NotFound,
    /// The run is live on another replica that did not answer (it is moving between replicas).
    Unanswered,
}

/// What tells whether a run canceled here kept its end: the registry's token for its leaving,
/// and its ownership (ended: its end is kept).
struct Left {
    gone: tokio_util::sync::CancellationToken,
    /// Its record's writer, holding this replica's ownership (ended: its end is kept).
    persister: crate::run::persist::Persister,
}

/// A durable run asked to end after its turn is answered so once its record keeps the ask:
/// told so before, its caller could see it go on from its checkpoint on the replica that takes
/// it over. The run's lease keeper writes the record at once; `Unanswered` when no record with
/// the ask landed within two store timeouts (the run's id not claimed yet, its slot not taken
/// again after a park, or the store not answering). The run still ends after its turn if it
/// stays here, and the caller asks again.
async fn after_turn_kept(left: &Left, store_timeout: std::time::Duration) -> CancelOutcome {
    if left.persister.ownership().ended() || left.persister.after_turn_kept(2 * store_timeout).await {
        CancelOutcome::EndsAfterTurn
    } else {
        CancelOutcome::Unanswered
    }
}

impl Runs {
    /// Cancels a run of `caller` `mode`'s way: live here, parked waiting for approvals (at once
    /// in either mode: no turn of it can end without a person), or (shared store) live on another
    /// replica, which is asked to; `Err` when the store, asked about a run not live here, cannot
    /// be read.
    pub(crate) async fn cancel(
        &self,
        run_id: &str,
        caller: &Principal,
        reason: &str,
        mode: CancelMode,
    ) -> Result<CancelOutcome, StoreError> {
        self.until_parked(run_id).await;
        // A run moving between its slot and the approval store (parking, or resuming) can be
        // missed in both by one look: it is looked for again while it is in sight here.
        for _ in 0..MOVING_LOOKS {
            let outcome = self.cancel_once(run_id, caller, reason, mode).await?;
            if outcome != CancelOutcome::NotFound || !self.in_sight(run_id) {
                return Ok(outcome);
            }
            tokio::task::yield_now().await;
        }
        Ok(CancelOutcome::NotFound)
    }

    /// Waits (at most twice the store's timeout, which bounds each of the park's requests) while
    /// `run_id` is parking here: cut short, the park would leave the run's record and its log
    /// apart; parked, the run is canceled in the approval store.
    async fn until_parked(&self, run_id: &str) {
        let until = tokio::time::Instant::now() + 2 * self.store_timeout;
        while self.parking_here(run_id) && tokio::time::Instant::now() < until {
            tokio::time::sleep(PARKING_LOOK).await;
        }
    }

    /// Whether `run_id` is live here and leaving its slot for the approval store.
    fn parking_here(&self, run_id: &str) -> bool {
        self.lock().get(run_id).is_some_and(|live| live.ownership().parking())
    }

    /// Whether `run_id` is live here or parked in this replica's approval store.
    fn in_sight(&self, run_id: &str) -> bool {
        let live = self.lock();
        live.contains_key(run_id) || self.parked_here(run_id).is_some()
    }

    /// One look for the run: here, parked, or elsewhere.
    async fn cancel_once(
        &self,
        run_id: &str,
        caller: &Principal,
        reason: &str,
        mode: CancelMode,
    ) -> Result<CancelOutcome, StoreError> {
        if let Some(outcome) = self.cancel_here(run_id, caller, reason, mode).await {
            return Ok(outcome);
        }
        let parked = match self.parked_here(run_id) {
            Some(parked) => Some(parked),
            None => self.stored(run_id).await?,
        };
        if let Some(parked) = parked.filter(|p| sees(caller, &p.principal) && p.status.is_parked())
            && self.approvals.cancel(run_id, reason).await?
        {
            tracing::info!(run_id = %run_id, principal = %parked.principal, "a run waiting for approvals is canceled");
            return Ok(CancelOutcome::Canceled);
        }
        Ok(match self.stored(run_id).await? {
            Some(result) if !sees(caller, &result.principal) => CancelOutcome::NotFound,
            Some(result) if !result.status.is_live() => CancelOutcome::AlreadyFinished(result.status),
            Some(_) => self.cancel_elsewhere(run_id, reason, mode).await,
            None => CancelOutcome::NotFound,
        })
    }

    /// Cancels `run_id` `mode`'s way when it is live on this replica and `caller` may see it;
    /// `None` when it is not here (or is leaving: parking, or being handed over, so its next
    /// replica answers; or its end could not be kept here, so it goes on elsewhere). A durable
    /// run canceled at once is answered `Canceled` only once its end is kept: told so before,
    /// its caller could see it go on elsewhere from its checkpoint (and run its tools).
    pub(crate) async fn cancel_here(
        &self,
        run_id: &str,
        caller: &Principal,
        reason: &str,
        mode: CancelMode,
    ) -> Option<CancelOutcome> {
        let (outcome, left) = self.cancel_live(run_id, caller, reason, mode)?;
        match (outcome, &self.journal) {
            (CancelOutcome::Canceled, Some(_)) => self.end_kept(left).await,
            (CancelOutcome::EndsAfterTurn, Some(_)) => Some(after_turn_kept(&left, self.store_timeout).await),
            _ => Some(outcome),
        }
    }

    /// The cancel itself, under the registry's lock: the outcome, and what tells when the run
    /// left this replica and whether its end was kept.
    fn cancel_live(
        &self,
        run_id: &str,
        caller: &Principal,
        reason: &str,
        mode: CancelMode,
    ) -> Option<(CancelOutcome, Left)> {
        let live = self.lock();
        let live = live.get(run_id).filter(|l| sees(caller, &l.principal))?;
        let left = Left {
            gone: live.gone.clone(),
            persister: live.persister.clone(),
        };
        // Under the state lock: the loop settles the end under it too, and a cancel that came
        // first wins there, so the answer is never `canceled` for a run that completed.
        let mut state = shared::sync::lock(&live.state);
        if !state.status.is_live() {
            return Some((CancelOutcome::AlreadyFinished(state.status), left));
        }
        let leaving = live.hand_over.at_safe_point.is_cancelled()
            || live.hand_over.now.is_cancelled()
            || live.ownership().parking();
        if state.status.is_parked() || leaving {
            return None;
        }
        live.cancel.cancel_with(mode, reason);
        let outcome = match mode {
            CancelMode::Immediate => CancelOutcome::Canceled,
            CancelMode::AfterTurn => {
                state.ends_after_turn.get_or_insert_with(|| reason.to_owned());
                CancelOutcome::EndsAfterTurn
            }
        };
        Some((outcome, left))
    }

    /// Waits (bounded by the writes a run's end takes) for a canceled run to leave this
    /// replica: `Canceled` once its end is kept here, `None` when it moved on unended (it is
    /// looked for again, and canceled where it resumes), `Unanswered` when its end takes longer.
    async fn end_kept(&self, left: Left) -> Option<CancelOutcome> {
        // Its spend, its log, its thread and its result: one store write each at most.
        let ending = 4 * self.store_timeout;
        if tokio::time::timeout(ending, left.gone.cancelled()).await.is_err() {
            return Some(CancelOutcome::Unanswered);
        }
        left.persister.ownership().ended().then_some(CancelOutcome::Canceled)
    }

    /// Asks the replica running `run_id` (shared store) to cancel it.
    async fn cancel_elsewhere(&self, run_id: &str, reason: &str, mode: CancelMode) -> CancelOutcome {
        let Some(journal) = &self.journal else {
            return CancelOutcome::NotFound;
        };
        match within(self.store_timeout, journal.cancel_elsewhere(run_id, reason, mode)).await {
            Ok(Some(RemoteCancel::Canceled)) => CancelOutcome::Canceled,
            Ok(Some(RemoteCancel::EndsAfterTurn)) => CancelOutcome::EndsAfterTurn,
            Ok(Some(RemoteCancel::Finished(status))) => CancelOutcome::AlreadyFinished(status),
            Ok(None) => CancelOutcome::Unanswered,
            Err(e) => {
                tracing::warn!(run_id = %run_id, "asking the run's replica to cancel it failed: {e}");
                CancelOutcome::Unanswered
            }
        }
    }

    /// Cancels every live run (the drain's last step).
    pub(crate) fn cancel_all(&self, reason: &str) -> usize {
        let live = self.lock();
        for run in live.values() {
            run.cancel.cancel(reason);
        }
        live.len()
    }
}
