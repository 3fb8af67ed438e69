//! A durable call runs once: the runner records it in the run store where it runs, so a call
//! sent again with the same run id and call id (by a new owner after its run moved, or by the same
//! one after a lost answer) is answered from the record instead of running the tool again.
//!
//! The record of a call lives under `call.<run>.<call>` (a call answered with questions, tried
//! again with the answers, has a record per round: the round's state is hashed into the key). It
//! is created (compare-and-set: only when absent) before the tool starts, naming the runner's
//! *incarnation* and the call's epoch, and updated at that revision with the outcome before the
//! runner answers. A runner finding a record:
//! * with an outcome answers it, and the tool does not run (a call that asked questions before
//!   doing anything keeps no record: sent again, it asks again);
//! * of a newer epoch refuses the call as a replaced owner's;
//! * started by a runner that is alive waits for its outcome (bounded by the tool's timeout and a
//!   lease: past that the tool has ended, and an outcome still missing was lost); one started by
//!   this very process whose start's answer was lost (the tool never ran) is run now;
//! * started by a runner that is gone (its incarnation's lease lapsed, or it deleted it leaving)
//!   finds the call *in doubt*: it may or may not have taken effect. A tool declared idempotent
//!   runs again (this runner takes the record over at its revision); any other is answered in
//!   doubt, the record marked so, and does not run again unless the caller says a person chose to
//!   ([`Call::rerun_in_doubt`]).
//!
//! Each runner process holds one incarnation record, `runner.<id>`, renewed every third of
//! `--runner-lease`; another runner counts it gone once it has seen no renewal for a whole lease on
//! its own clock (never by comparing two clocks), or finds it deleted. A runner that has not
//! renewed it within two thirds of the lease starts no durable call (it could be counted gone).
//! Records expire with the run store bucket's age, as runs' own records do.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use shared::jetstream::{Bucket, Consistency, Entry, Error as StoreError, Operation};
use tokio::time::Instant;

use crate::fence::RunFence;

/// What one runner writes of one call.
#[derive(Clone, PartialEq, prost::Message)]
struct Record {
    /// The epoch the call was started in.
    #[prost(uint64, tag = "1")]
    epoch: u64,
    /// The incarnation of the runner that started it.
    #[prost(string, tag = "2")]
    runner: String,
    /// Which start this is (a create whose answer was lost is known by it).
    #[prost(uint64, tag = "3")]
    attempt: u64,
    /// The outcome, encoded by the service, once the tool finished.
    #[prost(bytes = "bytes", optional, tag = "4")]
    outcome: Option<Bytes>,
    /// The call's runner went away before its outcome was kept, and the tool is not run again.
    #[prost(bool, tag = "5")]
    in_doubt: bool,
}

/// The call a runner is about to run, as its record is keyed and judged.
#[derive(Debug, Clone)]
pub struct Call<'a> {
    /// The run.
    pub run_id: &'a str,
    /// The model's call id.
    pub call_id: &'a str,
    /// The round of questions the call's answers belong to (`None`: its first attempt).
    pub round: Option<&'a str>,
    /// The epoch it was sent in.
    pub epoch: u64,
    /// The tool may run again when the call is in doubt.
    pub idempotent: bool,
    /// A person chose to run the call again although it is in doubt.
    pub rerun_in_doubt: bool,
    /// Longest wait for the outcome of the call running on another runner.
    pub wait: Duration,
}

/// What the record says of a call about to run.
#[derive(Debug)]
pub enum Begun {
    /// The call is this runner's to run: [`CallRecords::finish`] keeps its outcome.
    Run(Started),
    /// The call finished before: its outcome, as the service encoded it.
    Done(Bytes),
    /// The call started on `runner`, which went away before its outcome was kept.
    InDoubt {
        /// The incarnation that started it.
        runner: String,
    },
    /// A newer epoch started the call: this one comes from a replaced owner.
    Stale {
        /// The epoch the record holds.
        current: u64,
    },
    /// The record cannot be read or written: the call did not run.
    Unavailable(String),
}

/// A call this runner started, as its record holds it.
#[derive(Debug)]
pub struct Started {
    key: String,
    revision: u64,
    record: Record,
}

