//! The fixes of the store's behaviour a `--without` switch turns off, the adapters staying as they
//! ship: a checkpoint store that keeps checkpoints without the tasks their calls became
//! ([`without_tasks`], the filter of a replica's connection), and a journal that never tells a
//! takeover that the run it claimed read parked ([`Journal`]), and a result store whose runs never
//! find their incarnation's lease run out ([`Store`]). Each shows what the simulation catches when
//! the fix is gone.

use std::sync::Arc;

use futures::future::BoxFuture;
use futures::stream::BoxStream;
use orchestrator::domain::ports::{
    CancelAsk, Claim, Claimed, RemoteCancel, RemoteSteer, ResultStore, RunJournal, SteeringAsk, StoreError,
};
use orchestrator::domain::{CancelMode, LeaseTerms, Liveness, RunResult, steering::UserMessage};

/// Where a checkpoint written without its tasks keeps them for the checks alone: the loop reads
/// no such field, so a takeover resumes as if the calls had become no tasks, while the checks
/// still see that the owner had kept them.
pub const FORGOTTEN_TASKS: &str = "forgotten_tasks";

/// `checkpoint` without the tasks its calls became (`calls.tasks`, moved to
/// [`FORGOTTEN_TASKS`]).
pub fn without_tasks(checkpoint: Vec<u8>) -> Vec<u8> {
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

/// A journal that never tells a takeover that the run it claimed read parked (the run goes on
/// without a slot).
pub struct Journal {
    inner: Arc<dyn RunJournal>,
}

impl Journal {
    /// `inner`, telling a takeover its run read parked unless `parked_claims` is off.
    pub fn over(inner: Arc<dyn RunJournal>, parked_claims: bool) -> Arc<dyn RunJournal> {
        match parked_claims {
            true => inner,
            false => Arc::new(Self { inner }),
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
        self.inner.save(result, deadline, checkpoint)
    }

    fn claim_resumable(
        &self,
        result: RunResult,
        deadline: u64,
        checkpoint: Vec<u8>,
    ) -> BoxFuture<'static, Result<Claim, StoreError>> {
        self.inner.claim_resumable(result, deadline, checkpoint)
    }

    fn keeps_segments(&self) -> bool {
        self.inner.keeps_segments()
    }

    fn keep_segment(&self, run_id: &str, segment: Vec<u8>) -> BoxFuture<'static, Result<Option<u64>, StoreError>> {
        self.inner.keep_segment(run_id, segment)
    }

    fn segments(&self, run_id: &str, positions: Vec<u64>) -> BoxFuture<'static, Result<Vec<Vec<u8>>, StoreError>> {
        self.inner.segments(run_id, positions)
    }

    fn forget(&self, run_id: &str) -> BoxFuture<'static, Result<(), StoreError>> {
        self.inner.forget(run_id)
    }

    fn orphans(&self) -> BoxFuture<'static, Result<Vec<String>, StoreError>> {
        self.inner.orphans()
    }

    fn take_over(&self, run_id: &str) -> BoxFuture<'static, Result<Option<Claimed>, StoreError>> {
        let taken = self.inner.take_over(run_id);
        Box::pin(async move {
            Ok(taken.await?.map(|claimed| Claimed {
                parked: false,
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

    fn keep_alive(&self) -> BoxFuture<'static, ()> {
        self.inner.keep_alive()
    }

    fn retire(&self) -> BoxFuture<'static, ()> {
        self.inner.retire()
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

/// A result store whose runs read their incarnation's lease through a handle that never lapses
/// (`Liveness::never_lapsing`): a replica paused or cut off past its lease goes on acting for
/// the runs it held when it comes back, until a fence stops it.
pub struct Store {
    inner: Arc<dyn ResultStore>,
}

impl Store {
    /// `inner`, its runs' ownership never lapsing unless `self_expiry` is on.
    pub fn over(inner: Arc<dyn ResultStore>, self_expiry: bool) -> Arc<dyn ResultStore> {
        match self_expiry {
            true => inner,
            false => Arc::new(Self { inner }),
        }
    }
}

impl ResultStore for Store {
    fn put(&self, result: RunResult) -> BoxFuture<'static, Result<(), StoreError>> {
        self.inner.put(result)
    }

    fn claim(&self, result: RunResult) -> BoxFuture<'static, Result<Claim, StoreError>> {
        self.inner.claim(result)
    }

    fn get(&self, run_id: &str) -> BoxFuture<'static, Result<Option<RunResult>, StoreError>> {
        self.inner.get(run_id)
    }

    fn lease(&self) -> Option<LeaseTerms> {
        self.inner.lease()
    }

    fn epoch(&self, run_id: &str) -> u64 {
        self.inner.epoch(run_id)
    }

    fn liveness(&self) -> Option<Liveness> {
        self.inner.liveness().map(|liveness| liveness.never_lapsing())
    }

    fn generation(&self, run_id: &str) -> u64 {
        self.inner.generation(run_id)
    }
}
