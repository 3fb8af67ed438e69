//! Run results in a NATS JetStream key-value bucket: shared by every orchestrator replica and
//! kept across restarts. Each value is a [`Record`]: the `orchestrator.v1.RunResult`, the replica
//! that owns the run and, while it runs, the end of its lease, under a `run.<run_id>`-derived key
//! (run ids are escaped into a valid key); entries expire after the bucket's TTL.
//!
//! A live run is held by its replica's *incarnation* (`incarnation.rs`), which its record names:
//! the incarnation's one lease record is renewed for all its runs, and a quiet run writes nothing.
//! (A record from before incarnations names none: its owner renews it by writing the run's state
//! every third of the lease, and it is judged by its own revision.) A run is claimed with the bucket's create-if-absent, so of two replicas starting the same id at once
//! exactly one runs it; every later write of its owner is a compare-and-set on the revision it
//! wrote last, so once another replica took the run over (see the journal, `journal.rs`) the old
//! owner's writes are refused ([`StoreError::Fenced`]) and it stops the run.
//!
//! A RUNNING record whose owner stopped renewing it belongs to a replica that crashed or lost the
//! store: it reads as written (RUNNING, with the output last written) until another replica,
//! having seen it unchanged for a whole lease on its own clock, takes it over and ends it or
//! resumes it. No reader makes an end up by comparing the owner's clock with its own: the only
//! end a record shows is one written (FAILED `ORCHESTRATOR_LOST` is written by the replica that
//! finds a run it cannot resume).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::FutureExt;
use futures::future::BoxFuture;
use prost::Message;
use proto::orchestrator::v1 as pb;
use shared::jetstream::{Bucket, BucketConfig, Consistency, Error, JetStream, Objects, Operation};

use crate::domain::ports::{Claim, ResultStore, StoreError};
use crate::domain::{FailureReason, RunResult, RunStatus};
use crate::store::unavailable;

/// The fence grace unless set (the default tool-runners check their read timeout against).
const DEFAULT_FENCE_GRACE: Duration = shared::fence::DEFAULT_GRACE;

/// See the module docs.
pub struct KvStore {
    /// The run store's bucket, over its shards.
    pub(super) kv: Arc<dyn Bucket>,
    /// How many shards the store is spread over (fixed when it was made).
    pub(super) shards: usize,
    /// This replica, written into the records of its runs.
    pub(super) owner: String,
    /// The incarnation holding this replica's runs now.
    pub(super) incarnation: Arc<super::incarnation::Incarnation>,
    /// What this replica's looks for orphans remember between them.
    pub(super) finder: Arc<super::owners::Finder>,
    pub(super) lease: Duration,
    /// Copies JetStream keeps of the store's buckets (the approval store's beside it too).
    pub(super) replicas: usize,
    /// How much of the lease an owner leaves unused (it stops acting that long before anyone
    /// may take the run over).
    pub(super) margin: Duration,
    /// See [`crate::domain::LeaseTerms::fence_grace`].
    pub(super) fence_grace: Duration,
    /// Records of other replicas' live runs as this replica saw them: the revision, and when it
    /// was first seen here (this process's clock). A record seen unchanged for a whole lease has
    /// lapsed; no wall clock of another machine is read.
    pub(super) seen: Sightings,
    /// The runs this replica owns, by key: their writes are fenced on the revision.
    pub(super) owned: Arc<Mutex<HashMap<String, Owned>>>,
    /// Checkpoints of live runs, by key (an object store: a checkpoint may be larger than one
    /// message).
    pub(super) checkpoints: Arc<dyn Objects>,
    /// Where hand-overs are announced (core NATS, `<bucket>.hand_overs`).
    pub(super) js: Arc<dyn JetStream>,
    pub(super) hand_over_subject: String,
    /// Where cancels are asked of the replica running a run (core NATS, `<bucket>.cancels`).
    pub(super) cancel_subject: String,
    /// Where `SendMessage` asks the replica running a run (a subject of its own, so a replica
    /// that predates steering never reads a message as a cancel).
    pub(super) steering_subject: String,
    /// Where each claim enters its run first (`ListRuns`).
    pub(super) index: super::index::entry::IndexWriter,
    /// Where the transcript segments its checkpoints name are kept.
    pub(super) segments: super::segments::Segments,
}

/// Records of other replicas' live runs as this replica saw them: the revision, and when it was
/// first seen here (this process's monotonic clock). A record seen unchanged for a whole lease
/// has lapsed; no wall clock of another machine is read.
#[derive(Clone)]
pub(super) struct Sightings {
    seen: Arc<Mutex<HashMap<String, (u64, tokio::time::Instant)>>>,
    pub(super) lease: Duration,
    /// This process's incarnations: the current one never lapses as seen from here.
    pub(super) incarnation: Arc<super::incarnation::Incarnation>,
}

