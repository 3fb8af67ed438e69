//! The store the simulated replicas share, answering as the NATS adapters do: a run's record
//! with its owner, epoch and lease, written only by its owner in its epoch (compare-and-set on
//! the record's revision in NATS; `Fenced` otherwise); a takeover that raises the run's fence
//! before it claims the record; a run's event log whose appends must follow the position their
//! owner knows (`Nats-Expected-Last-Subject-Sequence`) and whose message ids make a repeated
//! append a duplicate (out of turn, never a success). Every request takes a latency drawn from
//! the seed, passes its replica's gate before it is applied and again before its answer is
//! heard: a replica paused or cut off in between has its write applied and never learns it.
//! One replica's requests apply in the order it sent them (one connection, as a NATS client's).
//! The principals' run slots ([`quotas`]), their spend ([`usage`]) and the runs waiting for a
//! person or a task ([`approvals`]) are keys of the store too.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::future::BoxFuture;
use futures::stream::BoxStream;
use futures::{FutureExt, StreamExt};
use orchestrator::domain::listing::{RunPage, RunQuery, RunSummary};
use orchestrator::domain::ports::{
    CancelAsk, Claim, Claimed, EventFeed, EventLog, LogError, LogWriter, Logged, RemoteCancel, ResultStore, RunIndex,
    RunJournal, Settled, StoreError, ThreadStore,
};
use orchestrator::domain::thread::Thread;
use orchestrator::domain::{CancelMode, LeaseTerms, NumberedEvent, Ownership, RunResult, RunStatus, Stop};
use tokio::sync::watch;
use tokio::time::Instant;

use super::gate::Gate;

pub mod approvals;
mod quotas;
mod usage;

/// A run's record.
#[derive(Debug, Clone)]
pub struct Record {
    /// Its state as last written.
    pub result: RunResult,
    /// The replica that owns it.
    pub owner: String,
    /// The owner's claim: 1 at admission, one more at each takeover.
    pub epoch: u64,
    /// When its owner last wrote it (its lease runs from there).
    renewed: Instant,
    /// Its last checkpoint (a durable run resumes from it).
    checkpoint: Option<Vec<u8>>,
    /// Released at a drain: another replica takes it at once.
    handed_over: bool,
    /// The calls whose outcome its last checkpoint holds.
    checkpointed_calls: BTreeSet<String>,
    /// Parked (waiting for a person or a task): no lease runs; taken over once `ready` or past
    /// `wake_at_unix_ms`.
    pub awaiting: bool,
    ready: bool,
    wake_at_unix_ms: u64,
}

/// A takeover: the run, the epoch it began, and the calls whose outcome the checkpoint it
/// resumed from held (none of them may run again).
#[derive(Debug, Clone)]
pub struct Takeover {
    /// The run.
    pub run_id: String,
    /// The new owner's epoch.
    pub epoch: u64,
    /// The calls the checkpoint held the outcome of.
    pub checkpointed_calls: BTreeSet<String>,
}

/// The calls a checkpoint holds so that they never start again: those whose outcome `result`
/// records, and those whose task (their server runs them in the background) the `checkpoint`
/// follows.
fn recorded(result: &RunResult, checkpoint: Option<&[u8]>) -> BTreeSet<String> {
    let mut calls: BTreeSet<String> = result.tool_calls.iter().map(|c| c.call_id.clone()).collect();
    calls.extend(checkpoint.map(followed_tasks).unwrap_or_default());
    calls
}

/// The calls whose task a checkpoint follows, read from its JSON (`calls.tasks[].index`, a
/// position in `calls.partition.calls`).
pub(crate) fn followed_tasks(checkpoint: &[u8]) -> Vec<String> {
    let Ok(json) = serde_json::from_slice::<serde_json::Value>(checkpoint) else {
        return Vec::new();
    };
    let calls = &json["calls"];
    calls["tasks"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|following| {
            let index = usize::try_from(following["index"].as_u64()?).ok()?;
            calls["partition"]["calls"][index]["id"].as_str().map(str::to_owned)
        })
        .collect()
}

impl Record {
    /// Whether it holds a checkpoint, and whether its owner handed it over.
    pub fn resumable(&self) -> (bool, bool) {
        (self.checkpoint.is_some(), self.handed_over)
    }
}