/// Why an outcome was not kept.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NotKept {
    /// The outcome is larger than the bound; an error naming it is kept in its place.
    #[error(
        "the outcome ({size} bytes) is larger than --call-record-max-bytes ({max}); an error naming the bound is kept in its place"
    )]
    #[allow(missing_docs, reason = "named by the message")]
    TooLarge { size: usize, max: usize },
    /// Another runner took the record over (the call was found in doubt while it ran).
    #[error("the record was taken over while the call ran (it was found in doubt)")]
    TakenOver,
    /// The store did not take the write.
    #[error("the run store did not take it: {0}")]
    Store(String),
}

/// This runner's records of the calls it runs (see the module docs).
pub struct CallRecords {
    fence: Arc<RunFence>,
    incarnation: Incarnation,
    max_bytes: usize,
    attempts: AtomicU64,
    /// Attempts of this process whose start may have landed (its answer lost) while the tool was
    /// never run: a record of one is this runner's to run when the call comes again, not a call
    /// in flight to wait for, nor one in doubt.
    never_ran: Arc<std::sync::Mutex<std::collections::HashSet<u64>>>,
}

/// How many starts that never ran one process remembers while their records could not be removed
/// (a long store outage): past it, such a call sent again waits and is found in doubt, as before.
const MAX_NEVER_RAN: usize = 4096;

/// This runner process's liveness record.
struct Incarnation {
    id: String,
    key: String,
    lease: Duration,
    /// When the store last confirmed a renewal (`None`: never yet).
    renewed: std::sync::Mutex<Option<Instant>>,
}

impl CallRecords {
    /// Records over the bucket `fence` reads, for the runner incarnation `id` holding its liveness
    /// for `lease`; outcomes larger than `max_bytes` are not kept (an error naming it is).
    pub fn new(fence: Arc<RunFence>, id: &str, lease: Duration, max_bytes: usize) -> Self {
        Self {
            fence,
            incarnation: Incarnation {
                id: id.to_owned(),
                key: shared::fence::escaped_key("runner.", id),
                lease,
                renewed: std::sync::Mutex::new(None),
            },
            max_bytes,
            attempts: AtomicU64::new(0),
            never_ran: Arc::default(),
        }
    }

    /// How long a runner's liveness may go unrenewed before its unanswered calls are in doubt.
    pub fn lease(&self) -> Duration {
        self.incarnation.lease
    }

    /// This runner's incarnation id.
    pub fn incarnation(&self) -> &str {
        &self.incarnation.id
    }

    /// Renews this runner's liveness every third of its lease, until dropped.
    pub async fn keep_alive(self: Arc<Self>) {
        loop {
            self.renew().await;
            tokio::time::sleep(self.incarnation.lease / 3).await;
        }
    }

    /// One renewal of this runner's liveness, timed on its own clock from before the write.
    pub async fn renew(&self) {
        let sent = Instant::now();
        let written = async {
            let bucket = self.fence.bucket().await?;
            let stamp = Bytes::from(shared::sync::unix_ms().to_string());
            bucket
                .put(&self.incarnation.key, stamp)
                .await
                .map_err(|e| e.to_string())
        };
        match tokio::time::timeout(self.incarnation.lease / 3, written).await {
            Ok(Ok(_)) => *shared::sync::lock(&self.incarnation.renewed) = Some(sent),
            Ok(Err(e)) => tracing::warn!("renewing the runner's liveness: {e}"),
            Err(_) => tracing::warn!("renewing the runner's liveness: no answer in time"),
        }
    }

    /// Deletes this runner's liveness (it leaves): calls it started and never answered are in
    /// doubt at once.
    pub async fn leave(&self) {
        if let Ok(bucket) = self.fence.bucket().await {
            let _ = tokio::time::timeout(self.incarnation.lease / 3, bucket.delete(&self.incarnation.key, None)).await;
        }
    }

    /// Whether this runner's liveness was renewed recently enough that no other runner can count
    /// it gone before a call it starts now is recorded.
    fn alive(&self) -> bool {
        let renewed = *shared::sync::lock(&self.incarnation.renewed);
        renewed.is_some_and(|at| at.elapsed() < self.incarnation.lease * 2 / 3)
    }