impl Sightings {
    /// How long this replica has seen the record under `key` at `revision` (and no later one).
    pub(super) fn unchanged_for(&self, key: &str, revision: u64) -> Duration {
        match shared::sync::lock(&self.seen).get(key) {
            Some((seen, since)) if *seen == revision => since.elapsed(),
            _ => Duration::ZERO,
        }
    }

    /// Whether the record under `key` at `revision` has lapsed: this replica has seen that
    /// revision, and no later one, for a whole lease. A revision not seen before starts the count.
    pub(super) fn lapsed(&self, key: &str, revision: u64) -> bool {
        let now = tokio::time::Instant::now();
        let mut seen = shared::sync::lock(&self.seen);
        match seen.get(key) {
            Some((seen_revision, since)) if *seen_revision == revision => now.duration_since(*since) >= self.lease,
            _ => {
                seen.insert(key.to_owned(), (revision, now));
                false
            }
        }
    }

    /// Whether the live run's `record` at `revision` under `key` has lapsed (see
    /// [`Sightings::lapsed`]); a record of no running run never does.
    pub(super) fn lapsed_run(&self, key: &str, record: &Record, revision: u64) -> bool {
        record.held() && self.lapsed(key, revision)
    }

    /// Whether the owner of the live run `record` (at `revision` under `key`) is gone: the
    /// incarnation it names is over, or was seen unchanged (or missing) for a whole lease here;
    /// a record naming no incarnation is judged by its own revision ([`Sightings::lapsed_run`]).
    pub(super) async fn owner_lapsed(
        &self,
        kv: &dyn Bucket,
        key: &str,
        record: &Record,
        revision: u64,
    ) -> Result<bool, StoreError> {
        if record.incarnation.is_empty() {
            return Ok(self.lapsed_run(key, record, revision));
        }
        if !record.held() || record.incarnation == self.incarnation.name().0 {
            return Ok(false);
        }
        self.incarnation_lapsed(kv, &record.incarnation).await
    }

    /// Whether incarnation `name` is over, or was seen unchanged (or missing) for a whole lease.
    pub(super) async fn incarnation_lapsed(&self, kv: &dyn Bucket, name: &str) -> Result<bool, StoreError> {
        let key = super::incarnation::key_of(name);
        // From the leader: a lagging copy would show an old revision standing still.
        let entry = kv.entry(&key, Consistency::Leader).await;
        match entry.map_err(|e| unavailable("KV entry", &key, e))? {
            Some(entry) if entry.operation == Operation::Put => {
                let record = super::incarnation::decode(&key, &entry.value)?;
                Ok(record.over || self.lapsed(&key, entry.revision))
            }
            _ => Ok(self.lapsed(&key, 0)),
        }
    }

    /// Forgets what was seen of records not among `keys` (ended, or gone) and not seen in the
    /// last two leases (an id asked for again at admission).
    pub(super) fn keep(&self, keys: &std::collections::HashSet<String>) {
        let now = tokio::time::Instant::now();
        let recent = self.lease * 2;
        shared::sync::lock(&self.seen).retain(|key, (_, since)| {
            !key.starts_with("run.") || keys.contains(key) || now.duration_since(*since) < recent
        });
    }

    /// Forgets what was seen of the records under `prefix` not among `keys` (gone).
    pub(super) fn keep_prefixed(&self, prefix: &str, keys: &std::collections::HashSet<String>) {
        shared::sync::lock(&self.seen).retain(|key, _| !key.starts_with(prefix) || keys.contains(key));
    }
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
    pub parked: bool,
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
    /// The claim's number: 1 at admission, one more at each takeover. Tools are told it, so one
    /// with side effects can refuse a replaced owner.
    #[prost(uint64, tag = "10")]
    pub epoch: u64,
    /// The epoch whose checkpoint object holds the run's last checkpoint (0: an object named by
    /// the key alone, as versions before epochs wrote it). A replaced owner writes only objects
    /// of its own epoch, which the new owner never reads.
    #[prost(uint64, tag = "11")]
    pub checkpoint_epoch: u64,
    /// Which of its epoch's two objects holds the last checkpoint (0 or 1). An owner puts each
    /// checkpoint into the *other* one and then names it here by compare-and-set, so the object
    /// a record names is never written again while it names it: a replaced owner (whose
    /// compare-and-set is refused) never overwrites what a takeover reads.
    #[prost(uint32, tag = "12")]
    pub checkpoint_slot: u32,
    /// Why a caller asked the run to end after its turn under way (empty: none): a replica
    /// that takes the run over ends it there too (`RunResult::ends_after_turn`).
    #[prost(string, tag = "13")]
    pub ends_after_turn: String,
    /// The incarnation holding the run (empty: a record from before incarnations, whose owner
    /// renews the record itself).
    #[prost(string, tag = "14")]
    pub incarnation: String,
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
    /// See [`Record::epoch`].
    pub epoch: u64,
    /// See [`Record::checkpoint_epoch`].
    pub checkpoint_epoch: u64,
    /// See [`Record::checkpoint_slot`].
    pub checkpoint_slot: u32,
    /// See [`Record::incarnation`].
    pub incarnation: String,
}