/// One message of a run's log.
#[derive(Debug, Clone)]
pub struct Message {
    /// Its position in the stream.
    pub position: u64,
    /// Its events.
    pub events: Vec<NumberedEvent>,
}

/// What the replicas share.
pub struct Shared {
    /// The runs' records, by run id.
    pub records: BTreeMap<String, Record>,
    /// The runs' fences (what the runners read), by run id.
    pub fences: BTreeMap<String, u64>,
    /// The runs' logs, by run id.
    pub logs: BTreeMap<String, Vec<Message>>,
    /// Every takeover, in order.
    pub takeovers: Vec<Takeover>,
    /// The threads, by id, each with its revision.
    pub threads: BTreeMap<String, (Thread, u64)>,
    next_revision: u64,
    /// Message ids the stream has seen (its duplicate window, kept whole here).
    message_ids: BTreeSet<String>,
    next_position: u64,
    /// Draws latencies.
    rng: fastrand::Rng,
    /// Until then, every request is slow (a store restarting or overloaded).
    slow_until: Option<Instant>,
    /// Until then, the event stream takes no message (its leader lost, a new one not yet
    /// elected), while the key-value buckets answer.
    log_down_until: Option<Instant>,
    /// Told when a log grows.
    appended: Arc<tokio::sync::Notify>,
    /// The principals' run slots, by key (`<principal>.<n>`): the value naming the run and
    /// admission that hold it, and its revision.
    pub slots: BTreeMap<String, (String, u64)>,
    /// Each principal's `max_runs`, for [`Shared::quota_breaches`].
    pub max_runs: BTreeMap<String, usize>,
    /// Every moment a principal had more runs running (their records read running: a parked run
    /// holds no slot) than its `max_runs`, as the writes that made it so left the store.
    pub quota_breaches: Vec<String>,
    /// Each principal's spend by hour window (and how far each run booked into it).
    pub usage: BTreeMap<(String, u64), orchestrator::domain::usage::Window>,
    /// The runs' waits ([`approvals`]), by run id, each with its revision.
    pub waits: BTreeMap<String, (approvals::StoredWait, u64)>,
}

/// The store, shared.
pub type Store = Arc<Mutex<Shared>>;

/// A store seeded with `seed`.
pub fn store(seed: u64) -> Store {
    Arc::new(Mutex::new(Shared {
        records: BTreeMap::new(),
        fences: BTreeMap::new(),
        logs: BTreeMap::new(),
        takeovers: Vec::new(),
        threads: BTreeMap::new(),
        next_revision: 1,
        message_ids: BTreeSet::new(),
        next_position: 1,
        rng: fastrand::Rng::with_seed(seed ^ 0x5707e),
        slow_until: None,
        log_down_until: None,
        appended: Arc::default(),
        slots: BTreeMap::new(),
        max_runs: BTreeMap::new(),
        quota_breaches: Vec::new(),
        usage: BTreeMap::new(),
        waits: BTreeMap::new(),
    }))
}

/// Makes every request slow until `until`.
pub fn slow_down(store: &Store, until: Instant) {
    lock(store).slow_until = Some(until);
}

/// Makes the event stream refuse messages until `until`.
pub fn take_log_down(store: &Store, until: Instant) {
    lock(store).log_down_until = Some(until);
}

/// The store, locked (a poisoned lock is taken as it is).
pub fn lock(store: &Store) -> std::sync::MutexGuard<'_, Shared> {
    store.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Shared {
    /// Notes a principal with more runs running than its `max_runs` after `operation`.
    fn check_quotas(&mut self, operation: &str) {
        for (principal, max) in &self.max_runs {
            let live: Vec<&str> = self
                .records
                .values()
                .filter(|r| &r.result.principal == principal && r.result.status == RunStatus::Running)
                .map(|r| r.result.run_id.as_str())
                .collect();
            let again = self
                .quota_breaches
                .last()
                .is_some_and(|last| last.ends_with(&format!("{live:?}")));
            if live.len() > *max && !again {
                let breach = format!(
                    "{principal} has {} runs live after a {operation}, its max_runs {max}: {live:?}",
                    live.len()
                );
                self.quota_breaches.push(breach);
            }
        }
    }

    /// A request's latency: a few milliseconds, or up to seconds while the store is slow.
    fn latency(&mut self) -> Duration {
        let slow = self.slow_until.is_some_and(|until| Instant::now() < until);
        match slow {
            true => Duration::from_millis(self.rng.u64(200..3000)),
            false => Duration::from_micros(self.rng.u64(200..8000)),
        }
    }
}

