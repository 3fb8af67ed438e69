//! Run results in a NATS JetStream key-value bucket: shared by every orchestrator replica and
//! kept across restarts. Each value is a [`Record`]: the `orchestrator.v1.RunResult`, the replica
//! that owns the run and, while it runs, the end of its lease, under a `run.<run_id>`-derived key
//! (run ids are escaped into a valid key); entries expire after the bucket's TTL.
//!
//! A live run's owner renews its lease by writing the run's state every third of the lease. A run
//! is claimed with the bucket's create-if-absent, so of two replicas starting the same id at once
//! exactly one runs it; every later write of its owner is a compare-and-set on the revision it
//! wrote last, so once another replica took the run over (see the journal, `nats_journal.rs`) the old
//! owner's writes are refused ([`StoreError::Fenced`]) and it stops the run.
//!
//! A RUNNING record whose lease has expired belongs to a replica that crashed or lost the store.
//! With a checkpoint it reads RUNNING until its deadline (another replica resumes it); without
//! one, or past the deadline, it reads FAILED `ORCHESTRATOR_LOST` with the output last written.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::jetstream;
use futures::FutureExt;
use futures::future::BoxFuture;
use prost::Message;
use proto::orchestrator::v1 as pb;

use crate::domain::ports::{Claim, ResultStore, StoreError};
use crate::domain::{FailureReason, RunResult, RunStatus};

/// See the module docs.
pub struct KvStore {
    pub(super) kv: jetstream::kv::Store,
    /// This replica, written into the records of its runs.
    pub(super) owner: String,
    pub(super) lease: Duration,
    /// The runs this replica owns, by key: their writes are fenced on the revision.
    pub(super) owned: Arc<Mutex<HashMap<String, Owned>>>,
    /// Checkpoints of live runs, by key (an object store: a checkpoint may be larger than one
    /// message).
    pub(super) checkpoints: jetstream::object_store::ObjectStore,
    /// Where hand-overs are announced (core NATS, `<bucket>.handovers`).
    pub(super) client: async_nats::Client,
    pub(super) handover_subject: String,
    /// Where cancels are asked of the replica running a run (core NATS, `<bucket>.cancels`).
    pub(super) cancel_subject: String,
}

/// A stored run.
#[derive(Clone, PartialEq, prost::Message)]
pub(super) struct Record {
    #[prost(message, optional, tag = "1")]
    pub result: Option<pb::RunResult>,
    /// The replica running (or that ran) the run.
    #[prost(string, tag = "2")]
    pub owner: String,
    /// While RUNNING: the record counts only until then (Unix ms) unless renewed.
    #[prost(uint64, tag = "3")]
    pub lease_expires_unix_ms: u64,
    /// The owner released the run at a safe point (drain): another replica takes it at once.
    #[prost(bool, tag = "4")]
    pub handed_over: bool,
    /// The run has a checkpoint another replica may resume until then (its deadline, Unix ms);
    /// 0: none.
    #[prost(uint64, tag = "5")]
    pub resumable_until_unix_ms: u64,
    /// The run is parked waiting for approvals: it has no owner until it is ready.
    #[prost(bool, tag = "6")]
    pub awaiting: bool,
    /// A parked run's calls are decided (or it was canceled): any replica resumes it now.
    #[prost(bool, tag = "7")]
    pub ready: bool,
    /// A parked run wakes then even undecided (its first expiry, or its deadline; Unix ms).
    #[prost(uint64, tag = "8")]
    pub wake_at_unix_ms: u64,
    /// The admission that created the run, named again in the description of each of its
    /// checkpoints: a duplicate admission that lost the race for the id may have put its own
    /// checkpoint under the key, and that one is never resumed as this run.
    #[prost(string, tag = "9")]
    pub claim: String,
}

/// What this replica knows of a run it owns.
#[derive(Debug, Clone)]
pub(super) struct Owned {
    /// The revision of its record this replica wrote last.
    pub revision: u64,
    /// See [`Record::resumable_until_unix_ms`].
    pub resumable_until_unix_ms: u64,
    /// See [`Record::claim`].
    pub claim: String,
}