impl Owned {
    /// What this replica knows of a run it owns once `record` stands at `revision`.
    pub(super) fn of(revision: u64, record: &Record) -> Self {
        Self {
            revision,
            resumable_until_unix_ms: record.resumable_until_unix_ms,
            claim: record.claim.clone(),
            epoch: record.epoch,
            checkpoint_epoch: record.checkpoint_epoch,
            checkpoint_slot: record.checkpoint_slot,
            incarnation: record.incarnation.clone(),
        }
    }

    /// The object the run's next checkpoint goes to: the one of its epoch that its record does
    /// not name (the first of the epoch's two when the record names an older epoch's).
    pub(super) fn next_checkpoint(&self) -> CheckpointName {
        let slot = match self.checkpoint_epoch == self.epoch {
            true => 1 - self.checkpoint_slot.min(1),
            false => 0,
        };
        CheckpointName {
            epoch: self.epoch,
            slot,
        }
    }

    /// The object the run's record names.
    pub(super) fn named_checkpoint(&self) -> CheckpointName {
        CheckpointName {
            epoch: self.checkpoint_epoch,
            slot: self.checkpoint_slot,
        }
    }
}

/// Which checkpoint object of a run: its epoch's, and which of the two.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct CheckpointName {
    pub epoch: u64,
    pub slot: u32,
}

impl CheckpointName {
    /// The object a record names before a run's first save: its epoch's first.
    pub(super) const FIRST: Self = Self { epoch: 1, slot: 0 };

    /// `record`, naming this object.
    pub(super) fn named_by(self, record: Record) -> Record {
        Record {
            checkpoint_epoch: self.epoch,
            checkpoint_slot: self.slot,
            ..record
        }
    }

    /// The object a record names.
    pub(super) fn of(record: &Record) -> Self {
        Self {
            epoch: record.checkpoint_epoch,
            slot: record.checkpoint_slot,
        }
    }

    /// The object's name for the run under `key`.
    pub(super) fn name(self, key: &str) -> String {
        match (self.epoch, self.slot) {
            (0, _) => key.to_owned(),
            (epoch, 0) => format!("{key}#{epoch}"),
            (epoch, _) => format!("{key}#{epoch}~1"),
        }
    }

    /// Both objects of `epoch` for the run under `key` (one for the start epoch).
    pub(super) fn both(key: &str, epoch: u64) -> Vec<String> {
        let first = Self { epoch, slot: 0 }.name(key);
        match epoch {
            0 => vec![first],
            _ => vec![first, Self { epoch, slot: 1 }.name(key)],
        }
    }
}

/// The key and epoch of a checkpoint object's name.
pub(super) fn checkpoint_of(name: &str) -> (&str, u64) {
    match name.rsplit_once('#') {
        Some((key, epoch)) => match epoch.strip_suffix("~1").unwrap_or(epoch).parse() {
            Ok(epoch) => (key, epoch),
            Err(_) => (name, 0),
        },
        None => (name, 0),
    }
}

impl Record {
    /// The result as written: a run marked lost (see [`Record::marked_lost`]) reads FAILED
    /// `ORCHESTRATOR_LOST` with its output so far; every other record as it stands.
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
        if self.marked_lost() {
            result.status = RunStatus::Failed;
            result.failure_reason = Some(FailureReason::OrchestratorLost);
            result.failure_detail = format!(
                "the orchestrator replica {} running this run stopped, and the run could not be resumed; the output is its last checkpoint",
                self.owner
            );
        }
        Ok(result)
    }

    /// Whether a replica wrote the run lost: live as written, with neither a lease nor a
    /// checkpoint to resume (a takeover that found no checkpoint of the run's admission).
    pub(super) fn marked_lost(&self) -> bool {
        self.held() && self.lease_expires_unix_ms == 0 && self.resumable_until_unix_ms == 0
    }

    /// Whether the run has a checkpoint another replica may resume it from (past its deadline
    /// too: the replica that resumes it ends it there).
    pub(super) fn resumable(&self) -> bool {
        self.resumable_until_unix_ms > 0
    }

    /// Whether a replica holds the run (as written, lease aside): it is live — running, or
    /// waiting in place for a person, a task or a slot — and not parked in the approval store (a parked
    /// run has no owner until it is ready).
    pub(super) fn held(&self) -> bool {
        let live = [
            pb::RunStatus::Running,
            pb::RunStatus::AwaitingApproval,
            pb::RunStatus::AwaitingInput,
            pb::RunStatus::AwaitingTask,
        ];
        !self.parked
            && self
                .result
                .as_ref()
                .is_some_and(|r| live.iter().any(|s| r.status == *s as i32))
    }

    /// Whether the run's replica died before the run's first checkpoint, having shown nothing:
    /// RUNNING, never checkpointed, no output, and `lapsed` (seen unchanged for a lease here) or
    /// written lost by the replica that found it unresumable (no lease at all).
    pub(super) fn never_started(&self, lapsed: bool) -> bool {
        let empty = self
            .result
            .as_ref()
            .is_some_and(|r| r.text.is_empty() && r.turns == 0 && r.tool_calls.is_empty());
        self.held()
            && empty
            && !self.handed_over
            && self.resumable_until_unix_ms == 0
            && (lapsed || self.lease_expires_unix_ms == 0)
    }

    /// Whether the run has not ended: a replica holds it, or it is parked in the approval store.
    pub(super) fn live(&self) -> bool {
        self.held() || self.parked
    }

    /// The domain's orphan rule ([`crate::domain::Holding::orphaned`]) on this record.
    pub(super) fn orphaned(&self, now_unix_ms: u64, lapsed: bool) -> bool {
        let holding = crate::domain::Holding {
            held: self.held(),
            resumable: self.resumable(),
            handed_over: self.handed_over,
            parked: self.parked,
            ready: self.ready,
            wake_at_unix_ms: self.wake_at_unix_ms,
        };
        holding.orphaned(now_unix_ms, lapsed)
    }
}

