//! The fixes of the store's behaviour a `--without` switch turns off, as wrappers over the real
//! adapters' ports (the adapters themselves stay as they ship): a journal that keeps checkpoints
//! without the tasks their calls became, or never tells a takeover that the run it claimed read
//! parked (and an approval store keeping a parked run's checkpoint without them too). Each shows
//! what the simulation catches when the fix is gone.

use std::sync::Arc;

use futures::future::BoxFuture;
use futures::stream::BoxStream;
use orchestrator::domain::approval::{DecideError, Decider, Decision, PendingApproval};
use orchestrator::domain::ports::{
    ApprovalStore, CancelAsk, Claim, Claimed, ParkOutcome, Parked, Ready, RemoteCancel, RemoteSteer, RunJournal,
    SteeringAsk, StoreError, Wait, Waiting,
};
use orchestrator::domain::{CancelMode, RunResult, steering::UserMessage};

/// Where a checkpoint written without its tasks keeps them for the checks alone: the loop reads
/// no such field, so a takeover resumes as if the calls had become no tasks, while the checks
/// still see that the owner had kept them.
pub const FORGOTTEN_TASKS: &str = "forgotten_tasks";

/// `checkpoint` without the tasks its calls became (`calls.tasks`, moved to
/// [`FORGOTTEN_TASKS`]).
fn without_tasks(checkpoint: Vec<u8>) -> Vec<u8> {
    let Ok(mut json) = serde_json::from_slice::<serde_json::Value>(&checkpoint) else {
        return checkpoint;
    };
    if let Some(calls) = json.get_mut("calls").and_then(serde_json::Value::as_object_mut)
        && let Some(tasks) = calls.remove("tasks")
    {
        calls.insert(FORGOTTEN_TASKS.to_owned(), tasks);
    }
    serde_json::to_vec(&json).unwrap_or(checkpoint)
}

/// A journal with some of its fixes off.
pub struct Journal {
    inner: Arc<dyn RunJournal>,
    /// Checkpoints are kept without their tasks (a takeover starts such a call again).
    forget_tasks: bool,
    /// A takeover is never told that its run read parked (the run goes on without a slot).
    hide_parked: bool,
}

impl Journal {
    /// `inner`, keeping checkpoints' tasks unless `task_handles` is off, telling a takeover its
    /// run read parked unless `parked_claims` is off.
    pub fn over(inner: Arc<dyn RunJournal>, task_handles: bool, parked_claims: bool) -> Arc<dyn RunJournal> {
        if task_handles && parked_claims {
            return inner;
        }
        Arc::new(Self {
            inner,
            forget_tasks: !task_handles,
            hide_parked: !parked_claims,
        })
    }

    fn kept(&self, checkpoint: Vec<u8>) -> Vec<u8> {
        match self.forget_tasks {
            true => without_tasks(checkpoint),
            false => checkpoint,
        }
    }
}

impl RunJournal for Journal {
    fn save(
        &self,
        result: RunResult,
        deadline: u64,
        checkpoint: Vec<u8>,
    ) -> BoxFuture<'static, Result<(), StoreError>> {
        self.inner.save(result, deadline, self.kept(checkpoint))
    }

    fn claim_resumable(
        &self,
        result: RunResult,
        deadline: u64,
        checkpoint: Vec<u8>,
    ) -> BoxFuture<'static, Result<Claim, StoreError>> {
        self.inner.claim_resumable(result, deadline, self.kept(checkpoint))
    }

    fn forget(&self, run_id: &str) -> BoxFuture<'static, Result<(), StoreError>> {
        self.inner.forget(run_id)
    }

    fn orphans(&self) -> BoxFuture<'static, Result<Vec<String>, StoreError>> {
        self.inner.orphans()
    }

    fn take_over(&self, run_id: &str) -> BoxFuture<'static, Result<Option<Claimed>, StoreError>> {
        let taken = self.inner.take_over(run_id);
        let hide_parked = self.hide_parked;
        Box::pin(async move {
            Ok(taken.await?.map(|claimed| Claimed {
                parked: claimed.parked && !hide_parked,
                ..claimed
            }))
        })
    }

    fn hand_over(&self, run_id: &str) -> BoxFuture<'static, Result<(), StoreError>> {
        self.inner.hand_over(run_id)
    }

    fn hand_overs(&self) -> BoxFuture<'static, BoxStream<'static, ()>> {
        self.inner.hand_overs()
    }

    fn cancel_elsewhere(
        &self,
        run_id: &str,
        reason: &str,
        mode: CancelMode,
    ) -> BoxFuture<'static, Result<Option<RemoteCancel>, StoreError>> {
        self.inner.cancel_elsewhere(run_id, reason, mode)
    }

    fn cancel_asks(&self) -> BoxFuture<'static, BoxStream<'static, CancelAsk>> {
        self.inner.cancel_asks()
    }

    fn steer_elsewhere(
        &self,
        run_id: &str,
        message: UserMessage,
    ) -> BoxFuture<'static, Result<Option<RemoteSteer>, StoreError>> {
        self.inner.steer_elsewhere(run_id, message)
    }

    fn steering_asks(&self) -> BoxFuture<'static, BoxStream<'static, SteeringAsk>> {
        self.inner.steering_asks()
    }
}