/// One replica's view of the store: its name, its gate, the epochs it claimed.
#[derive(Clone)]
pub struct ReplicaStore {
    store: Store,
    me: String,
    gate: Gate,
    terms: LeaseTerms,
    /// How long a request waits for an answer.
    timeout: Duration,
    owned: Arc<Mutex<BTreeMap<String, u64>>>,
    /// The slots it saw naming a run with no record: the revision seen, and since when.
    sightings: Arc<Mutex<BTreeMap<String, (u64, Instant)>>>,
    /// Held by the request on the wire: the replica's requests apply in order.
    wire: Arc<tokio::sync::Mutex<()>>,
    /// Checkpoints are kept without the tasks their calls became (off only to show what breaks
    /// without them: a takeover starts such a call again).
    forget_tasks: bool,
    /// A parked run that wakes reads its wait, deciding no expired call in the store (only to
    /// show what breaks: a person's late answer is taken and the call goes on canceled).
    wake_reads_only: bool,
    /// A takeover never tells that the run it claimed read parked (only to show what breaks: a
    /// parked run goes on without a slot).
    hide_parked: bool,
}

impl ReplicaStore {
    /// Replica `me`'s handle on `store`, its requests passing `gate`.
    pub fn new(store: Store, me: &str, gate: Gate, terms: LeaseTerms, timeout: Duration) -> Self {
        Self {
            store,
            me: me.to_owned(),
            gate,
            terms,
            timeout,
            owned: Arc::default(),
            sightings: Arc::default(),
            wire: Arc::default(),
            forget_tasks: false,
            wake_reads_only: false,
            hide_parked: false,
        }
    }

    /// The same store, keeping checkpoints without the tasks their calls became.
    #[must_use]
    pub fn forgetting_tasks(mut self) -> Self {
        self.forget_tasks = true;
        self
    }

    /// The same store, waking parked runs without deciding their expired calls in it.
    #[must_use]
    pub fn waking_without_expiry(mut self) -> Self {
        self.wake_reads_only = true;
        self
    }

    /// The same store, never telling a takeover that the run it claimed read parked.
    #[must_use]
    pub fn hiding_parked_claims(mut self) -> Self {
        self.hide_parked = true;
        self
    }

    /// `checkpoint` as this store keeps it.
    fn kept(&self, checkpoint: Vec<u8>) -> Vec<u8> {
        if !self.forget_tasks {
            return checkpoint;
        }
        let Ok(mut json) = serde_json::from_slice::<serde_json::Value>(&checkpoint) else {
            return checkpoint;
        };
        if let Some(calls) = json.get_mut("calls").and_then(serde_json::Value::as_object_mut) {
            calls.remove("tasks");
        }
        serde_json::to_vec(&json).unwrap_or(checkpoint)
    }