/// The name of `incarnation` if it may hold runs now: stored, and within its lease less the
/// margin (`acting`).
fn holds(incarnation: &super::incarnation::Incarnation, acting: Duration) -> Option<String> {
    let (name, generation) = incarnation.name();
    let acts = tokio::time::Instant::now() < incarnation.liveness().acts_until(generation, acting);
    (incarnation.stored() && acts).then_some(name)
}

/// Where the run store is and how it is made: its bucket (the first shard's name), how long it
/// keeps a value, the copies of each shard and how many shards there are.
#[derive(Debug, Clone, Copy)]
pub struct Shape<'a> {
    /// The bucket (`--run-store-bucket`), its shards named after it.
    pub bucket: &'a str,
    /// How long a value is kept after its last write (`--run-store-ttl`).
    pub ttl: Duration,
    /// Copies of each shard (`--nats-replicas`).
    pub replicas: usize,
    /// Shards (`--run-store-shards`).
    pub shards: usize,
}

/// Opens the store's buckets and checkpoint object stores, one of each per shard, and checks the
/// shard count against the one the store was made with (recorded at its making).
async fn open_shards(js: &dyn JetStream, shape: Shape<'_>) -> Result<(Arc<dyn Bucket>, Arc<dyn Objects>), StoreError> {
    use shared::jetstream::shards::{self, ShardedBucket, ShardedObjects};
    let Shape {
        bucket,
        ttl,
        replicas,
        shards: count,
    } = shape;
    let home = KvStore::open_bucket(js, bucket, ttl, "orchestrator run results", replicas).await?;
    shards::agree(home.as_ref(), count)
        .await
        .map_err(|reason| unavailable("checking the shard count of", bucket, reason))?;
    let (mut buckets, mut objects) = (vec![home], Vec::with_capacity(count));
    for shard in 0..count {
        let name = shards::name(bucket, shard);
        if shard > 0 {
            buckets.push(KvStore::open_bucket(js, &name, ttl, "orchestrator run results (a shard)", replicas).await?);
        }
        objects.push(super::checkpoints::open(js, &name, ttl, replicas).await?);
    }
    Ok((ShardedBucket::over(buckets), ShardedObjects::over(objects)))
}

/// A valid KV key for `run_id`.
pub(super) fn key(run_id: &str) -> String {
    escaped_key("run.", run_id)
}

pub(super) use shared::fence::escaped_key;

impl KvStore {
    /// Binds the bucket, creating it when missing. The bucket's stream is created in the KV
    /// layout directly (`KV_<bucket>`, subjects `$KV.<bucket>.>`, one value per key), which works
    /// with every JetStream server from 2.9 on and stays a bucket for `nats kv` tools.
    pub async fn open(
        js: &dyn JetStream,
        bucket: &str,
        ttl: Duration,
        owner: String,
        lease: Duration,
        replicas: usize,
    ) -> Result<Self, StoreError> {
        Self::open_sharded(
            js,
            Shape {
                bucket,
                ttl,
                replicas,
                shards: 1,
            },
            owner,
            lease,
        )
        .await
    }