    /// What the record says of `call`, creating it when absent (see the module docs).
    pub async fn begin(&self, call: &Call<'_>) -> Begun {
        if !self.alive() {
            // Not renewed yet (the bucket came after this runner), or not lately: try now.
            self.renew().await;
        }
        if !self.alive() {
            return Begun::Unavailable(format!(
                "this runner has not renewed its liveness within two thirds of --runner-lease ({}); it starts no durable call",
                humantime::format_duration(self.incarnation.lease)
            ));
        }
        let bucket = match self.fence.bucket().await {
            Ok(bucket) => bucket,
            Err(why) => return Begun::Unavailable(why),
        };
        let key = key(call);
        let record = Record {
            epoch: call.epoch,
            runner: self.incarnation.id.clone(),
            attempt: self.attempts.fetch_add(1, Ordering::Relaxed) + 1,
            outcome: None,
            in_doubt: false,
        };
        // Until it is known whose the record is, this start may land with nothing to run it:
        // should this future end there (its caller left), or the record not be read, the start
        // is forgotten (see [`Unrun`]).
        let unrun = Unrun {
            fence: Arc::clone(&self.fence),
            lease: self.incarnation.lease,
            never_ran: Arc::clone(&self.never_ran),
            start: Some((key.clone(), record.clone())),
        };
        match bucket.create(&key, encode(&record)).await {
            Ok(revision) => {
                unrun.disarm();
                return Begun::Run(Started { key, revision, record });
            }
            Err(StoreError::Exists) => {}
            // The create may have landed: the record tells.
            Err(e) => tracing::debug!(%key, "creating the call's record: {e}"),
        }
        let deadline = Instant::now() + call.wait;
        let begun = Judge {
            bucket: bucket.as_ref(),
            call,
            key: key.clone(),
            mine: record.clone(),
            lease: self.incarnation.lease,
            watched: None,
            never_ran: &self.never_ran,
        }
        .until(deadline)
        .await;
        if !matches!(begun, Begun::Unavailable(_)) {
            // The record was read: this start is the one to run, or it never landed.
            unrun.disarm();
        }
        begun
    }

    /// Keeps `outcome` (the service's encoding of the call's answer) in the call's record; an
    /// outcome larger than the bound is kept as `too_large(size, max)` instead.
    pub async fn finish(
        &self,
        started: Started,
        outcome: Bytes,
        too_large: impl FnOnce(usize, usize) -> Bytes,
    ) -> Result<(), NotKept> {
        let (size, max) = (outcome.len(), self.max_bytes);
        let (kept, refused) = match size > max {
            true => (too_large(size, max), Some(NotKept::TooLarge { size, max })),
            false => (outcome, None),
        };
        let Started { key, revision, record } = started;
        let done = encode(&Record {
            outcome: Some(kept),
            ..record.clone()
        });
        let bucket = self.fence.bucket().await.map_err(NotKept::Store)?;
        // A store electing a leader takes seconds; a lease of tries covers it.
        let give_up = Instant::now() + self.incarnation.lease;
        let mut backoff = Backoff::from(Duration::from_millis(100));
        let mut failed = None;
        while failed.is_none() || Instant::now() < give_up {
            match bucket.update(&key, done.clone(), revision).await {
                Ok(_) => return refused.map_or(Ok(()), Err),
                Err(StoreError::WrongRevision) if failed.is_some() && kept_by(bucket.as_ref(), &key, &record).await => {
                    return refused.map_or(Ok(()), Err);
                }
                Err(StoreError::WrongRevision) => return Err(NotKept::TakenOver),
                Err(e) => failed = Some(e.to_string()),
            }
            tracing::debug!(%key, "keeping the call's outcome: {}", failed.as_deref().unwrap_or_default());
            tokio::time::sleep(backoff.next()).await;
        }
        Err(NotKept::Store(failed.unwrap_or_default()))
    }

    /// Deletes the record of a call that asked questions before it did anything (an MCP
    /// `input_required`: the request was not processed): sent again without the answers it asks
    /// again, a new round, as it would have had it never been recorded.
    pub async fn release(&self, started: Started) {
        let Ok(bucket) = self.fence.bucket().await else { return };
        if let Err(e) = bucket.delete(&started.key, Some(started.revision)).await {
            tracing::debug!(key = %started.key, "releasing the call's record: {e}");
        }
    }
}

/// Whether the record under `key` holds `record`'s start with an outcome: an earlier write whose
/// answer was lost landed.
async fn kept_by(bucket: &dyn Bucket, key: &str, record: &Record) -> bool {
    let entry = bucket.entry(key, Consistency::Leader).await.ok().flatten();
    live(entry).is_some_and(|(_, kept)| {
        kept.runner == record.runner && kept.attempt == record.attempt && kept.outcome.is_some()
    })
}

/// What one read of a call's record says.
enum Verdict {
    /// This.
    Said(Begun),
    /// The call is this runner's to run again: take the record over at this revision.
    Take(u64),
    /// Its runner still runs it (or cannot be judged now): read again.
    Wait,
}