    /// One request: it leaves through the gate, takes its latency, is applied at once by `apply`,
    /// and its answer is heard through the gate (a replica cut off by then never hears it).
    async fn request<T: Send + 'static>(
        &self,
        operation: &'static str,
        key: &str,
        apply: impl FnOnce(&mut Shared, &ReplicaStore) -> Result<T, StoreError> + Send,
    ) -> Result<T, StoreError> {
        let unavailable = |reason: &str| StoreError::Unavailable {
            operation,
            key: key.to_owned(),
            reason: reason.to_owned(),
        };
        let wire = self.wire.lock().await;
        if !self.gate.pass().await {
            drop(wire);
            tokio::time::sleep(self.timeout).await;
            return Err(unavailable("no route to the store"));
        }
        let latency = lock(&self.store).latency();
        tokio::time::sleep(latency).await;
        let answer = {
            let mut shared = lock(&self.store);
            let answer = apply(&mut shared, self);
            shared.check_quotas(operation);
            answer
        };
        drop(wire);
        if !self.gate.pass().await {
            return Err(unavailable("the answer was lost"));
        }
        answer
    }

    /// [`Self::request`] as a port's boxed future.
    fn boxed<T: Send + 'static>(
        &self,
        operation: &'static str,
        key: &str,
        apply: impl FnOnce(&mut Shared, &ReplicaStore) -> Result<T, StoreError> + Send + 'static,
    ) -> BoxFuture<'static, Result<T, StoreError>> {
        let (this, key) = (self.clone(), key.to_owned());
        async move { this.request(operation, &key, apply).await }.boxed()
    }

    fn owned_epoch(&self, run_id: &str) -> Option<u64> {
        self.owned
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get(run_id)
            .copied()
    }

    fn own(&self, run_id: &str, epoch: u64) {
        self.owned
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert(run_id.to_owned(), epoch);
    }

    /// The record of `run_id` when this replica owns it in the epoch it claimed; `Fenced` else.
    fn mine<'a>(&self, shared: &'a mut Shared, run_id: &str) -> Result<&'a mut Record, StoreError> {
        let epoch = self.owned_epoch(run_id);
        match shared.records.get_mut(run_id) {
            Some(record) if record.owner == self.me && Some(record.epoch) == epoch => Ok(record),
            Some(record) => Err(StoreError::Fenced {
                run_id: run_id.to_owned(),
                owner: record.owner.clone(),
            }),
            None => Err(StoreError::Fenced {
                run_id: run_id.to_owned(),
                owner: "nobody".to_owned(),
            }),
        }
    }

    fn claim_with(&self, shared: &mut Shared, result: RunResult, checkpoint: Option<Vec<u8>>) -> Claim {
        if let Some(taken) = shared.records.get(&result.run_id) {
            return Claim::Taken(Box::new(taken.result.clone()));
        }
        let run_id = result.run_id.clone();
        shared.records.insert(
            run_id.clone(),
            Record {
                checkpointed_calls: recorded(&result, checkpoint.as_deref()),
                checkpoint: checkpoint.map(|c| self.kept(c)),
                result,
                owner: self.me.clone(),
                epoch: 1,
                renewed: Instant::now(),
                handed_over: false,
                awaiting: false,
                ready: false,
                wake_at_unix_ms: 0,
            },
        );
        self.own(&run_id, 1);
        Claim::Claimed
    }

    /// Whether `record` is an orphan now: live, resumable, and its owner gone or released it;
    /// or parked, and ready to go on (decided, canceled, or its wake time passed).
    fn orphaned(&self, record: &Record) -> bool {
        let gone = match record.awaiting {
            true => record.ready || record.wake_at_unix_ms <= shared::sync::unix_ms(),
            false => record.handed_over || record.renewed.elapsed() > self.terms.length,
        };
        record.result.status.is_live() && record.checkpoint.is_some() && gone
    }
}

/// A listing reads every record (a store of a few dozen runs), the live runs of the replica
/// asking shown as it sees them.
impl RunIndex for ReplicaStore {
    fn list(&self, query: RunQuery, here: Vec<RunSummary>) -> BoxFuture<'static, Result<RunPage, StoreError>> {
        self.boxed("KV list", "run.>", move |shared, _| {
            let mut rows: BTreeMap<String, RunSummary> = shared
                .records
                .values()
                .map(|r| (r.result.run_id.clone(), RunSummary::from(&r.result)))
                .collect();
            for live in here {
                if rows.contains_key(&live.run_id) {
                    rows.insert(live.run_id.clone(), live);
                }
            }
            Ok(query.page_of(rows.into_values()))
        })
    }
}

impl ResultStore for ReplicaStore {
    fn put(&self, result: RunResult) -> BoxFuture<'static, Result<(), StoreError>> {
        let run_id = result.run_id.clone();
        self.boxed("KV update", &run_id.clone(), move |shared, this| {
            let record = this.mine(shared, &run_id)?;
            record.result = result;
            record.renewed = Instant::now();
            Ok(())
        })
    }

    fn claim(&self, result: RunResult) -> BoxFuture<'static, Result<Claim, StoreError>> {
        let run_id = result.run_id.clone();
        self.boxed("KV create", &run_id.clone(), move |shared, this| {
            Ok(this.claim_with(shared, result, None))
        })
    }

    fn get(&self, run_id: &str) -> BoxFuture<'static, Result<Option<RunResult>, StoreError>> {
        let run_id = run_id.to_owned();
        self.boxed("KV get", &run_id.clone(), move |shared, _| {
            Ok(shared.records.get(&run_id).map(|r| r.result.clone()))
        })
    }

    fn lease(&self) -> Option<LeaseTerms> {
        Some(self.terms)
    }

    fn epoch(&self, run_id: &str) -> u64 {
        self.owned_epoch(run_id).unwrap_or(0)
    }
}

