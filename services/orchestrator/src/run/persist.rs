//! Writing one run's state to the result store: checkpoints of a live run, its lease in a shared
//! store, and its final result (which waits in the [`Backlog`] when the store does not take it).
//! With a [`RunJournal`] (the NATS store) a checkpoint also holds what another replica needs to
//! resume the run; once another replica took the run over, every write of it here is refused and
//! the persister says so ([`Persister::taken_over`]).
//! The snapshot is taken inside a per-run lock, so the last write is always the newest state even
//! when writes race (e.g. a signal confirmed late).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::domain::{Ownership, Stop};

use super::SharedState;
use super::backlog::Backlog;
use crate::domain::ports::{Claim, ParkOutcome, ResultStore, RunJournal, StoreError, within};
use crate::domain::result::RunResult;

/// Writes one run's state to the store, newest state last.
#[derive(Clone)]
pub struct Persister {
    store: Arc<dyn ResultStore>,
    state: SharedState,
    lock: Arc<tokio::sync::Mutex<()>>,
    timeout: Duration,
    backlog: Arc<Backlog>,
    journal: Option<Arc<dyn RunJournal>>,
    /// This replica's lease on the run: stopped once a write was refused because another replica
    /// owns the run, a checkpoint was not saved, the lease ran out unrenewed, or the run was
    /// handed over. Nothing of the run is written from here after that — unless it ended here
    /// (`Ownership::end`): a later write (a signal confirmed late) rewrites the run's own final
    /// record, which no other replica takes over, so it needs no lease.
    ownership: Ownership,
    /// Set once the run parked for approvals: its record is the approval store's now, and nothing of it is
    /// written from here (a lease renewal would make it running again).
    released: CancellationToken,
    /// The run's id was claimed with its start checkpoint: its first safe point has nothing new
    /// to save.
    claimed_resumable: Arc<AtomicBool>,
    /// Asks the lease keeper to renew now (a cancel after the turn waits for its record).
    renew_now: Arc<tokio::sync::Notify>,
    /// A record the store took held the run's ask to end after its turn.
    after_turn_kept: Arc<tokio::sync::watch::Sender<bool>>,
    /// The chunks of the run's checkpoints and segments the journal keeps, so each is written
    /// once (see [`super::chunks`]).
    chunks: Arc<std::sync::Mutex<super::chunks::Kept>>,
}

/// A checkpoint as the loop hands it over: the run's state, its deadline and the serialized
/// checkpoint.
pub struct Snapshot {
    /// The run's output at the checkpoint.
    pub result: RunResult,
    /// Until when the run may be resumed (its deadline, Unix ms).
    pub deadline_unix_ms: u64,
    /// The checkpoint itself, as JSON (folded into chunks, then encoded, when written).
    pub checkpoint: serde_json::Value,
}

/// A claim the store could not answer: the run goes on unclaimed (a store that is down does not
/// stop runs).
/// A claim the store did not answer: the run does not start (it might run twice, or at epoch 0,
/// which tools read as "not durable"); the caller is told to retry.
fn unclaimed(run_id: &str, error: StoreError) -> Result<Claim, StoreError> {
    tracing::warn!(run_id = %run_id, "claiming the run id in the store failed; the run is not started: {error}");
    Err(error)
}

impl Snapshot {
    /// `bytes`, a checkpoint about to be written, counted in the checkpoint metrics.
    fn counted(bytes: Vec<u8>) -> Vec<u8> {
        metrics::counter!(crate::telemetry::metric::CHECKPOINTS).increment(1);
        metrics::histogram!(crate::telemetry::metric::CHECKPOINT_BYTES).record(bytes.len() as f64);
        bytes
    }
}

impl Persister {
    /// A persister of `state` into `store`; one write waits at most `timeout`; a final result
    /// the store does not take waits in `backlog`.
    pub fn new(store: Arc<dyn ResultStore>, state: SharedState, timeout: Duration, backlog: Arc<Backlog>) -> Self {
        Self {
            ownership: Ownership::held_by(store.lease(), store.liveness(), tokio::time::Instant::now()),
            store,
            state,
            lock: Arc::default(),
            timeout,
            backlog,
            journal: None,
            released: CancellationToken::new(),
            claimed_resumable: Arc::default(),
            renew_now: Arc::default(),
            after_turn_kept: Arc::new(tokio::sync::watch::Sender::new(false)),
            chunks: Arc::default(),
        }
    }