/// A start whose record may have landed with nothing to run it (its creator's future ended
/// before the record was read, or the read failed): when dropped armed, the attempt is known to
/// this process as one that never ran, so that the call sent again runs here rather than wait
/// for it or find it in doubt, and its record is deleted in the background while it is still
/// that start (tried for a lease).
struct Unrun {
    fence: Arc<RunFence>,
    lease: Duration,
    never_ran: Arc<std::sync::Mutex<std::collections::HashSet<u64>>>,
    /// The record's key and the start it may hold (`None`: disarmed).
    start: Option<(String, Record)>,
}

impl Unrun {
    /// The start is accounted for: nothing to forget.
    fn disarm(mut self) {
        self.start = None;
    }
}

impl Drop for Unrun {
    fn drop(&mut self) {
        let Some((key, start)) = self.start.take() else {
            return;
        };
        let mut never_ran = shared::sync::lock(&self.never_ran);
        if never_ran.len() < MAX_NEVER_RAN {
            never_ran.insert(start.attempt);
        }
        drop(never_ran);
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            let (fence, lease, never_ran) = (Arc::clone(&self.fence), self.lease, Arc::clone(&self.never_ran));
            runtime.spawn(forget(fence, lease, never_ran, key, start));
        }
    }
}

/// Deletes the record under `key` if it is still `start` (this runner's, with no outcome),
/// trying for a lease while the store does not answer; `start` is then no longer one that
/// never ran (its record is gone, or holds another start or an outcome).
async fn forget(
    fence: Arc<RunFence>,
    lease: Duration,
    never_ran: Arc<std::sync::Mutex<std::collections::HashSet<u64>>>,
    key: String,
    start: Record,
) {
    let give_up = Instant::now() + lease;
    let mut backoff = Backoff::from(Duration::from_millis(100));
    while Instant::now() < give_up {
        if let Ok(bucket) = fence.bucket().await
            && let Ok(entry) = bucket.entry(&key, Consistency::Leader).await
        {
            let forgotten = || shared::sync::lock(&never_ran).remove(&start.attempt);
            let Some((revision, record)) = live(entry) else {
                forgotten();
                return;
            };
            let mine = record.runner == start.runner && record.attempt == start.attempt;
            if mine && record.outcome.is_none() && bucket.delete(&key, Some(revision)).await.is_err() {
                tokio::time::sleep(backoff.current()).await;
                continue;
            }
            forgotten();
            return;
        }
        tokio::time::sleep(backoff.next()).await;
    }
    tracing::warn!(%key, "a call's record of a start that did not run could not be removed; this runner runs the call sent again, another waits for it, then finds it in doubt");
}

/// Reads a call's record until it says what to do (see [`CallRecords::begin`]).
struct Judge<'a> {
    bucket: &'a dyn Bucket,
    call: &'a Call<'a>,
    key: String,
    /// The record this runner would start.
    mine: Record,
    /// How long another runner's liveness may go unrenewed (the lease runners share).
    lease: Duration,
    /// The starting runner's liveness as first seen: its revision, and when this runner saw it
    /// change last.
    watched: Option<(String, u64, Instant)>,
    /// See [`CallRecords::never_ran`].
    never_ran: &'a std::sync::Mutex<std::collections::HashSet<u64>>,
}