impl RunJournal for ReplicaStore {
    fn save(
        &self,
        result: RunResult,
        _deadline: u64,
        checkpoint: Vec<u8>,
    ) -> BoxFuture<'static, Result<(), StoreError>> {
        let run_id = result.run_id.clone();
        self.boxed("KV update", &run_id.clone(), move |shared, this| {
            let record = this.mine(shared, &run_id)?;
            record.checkpointed_calls = recorded(&result, Some(&checkpoint));
            record.result = result;
            record.checkpoint = Some(this.kept(checkpoint));
            record.renewed = Instant::now();
            Ok(())
        })
    }

    fn claim_resumable(
        &self,
        result: RunResult,
        _deadline: u64,
        checkpoint: Vec<u8>,
    ) -> BoxFuture<'static, Result<Claim, StoreError>> {
        let run_id = result.run_id.clone();
        self.boxed("KV create", &run_id.clone(), move |shared, this| {
            Ok(this.claim_with(shared, result, Some(checkpoint)))
        })
    }

    fn forget(&self, run_id: &str) -> BoxFuture<'static, Result<(), StoreError>> {
        let run_id = run_id.to_owned();
        self.boxed("checkpoint delete", &run_id.clone(), move |shared, this| {
            this.mine(shared, &run_id)?.checkpoint = None;
            Ok(())
        })
    }

    fn orphans(&self) -> BoxFuture<'static, Result<Vec<String>, StoreError>> {
        self.boxed("KV keys", "runs", |shared, this| {
            Ok(shared
                .records
                .iter()
                .filter(|(_, record)| this.orphaned(record))
                .map(|(id, _)| id.clone())
                .collect())
        })
    }

    fn take_over(&self, run_id: &str) -> BoxFuture<'static, Result<Option<Claimed>, StoreError>> {
        let run_id = run_id.to_owned();
        self.boxed("KV update", &run_id.clone(), move |shared, this| {
            let Some(record) = shared.records.get(&run_id).filter(|r| this.orphaned(r)) else {
                return Ok(None);
            };
            let epoch = record.epoch + 1;
            // The fence first: a runner refuses the old owner's calls from now on.
            let fence = shared.fences.entry(run_id.clone()).or_default();
            *fence = (*fence).max(epoch);
            let Some(record) = shared.records.get_mut(&run_id) else {
                return Ok(None);
            };
            record.epoch = epoch;
            record.owner.clone_from(&this.me);
            record.renewed = Instant::now();
            record.handed_over = false;
            let parked = record.result.status.is_parked() && !this.hide_parked;
            record.awaiting = false;
            record.ready = false;
            this.own(&run_id, epoch);
            let taken = record
                .checkpoint
                .clone()
                .map(|checkpoint| Claimed { checkpoint, parked });
            let checkpointed_calls = record.checkpointed_calls.clone();
            shared.takeovers.push(Takeover {
                run_id,
                epoch,
                checkpointed_calls,
            });
            Ok(taken)
        })
    }

    fn hand_over(&self, run_id: &str) -> BoxFuture<'static, Result<(), StoreError>> {
        let run_id = run_id.to_owned();
        self.boxed("KV update", &run_id.clone(), move |shared, this| {
            this.mine(shared, &run_id)?.handed_over = true;
            Ok(())
        })
    }

    fn hand_overs(&self) -> BoxFuture<'static, BoxStream<'static, ()>> {
        async { futures::stream::pending().boxed() }.boxed()
    }

    fn cancel_elsewhere(
        &self,
        _run_id: &str,
        _reason: &str,
        _mode: CancelMode,
    ) -> BoxFuture<'static, Result<Option<RemoteCancel>, StoreError>> {
        async { Ok(None) }.boxed()
    }

    fn cancel_asks(&self) -> BoxFuture<'static, BoxStream<'static, CancelAsk>> {
        async { futures::stream::pending().boxed() }.boxed()
    }
}

