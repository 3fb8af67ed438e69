//! Runs waiting for approvals on NATS (with the NATS store): any replica decides, any replica
//! resumes, and a parked run holds nothing on any replica.
//!
//! A run's wait is a JSON record in the key-value bucket `<bucket>-approvals` (under the run's
//! key): its owner, its calls with their decisions, their tools' schemas, and whether it was
//! canceled. Every change is a compare-and-set on the record's revision, so two decisions of one
//! call never both land. A parked run is its checkpoint (in the checkpoint object store) and its
//! run record marked `parked`, with no owner; once its calls are decided (or it is canceled) the
//! replica that saw it so marks the record `ready` (entered in the wake index under that minute,
//! as every parked run is under the minute it wakes) and announces it like a hand-over, and the
//! takeover of every replica claims it (one winner) and resumes it with the decisions; a record
//! whose wake time passed (a call's expiry, or the run's deadline) is claimed the same way.
//!
//! Beside each wait, an empty *marker* key `by.<principal>.<run key>` says whose it is, written
//! before the wait and deleted after it: a principal's listing reads only the waits its markers
//! name, however many other principals' runs wait (an approver's, or a server's without
//! authentication, reads them all).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use futures::{FutureExt, StreamExt};
use prost::Message;
use serde::{Deserialize, Serialize};
use shared::jetstream::{Bucket, Consistency, Error, JetStream, Operation};

use super::kv::token;
use super::results::{KvStore, decode_record, key};
use crate::domain::approval::{
    DecideError, Decider, Decision, PendingApproval, expire_calls, record_decisions, same_calls, wait_decided,
};
use crate::domain::ports::{ApprovalStore, ParkOutcome, Parked, ParkedCalls, StoreError, Wait};
use crate::store::unavailable;

/// Compare-and-set attempts on one record before giving up (others kept changing it).
const CAS_ATTEMPTS: usize = 16;
/// The prefix of the marker keys.
const MARKERS: &str = "by.";
/// Waits read at once while listing.
const LIST_CONCURRENCY: usize = 16;

/// One run's wait, as stored.
#[derive(Serialize, Deserialize)]
struct WaitRecord {
    principal: String,
    calls: Vec<PendingApproval>,
    schemas: BTreeMap<String, serde_json::Value>,
    canceled: Option<String>,
    parked_at_unix_ms: u64,
    /// The epoch of the claim that opened it (absent from versions before epochs: 0): an older
    /// owner neither replaces nor deletes it.
    #[serde(default)]
    epoch: u64,
}

/// The calls of the stored wait `bytes` a person may still decide (none once it was canceled).
pub(super) fn undecided(bytes: &[u8]) -> Result<Vec<String>, String> {
    let wait: WaitRecord = serde_json::from_slice(bytes).map_err(|e| e.to_string())?;
    let open = wait.canceled.is_none();
    Ok(wait
        .calls
        .into_iter()
        .filter(|c| open && c.decision.is_none())
        .map(|c| c.call_id)
        .collect())
}

impl WaitRecord {
    fn decided(&self) -> bool {
        wait_decided(&self.calls)
    }

    /// Decides its undecided calls past their expiry as expired; whether any was.
    fn expire(&mut self, now_unix_ms: u64) -> bool {
        expire_calls(&mut self.calls, now_unix_ms)
    }

    fn parked_calls(&self) -> ParkedCalls {
        ParkedCalls {
            calls: self.calls.clone(),
            canceled: self.canceled.clone(),
            parked_at_unix_ms: self.parked_at_unix_ms,
        }
    }
}

/// See the module docs.
pub struct NatsApprovals {
    waits: Arc<dyn Bucket>,
    store: Arc<KvStore>,
}

impl NatsApprovals {
    /// Binds (or creates) the bucket of waits beside the results bucket `bucket`.
    pub async fn open(
        js: &dyn JetStream,
        bucket: &str,
        ttl: Duration,
        store: Arc<KvStore>,
    ) -> Result<Self, StoreError> {
        let name = format!("{bucket}-approvals");
        let description = "orchestrator tool calls waiting for approval";
        let waits = KvStore::open_bucket(js, &name, ttl, description, store.replicas).await?;
        Ok(Self { waits, store })
    }
}