impl Judge<'_> {
    /// Reads the record (and its runner's liveness) until it says what to do or `deadline`.
    async fn until(mut self, deadline: Instant) -> Begun {
        let mut backoff = Backoff::from(Duration::from_millis(50));
        loop {
            let entry = match self.bucket.entry(&self.key, Consistency::Leader).await {
                Ok(entry) => entry,
                Err(e) => return Begun::Unavailable(format!("reading the call's record: {e}")),
            };
            let Some((revision, record)) = live(entry) else {
                // Gone between the create and the read (aged out): start it afresh.
                return self.take(None).await;
            };
            if record.runner == self.mine.runner && record.attempt == self.mine.attempt {
                return Begun::Run(Started {
                    key: self.key,
                    revision,
                    record,
                });
            }
            // Past the wait, the tool has ended (it runs no longer than its timeout): an outcome
            // still missing was lost with its runner's write.
            let waited_out = Instant::now() >= deadline;
            match self.judge(revision, record, waited_out).await {
                Verdict::Said(next) => return next,
                Verdict::Take(revision) => return self.take(Some(revision)).await,
                Verdict::Wait if waited_out => {
                    return Begun::Unavailable("the call's record could not be marked in doubt".to_owned());
                }
                Verdict::Wait => {}
            }
            let pause = backoff.next().min(deadline.saturating_duration_since(Instant::now()));
            tokio::time::sleep(pause).await;
        }
    }

    /// What the record at `revision` says (`waited_out`: its runner is taken as gone).
    async fn judge(&mut self, revision: u64, record: Record, waited_out: bool) -> Verdict {
        if record.epoch > self.call.epoch {
            return Verdict::Said(Begun::Stale { current: record.epoch });
        }
        if let Some(outcome) = record.outcome {
            return Verdict::Said(Begun::Done(outcome));
        }
        let own = record.runner == self.mine.runner && !record.in_doubt;
        if own && shared::sync::lock(self.never_ran).remove(&record.attempt) {
            // This process's own start whose answer was lost: the tool never ran, so it runs now
            // (once: taking the record over replaces that attempt).
            return Verdict::Take(revision);
        }
        if !record.in_doubt && !waited_out && self.gone(&record.runner).await != Some(true) {
            return Verdict::Wait;
        }
        if self.call.idempotent || self.call.rerun_in_doubt {
            return Verdict::Take(revision);
        }
        if !record.in_doubt {
            // Marked, so that the runner (if it was only paused) cannot keep an outcome the
            // model was told may not exist, and later attempts need not wait again.
            let marked = Record {
                in_doubt: true,
                ..record.clone()
            };
            if let Err(e) = self.bucket.update(&self.key, encode(&marked), revision).await {
                tracing::debug!(key = %self.key, "marking the call in doubt: {e}");
                return Verdict::Wait;
            }
        }
        Verdict::Said(Begun::InDoubt { runner: record.runner })
    }

    /// Whether `runner`'s liveness is gone: deleted, or seen unrenewed for a whole lease
    /// (`None`: it cannot be read now).
    async fn gone(&mut self, runner: &str) -> Option<bool> {
        let key = shared::fence::escaped_key("runner.", runner);
        let entry = self.bucket.entry(&key, Consistency::Leader).await.ok()?;
        let Some(Entry { revision, .. }) = entry.filter(|e| e.operation == Operation::Put) else {
            return Some(true);
        };
        let now = Instant::now();
        match &mut self.watched {
            Some((who, seen, since)) if who == runner && *seen == revision => Some(since.elapsed() >= self.lease),
            watched => {
                *watched = Some((runner.to_owned(), revision, now));
                Some(false)
            }
        }
    }

    /// Starts the call here: creates the record (`revision` `None`) or takes it over at `revision`.
    async fn take(self, revision: Option<u64>) -> Begun {
        let written = match revision {
            Some(revision) => self.bucket.update(&self.key, encode(&self.mine), revision).await,
            None => self.bucket.create(&self.key, encode(&self.mine)).await,
        };
        match written {
            Ok(revision) => Begun::Run(Started {
                key: self.key,
                revision,
                record: self.mine,
            }),
            Err(e) => Begun::Unavailable(format!("starting the call's record: {e}")),
        }
    }
}

/// Pauses between tries against the store: doubling from the first, at most a second.
struct Backoff(Duration);

impl From<Duration> for Backoff {
    fn from(first: Duration) -> Self {
        Self(first)
    }
}

impl Backoff {
    /// The pause before the next try, without moving on.
    fn current(&self) -> Duration {
        self.0
    }

    /// The pause before the next try; the one after it is doubled.
    fn next(&mut self) -> Duration {
        let pause = self.0;
        self.0 = (pause * 2).min(Duration::from_secs(1));
        pause
    }
}

/// The record's value.
fn encode(record: &Record) -> Bytes {
    prost::Message::encode_to_vec(record).into()
}

/// The record an entry holds, with its revision (`None`: deleted, or unreadable).
fn live(entry: Option<Entry>) -> Option<(u64, Record)> {
    let entry = entry.filter(|e| e.operation == Operation::Put)?;
    let record = <Record as prost::Message>::decode(entry.value).ok()?;
    Some((entry.revision, record))
}

/// The key of a call's record: the run, the call, and the round of questions its answers belong
/// to (hashed: a round's state is opaque and may be long).
fn key(call: &Call<'_>) -> String {
    let mut key = shared::fence::escaped_key("call.", call.run_id);
    key.push_str(&shared::fence::escaped_key(".", call.call_id));
    if let Some(round) = call.round {
        key.push_str(&format!(".{:016x}", shared::text::fnv1a(round.as_bytes())));
    }
    key
}