impl ThreadStore for ReplicaStore {
    fn read(&self, thread_id: &str) -> BoxFuture<'static, Result<Option<(Thread, u64)>, StoreError>> {
        let thread_id = thread_id.to_owned();
        self.boxed("KV get", &thread_id.clone(), move |shared, _| {
            Ok(shared.threads.get(&thread_id).cloned())
        })
    }

    fn write(&self, thread: Thread, revision: u64) -> BoxFuture<'static, Result<bool, StoreError>> {
        let thread_id = thread.thread_id.clone();
        self.boxed("KV update", &thread_id.clone(), move |shared, _| {
            let now = shared.threads.get(&thread_id).map_or(0, |(_, r)| *r);
            if now != revision {
                return Ok(false);
            }
            let next = shared.next_revision;
            shared.next_revision += 1;
            shared.threads.insert(thread_id, (thread, next));
            Ok(true)
        })
    }

    fn delete(&self, thread_id: &str, revision: u64) -> BoxFuture<'static, Result<bool, StoreError>> {
        let thread_id = thread_id.to_owned();
        self.boxed("KV delete", &thread_id.clone(), move |shared, _| {
            match shared.threads.get(&thread_id) {
                Some((_, now)) if *now == revision => {
                    shared.threads.remove(&thread_id);
                    Ok(true)
                }
                _ => Ok(false),
            }
        })
    }
}

/// How often a replica's log writer tries a message before the log is broken for the run.
const PUBLISH_ATTEMPTS: u32 = 4;

impl EventLog for ReplicaStore {
    fn writer(&self, run_id: &str, logged: u64) -> Box<dyn LogWriter> {
        self.start_writer(run_id, logged, None, Ownership::local())
    }

    fn owned_writer(&self, run_id: &str, from: &Logged, owner: &Ownership) -> Box<dyn LogWriter> {
        self.start_writer(run_id, from.seq, Some(from.position), owner.clone())
    }

    fn follow(&self, run_id: &str, after_seq: u64) -> BoxFuture<'static, Result<Option<EventFeed>, LogError>> {
        let (store, run_id) = (Arc::clone(&self.store), run_id.to_owned());
        async move {
            let feed = futures::stream::unfold(after_seq, move |cursor| {
                let (store, run_id) = (Arc::clone(&store), run_id.clone());
                async move {
                    loop {
                        let appended = Arc::clone(&lock(&store).appended);
                        let notified = appended.notified();
                        let next = lock(&store).logs.get(&run_id).and_then(|log| {
                            log.iter()
                                .flat_map(|m| m.events.iter())
                                .find(|e| e.seq > cursor)
                                .cloned()
                        });
                        if let Some(event) = next {
                            if event.seq != cursor + 1 {
                                let lost = LogError::Lost {
                                    run_id: run_id.clone(),
                                    after_seq: cursor,
                                    reason: format!("the next event kept is seq {}", event.seq),
                                };
                                return Some((Err(lost), u64::MAX));
                            }
                            let seq = if event.is_last() { u64::MAX } else { event.seq };
                            return Some((Ok(event), seq));
                        }
                        if cursor == u64::MAX {
                            return None;
                        }
                        notified.await;
                    }
                }
            });
            Ok(Some(feed.boxed()))
        }
        .boxed()
    }

    fn last(&self, run_id: &str) -> BoxFuture<'static, Result<Logged, LogError>> {
        let (this, run_id) = (self.clone(), run_id.to_owned());
        async move {
            let key = run_id.clone();
            this.request("last message", &run_id.clone(), move |shared, _| {
                let Some(message) = shared.logs.get(&key).and_then(|log| log.last()) else {
                    return Ok(Logged::default());
                };
                let last = message.events.last();
                Ok(Logged {
                    seq: last.map_or(0, |e| e.seq),
                    position: message.position,
                    finished: last.and_then(|e| e.finished().cloned()),
                })
            })
            .await
            .map_err(|e| LogError::Unavailable {
                run_id: run_id.clone(),
                reason: e.to_string(),
            })
        }
        .boxed()
    }
}