/// A wait and its revision.
async fn read(waits: &dyn Bucket, key: &str) -> Result<Option<(WaitRecord, u64)>, StoreError> {
    read_from(waits, key, Consistency::Leader).await
}

/// A wait and its revision, as `consistency` reads it: from the leader ([`read`]) wherever what
/// is read decides something (a takeover reading a cancel the wait keeps, a park reading a
/// decision made meanwhile, a compare-and-set), direct only for a listing.
async fn read_from(
    waits: &dyn Bucket,
    key: &str,
    consistency: Consistency,
) -> Result<Option<(WaitRecord, u64)>, StoreError> {
    let entry = waits.entry(key, consistency).await;
    let Some(entry) = entry.map_err(|e| unavailable("KV entry", key, e))? else {
        return Ok(None);
    };
    if entry.operation != Operation::Put {
        return Ok(None);
    }
    let record = serde_json::from_slice(&entry.value).map_err(|e| StoreError::Corrupt {
        key: key.to_owned(),
        reason: e.to_string(),
    })?;
    Ok(Some((record, entry.revision)))
}

/// Writes `record` over `revision`; `Ok(false)` when another write came first.
async fn replace(waits: &dyn Bucket, key: &str, record: &WaitRecord, revision: u64) -> Result<bool, StoreError> {
    let bytes = crate::domain::ports::json("a run's wait", record)?;
    super::kv::write_at(waits, key, bytes.into(), Some(revision)).await
}

/// Marks a parked run `ready` in the run store (compare-and-set; nothing when it is not parked
/// or is ready already) and announces it, so a replica takes it over at once.
async fn mark_ready(store: &KvStore, key: &str) -> Result<(), StoreError> {
    for _ in 0..CAS_ATTEMPTS {
        let entry = store.kv.entry(key, Consistency::Direct).await;
        let Some(entry) = entry.map_err(|e| unavailable("KV entry", key, e))? else {
            return Ok(());
        };
        let mut record = decode_record(key, &entry.value)?;
        if !record.parked || record.ready {
            return Ok(());
        }
        record.ready = true;
        // Entered under this minute first: the next look for orphans finds it.
        super::owners::enter(&*store.kv, &super::owners::wake_key(shared::sync::unix_ms(), key)).await?;
        match store
            .kv
            .update(key, record.encode_to_vec().into(), entry.revision)
            .await
        {
            Ok(_) => {
                let _ = store
                    .js
                    .publish(store.hand_over_subject.clone(), key.as_bytes().to_vec().into())
                    .await;
                return Ok(());
            }
            Err(Error::WrongRevision) => {}
            Err(e) => return Err(unavailable("KV update", key, e)),
        }
    }
    Err(unavailable("KV update", key, "the record kept changing"))
}

/// The decisions of a `decide` call, applied to the stored wait (compare-and-set, tried again
/// while other writes come first).
async fn decide_stored(
    waits: &dyn Bucket,
    run_id: &str,
    decider: &Decider,
    decisions: &[Decision],
) -> Result<WaitRecord, DecideError> {
    let key = key(run_id);
    let unavailable = |e: StoreError| DecideError::Unavailable(e.to_string());
    for _ in 0..CAS_ATTEMPTS {
        let (mut record, revision) = read(waits, &key)
            .await
            .map_err(unavailable)?
            .filter(|(r, _)| r.canceled.is_none())
            .ok_or_else(|| DecideError::NotFound(run_id.to_owned()))?;
        record_decisions(
            run_id,
            &record.principal,
            &mut record.calls,
            &record.schemas,
            decider,
            decisions,
        )?;
        if replace(waits, &key, &record, revision).await.map_err(unavailable)? {
            return Ok(record);
        }
    }
    Err(DecideError::Unavailable(format!(
        "the wait of run {run_id} kept changing under this decision; send it again"
    )))
}