    /// Notes the chunks of the run the journal keeps already (read when the run was taken
    /// over), so they are not written again.
    pub fn knows_chunks(&self, kept: super::chunks::Kept) {
        *shared::sync::lock(&self.chunks) = kept;
    }

    /// The persister, writing checkpoints another replica can resume the run from to `journal`.
    pub fn with_journal(mut self, journal: Option<Arc<dyn RunJournal>>) -> Self {
        self.journal = journal;
        self
    }

    /// Whether checkpoints let another replica resume the run.
    pub fn durable(&self) -> bool {
        self.journal.is_some()
    }

    /// This replica's ownership of the run (its lease and its stop).
    pub fn ownership(&self) -> &Ownership {
        &self.ownership
    }

    /// Resolves once this replica stopped acting for the run (fenced, unsaved, expired or
    /// handed over): the run is another replica's to resume.
    pub async fn taken_over(&self) {
        self.ownership.lost().await;
    }

    /// The persister, acting for the run with `ownership` (made by the registry, which shows the
    /// run's end only once that ownership says it is stored).
    #[must_use]
    pub fn with_ownership(mut self, ownership: Ownership) -> Self {
        self.ownership = ownership;
        self
    }

    /// Whether a write may leave now: the run is this replica's (or ended here), and not parked
    /// or parking.
    fn may_write(&self) -> bool {
        !self.released.is_cancelled() && !self.ownership.parking() && self.ownership.may_log()
    }

    /// Writes the current state now; whether the store took it.
    pub async fn write(&self) -> bool {
        self.write_state(false).await
    }

    /// Whether the store took, within `wait`, a record holding the run's ask to end after its
    /// turn: the lease keeper is asked to renew at once. A run whose lease is not kept here (not
    /// claimed yet, or waiting to take its slot again after a park) renews nothing: `false`.
    pub async fn after_turn_kept(&self, wait: Duration) -> bool {
        let mut kept = self.after_turn_kept.subscribe();
        self.renew_now.notify_one();
        let kept_or_lost = async {
            tokio::select! {
                kept = kept.wait_for(|kept| *kept) => kept.is_ok(),
                () = self.ownership.lost() => false,
            }
        };
        tokio::time::timeout(wait, kept_or_lost).await.unwrap_or(false)
    }

    /// Renews the lease with the run's state, as a live run's: a state that reads ended already
    /// (the run is logging its end) is written as still running. Only
    /// [`Persister::write_final`] stores an end, once the log keeps it; otherwise the record
    /// could say the run ended while its log lacks the end for good.
    async fn renew(&self) -> bool {
        self.write_state(true).await
    }

    /// Writes the current state (as a live run's when `still_live`); whether the store took it.
    async fn write_state(&self, still_live: bool) -> bool {
        let _serialized = self.lock.lock().await;
        // An ended run's lease matters no more, and its record is its end.
        if !self.may_write() || (still_live && self.ownership.ended()) {
            return false;
        }
        let mut snapshot = self.snapshot();
        // A live run's record says when it was written; an end keeps the time it was settled
        // (the result `run_finished` carries, which GetRun answers the same).
        if still_live {
            snapshot = snapshot.unended();
            snapshot.updated_at_ms = shared::sync::unix_ms();
        }
        let run_id = snapshot.run_id.clone();
        let marked = snapshot.ends_after_turn.is_some();
        let sent = tokio::time::Instant::now();
        let written = within(self.timeout, self.store.put(snapshot)).await;
        let kept = self.outcome(&run_id, "storing the run's state", sent, written);
        if kept && marked {
            self.after_turn_kept.send_replace(true);
        }
        kept
    }