impl Record {
    /// The result as it reads now: a RUNNING run whose lease expired is lost.
    pub(super) fn read(self, key: &str) -> Result<RunResult, StoreError> {
        let corrupt = |reason: String| StoreError::Corrupt {
            key: key.to_owned(),
            reason,
        };
        let stored = self
            .result
            .clone()
            .ok_or_else(|| corrupt("it holds no result".to_owned()))?;
        let mut result = RunResult::try_from(stored).map_err(|e| corrupt(e.to_string()))?;
        let now = shared::sync::unix_ms();
        if result.status == RunStatus::Running && self.lease_expires_unix_ms < now && !self.resumable(now) {
            result.status = RunStatus::Failed;
            result.failure_reason = Some(FailureReason::OrchestratorLost);
            result.failure_detail = if self.resumable_until_unix_ms == 0 {
                format!(
                    "the orchestrator replica {} running this run stopped renewing its lease; the output is its last checkpoint",
                    self.owner
                )
            } else {
                format!(
                    "the orchestrator replica {} running this run stopped, and no replica took the run over before its deadline; the output is its last checkpoint",
                    self.owner
                )
            };
        }
        Ok(result)
    }

    /// Whether another replica may still resume the run from its checkpoint.
    pub(super) fn resumable(&self, now_unix_ms: u64) -> bool {
        self.resumable_until_unix_ms > now_unix_ms
    }

    /// Whether the record is of a live run (as written, lease aside).
    pub(super) fn running(&self) -> bool {
        self.result
            .as_ref()
            .is_some_and(|r| r.status == pb::RunStatus::Running as i32)
    }

    /// Whether the run's replica died before the run's first checkpoint, having shown nothing:
    /// RUNNING, lease lapsed, never checkpointed, no output.
    pub(super) fn never_started(&self, now_unix_ms: u64) -> bool {
        let empty = self
            .result
            .as_ref()
            .is_some_and(|r| r.text.is_empty() && r.turns == 0 && r.tool_calls.is_empty());
        self.running()
            && empty
            && !self.handed_over
            && self.resumable_until_unix_ms == 0
            && self.lease_expires_unix_ms < now_unix_ms
    }

    /// Whether the run has not ended: it runs, or it is parked waiting for approvals.
    pub(super) fn live(&self) -> bool {
        self.running() || self.awaiting
    }

    /// Whether the run's owner is gone (lease lapsed, or handed over) while it may be resumed, or
    /// it is parked and ready to go on (decided, canceled, or its wake time passed).
    pub(super) fn orphaned(&self, now_unix_ms: u64) -> bool {
        let lost_owner = self.running()
            && self.resumable(now_unix_ms)
            && (self.handed_over || self.lease_expires_unix_ms < now_unix_ms);
        lost_owner || (self.awaiting && (self.ready || self.wake_at_unix_ms <= now_unix_ms))
    }
}

/// A valid KV key for `run_id` (keys allow `[-/_=.a-zA-Z0-9]`; anything else is hex-escaped).
pub(super) fn key(run_id: &str) -> String {
    let mut key = String::with_capacity(run_id.len() + 4);
    key.push_str("run.");
    for b in run_id.bytes() {
        if b.is_ascii_alphanumeric() || b == b'-' || b == b'_' {
            key.push(b as char);
        } else {
            key.push_str(&format!("={b:02x}"));
        }
    }
    key
}

impl KvStore {
    /// Binds the bucket, creating it when missing. The bucket's stream is created in the KV
    /// layout directly (`KV_<bucket>`, subjects `$KV.<bucket>.>`, one value per key), which works
    /// with every JetStream server from 2.9 on and stays a bucket for `nats kv` tools.
    pub async fn open(
        js: &jetstream::Context,
        bucket: &str,
        ttl: Duration,
        owner: String,
        lease: Duration,
    ) -> Result<Self, StoreError> {
        let checkpoints = open_checkpoints(js, bucket, ttl).await?;
        let kv = Self::open_bucket(js, bucket, ttl, "orchestrator run results").await?;
        Ok(Self {
            kv,
            owner,
            lease,
            owned: Arc::default(),
            checkpoints,
            client: js.client(),
            handover_subject: format!("orchestrator.{bucket}.handovers"),
            cancel_subject: format!("orchestrator.{bucket}.cancels"),
        })
    }

    pub(super) async fn open_bucket(
        js: &jetstream::Context,
        bucket: &str,
        ttl: Duration,
        description: &str,
    ) -> Result<jetstream::kv::Store, StoreError> {
        if let Ok(kv) = js.get_key_value(bucket).await {
            return Ok(kv);
        }
        js.get_or_create_stream(jetstream::stream::Config {
            name: format!("KV_{bucket}"),
            description: Some(description.to_owned()),
            subjects: vec![format!("$KV.{bucket}.>")],
            max_messages_per_subject: 1,
            max_age: ttl,
            storage: jetstream::stream::StorageType::File,
            discard: jetstream::stream::DiscardPolicy::New,
            allow_rollup: true,
            deny_delete: true,
            allow_direct: true,
            ..Default::default()
        })
        .await
        .map_err(|e| unavailable("creating the key-value bucket", bucket, e))?;
        js.get_key_value(bucket)
            .await
            .map_err(|e| unavailable("binding the key-value bucket", bucket, e))
    }