impl NatsApprovals {
    /// Parks a run: its checkpoint, then its record marked `parked` (released by its owner).
    async fn park_stored(
        waits: Arc<dyn Bucket>,
        store: Arc<KvStore>,
        run_id: String,
        parked: Parked,
    ) -> Result<ParkOutcome, StoreError> {
        let key = key(&run_id);
        // The time it parked goes into its wait; every call decided already: it goes on here.
        let mut stamped = false;
        for _ in 0..CAS_ATTEMPTS {
            let Some((mut wait, revision)) = read(&*waits, &key).await? else {
                return Ok(ParkOutcome::Decided(Vec::new(), Box::new(parked)));
            };
            if wait.decided() {
                // Taken by this run now; the wait stays until a checkpoint holds its decisions
                // (this owner may have been replaced: the next one resumes with them).
                return Ok(ParkOutcome::Decided(wait.calls, Box::new(parked)));
            }
            wait.parked_at_unix_ms = parked.parked_at_unix_ms;
            if replace(&*waits, &key, &wait, revision).await? {
                stamped = true;
                break;
            }
        }
        if !stamped {
            return Err(unavailable("KV update", &key, "the wait kept changing"));
        }
        let (target, put) = store.put_checkpoint(&key, parked.checkpoint);
        put.await?;
        let mut record =
            target.named_by(store.record(&parked.result, parked.deadline_unix_ms.max(parked.wake_at_unix_ms)));
        record.parked = true;
        record.wake_at_unix_ms = parked.wake_at_unix_ms;
        record.lease_expires_unix_ms = shared::sync::unix_ms();
        // Entered under the minute it wakes first (never one passed: looks list from now on).
        let wakes = parked.wake_at_unix_ms.max(record.lease_expires_unix_ms);
        super::owners::enter(&*store.kv, &super::owners::wake_key(wakes, &key)).await?;
        store.write(key.clone(), record).await?;
        // Decided (or canceled) while it parked: it is ready at once.
        if let Some((wait, _)) = read(&*waits, &key).await?
            && (wait.decided() || wait.canceled.is_some())
        {
            mark_ready(&store, &key).await?;
        }
        Ok(ParkOutcome::Parked)
    }

    /// The waits `decider` may decide (of `run_id` only, when given), oldest request first: an
    /// approver's (or the anonymous caller's) of every run, another's of its own runs only, found
    /// by their markers.
    async fn listed(
        waits: Arc<dyn Bucket>,
        decider: Decider,
        run_id: Option<String>,
        limit: usize,
    ) -> Result<(Vec<PendingApproval>, bool), StoreError> {
        let keys: Vec<String> = match run_id {
            Some(run_id) => vec![key(&run_id)],
            None if decider.anonymous || decider.approver => every_wait(&*waits).await?,
            None => waits_of(&*waits, &decider.name).await?,
        };
        let records: Vec<WaitRecord> = futures::stream::iter(keys)
            .map(|key| {
                let waits = waits.clone();
                async move {
                    let read = read_from(&*waits, &key, Consistency::Direct).await;
                    read.ok().flatten().map(|(r, _)| r)
                }
            })
            .buffer_unordered(LIST_CONCURRENCY)
            .filter_map(std::future::ready)
            .collect()
            .await;
        let mut calls: Vec<PendingApproval> = records
            .into_iter()
            .filter(|r| r.canceled.is_none() && decider.may_decide(&r.principal))
            .flat_map(|r| r.calls.into_iter().filter(|c| c.decision.is_none()))
            .collect();
        calls.sort_by_key(|c| c.requested_at_unix_ms);
        let more = calls.len() > limit;
        calls.truncate(limit);
        Ok((calls, more))
    }
}

/// The keys of every wait (no marker).
async fn every_wait(waits: &dyn Bucket) -> Result<Vec<String>, StoreError> {
    // Each key is listed once, so no call is listed twice.
    let keys = waits.keys(">").await.map_err(|e| unavailable("KV keys", "", e))?;
    Ok(keys.into_iter().filter(|key| !key.starts_with(MARKERS)).collect())
}