    /// [`KvStore::open`] over a store of `shape.shards` shards (see [`shared::jetstream::shards`]):
    /// refused, naming both counts, when the store was made with another.
    pub async fn open_sharded(
        js: &dyn JetStream,
        shape: Shape<'_>,
        owner: String,
        lease: Duration,
    ) -> Result<Self, StoreError> {
        let Shape {
            bucket,
            ttl,
            replicas,
            shards,
        } = shape;
        let (kv, checkpoints) = open_shards(js, shape).await?;
        let index = super::index::entry::IndexWriter::open(js, bucket, ttl, replicas, shards).await?;
        let segments = super::segments::Segments::open(js, bucket, ttl, replicas, shards).await?;
        let incarnation = Arc::new(super::incarnation::Incarnation::new(&owner));
        if let Err(e) = incarnation.begin(kv.as_ref()).await {
            // Its runs act only within a lease of now until it lands (the keeper tries again).
            tracing::warn!("storing the replica's incarnation failed (tried again at its first renewal): {e}");
        }
        Ok(Self {
            index,
            segments,
            kv,
            shards,
            replicas,
            owner,
            lease,
            margin: lease / 3,
            fence_grace: DEFAULT_FENCE_GRACE,
            seen: Sightings {
                seen: Arc::default(),
                lease,
                incarnation: Arc::clone(&incarnation),
            },
            incarnation,
            finder: Arc::default(),
            owned: Arc::default(),
            checkpoints,
            js: js.handle(),
            hand_over_subject: format!("orchestrator.{bucket}.hand_overs"),
            cancel_subject: format!("orchestrator.{bucket}.cancels"),
            steering_subject: format!("orchestrator.{bucket}.messages"),
        })
    }

    /// The store, its owners leaving `margin` of their lease unused (default a third).
    #[must_use]
    pub fn with_lease_margin(mut self, margin: Duration) -> Self {
        self.margin = margin;
        self
    }

    /// The store, a new owner's tool calls waiting `grace` after its claim raised the run's
    /// fence (see [`crate::domain::LeaseTerms::fence_grace`]).
    #[must_use]
    pub fn with_fence_grace(mut self, grace: Duration) -> Self {
        self.fence_grace = grace;
        self
    }

    /// Keeps this replica's fence grace in the bucket, where each tool-runner reading the run
    /// fence checks its read timeout against it.
    pub async fn announce_fence_grace(&self) -> Result<(), StoreError> {
        let ms = u64::try_from(self.fence_grace.as_millis()).unwrap_or(u64::MAX);
        self.kv
            .put(shared::fence::GRACE_KEY, ms.to_string().into())
            .await
            .map(|_| ())
            .map_err(|e| unavailable("KV put", shared::fence::GRACE_KEY, e))
    }

    /// The store's shard count.
    pub fn shards(&self) -> usize {
        self.shards
    }

    /// Binds the bucket `bucket` (its stream created when missing, its replicas brought to
    /// `replicas`).
    pub(super) async fn open_bucket(
        js: &dyn JetStream,
        bucket: &str,
        ttl: Duration,
        description: &str,
        replicas: usize,
    ) -> Result<Arc<dyn Bucket>, StoreError> {
        let config = BucketConfig {
            name: bucket.to_owned(),
            description: description.to_owned(),
            max_age: ttl,
            replicas,
        };
        js.bucket(config)
            .await
            .map_err(|e| unavailable("creating the key-value bucket", bucket, e))
    }

    /// The record of `result` as this replica writes it now.
    pub(super) fn record(&self, result: &RunResult, resumable_until_unix_ms: u64) -> Record {
        let ends_after_turn = result.ends_after_turn.clone().unwrap_or_default();
        let result = pb::RunResult::from(result);
        let lease = u64::try_from(self.lease.as_millis()).unwrap_or(u64::MAX);
        let key = key(&result.run_id);
        let (claim, epoch, named, incarnation) = self.owned().get(&key).map_or_else(
            || (String::new(), 1, CheckpointName::FIRST, self.incarnation.name().0),
            |o| (o.claim.clone(), o.epoch, o.named_checkpoint(), o.incarnation.clone()),
        );
        named.named_by(Record {
            result: Some(result),
            owner: self.owner.clone(),
            lease_expires_unix_ms: shared::sync::unix_ms().saturating_add(lease),
            handed_over: false,
            resumable_until_unix_ms,
            parked: false,
            ready: false,
            wake_at_unix_ms: 0,
            claim,
            epoch,
            ends_after_turn,
            incarnation,
            ..Record::default()
        })
    }

    /// Holds `run_id` under this replica's incarnation: the incarnation's name, once it may hold
    /// runs. One whose lease ran out (a process resumed from a pause) or whose record is not
    /// stored yet is first brought up ([`super::incarnation::Incarnation::come_up`]); refused
    /// when that fails (a run claimed under it could not act, or no other replica could find
    /// it).
    pub(super) fn hold(&self, run_id: &str) -> impl Future<Output = Result<String, StoreError>> + use<> {
        let (incarnation, kv, key) = (Arc::clone(&self.incarnation), self.kv.clone(), key(run_id));
        let acting = self.lease.saturating_sub(self.margin);
        async move {
            if let Some(name) = holds(&incarnation, acting) {
                return Ok(name);
            }
            incarnation.come_up(kv.as_ref(), acting).await?;
            holds(&incarnation, acting).ok_or_else(|| {
                let (name, _) = incarnation.name();
                unavailable(
                    "claim",
                    &key,
                    format!("this replica's incarnation {name} cannot hold runs yet"),
                )
            })
        }
    }