    /// The record of `result` as this replica writes it now.
    pub(super) fn record(&self, result: pb::RunResult, resumable_until_unix_ms: u64) -> Record {
        let lease = u64::try_from(self.lease.as_millis()).unwrap_or(u64::MAX);
        let claim = self.claim_of(&key(&result.run_id));
        Record {
            result: Some(result),
            owner: self.owner.clone(),
            lease_expires_unix_ms: shared::sync::unix_ms().saturating_add(lease),
            handed_over: false,
            resumable_until_unix_ms,
            awaiting: false,
            ready: false,
            wake_at_unix_ms: 0,
            claim,
        }
    }

    /// The admission of this replica's run under `key` (empty: not known here).
    pub(super) fn claim_of(&self, key: &str) -> String {
        self.owned().get(key).map(|o| o.claim.clone()).unwrap_or_default()
    }

    /// Creates the record of a new run under `key` unless the id is taken, atomically; takes
    /// over the record of a run whose replica died before it showed anything
    /// ([`Record::never_started`]). This replica owns the run once it is [`Claim::Claimed`].
    pub(super) fn create(
        &self,
        key: String,
        record: Record,
    ) -> impl Future<Output = Result<Claim, StoreError>> + use<> {
        let (kv, owned) = (self.kv.clone(), Arc::clone(&self.owned));
        let bytes = bytes::Bytes::from(record.encode_to_vec());
        let owned_now = move |revision| Owned {
            revision,
            resumable_until_unix_ms: record.resumable_until_unix_ms,
            claim: record.claim,
        };
        async move {
            match kv.create(&key, bytes.clone()).await {
                Ok(revision) => {
                    shared::sync::lock(&owned).insert(key, owned_now(revision));
                    Ok(Claim::Claimed)
                }
                Err(e) if e.kind() == jetstream::kv::CreateErrorKind::AlreadyExists => {
                    let Some((taken, revision)) = holder(&kv, &key).await? else {
                        return Err(unavailable("KV create", &key, "taken, then gone"));
                    };
                    if taken.never_started(shared::sync::unix_ms()) {
                        // Its replica died before the run showed anything, and nothing of it can
                        // be resumed: the id is free again (one winner).
                        if let Ok(revision) = kv.update(&key, bytes, revision).await {
                            shared::sync::lock(&owned).insert(key, owned_now(revision));
                            return Ok(Claim::Claimed);
                        }
                    }
                    Ok(Claim::Taken(Box::new(taken.read(&key)?)))
                }
                Err(e) => Err(unavailable("KV create", &key, e)),
            }
        }
    }

    pub(super) fn owned(&self) -> std::sync::MutexGuard<'_, HashMap<String, Owned>> {
        shared::sync::lock(&self.owned)
    }

    /// Writes `record` under `key`: a compare-and-set on the revision this replica wrote last
    /// when it owns the run (refused [`StoreError::Fenced`] when another replica took it), a plain
    /// put otherwise. A final record ends this replica's ownership.
    pub(super) fn write(&self, key: String, record: Record) -> BoxFuture<'static, Result<(), StoreError>> {
        let (kv, owned, owner) = (self.kv.clone(), Arc::clone(&self.owned), self.owner.clone());
        let last = shared::sync::lock(&owned).get(&key).cloned();
        let running = record.running();
        async move {
            let bytes = bytes::Bytes::from(record.encode_to_vec());
            let Some(last) = last else {
                return kv
                    .put(&key, bytes)
                    .await
                    .map(|_| ())
                    .map_err(|e| unavailable("KV put", &key, e));
            };
            match update_owned(&kv, &key, bytes, last.revision, &owner).await {
                Ok(revision) => {
                    let mut owned = shared::sync::lock(&owned);
                    if running {
                        owned.insert(key, Owned { revision, ..last });
                    } else {
                        owned.remove(&key);
                    }
                    Ok(())
                }
                Err(e) => {
                    if matches!(e, StoreError::Fenced { .. }) {
                        shared::sync::lock(&owned).remove(&key);
                    }
                    Err(e)
                }
            }
        }
        .boxed()
    }
}