/// The key of the marker of `principal`'s wait under `key`.
fn marker(principal: &str, key: &str) -> String {
    format!("{MARKERS}{}.{key}", token(principal))
}

/// The keys of `principal`'s waits, by their markers: the last entry of each marker key under
/// `by.<principal>.`, read as headers only, deleted ones left out.
async fn waits_of(waits: &dyn Bucket, principal: &str) -> Result<Vec<String>, StoreError> {
    let under = marker(principal, "");
    let keys = waits
        .keys(&format!("{under}>"))
        .await
        .map_err(|e| unavailable("KV markers", &under, e))?;
    Ok(keys
        .into_iter()
        .filter_map(|key| key.strip_prefix(&under).map(str::to_owned))
        .collect())
}

/// Opens `record` under `key`, by compare-and-set: over no wait, over an older owner's, or over
/// the same calls' wait (a resumed run opening it again), whose decisions it keeps. A newer
/// owner's wait stands: the opener was replaced.
async fn open_stored(waits: &dyn Bucket, key: &str, mut record: WaitRecord) -> Result<(), String> {
    let refused = |e: &dyn std::fmt::Display| format!("the approvals bucket did not take the wait: {e}");
    // The marker first: a wait is never without its marker (a marker without its wait is
    // passed over, and expires with the bucket).
    waits
        .put(&marker(&record.principal, key), bytes::Bytes::new())
        .await
        .map_err(|e| refused(&e))?;
    for _ in 0..CAS_ATTEMPTS {
        let current = read(waits, key).await.map_err(|e| refused(&e))?;
        let written = match current {
            None => {
                let bytes = crate::domain::ports::json("a run's wait", &record).map_err(|e| refused(&e))?;
                match waits.create(key, bytes.into()).await {
                    Ok(_) => true,
                    Err(Error::Exists) => false,
                    Err(e) => return Err(refused(&e)),
                }
            }
            Some((stored, _)) if stored.epoch > record.epoch => {
                return Err(format!(
                    "another replica holds the run (its wait is of epoch {}, this replica's claim of epoch {})",
                    stored.epoch, record.epoch
                ));
            }
            Some((stored, revision)) => {
                if same_calls(&stored.calls, &record.calls) {
                    record.calls = stored.calls.clone();
                    record.canceled = stored.canceled.clone();
                }
                replace(waits, key, &record, revision).await.map_err(|e| refused(&e))?
            }
        };
        if written {
            return Ok(());
        }
    }
    Err(refused(&"the wait kept changing"))
}

/// Deletes the wait at `key` unless a newer owner than `epoch`'s opened it, or (`keep_canceled`)
/// it holds a cancel, which is returned (the delete is at the revision read, so a cancel either
/// landed before the read, and is seen, or finds no wait).
async fn close_stored(waits: &dyn Bucket, key: &str, epoch: u64, keep_canceled: bool) -> Option<String> {
    for _ in 0..CAS_ATTEMPTS {
        let Ok(Some((stored, revision))) = read(waits, key).await else {
            return None;
        };
        if stored.epoch > epoch {
            return None;
        }
        if keep_canceled && stored.canceled.is_some() {
            return stored.canceled;
        }
        match waits.delete(key, Some(revision)).await {
            Ok(()) => {
                if let Err(e) = waits.delete(&marker(&stored.principal, key), None).await {
                    tracing::debug!(%key, "the wait's marker stays until it expires: {e}");
                }
                return None;
            }
            Err(Error::WrongRevision) => {}
            Err(e) => {
                tracing::warn!(%key, "closing the approval wait failed (it expires with the bucket): {e}");
                return None;
            }
        }
    }
    None
}

