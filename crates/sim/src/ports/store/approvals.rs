//! Runs waiting for a person (approvals, a tool's questions) or a task, as the NATS adapter keeps
//! them (`store/nats/approvals.rs`): a run's wait is a record of its own, changed only by
//! compare-and-set on its revision (two answers to one call never both land), carrying the epoch
//! that opened it (an older owner neither replaces nor deletes a newer owner's); a parked run is
//! its checkpoint and its record marked `awaiting`, with no lease; once decided (or canceled) the
//! replica that saw it so marks the record `ready`, and the takeover of every replica claims it
//! (one winner), as it claims a record whose wake time passed. The decision rules are the
//! domain's (`record_decisions`). Every read and write is a request of its own, so faults fall
//! between them as between the adapter's.

use std::collections::BTreeMap;

use futures::FutureExt as _;
use futures::future::BoxFuture;
use orchestrator::domain::RunResult;
use orchestrator::domain::approval::{
    DecideError, Decider, Decision, PendingApproval, expire_calls, record_decisions, same_calls, wait_decided,
};
use orchestrator::domain::ports::{ApprovalStore, ParkOutcome, Parked, Ready, StoreError, Wait, Waiting};

use super::quotas::next_revision;
use super::{ReplicaStore, Shared, recorded};

/// Compare-and-set attempts on one wait before giving up (others kept changing it).
const CAS_ATTEMPTS: usize = 16;

/// One run's wait, as stored.
#[derive(Debug, Clone)]
pub struct StoredWait {
    principal: String,
    /// Its calls, each with its decision once made.
    pub calls: Vec<PendingApproval>,
    schemas: BTreeMap<String, serde_json::Value>,
    canceled: Option<String>,
    parked_at_unix_ms: u64,
    /// The epoch of the claim that opened it.
    pub epoch: u64,
}

impl StoredWait {
    fn decided(&self) -> bool {
        wait_decided(&self.calls)
    }

    /// The calls a person may still decide (none once canceled).
    pub fn undecided(&self) -> impl Iterator<Item = &PendingApproval> {
        let open = self.canceled.is_none();
        self.calls.iter().filter(move |c| open && c.decision.is_none())
    }

    fn waiting(&self) -> Waiting {
        Waiting {
            calls: self.calls.clone(),
            canceled: self.canceled.clone(),
            parked_at_unix_ms: self.parked_at_unix_ms,
        }
    }
}

impl ReplicaStore {
    /// A run's wait and its revision.
    async fn read_wait(&self, run_id: &str) -> Result<Option<(StoredWait, u64)>, StoreError> {
        let run_id = run_id.to_owned();
        self.request("KV entry", &run_id.clone(), move |shared, _| {
            Ok(shared.waits.get(&run_id).cloned())
        })
        .await
    }

    /// Writes `wait` over `revision` (`None`: absent); whether this write won.
    async fn write_wait(&self, run_id: &str, wait: StoredWait, over: Option<u64>) -> Result<bool, StoreError> {
        let run_id = run_id.to_owned();
        self.request("KV wait write", &run_id.clone(), move |shared, _| {
            if shared.waits.get(&run_id).map(|(_, revision)| *revision) != over {
                return Ok(false);
            }
            let revision = next_revision(shared);
            shared.waits.insert(run_id, (wait, revision));
            Ok(true)
        })
        .await
    }

    /// Deletes a run's wait at `revision`; whether this delete won.
    async fn delete_wait(&self, run_id: &str, revision: u64) -> Result<bool, StoreError> {
        let run_id = run_id.to_owned();
        self.request("KV wait delete", &run_id.clone(), move |shared, _| {
            if shared.waits.get(&run_id).map(|(_, r)| *r) != Some(revision) {
                return Ok(false);
            }
            shared.waits.remove(&run_id);
            Ok(true)
        })
        .await
    }

    /// Marks a parked run `ready` (nothing when it is not parked, or is ready already).
    async fn mark_ready(&self, run_id: &str) -> Result<(), StoreError> {
        let run_id = run_id.to_owned();
        self.request("KV update", &run_id.clone(), move |shared, _| {
            if let Some(record) = shared.records.get_mut(&run_id)
                && record.awaiting
            {
                record.ready = true;
            }
            Ok(())
        })
        .await
    }

    /// Opens `wait` by compare-and-set: over no wait, an older owner's, or the same calls' (a
    /// resumed run opening it again), whose decisions it keeps; a newer owner's stands.
    async fn open_wait(&self, run_id: &str, mut wait: StoredWait) -> Result<(), String> {
        let refused = |e: &dyn std::fmt::Display| format!("the approvals bucket did not take the wait: {e}");
        for _ in 0..CAS_ATTEMPTS {
            let current = self.read_wait(run_id).await.map_err(|e| refused(&e))?;
            let over = match current {
                Some((stored, _)) if stored.epoch > wait.epoch => {
                    return Err(format!(
                        "another replica holds the run (its wait is of epoch {}, this replica's claim of epoch {})",
                        stored.epoch, wait.epoch
                    ));
                }
                Some((stored, revision)) => {
                    if same_calls(&stored.calls, &wait.calls) {
                        wait.calls = stored.calls;
                        wait.canceled = stored.canceled;
                    }
                    Some(revision)
                }
                None => None,
            };
            if self
                .write_wait(run_id, wait.clone(), over)
                .await
                .map_err(|e| refused(&e))?
            {
                return Ok(());
            }
        }
        Err(refused(&"the wait kept changing"))
    }