/// A compare-and-set of a record this replica (`owner`) owns, on the revision it wrote last; the
/// new revision. A revision moved on by a write of this replica's own (one that timed out here,
/// yet landed) is taken as the last one; moved on by another replica, the write is fenced.
async fn update_owned(
    kv: &jetstream::kv::Store,
    key: &str,
    bytes: bytes::Bytes,
    revision: u64,
    owner: &str,
) -> Result<u64, StoreError> {
    match kv.update(key, bytes.clone(), revision).await {
        Ok(revision) => return Ok(revision),
        Err(e) if e.kind() == jetstream::kv::UpdateErrorKind::WrongLastRevision => {}
        Err(e) => return Err(unavailable("KV update", key, e)),
    }
    let entry = kv.entry(key).await.map_err(|e| unavailable("KV entry", key, e))?;
    let current = entry.and_then(|entry| Some((Record::decode(entry.value.as_ref()).ok()?, entry.revision)));
    match current {
        Some((record, revision)) if record.owner == owner && record.running() => {
            kv.update(key, bytes, revision).await.map_err(|e| match e.kind() {
                jetstream::kv::UpdateErrorKind::WrongLastRevision => StoreError::Fenced {
                    run_id: run_id_of(key),
                    owner: "another replica".to_owned(),
                },
                _ => unavailable("KV update", key, e),
            })
        }
        Some((record, _)) => Err(StoreError::Fenced {
            run_id: run_id_of(key),
            owner: record.owner,
        }),
        None => Err(StoreError::Fenced {
            run_id: run_id_of(key),
            owner: "another replica".to_owned(),
        }),
    }
}

pub(super) fn run_id_of(key: &str) -> String {
    key.strip_prefix("run.").unwrap_or(key).to_owned()
}

/// The record under `key` and its revision, if there is one.
pub(super) async fn holder(kv: &jetstream::kv::Store, key: &str) -> Result<Option<(Record, u64)>, StoreError> {
    match kv.entry(key).await.map_err(|e| unavailable("KV entry", key, e))? {
        Some(entry) => Ok(Some((decode_record(key, &entry.value)?, entry.revision))),
        None => Ok(None),
    }
}

pub(super) fn decode_record(key: &str, bytes: &[u8]) -> Result<Record, StoreError> {
    Record::decode(bytes).map_err(|e| StoreError::Corrupt {
        key: key.to_owned(),
        reason: e.to_string(),
    })
}

fn decode(key: &str, bytes: &[u8]) -> Result<RunResult, StoreError> {
    decode_record(key, bytes)?.read(key)
}

/// The store's refusal of `operation` on `key`.
pub(super) fn unavailable(operation: &'static str, key: &str, reason: impl ToString) -> StoreError {
    StoreError::Unavailable {
        operation,
        key: key.to_owned(),
        reason: reason.to_string(),
    }
}

impl ResultStore for KvStore {
    fn put(&self, result: RunResult) -> BoxFuture<'static, Result<(), StoreError>> {
        let key = key(&result.run_id);
        let resumable_until = self.owned().get(&key).map_or(0, |o| o.resumable_until_unix_ms);
        let record = self.record(pb::RunResult::from(&result), resumable_until);
        self.write(key, record)
    }

    fn claim(&self, result: RunResult) -> BoxFuture<'static, Result<Claim, StoreError>> {
        let record = self.record(pb::RunResult::from(&result), 0);
        self.create(key(&result.run_id), record).boxed()
    }

    fn shared(&self) -> Option<Duration> {
        Some(self.lease / 3)
    }

    fn get(&self, run_id: &str) -> BoxFuture<'static, Result<Option<RunResult>, StoreError>> {
        let kv = self.kv.clone();
        let key = key(run_id);
        async move {
            let Some(bytes) = kv.get(&key).await.map_err(|e| unavailable("KV get", &key, e))? else {
                return Ok(None);
            };
            decode(&key, &bytes).map(Some)
        }
        .boxed()
    }
}

/// Binds (or creates) the object store of the checkpoints beside the results bucket `bucket`.
async fn open_checkpoints(
    js: &jetstream::Context,
    bucket: &str,
    ttl: Duration,
) -> Result<jetstream::object_store::ObjectStore, StoreError> {
    let name = format!("{bucket}-checkpoints");
    if let Ok(store) = js.get_object_store(&name).await {
        return Ok(store);
    }
    js.create_object_store(jetstream::object_store::Config {
        bucket: name.clone(),
        description: Some("orchestrator checkpoints of live runs".to_owned()),
        max_age: ttl,
        storage: jetstream::stream::StorageType::File,
        ..Default::default()
    })
    .await
    .map_err(|e| unavailable("creating the checkpoint object store", &name, e))
}

#[cfg(test)]
mod tests {
    #[test]
    fn keys_are_valid_and_distinct() {
        assert_eq!(super::key("0193-abc_DEF"), "run.0193-abc_DEF");
        assert_eq!(super::key("a.b:c"), "run.a=2eb=3ac");
        assert_ne!(super::key("a.b"), super::key("a_b"));
    }
}