    /// The run stored under `key`, as any replica of the bucket reads it now (a follower may
    /// not have the newest write yet).
    pub(super) fn read_key(&self, key: &str) -> BoxFuture<'static, Result<Option<RunResult>, StoreError>> {
        self.read_key_from(key, Consistency::Direct)
    }

    /// The run stored under `key`, read as `consistency` says: from the leader for a decision
    /// no compare-and-set on the record guards (a slot taken from a run read ended).
    pub(super) fn read_key_from(
        &self,
        key: &str,
        consistency: Consistency,
    ) -> BoxFuture<'static, Result<Option<RunResult>, StoreError>> {
        let (kv, key) = (self.kv.clone(), key.to_owned());
        async move {
            let entry = kv.entry(&key, consistency).await;
            match entry.map_err(|e| unavailable("KV entry", &key, e))? {
                Some(entry) if entry.operation == Operation::Put => decode(&key, &entry.value).map(Some),
                _ => Ok(None),
            }
        }
        .boxed()
    }

    pub(super) fn owned(&self) -> std::sync::MutexGuard<'_, HashMap<String, Owned>> {
        shared::sync::lock(&self.owned)
    }

    /// Writes `record` under `key`, always conditionally: a compare-and-set on the revision this
    /// replica wrote last when it owns the run (refused [`StoreError::Fenced`] when another
    /// replica took it); otherwise only the run's own final record is written again (a signal
    /// confirmed late, a result from the backlog), or a record that is missing created. A final
    /// record ends this replica's ownership.
    pub(super) fn write(&self, key: String, record: Record) -> BoxFuture<'static, Result<(), StoreError>> {
        let (kv, owned, owner) = (self.kv.clone(), Arc::clone(&self.owned), self.owner.clone());
        let last = shared::sync::lock(&owned).get(&key).cloned();
        let (running, names) = (record.held(), CheckpointName::of(&record));
        async move {
            let bytes = bytes::Bytes::from(record.encode_to_vec());
            let Some(last) = last else {
                return rewrite_own_final(kv.as_ref(), &key, bytes, &owner, running).await;
            };
            let revision = update_owned(kv.as_ref(), &key, bytes, &last, &owner).await?;
            if !running {
                shared::sync::lock(&owned).remove(&key);
                super::owners::leave(kv.as_ref(), &super::owners::owner_key(&last.incarnation, &key)).await;
                return Ok(());
            }
            let mut owned = shared::sync::lock(&owned);
            // The revision is this write's, and the object the record names now (unless a later
            // epoch's was named meanwhile). Put back as it was read, the entry would name an
            // object that may be deleted by now, and the next renewal would write that name into
            // the record.
            let entry = owned.entry(key).or_insert(last);
            entry.revision = revision;
            if names.epoch >= entry.checkpoint_epoch {
                entry.checkpoint_epoch = names.epoch;
                entry.checkpoint_slot = names.slot;
            }
            Ok(())
        }
        .boxed()
    }
}

/// The checkpoint a claimed record names: the start object (epoch 0) when the claim put one
/// (`claim_resumable`), else the object of its epoch.
fn named_checkpoint(record: &Record) -> u64 {
    match record.checkpoint_epoch {
        0 => 0,
        _ => record.epoch,
    }
}

/// A claim (or hand-over) of the run under `key` on its way: should it not finish (an error, an
/// answer lost, the future dropped at a timeout) the run may be held in the store under this
/// incarnation while nothing runs it here, so it is abandoned to the keeper.
pub(super) struct Claiming {
    key: String,
    owned: Arc<Mutex<HashMap<String, Owned>>>,
    incarnation: Arc<super::incarnation::Incarnation>,
    finished: bool,
}

impl Claiming {
    /// A claim of the run under `key`, by the replica owning `owned` under `incarnation`.
    pub(super) fn of(
        key: &str,
        owned: &Arc<Mutex<HashMap<String, Owned>>>,
        incarnation: &Arc<super::incarnation::Incarnation>,
    ) -> Self {
        Self {
            key: key.to_owned(),
            owned: Arc::clone(owned),
            incarnation: Arc::clone(incarnation),
            finished: false,
        }
    }

    /// The claim finished: the run runs here, or is not this replica's.
    pub(super) fn finished(mut self) {
        self.finished = true;
    }
}

impl Drop for Claiming {
    fn drop(&mut self) {
        if !self.finished {
            shared::sync::lock(&self.owned).remove(&self.key);
            self.incarnation.abandon(&self.key);
        }
    }
}