    /// Stamps the time the run parked into its wait; the wait's calls when every one was
    /// decided already (it goes on here), `None` when the run parks.
    async fn stamp_parked(&self, run_id: &str, at: u64) -> Result<Option<Vec<PendingApproval>>, StoreError> {
        for _ in 0..CAS_ATTEMPTS {
            let Some((mut wait, revision)) = self.read_wait(run_id).await? else {
                return Ok(Some(Vec::new()));
            };
            if wait.decided() {
                // It stays until a checkpoint holds its decisions.
                return Ok(Some(wait.calls));
            }
            wait.parked_at_unix_ms = at;
            if self.write_wait(run_id, wait, Some(revision)).await? {
                return Ok(None);
            }
        }
        Err(unchanged(run_id))
    }

    /// The parked run's checkpoint and record marked `awaiting` (by its owner, fenced).
    async fn write_parked(&self, result: RunResult, checkpoint: Vec<u8>, wake_at: u64) -> Result<(), StoreError> {
        let run_id = result.run_id.clone();
        self.request("KV update", &run_id.clone(), move |shared, this| {
            let kept = this.kept(checkpoint);
            let record = this.mine(shared, &run_id)?;
            record.checkpointed_calls = recorded(&result, Some(&kept));
            record.result = result;
            record.checkpoint = Some(kept);
            record.awaiting = true;
            record.ready = false;
            record.wake_at_unix_ms = wake_at;
            Ok(())
        })
        .await
    }

    async fn park_stored(self, run_id: String, parked: Parked) -> Result<ParkOutcome, StoreError> {
        if let Some(calls) = self.stamp_parked(&run_id, parked.parked_at_unix_ms).await? {
            return Ok(ParkOutcome::Decided(calls, Box::new(parked)));
        }
        let (result, checkpoint) = (parked.result.clone(), parked.checkpoint.clone());
        self.write_parked(result, checkpoint, parked.wake_at_unix_ms).await?;
        // Decided (or canceled) while it parked: it is ready at once.
        if let Some((wait, _)) = self.read_wait(&run_id).await?
            && (wait.decided() || wait.canceled.is_some())
        {
            self.mark_ready(&run_id).await?;
        }
        Ok(ParkOutcome::Parked)
    }

    async fn decide_stored(
        self,
        run_id: String,
        decider: Decider,
        decisions: Vec<Decision>,
    ) -> Result<Vec<PendingApproval>, DecideError> {
        let unavailable = |e: StoreError| DecideError::Unavailable(e.to_string());
        for _ in 0..CAS_ATTEMPTS {
            let (mut wait, revision) = self
                .read_wait(&run_id)
                .await
                .map_err(unavailable)?
                .filter(|(w, _)| w.canceled.is_none())
                .ok_or_else(|| DecideError::NotFound(run_id.clone()))?;
            record_decisions(
                &run_id,
                &wait.principal,
                &mut wait.calls,
                &wait.schemas,
                &decider,
                &decisions,
            )?;
            let calls = wait.calls.clone();
            let decided = wait.decided();
            if self
                .write_wait(&run_id, wait, Some(revision))
                .await
                .map_err(unavailable)?
            {
                if decided {
                    self.mark_ready(&run_id).await.map_err(unavailable)?;
                }
                return Ok(calls);
            }
        }
        Err(DecideError::Unavailable(format!(
            "the wait of run {run_id} kept changing under this decision; send it again"
        )))
    }

    async fn wake_stored(self, run_id: String, now_unix_ms: u64) -> Result<Option<Waiting>, StoreError> {
        for _ in 0..CAS_ATTEMPTS {
            let Some((mut wait, revision)) = self.read_wait(&run_id).await? else {
                return Ok(None);
            };
            let expired = !self.wake_reads_only && expire_calls(&mut wait.calls, now_unix_ms);
            let waiting = wait.waiting();
            if !expired || self.write_wait(&run_id, wait, Some(revision)).await? {
                return Ok(Some(waiting));
            }
        }
        Err(unchanged(&run_id))
    }

    async fn cancel_stored(self, run_id: String, reason: String) -> Result<bool, StoreError> {
        for _ in 0..CAS_ATTEMPTS {
            let Some((mut wait, revision)) = self.read_wait(&run_id).await? else {
                return Ok(false);
            };
            wait.canceled = Some(reason.clone());
            if self.write_wait(&run_id, wait, Some(revision)).await? {
                self.mark_ready(&run_id).await?;
                return Ok(true);
            }
        }
        Err(unchanged(&run_id))
    }