    /// Whether a write sent at `sent` went through (the lease runs from then); a fenced one
    /// stops this replica's ownership.
    fn outcome(&self, run_id: &str, what: &str, sent: tokio::time::Instant, written: Result<(), StoreError>) -> bool {
        match written {
            Ok(()) => {
                self.ownership.confirmed(sent);
                true
            }
            Err(e @ StoreError::Fenced { .. }) => {
                tracing::warn!(run_id = %run_id, "{e}; this replica stops the run");
                self.ownership.stop(Stop::Fenced(e.to_string()));
                false
            }
            Err(e) => {
                tracing::warn!(run_id = %run_id, "{what} failed: {e}");
                false
            }
        }
    }

    /// Saves a checkpoint (made by `make` once the write's turn came, so the newest one is
    /// written last) and renews the lease with it; whether the store took it. A checkpoint the
    /// store did not take (or that could not be encoded) stops the run here: what it would reveal
    /// next is not saved, so the run resumes (elsewhere, or here through a fresh claim) from the
    /// last good one. Without a journal nothing is written.
    pub async fn save(&self, make: impl FnOnce() -> Result<Snapshot, StoreError>) -> bool {
        let Some(journal) = &self.journal else {
            return false;
        };
        let _serialized = self.lock.lock().await;
        if !self.may_write() {
            return false;
        }
        let Snapshot {
            mut result,
            deadline_unix_ms,
            checkpoint,
        } = match make() {
            Ok(snapshot) => snapshot,
            Err(e) => {
                tracing::error!("{e}; the run stops here and resumes from its last checkpoint");
                self.ownership.stop(Stop::Unsaved(e.to_string()));
                return false;
            }
        };
        result.updated_at_ms = shared::sync::unix_ms();
        let run_id = result.run_id.clone();
        let bytes = Snapshot::counted(self.folded(checkpoint).await);
        let sent = tokio::time::Instant::now();
        let saved = within(self.timeout, journal.save(result, deadline_unix_ms, bytes)).await;
        let failure = saved.as_ref().err().map(ToString::to_string);
        let ok = self.outcome(&run_id, "saving the run's checkpoint", sent, saved);
        if let Some(failure) = failure {
            self.ownership.stop(Stop::Unsaved(failure));
        }
        ok
    }

    /// Keeps `segment` of the run's transcript in the journal for its checkpoints to name: its
    /// position, `None` when the journal keeps no segments, or did not take this one in time
    /// (the checkpoints then hold those messages themselves).
    pub async fn keep_segment(&self, segment: serde_json::Value) -> Option<u64> {
        let segment = self.folded(segment).await;
        self.keep_chunk(segment).await
    }

    /// `value` (a checkpoint or a segment) encoded, its long strings and arrays kept apart as
    /// chunks and named (see [`super::chunks`]) when the journal keeps segments.
    async fn folded(&self, value: serde_json::Value) -> Vec<u8> {
        let value = match self.journal.as_ref().is_some_and(|j| j.keeps_segments()) {
            true => super::chunks::fold(value, &self.chunks, |chunk| self.keep_chunk(chunk)).await,
            false => value,
        };
        // A JSON value always encodes.
        serde_json::to_vec(&value).unwrap_or_default()
    }

    /// Keeps `bytes` in the journal beside the transcript's segments: its position, `None` when
    /// the journal keeps none or did not take it in time.
    async fn keep_chunk(&self, segment: Vec<u8>) -> Option<u64> {
        let journal = self.journal.as_ref()?;
        if !self.may_write() {
            return None;
        }
        let run_id = shared::sync::lock(&self.state).run_id.clone();
        match within(self.timeout, journal.keep_segment(&run_id, segment)).await {
            Ok(position) => position,
            Err(e) => {
                tracing::warn!(run_id = %run_id, "keeping a transcript segment failed (the checkpoint holds it): {e}");
                None
            }
        }
    }