/// Creates the record of a new run under `key` unless the id is taken, atomically; takes over
/// the record of a run whose replica died before it showed anything ([`Record::never_started`]).
/// This replica owns the run once it is [`Claim::Claimed`]. A claim the store does not answer is
/// remembered, so a later write adopts the record if it landed (or creates it). `record.epoch` is the claim's (1 when not given), one more than the
/// taken record's when it takes over a run that never started.
pub(super) async fn create_record(
    kv: Arc<dyn Bucket>,
    owned: Arc<Mutex<HashMap<String, Owned>>>,
    seen: Sightings,
    key: String,
    record: Record,
) -> Result<Claim, StoreError> {
    let claiming = Claiming::of(&key, &owned, &seen.incarnation);
    let claim = create_claimed(kv, owned, seen, key, record).await;
    // Unanswered (or dropped at a timeout), the claim may have landed: the run is not started
    // here, and a record that did land is handed over by the keeper (then it is resumed from its
    // start checkpoint, or reads lost).
    if claim.is_ok() {
        claiming.finished();
    }
    claim
}

/// See [`create_record`].
async fn create_claimed(
    kv: Arc<dyn Bucket>,
    owned: Arc<Mutex<HashMap<String, Owned>>>,
    seen: Sightings,
    key: String,
    mut record: Record,
) -> Result<Claim, StoreError> {
    record.epoch = record.epoch.max(1);
    record.checkpoint_epoch = named_checkpoint(&record);
    record.checkpoint_slot = 0;
    // Entered under its incarnation first: a held run is always found when that one lapses.
    super::owners::enter_owner(kv.as_ref(), &record.incarnation, &key, record.epoch).await?;
    match kv.create(&key, record.encode_to_vec().into()).await {
        Ok(revision) => {
            shared::sync::lock(&owned).insert(key, Owned::of(revision, &record));
            Ok(Claim::Claimed)
        }
        Err(Error::Exists) => {
            let Some((taken, revision)) = holder_from(kv.as_ref(), &key, Consistency::Leader).await? else {
                return Err(unavailable("KV create", &key, "taken, then gone"));
            };
            if taken.never_started(seen.owner_lapsed(kv.as_ref(), &key, &taken, revision).await?) {
                // Its replica died before the run showed anything, and nothing of it can be
                // resumed: the id is free again (one winner), in a later epoch.
                record.epoch = record.epoch.max(taken.epoch.saturating_add(1));
                record.checkpoint_epoch = named_checkpoint(&record);
                super::owners::enter_owner(kv.as_ref(), &record.incarnation, &key, record.epoch).await?;
                super::fence::raise(kv.as_ref(), &key, record.epoch).await?;
                if let Ok(revision) = kv.update(&key, record.encode_to_vec().into(), revision).await {
                    shared::sync::lock(&owned).insert(key, Owned::of(revision, &record));
                    return Ok(Claim::Claimed);
                }
            }
            Ok(Claim::Taken(Box::new(taken.read(&key)?)))
        }
        Err(e) => Err(unavailable("KV create", &key, e)),
    }
}

/// Writes a record this replica does not own (any more): created when missing; otherwise only a
/// final (not `live`) record over a final record of this replica's, by compare-and-set. Anything
/// else is another replica's run, or would turn an end back into a live run, and is fenced.
async fn rewrite_own_final(
    kv: &dyn Bucket,
    key: &str,
    bytes: bytes::Bytes,
    owner: &str,
    live: bool,
) -> Result<(), StoreError> {
    let Some((current, revision)) = holder(kv, key).await? else {
        return match kv.create(key, bytes).await {
            Ok(_) => Ok(()),
            Err(Error::Exists) => Err(fenced(key, "another replica")),
            Err(e) => Err(unavailable("KV create", key, e)),
        };
    };
    // An end is rewritten only as an end: a live record over it would read lost once its lease
    // ran out.
    if current.live() || current.owner != owner || live {
        return Err(fenced(key, &current.owner));
    }
    match kv.update(key, bytes, revision).await {
        Ok(_) => Ok(()),
        Err(Error::WrongRevision) => Err(fenced(key, "another replica")),
        Err(e) => Err(unavailable("KV update", key, e)),
    }
}

fn fenced(key: &str, owner: &str) -> StoreError {
    StoreError::Fenced {
        run_id: run_id_of(key),
        owner: owner.to_owned(),
    }
}