    async fn close_stored(self, run_id: String, epoch: u64, keep_canceled: bool) -> Option<String> {
        for _ in 0..CAS_ATTEMPTS {
            let Ok(Some((stored, revision))) = self.read_wait(&run_id).await else {
                return None;
            };
            if stored.epoch > epoch {
                return None;
            }
            if keep_canceled && stored.canceled.is_some() {
                return stored.canceled;
            }
            match self.delete_wait(&run_id, revision).await {
                Ok(false) => {}
                Ok(true) | Err(_) => return None,
            }
        }
        None
    }
}

fn unchanged(run_id: &str) -> StoreError {
    StoreError::Unavailable {
        operation: "KV update",
        key: run_id.to_owned(),
        reason: "the wait kept changing".to_owned(),
    }
}

/// The calls of every wait `decider` may decide (of `run_id` only, when given), oldest first.
fn listed(shared: &Shared, decider: &Decider, run_id: Option<&str>) -> Vec<PendingApproval> {
    let mut calls: Vec<PendingApproval> = shared
        .waits
        .iter()
        .filter(|(id, _)| run_id.is_none_or(|r| r == id.as_str()))
        .map(|(_, (wait, _))| wait)
        .filter(|w| decider.may_decide(&w.principal))
        .flat_map(|w| w.undecided().cloned())
        .collect();
    calls.sort_by_key(|c| c.requested_at_unix_ms);
    calls
}

impl ApprovalStore for ReplicaStore {
    fn open(&self, wait: Wait) -> BoxFuture<'static, Result<(), String>> {
        let (this, run_id, principal, epoch) = (self.clone(), wait.run_id.clone(), wait.principal.clone(), wait.epoch);
        let (calls, schemas) = wait.into_calls();
        let stored = StoredWait {
            principal,
            calls,
            schemas,
            canceled: None,
            parked_at_unix_ms: 0,
            epoch,
        };
        async move { this.open_wait(&run_id, stored).await }.boxed()
    }

    fn park(&self, run_id: &str, parked: Parked) -> BoxFuture<'static, Result<ParkOutcome, StoreError>> {
        self.clone().park_stored(run_id.to_owned(), parked).boxed()
    }

    fn decide(
        &self,
        run_id: &str,
        decider: &Decider,
        decisions: &[Decision],
    ) -> BoxFuture<'static, Result<Vec<PendingApproval>, DecideError>> {
        self.clone()
            .decide_stored(run_id.to_owned(), decider.clone(), decisions.to_vec())
            .boxed()
    }

    fn pending(
        &self,
        decider: &Decider,
        run_id: Option<&str>,
        limit: usize,
    ) -> BoxFuture<'static, Result<(Vec<PendingApproval>, bool), StoreError>> {
        let (decider, run_id) = (decider.clone(), run_id.map(str::to_owned));
        self.boxed("KV keys", "waits", move |shared, _| {
            let mut calls = listed(shared, &decider, run_id.as_deref());
            let more = calls.len() > limit;
            calls.truncate(limit);
            Ok((calls, more))
        })
    }

    fn waiting(&self, run_id: &str) -> BoxFuture<'static, Result<Option<Waiting>, StoreError>> {
        let this = self.clone();
        let run_id = run_id.to_owned();
        async move { Ok(this.read_wait(&run_id).await?.map(|(w, _)| w.waiting())) }.boxed()
    }

    fn wake(&self, run_id: &str, now_unix_ms: u64) -> BoxFuture<'static, Result<Option<Waiting>, StoreError>> {
        self.clone().wake_stored(run_id.to_owned(), now_unix_ms).boxed()
    }

    fn parked(&self, _run_id: &str) -> Option<RunResult> {
        // The run store answers for a parked run (its record reads parked).
        None
    }

    fn cancel(&self, run_id: &str, reason: &str) -> BoxFuture<'static, Result<bool, StoreError>> {
        self.clone().cancel_stored(run_id.to_owned(), reason.to_owned()).boxed()
    }

    fn close(&self, run_id: &str, epoch: u64) -> BoxFuture<'static, ()> {
        self.clone()
            .close_stored(run_id.to_owned(), epoch, false)
            .map(drop)
            .boxed()
    }

    fn close_decided(&self, run_id: &str, epoch: u64) -> BoxFuture<'static, Option<String>> {
        self.clone().close_stored(run_id.to_owned(), epoch, true).boxed()
    }

    fn expire(&self, _now_unix_ms: u64) {
        // The takeover wakes parked runs (their record's wake time).
    }

    fn take_ready(&self) -> Option<Ready> {
        None
    }

    fn put_back(&self, _ready: Ready) {}

    fn changed(&self) -> BoxFuture<'static, ()> {
        futures::future::pending().boxed()
    }
}