impl ApprovalStore for NatsApprovals {
    fn open(&self, wait: Wait) -> BoxFuture<'static, Result<(), String>> {
        let waits = self.waits.clone();
        let (key, principal, epoch) = (key(&wait.run_id), wait.principal.clone(), wait.epoch);
        let (calls, schemas) = wait.into_calls();
        let record = WaitRecord {
            principal,
            calls,
            schemas,
            canceled: None,
            parked_at_unix_ms: 0,
            epoch,
        };
        async move { open_stored(&*waits, &key, record).await }.boxed()
    }

    fn park(&self, run_id: &str, parked: Parked) -> BoxFuture<'static, Result<ParkOutcome, StoreError>> {
        Self::park_stored(self.waits.clone(), Arc::clone(&self.store), run_id.to_owned(), parked).boxed()
    }

    fn decide(
        &self,
        run_id: &str,
        decider: &Decider,
        decisions: &[Decision],
    ) -> BoxFuture<'static, Result<Vec<PendingApproval>, DecideError>> {
        let (waits, store) = (self.waits.clone(), Arc::clone(&self.store));
        let (run_id, decider, decisions) = (run_id.to_owned(), decider.clone(), decisions.to_vec());
        async move {
            let record = decide_stored(&*waits, &run_id, &decider, &decisions).await?;
            if record.decided() {
                // A parked run goes on; a live one takes the decisions when it parks.
                mark_ready(&store, &key(&run_id))
                    .await
                    .map_err(|e| DecideError::Unavailable(e.to_string()))?;
            }
            Ok(record.calls)
        }
        .boxed()
    }

    fn pending(
        &self,
        decider: &Decider,
        run_id: Option<&str>,
        limit: usize,
    ) -> BoxFuture<'static, Result<(Vec<PendingApproval>, bool), StoreError>> {
        Self::listed(self.waits.clone(), decider.clone(), run_id.map(str::to_owned), limit).boxed()
    }

    fn parked_calls(&self, run_id: &str) -> BoxFuture<'static, Result<Option<ParkedCalls>, StoreError>> {
        let (waits, key) = (self.waits.clone(), key(run_id));
        async move { Ok(read(&*waits, &key).await?.map(|(r, _)| r.parked_calls())) }.boxed()
    }

    fn wake(&self, run_id: &str, now_unix_ms: u64) -> BoxFuture<'static, Result<Option<ParkedCalls>, StoreError>> {
        let (waits, key) = (self.waits.clone(), key(run_id));
        async move {
            for _ in 0..CAS_ATTEMPTS {
                let Some((mut wait, revision)) = read(&*waits, &key).await? else {
                    return Ok(None);
                };
                if !wait.expire(now_unix_ms) || replace(&*waits, &key, &wait, revision).await? {
                    return Ok(Some(wait.parked_calls()));
                }
            }
            Err(unavailable("KV update", &key, "the wait kept changing"))
        }
        .boxed()
    }

    fn cancel(&self, run_id: &str, reason: &str) -> BoxFuture<'static, Result<bool, StoreError>> {
        let (waits, store, key, reason) = (
            self.waits.clone(),
            Arc::clone(&self.store),
            key(run_id),
            reason.to_owned(),
        );
        async move {
            for _ in 0..CAS_ATTEMPTS {
                let Some((mut wait, revision)) = read(&*waits, &key).await? else {
                    return Ok(false);
                };
                wait.canceled = Some(reason.clone());
                if replace(&*waits, &key, &wait, revision).await? {
                    mark_ready(&store, &key).await?;
                    return Ok(true);
                }
            }
            Err(unavailable("KV update", &key, "the wait kept changing"))
        }
        .boxed()
    }

    fn close(&self, run_id: &str, epoch: u64) -> BoxFuture<'static, ()> {
        let (waits, key) = (self.waits.clone(), key(run_id));
        async move {
            close_stored(&*waits, &key, epoch, false).await;
        }
        .boxed()
    }

    fn close_decided(&self, run_id: &str, epoch: u64) -> BoxFuture<'static, Option<String>> {
        let (waits, key) = (self.waits.clone(), key(run_id));
        async move { close_stored(&*waits, &key, epoch, true).await }.boxed()
    }
}