/// A compare-and-set of a record this replica (`owner`) owns, on the revision it wrote last; the
/// new revision. A revision moved on by a write of this replica's own claim (one that timed out
/// here, yet landed: same owner, same admission, same epoch, still running) is taken as the last
/// one; moved on by anyone else, the write is fenced.
async fn update_owned(
    kv: &dyn Bucket,
    key: &str,
    bytes: bytes::Bytes,
    last: &Owned,
    owner: &str,
) -> Result<u64, StoreError> {
    match kv.update(key, bytes.clone(), last.revision).await {
        Ok(revision) => return Ok(revision),
        Err(Error::WrongRevision) => {}
        Err(e) => return Err(unavailable("KV update", key, e)),
    }
    let current = holder(kv, key).await?;
    match current {
        Some((record, revision))
            if record.owner == owner && record.held() && record.claim == last.claim && record.epoch == last.epoch =>
        {
            kv.update(key, bytes, revision).await.map_err(|e| match e {
                Error::WrongRevision => fenced(key, "another replica"),
                e => unavailable("KV update", key, e),
            })
        }
        Some((record, _)) => Err(fenced(key, &record.owner)),
        None => Err(fenced(key, "another replica")),
    }
}

pub(super) fn run_id_of(key: &str) -> String {
    key.strip_prefix("run.").unwrap_or(key).to_owned()
}

/// The record under `key` and its revision, if there is one.
pub(super) async fn holder(kv: &dyn Bucket, key: &str) -> Result<Option<(Record, u64)>, StoreError> {
    holder_from(kv, key, Consistency::Direct).await
}

/// As [`holder`], read as `consistency` says: from the leader where what is read decides a
/// write that no compare-and-set on its revision guards (a lagging follower may lack a claim
/// that landed).
pub(super) async fn holder_from(
    kv: &dyn Bucket,
    key: &str,
    consistency: Consistency,
) -> Result<Option<(Record, u64)>, StoreError> {
    let entry = kv.entry(key, consistency).await;
    match entry.map_err(|e| unavailable("KV entry", key, e))? {
        Some(entry) if entry.operation == Operation::Put => {
            Ok(Some((decode_record(key, &entry.value)?, entry.revision)))
        }
        _ => Ok(None),
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

impl ResultStore for KvStore {
    fn put(&self, result: RunResult) -> BoxFuture<'static, Result<(), StoreError>> {
        let key = key(&result.run_id);
        let resumable_until = self.owned().get(&key).map_or(0, |o| o.resumable_until_unix_ms);
        let record = self.record(&result, resumable_until);
        self.write(key, record)
    }

    fn claim(&self, result: RunResult) -> BoxFuture<'static, Result<Claim, StoreError>> {
        let hold = self.hold(&result.run_id);
        let mut record = self.record(&result, 0);
        let enter = self.index.enter(&result);
        let (kv, owned, seen, key) = (
            self.kv.clone(),
            Arc::clone(&self.owned),
            self.seen.clone(),
            key(&result.run_id),
        );
        async move {
            record.incarnation = hold.await?;
            enter.await?;
            create_record(kv, owned, seen, key, record).await
        }
        .boxed()
    }

    fn lease(&self) -> Option<crate::domain::LeaseTerms> {
        Some(crate::domain::LeaseTerms {
            length: self.lease,
            margin: self.margin,
            fence_grace: self.fence_grace,
        })
    }

    fn epoch(&self, run_id: &str) -> u64 {
        self.owned().get(&key(run_id)).map_or(0, |o| o.epoch)
    }

    fn liveness(&self) -> Option<crate::domain::Liveness> {
        Some(self.incarnation.liveness())
    }

    fn generation(&self, run_id: &str) -> u64 {
        let named = self.owned().get(&key(run_id)).map(|o| o.incarnation.clone());
        let (current, generation) = self.incarnation.name();
        // A record naming an incarnation that is over holds nothing here any more.
        named.filter(|named| *named == current).map_or(0, |_| generation)
    }

    fn get(&self, run_id: &str) -> BoxFuture<'static, Result<Option<RunResult>, StoreError>> {
        self.read_key(&key(run_id))
    }
}

#[cfg(test)]
mod tests {
    /// A tool-runner reads a run's epoch from its record without knowing the rest of it.
    #[test]
    fn a_runner_reads_the_epoch_the_record_holds_under_its_key() {
        use prost::Message as _;
        let record = super::Record {
            result: Some(super::pb::RunResult::default()),
            owner: "a".into(),
            epoch: 7,
            checkpoint_epoch: 6,
            ..Default::default()
        };
        assert_eq!(shared::fence::record_epoch(&record.encode_to_vec()), Ok(7));
        assert_eq!(super::key("a.b:c"), shared::fence::record_key("a.b:c"));
    }

    #[test]
    fn keys_are_valid_and_distinct() {
        assert_eq!(super::key("0193-abc_DEF"), "run.0193-abc_DEF");
        assert_eq!(super::key("a.b:c"), "run.a=2eb=3ac");
        assert_ne!(super::key("a.b"), super::key("a_b"));
        assert_ne!(
            super::key("a"),
            shared::fence::key("a"),
            "a run's fence is not its record"
        );
    }
}