    /// Parks the run (`park`, the approval store's) with no write of this persister in between:
    /// a write under way finishes first, and those asked for while the park's requests are out
    /// are not sent (they do not wait on them either: the lock is not held across the park; a
    /// renewal landing after the park's record would make the run running again). Once parked,
    /// nothing of the run is written from here any more, and the ownership stays marked as
    /// parking (a cancel finds the run in the approval store).
    pub async fn parking(
        &self,
        park: impl Future<Output = Result<ParkOutcome, StoreError>>,
    ) -> Result<ParkOutcome, StoreError> {
        {
            let _serialized = self.lock.lock().await;
            self.ownership.set_parking(true);
        }
        let parked = park.await;
        if matches!(parked, Ok(ParkOutcome::Parked)) {
            self.released.cancel();
        } else {
            self.ownership.set_parking(false);
        }
        parked
    }

    /// Releases the run as handed over at a drain (its last checkpoint stands, and the caller
    /// flushed its events to the log first): another replica takes it at once.
    pub async fn hand_over(&self) {
        let Some(journal) = &self.journal else { return };
        let _serialized = self.lock.lock().await;
        let held = self.ownership.holds();
        // Stopped before the record says handed over: another replica may claim the run the
        // moment it does, and nothing of this one's (a tool call sent again, a write) may
        // leave after that.
        self.ownership.stop(Stop::HandedOver);
        if held {
            let run_id = self.snapshot().run_id;
            let sent = tokio::time::Instant::now();
            let handed = within(self.timeout, journal.hand_over(&run_id)).await;
            self.outcome(&run_id, "handing the run over", sent, handed);
        }
    }

    /// Gives the run back in the store once this replica stopped acting for it while its
    /// incarnation lives (a checkpoint or its events not kept, a refusal by the event log) and its
    /// record may still name this replica: marked handed over, so any replica resumes it from its
    /// last good checkpoint (held by a live incarnation, its record would never lapse). A record
    /// another replica wrote since is left alone.
    pub async fn give_back(&self) {
        let Some(journal) = &self.journal else { return };
        if matches!(self.ownership.why(), None | Some(Stop::HandedOver | Stop::Expired)) {
            return;
        }
        let run_id = self.snapshot().run_id;
        if let Err(e) = within(self.timeout, journal.hand_over(&run_id)).await {
            tracing::warn!(run_id = %run_id, "giving the run back failed (the keeper tries again): {e}");
        }
    }

    /// Forgets the run's checkpoint once its final result is stored.
    async fn forget(&self) {
        let Some(journal) = &self.journal else { return };
        let run_id = self.snapshot().run_id;
        if let Err(e) = within(self.timeout, journal.forget(&run_id)).await {
            tracing::warn!(run_id = %run_id, "deleting the run's checkpoint failed (it expires with the results): {e}");
        }
    }

    /// Writes the final result; if the store does not take it, it waits in the backlog (written
    /// again until the store takes it; GetRun reads the run as running meanwhile).
    pub async fn write_final(&self) {
        let written = self.snapshot();
        if self.write().await {
            self.ownership.end();
            // A signal confirmed while the end was on its way changed it (its delivery report
            // found the end not stored yet, and left the write to this one).
            if self.snapshot() != written {
                self.write().await;
            }
            self.forget().await;
        } else if !self.ownership.stopped() {
            self.backlog.push(self.snapshot());
        }
    }

    fn snapshot(&self) -> RunResult {
        shared::sync::lock(&self.state).clone()
    }

    /// Claims the run's id in the store (see [`ResultStore::claim`]). A store that cannot be
    /// reached does not stop the run at once: it is logged, and the run goes on unclaimed, its
    /// lease running from the claim's send (it stops unless a later write lands in time).
    pub async fn claim(&self) -> Result<Claim, StoreError> {
        let snapshot = self.snapshot();
        let run_id = snapshot.run_id.clone();
        let sent = tokio::time::Instant::now();
        let claim = within(self.timeout, self.store.claim(snapshot)).await;
        self.claimed(&run_id, sent, claim)
    }

    /// The outcome of a claim sent at `sent`: a claimed run's lease runs from then, with the
    /// epoch the store gave.
    fn claimed(
        &self,
        run_id: &str,
        sent: tokio::time::Instant,
        claim: Result<Claim, StoreError>,
    ) -> Result<Claim, StoreError> {
        match claim {
            Ok(Claim::Claimed) => {
                self.ownership.begin(sent);
                self.ownership.set_generation(self.store.generation(run_id));
                self.ownership.set_epoch(self.store.epoch(run_id));
                Ok(Claim::Claimed)
            }
            Ok(taken) => Ok(taken),
            Err(e) => unclaimed(run_id, e),
        }
    }