/// An approval store keeping parked runs' checkpoints without their tasks.
pub struct Approvals {
    inner: Arc<dyn ApprovalStore>,
}

impl Approvals {
    /// `inner`, keeping parked checkpoints' tasks unless `task_handles` is off.
    pub fn over(inner: Arc<dyn ApprovalStore>, task_handles: bool) -> Arc<dyn ApprovalStore> {
        match task_handles {
            true => inner,
            false => Arc::new(Self { inner }),
        }
    }
}

impl ApprovalStore for Approvals {
    fn open(&self, wait: Wait) -> BoxFuture<'static, Result<(), String>> {
        self.inner.open(wait)
    }

    fn park(&self, run_id: &str, mut parked: Parked) -> BoxFuture<'static, Result<ParkOutcome, StoreError>> {
        parked.checkpoint = without_tasks(std::mem::take(&mut parked.checkpoint));
        self.inner.park(run_id, parked)
    }

    fn decide(
        &self,
        run_id: &str,
        decider: &Decider,
        decisions: &[Decision],
    ) -> BoxFuture<'static, Result<Vec<PendingApproval>, DecideError>> {
        self.inner.decide(run_id, decider, decisions)
    }

    fn pending(
        &self,
        decider: &Decider,
        run_id: Option<&str>,
        limit: usize,
    ) -> BoxFuture<'static, Result<(Vec<PendingApproval>, bool), StoreError>> {
        self.inner.pending(decider, run_id, limit)
    }

    fn waiting(&self, run_id: &str) -> BoxFuture<'static, Result<Option<Waiting>, StoreError>> {
        self.inner.waiting(run_id)
    }

    fn wake(&self, run_id: &str, now_unix_ms: u64) -> BoxFuture<'static, Result<Option<Waiting>, StoreError>> {
        self.inner.wake(run_id, now_unix_ms)
    }

    fn parked(&self, run_id: &str) -> Option<RunResult> {
        self.inner.parked(run_id)
    }

    fn parked_runs(&self) -> Vec<RunResult> {
        self.inner.parked_runs()
    }

    fn cancel(&self, run_id: &str, reason: &str) -> BoxFuture<'static, Result<bool, StoreError>> {
        self.inner.cancel(run_id, reason)
    }

    fn close(&self, run_id: &str, epoch: u64) -> BoxFuture<'static, ()> {
        self.inner.close(run_id, epoch)
    }

    fn close_decided(&self, run_id: &str, epoch: u64) -> BoxFuture<'static, Option<String>> {
        self.inner.close_decided(run_id, epoch)
    }

    fn expire(&self, now_unix_ms: u64) {
        self.inner.expire(now_unix_ms);
    }

    fn take_ready(&self) -> Option<Ready> {
        self.inner.take_ready()
    }

    fn put_back(&self, ready: Ready) {
        self.inner.put_back(ready);
    }

    fn changed(&self) -> BoxFuture<'static, ()> {
        self.inner.changed()
    }
}