impl ReplicaStore {
    fn start_writer(&self, run_id: &str, logged: u64, position: Option<u64>, owner: Ownership) -> Box<dyn LogWriter> {
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<Vec<NumberedEvent>>();
        let (settled, settled_rx) = watch::channel(Settled {
            kept_through: logged,
            broken: false,
        });
        let mut publisher = Publisher {
            store: self.clone(),
            run_id: run_id.to_owned(),
            owner,
            position,
            settled,
        };
        tokio::spawn(async move {
            while let Some(events) = rx.recv().await {
                publisher.publish(events).await;
            }
        });
        Box::new(Writer {
            tx,
            settled: settled_rx,
        })
    }
}

/// Hands a run's batches to its publishing task.
struct Writer {
    tx: tokio::sync::mpsc::UnboundedSender<Vec<NumberedEvent>>,
    settled: watch::Receiver<Settled>,
}

impl LogWriter for Writer {
    fn append(&mut self, events: &[NumberedEvent]) {
        let _ = self.tx.send(events.to_vec());
    }

    fn settled(&self) -> Option<watch::Receiver<Settled>> {
        Some(self.settled.clone())
    }
}

/// One run's publishing task, as the NATS log's.
struct Publisher {
    store: ReplicaStore,
    run_id: String,
    owner: Ownership,
    position: Option<u64>,
    settled: watch::Sender<Settled>,
}

/// Why a message was not kept.
enum Refused {
    Unavailable,
    OutOfTurn(String),
}

impl Publisher {
    /// Publishes one batch (retried while the store cannot be reached), and settles it.
    async fn publish(&mut self, events: Vec<NumberedEvent>) {
        let Some(last) = events.last().map(|e| e.seq) else {
            return;
        };
        if self.settled.borrow().broken || !self.owner.may_log() {
            return self.settled.send_modify(|s| s.broken = true);
        }
        for attempt in 0..PUBLISH_ATTEMPTS {
            match self.try_publish(&events).await {
                Ok(()) => return self.settled.send_modify(|s| s.kept_through = s.kept_through.max(last)),
                Err(Refused::OutOfTurn(why)) => {
                    self.owner.stop(Stop::Fenced(format!("the run's event log: {why}")));
                    break;
                }
                Err(Refused::Unavailable) => {
                    tokio::time::sleep(Duration::from_millis(100) * 2u32.pow(attempt)).await;
                }
            }
        }
        self.settled.send_modify(|s| s.broken = true);
    }

    /// One attempt: the message id names the run, the owner's epoch and the first seq; with a
    /// position the message must follow it.
    async fn try_publish(&mut self, events: &[NumberedEvent]) -> Result<(), Refused> {
        let first = events.first().map_or(0, |e| e.seq);
        let id = format!("{}/{}/{first}", self.run_id, self.owner.epoch());
        let (run_id, expected, batch) = (self.run_id.clone(), self.position, events.to_vec());
        let answer = self
            .store
            .request("publish", &run_id.clone(), move |shared, _| {
                if shared.log_down_until.is_some_and(|until| Instant::now() < until) {
                    return Err(StoreError::Unavailable {
                        operation: "publish",
                        key: run_id,
                        reason: "the stream has no leader".to_owned(),
                    });
                }
                let last_position = shared
                    .logs
                    .get(&run_id)
                    .and_then(|l| l.last())
                    .map_or(0, |m| m.position);
                if let Some(expected) = expected
                    && expected != last_position
                {
                    return Ok(Err(format!("another owner appended after stream sequence {expected}")));
                }
                if !shared.message_ids.insert(id.clone()) {
                    return Ok(Err(format!("message {id} was in the log already")));
                }
                let position = shared.next_position;
                shared.next_position += 1;
                shared.logs.entry(run_id).or_default().push(Message {
                    position,
                    events: batch,
                });
                shared.appended.notify_waiters();
                Ok(Ok(position))
            })
            .await;
        match answer {
            Ok(Ok(position)) => {
                if self.position.is_some() {
                    self.position = Some(position);
                }
                Ok(())
            }
            Ok(Err(why)) => Err(Refused::OutOfTurn(why)),
            Err(_) => Err(Refused::Unavailable),
        }
    }
}