    /// Claims the run's id with its start checkpoint (made by `start`), so another replica can
    /// resume the run from its first moment ([`RunJournal::claim_resumable`]); without a journal
    /// as [`Persister::claim`]. A store that cannot be reached does not stop the run at once: it
    /// goes on unclaimed, resumable from its first saved checkpoint.
    pub async fn claim_resumable(
        &self,
        start: impl FnOnce() -> Result<Snapshot, StoreError>,
    ) -> Result<Claim, StoreError> {
        let Some(journal) = &self.journal else {
            return self.claim().await;
        };
        let Snapshot {
            result,
            deadline_unix_ms,
            checkpoint,
        } = start()?;
        let bytes = Snapshot::counted(crate::domain::ports::json("the run's start checkpoint", &checkpoint)?);
        let run_id = result.run_id.clone();
        let sent = tokio::time::Instant::now();
        let claim = within(self.timeout, journal.claim_resumable(result, deadline_unix_ms, bytes)).await;
        let claim = self.claimed(&run_id, sent, claim);
        self.claimed_resumable
            .store(matches!(claim, Ok(Claim::Claimed)), Ordering::Release);
        claim
    }

    /// A run taken over here: the claim (sent at `sent`) gave it `epoch`, its record naming the
    /// incarnation of `generation`.
    pub fn taken(&self, sent: tokio::time::Instant, epoch: u64, generation: u64) {
        self.ownership.begin(sent);
        self.ownership.set_generation(generation);
        self.ownership.set_epoch(epoch);
    }

    /// Whether the run's id was claimed with its start checkpoint.
    pub fn claimed_resumable(&self) -> bool {
        self.claimed_resumable.load(Ordering::Acquire)
    }

    /// Renews the run's lease in a shared store until the returned guard is dropped: the state is
    /// written every [`LeaseTerms::renew_every`]; a lease that runs out unrenewed stops the
    /// ownership (the run ends here, see [`Persister::taken_over`]). A run held by its
    /// replica's incarnation ([`ResultStore::liveness`]) writes only when asked to (a quiet run
    /// costs the store nothing), and stops when the incarnation's lease runs out.
    ///
    /// [`LeaseTerms::renew_every`]: crate::domain::LeaseTerms::renew_every
    pub fn keep_lease(&self) -> Option<shared::runtime::AbortOnDrop> {
        let terms = self.store.lease()?;
        let every = self.store.liveness().is_none().then(|| terms.renew_every());
        let this = self.clone();
        Some(shared::runtime::AbortOnDrop(shared::tasks::spawn(async move {
            loop {
                let renewal = async {
                    match every {
                        Some(every) => tokio::time::sleep(every).await,
                        None => std::future::pending().await,
                    }
                };
                tokio::select! {
                    biased;
                    () = this.ownership.expire() => return,
                    () = renewal => {
                        let _ = this.renew().await;
                    }
                    () = this.renew_now.notified() => {
                        let _ = this.renew().await;
                    }
                }
            }
        })))
    }

    /// Writes the final result again in the background (off the run's path), e.g. after a late
    /// signal confirmation changed it, once it is stored: an end not stored yet is the run's own
    /// to store, after its log keeps it (written earlier, the record would say the run ended
    /// while its log may never hold the end, and the checkpoint would be gone).
    pub fn write_final_soon(&self) {
        if !self.ownership.ended() {
            return;
        }
        let this = self.clone();
        shared::tasks::spawn(async move { this.write_final().await });
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use futures::future::BoxFuture;

    use super::*;
    use crate::domain::{LeaseTerms, RunStatus};

    /// A store other replicas read (it has lease terms) that records what is put.
    #[derive(Default)]
    struct Recording {
        puts: Mutex<Vec<RunResult>>,
    }

    impl ResultStore for Recording {
        fn put(&self, result: RunResult) -> BoxFuture<'static, Result<(), StoreError>> {
            shared::sync::lock(&self.puts).push(result);
            Box::pin(std::future::ready(Ok(())))
        }
        fn claim(&self, _: RunResult) -> BoxFuture<'static, Result<Claim, StoreError>> {
            Box::pin(std::future::ready(Ok(Claim::Claimed)))
        }
        fn get(&self, _: &str) -> BoxFuture<'static, Result<Option<RunResult>, StoreError>> {
            Box::pin(std::future::ready(Ok(None)))
        }
        fn lease(&self) -> Option<LeaseTerms> {
            Some(LeaseTerms {
                length: Duration::from_secs(3),
                margin: Duration::from_secs(1),
                fence_grace: Duration::ZERO,
            })
        }
    }

    /// While a run logs its end, its state reads ended already, and its lease is still renewed:
    /// as a live run's. The end itself is stored only by `write_final`, once the log keeps it.
    #[tokio::test(start_paused = true)]
    async fn a_lease_renewal_never_stores_an_end() {
        let store = Arc::new(Recording::default());
        let state: SharedState = Arc::new(Mutex::new(RunResult::running("r")));
        let timeout = Duration::from_secs(1);
        let backlog = Backlog::new(Arc::clone(&store) as Arc<dyn ResultStore>, 4, timeout, timeout);
        let persister = Persister::new(
            Arc::clone(&store) as Arc<dyn ResultStore>,
            Arc::clone(&state),
            timeout,
            backlog,
        );
        {
            let mut ended = shared::sync::lock(&state);
            ended.status = RunStatus::Failed;
            ended.failure_reason = Some(crate::domain::FailureReason::LlmStreamStalled);
            ended.text = "so far".into();
        }
        let _lease = persister.keep_lease();
        tokio::time::sleep(Duration::from_millis(2500)).await;
        let puts = shared::sync::lock(&store.puts).clone();
        assert!(!puts.is_empty(), "the lease was renewed");
        assert!(
            puts.iter()
                .all(|p| p.status == RunStatus::Running && p.failure_reason.is_none() && p.text == "so far"),
            "{puts:?}"
        );
        persister.write_final().await;
        tokio::time::sleep(Duration::from_millis(2500)).await;
        let last = shared::sync::lock(&store.puts).last().cloned().map(|p| p.status);
        assert_eq!(
            last,
            Some(RunStatus::Failed),
            "write_final stores the end, and no renewal writes after it"
        );
    }

    /// A park's requests hold no lock: a write asked for meanwhile neither waits for them nor
    /// leaves (it would make the parked run running again); once the park failed, writes go again.
    #[tokio::test(start_paused = true)]
    async fn a_write_during_a_park_neither_waits_nor_leaves() {
        let store = Arc::new(Recording::default());
        let state: SharedState = Arc::new(Mutex::new(RunResult::running("r")));
        let timeout = Duration::from_secs(1);
        let backlog = Backlog::new(Arc::clone(&store) as Arc<dyn ResultStore>, 4, timeout, timeout);
        let persister = Persister::new(Arc::clone(&store) as Arc<dyn ResultStore>, state, timeout, backlog);
        let (answer, answered) = tokio::sync::oneshot::channel::<Result<ParkOutcome, StoreError>>();
        let parking = shared::tasks::spawn({
            let persister = persister.clone();
            async move {
                let park = async move {
                    answered
                        .await
                        .unwrap_or_else(|_| Err(StoreError::Timeout(Duration::ZERO)))
                };
                persister.parking(park).await
            }
        });
        tokio::task::yield_now().await;
        let written = tokio::time::timeout(Duration::from_millis(10), persister.write()).await;
        assert_eq!(written.ok(), Some(false), "not sent, and not held up by the park");
        assert!(shared::sync::lock(&store.puts).is_empty());
        let _ = answer.send(Err(StoreError::Timeout(timeout)));
        assert!(parking.await.is_ok_and(|parked| parked.is_err()));
        assert!(persister.write().await, "the park failed: the run writes again");
    }
}
