//! The runs registry: run slots, live runs (for `GetRun` and `CancelRun`), runs parked waiting
//! for approvals (they hold no slot), the result store where finished results (and checkpoints
//! of live ones) are kept, and the runs' event logs that callers re-attach to (`AttachRun`).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};

use crate::domain::{EventBatch, RunResult, RunSpec, RunStatus};
use crate::run::live::{AdmittedRun, Cancel, Emitter, Handoff, SharedState};

type EventSender = tokio::sync::mpsc::Sender<EventBatch>;
use crate::domain::ports::{
    ApprovalLot, Claim, EventFeed, EventLog, LogError, LogWriter, Logged, Ready, RemoteCancel, ResultStore, RunJournal,
    StoreError, within,
};
use crate::run::backlog::Backlog;
use crate::run::persist::Persister;
use crate::run::tool_loop::{Checkpoint, Resumed};
use shared::auth::Principal;
use shared::runtime::AbortOnDrop;

/// How often the backlog of unstored results is written again while the store is unavailable.
const BACKLOG_RETRY: Duration = Duration::from_secs(1);

struct Live {
    state: SharedState,
    cancel: Cancel,
    handoff: Handoff,
    principal: String,
    /// Cancelled once the run leaves this replica (ended, or moved to another one).
    gone: tokio_util::sync::CancellationToken,
    /// It went on here after waiting for approvals (its callers follow its log).
    unparked: bool,
}

/// See the module docs.
pub(crate) struct Runs {
    live: Mutex<HashMap<String, Live>>,
    slots: Arc<Semaphore>,
    idle: Notify,
    /// Told when a run leaves its slot (runs waiting for one, parked and ready, go on).
    freed: Arc<Notify>,
    max_runs: usize,
    store: Arc<dyn ResultStore>,
    /// How long one write to the store may take.
    store_timeout: Duration,
    backlog: Arc<Backlog>,
    log: Arc<dyn EventLog>,
    /// Checkpoints and takeover (the NATS store): runs outlive this replica.
    journal: Option<Arc<dyn RunJournal>>,
    /// One permit per attached caller.
    attach_slots: Arc<Semaphore>,
    attach_permits: usize,
    /// Runs waiting for approvals.
    approvals: Arc<dyn ApprovalLot>,
    /// The drain's request that runs move: each run's [`Handoff`] is its child, so a run let in
    /// (or taken over) while the replica drains is asked too.
    drain: Handoff,
}

/// Why a caller cannot re-attach to a run.
#[derive(Debug)]
pub(crate) enum AttachError {
    /// No run the caller may see has this id (or its log expired).
    NotFound,
    /// The store cannot say.
    Store(StoreError),
    /// The log cannot serve it.
    Log(LogError),
    /// As many callers as allowed are attached already.
    Full(usize),
}

/// Why a run cannot start.
#[derive(Debug)]
pub(crate) enum Refusal {
    /// A live run has this id (here or, with a shared store, on another replica).
    Duplicate,
    /// No slot is free.
    Full(usize),
    /// The run already finished; here is its result (idempotent replay).
    Finished(Box<RunResult>),
    /// The caller has `max_runs` runs in flight already.
    CallerFull(usize),
    /// The id belongs to another caller's run, which this caller may not see.
    Foreign,
}

/// Whether `caller` may see a run of `owner`: its own runs, or every run when the server does
/// not authenticate (the anonymous caller).
fn sees(caller: &Principal, owner: &str) -> bool {
    caller.name.is_empty() || caller.name == owner
}

/// A started run's place in the registry; dropping it frees the slot and the live entry.
pub(crate) struct Admitted {
    runs: Arc<Runs>,
    run_id: String,
    /// The run's live state.
    pub state: SharedState,
    /// Cancels the run.
    pub cancel: Cancel,
    /// Asks the run to move to another replica (drain).
    pub handoff: Handoff,
    /// Writes the run's state to the store.
    pub persister: Persister,
    /// Appends the run's events to its log (taken by the run's emitter).
    pub log: Option<Box<dyn LogWriter>>,
    /// Renews the run's lease in a shared store while the run is admitted.
    _lease: Option<AbortOnDrop>,
    _permit: OwnedSemaphorePermit,
}

impl Drop for Admitted {
    fn drop(&mut self) {
        let mut live = self.runs.lock();
        if let Some(run) = live.remove(&self.run_id) {
            run.gone.cancel();
        }
        if live.is_empty() {
            self.runs.idle.notify_waiters();
        }
        self.runs.freed.notify_one();
    }
}

impl Admitted {
    /// Claims the id in the store, so no other replica runs it too, and keeps the run's lease
    /// there; a taken id gives the run holding it (dropping `self` frees the slot). A durable
    /// run's claim (`spec` given) puts its start checkpoint in place first.
    async fn claim(mut self, caller: &Principal, spec: Option<&RunSpec>) -> Result<Self, Refusal> {
        let claim = match spec {
            Some(spec) if self.persister.durable() => {
                let start = || Checkpoint::at_start(spec, shared::sync::lock(&self.state).clone()).snapshot();
                self.persister.claim_resumable(start).await
            }
            _ => self.persister.claim().await,
        };
        match claim {
            Claim::Claimed => {
                self._lease = self.persister.keep_lease();
                // The id is this run's: its log starts now (a replay or a duplicate leaves the
                // log of the run holding the id alone).
                self.log = Some(self.runs.log.owned_writer(
                    &self.run_id,
                    &Logged::default(),
                    self.persister.ownership(),
                ));
                Ok(self)
            }
            Claim::Taken(result) if !sees(caller, &result.principal) => Err(Refusal::Foreign),
            Claim::Taken(result) if result.status.is_live() => Err(Refusal::Duplicate),
            Claim::Taken(result) => Err(Refusal::Finished(result)),
        }
    }

    /// Stores `result` as the run's end: the run's log ends with it, its replica stopped before
    /// its record said so. Nothing of it runs again.
    async fn store_ended(self, result: RunResult) {
        tracing::info!(run_id = %self.run_id, status = ?result.status, "the run had ended on the replica that stopped; its result is stored");
        *shared::sync::lock(&self.state) = result;
        self.persister.write_final().await;
    }

    /// The run as the loop takes it: `spec`, its stream's `emitter`, the `caller`'s sender to
    /// watch (`None` when detached), and this slot, freed when the loop is done with the run.
    pub(crate) fn into_run(self, spec: RunSpec, emitter: Emitter, caller: Option<EventSender>) -> AdmittedRun {
        AdmittedRun {
            spec,
            state: Arc::clone(&self.state),
            emitter,
            cancel: self.cancel.clone(),
            caller,
            persister: Some(self.persister.clone()),
            handoff: self.handoff.clone(),
            slot: Some(Box::new(self)),
        }
    }
}

/// Outcome of a cancel request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CancelOutcome {
    /// A live run was canceled.
    Canceled,
    /// The run had already finished with this status.
    AlreadyFinished(RunStatus),
    /// No such run here.
    NotFound,
    /// The run is live on another replica that did not answer (it is moving between replicas).
    Unanswered,
}

/// Where the registry keeps what outlives a run's task: results, event logs, checkpoints (a
/// shared store) and runs waiting for approvals.
pub(crate) struct Keeping {
    pub(crate) store: Arc<dyn ResultStore>,
    pub(crate) log: Arc<dyn EventLog>,
    pub(crate) journal: Option<Arc<dyn RunJournal>>,
    pub(crate) approvals: Arc<dyn ApprovalLot>,
}

impl Runs {
    /// An empty registry of at most `max_runs` live runs and `max_attached` attached callers,
    /// over `keeping` (a store write waits at most `store_timeout`; final results the store does
    /// not take wait in a backlog of at most `backlog` results).
    pub(crate) fn new(
        max_runs: usize,
        max_attached: usize,
        keeping: Keeping,
        store_timeout: Duration,
        backlog: usize,
    ) -> Arc<Self> {
        let Keeping {
            store,
            log,
            journal,
            approvals,
        } = keeping;
        Arc::new(Self {
            live: Mutex::default(),
            slots: Arc::new(Semaphore::new(max_runs)),
            idle: Notify::new(),
            freed: Arc::new(Notify::new()),
            max_runs,
            backlog: Backlog::new(Arc::clone(&store), backlog, store_timeout, BACKLOG_RETRY),
            store,
            store_timeout,
            log,
            journal,
            attach_slots: Arc::new(Semaphore::new(max_attached)),
            attach_permits: max_attached,
            approvals,
            drain: Handoff::default(),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Live>> {
        shared::sync::lock(&self.live)
    }

    /// A result in the backlog or the store; `Err` when the store cannot be read.
    async fn stored(&self, run_id: &str) -> Result<Option<RunResult>, StoreError> {
        if let Some(result) = self.backlog.get(run_id) {
            return Ok(Some(result));
        }
        within(self.store_timeout, self.store.get(run_id)).await
    }

    /// Takes a slot for `run_id`, a run of `caller`; with its `spec`, a durable run is resumable
    /// from here on (its start checkpoint goes in with its claim).
    pub(crate) async fn admit(
        self: &Arc<Self>,
        run_id: &str,
        caller: &Principal,
        spec: Option<&RunSpec>,
    ) -> Result<Admitted, Refusal> {
        if let Some(refusal) = self.refusal_here(run_id, caller) {
            return Err(refusal);
        }
        match self.approvals.parked(run_id) {
            Some(parked) if !sees(caller, &parked.principal) => return Err(Refusal::Foreign),
            Some(_) => return Err(Refusal::Duplicate),
            None => {}
        }
        match self.stored(run_id).await {
            Ok(Some(result)) if !sees(caller, &result.principal) => return Err(Refusal::Foreign),
            Ok(Some(result)) if result.status.is_live() => return Err(Refusal::Duplicate),
            Ok(Some(result)) => return Err(Refusal::Finished(Box::new(result))),
            // The claim below tries the store again; a store that is down does not stop runs.
            Ok(None) | Err(_) => {}
        }
        self.admitted(run_id, caller)?.claim(caller, spec).await
    }

    /// Why `run_id` cannot start when it is live on this replica. A run that has just ended
    /// here keeps its entry until its task is done: it is replayed like a stored result.
    fn refusal_here(&self, run_id: &str, caller: &Principal) -> Option<Refusal> {
        let live = self.lock();
        let live = live.get(run_id)?;
        if !sees(caller, &live.principal) {
            return Some(Refusal::Foreign);
        }
        let result = shared::sync::lock(&live.state);
        Some(if result.status.is_live() {
            Refusal::Duplicate
        } else {
            Refusal::Finished(Box::new(result.clone()))
        })
    }

    /// A slot and a live entry for `run_id`, with its persister (not claimed in the store yet).
    fn admitted(self: &Arc<Self>, run_id: &str, caller: &Principal) -> Result<Admitted, Refusal> {
        let (state, cancel, handoff, permit) = self.register(run_id, caller)?;
        let persister = Persister::new(
            Arc::clone(&self.store),
            Arc::clone(&state),
            self.store_timeout,
            Arc::clone(&self.backlog),
        )
        .with_journal(self.journal.clone());
        Ok(Admitted {
            runs: Arc::clone(self),
            run_id: run_id.to_owned(),
            state,
            cancel,
            handoff,
            _lease: None,
            log: None,
            persister,
            _permit: permit,
        })
    }

    /// Whether runs outlive this replica (checkpoints and takeover).
    pub(crate) fn durable(&self) -> Option<&Arc<dyn RunJournal>> {
        self.journal.as_ref()
    }

    /// Resolves once a run left its slot (or already did since the last call).
    pub(crate) fn slot_freed(&self) -> impl Future<Output = ()> + Send + 'static {
        let freed = Arc::clone(&self.freed);
        async move { freed.notified().await }
    }

    /// Slots free now.
    pub(crate) fn free_slots(&self) -> usize {
        self.slots.available_permits()
    }

    /// Takes over the orphan `run_id` when a slot is free and this replica wins its claim: its
    /// slot here (with its lease kept and its log continued), its checkpoint and the last seq its
    /// log holds. `Ok(None)`: no slot, or another replica won.
    pub(crate) async fn take_over(self: &Arc<Self>, run_id: &str) -> Result<Option<(Admitted, Resumed)>, String> {
        let Some(journal) = self.journal.clone() else {
            return Ok(None);
        };
        if self.free_slots() == 0 || self.lock().contains_key(run_id) {
            // A run live here is not claimed again here, whatever its record says (a hand-over
            // announced while it runs, a record seen unchanged): its claim would fence the run
            // out of its own record, and the admission that follows would fail and hand it over.
            return Ok(None);
        }
        let sent = tokio::time::Instant::now();
        let bytes = match within(self.store_timeout, journal.take_over(run_id)).await {
            Ok(Some(bytes)) => bytes,
            Ok(None) => return Ok(None),
            Err(e) => return Err(e.to_string()),
        };
        let checkpoint: Checkpoint = serde_json::from_slice(&bytes)
            .map_err(|e| format!("the checkpoint of run {run_id} cannot be read: {e}"))?;
        let owner = Principal::unrestricted(checkpoint.spec.principal.clone());
        let Ok(mut admitted) = self.admitted(run_id, &owner) else {
            // The slot went to a new run meanwhile: the run goes back for another replica.
            let _ = within(self.store_timeout, journal.hand_over(run_id)).await;
            return Ok(None);
        };
        admitted.persister.taken(sent, self.store.epoch(run_id));
        let logged = self.log.last(run_id).await.map_err(|e| e.to_string())?;
        if let Some(result) = logged.finished {
            admitted.store_ended(result).await;
            return Ok(None);
        }
        // A run parked for approvals goes on with its decisions (or to end, canceled).
        let (checkpoint, canceled) = match checkpoint.awaits_decisions() {
            true => match self.approvals.waiting(run_id).await.map_err(|e| e.to_string())? {
                Some(waiting) => {
                    let canceled = waiting.canceled.clone();
                    (checkpoint.decided(&waiting), canceled)
                }
                None => (checkpoint, None),
            },
            false => (checkpoint, None),
        };
        *shared::sync::lock(&admitted.state) = checkpoint.result.clone();
        admitted._lease = admitted.persister.keep_lease();
        admitted.log = Some(self.log.owned_writer(run_id, &logged, admitted.persister.ownership()));
        if let Some(reason) = canceled {
            admitted.cancel.cancel(&reason);
        }
        let logged = logged.seq;
        Ok(Some((admitted, Resumed { checkpoint, logged })))
    }

    /// Asks every run, live now or let in from now on (a takeover racing the drain), to hand over
    /// at its next safe point, or at once (`now`) (drain, durable runs); how many are live.
    pub(crate) fn hand_over_all(&self, now: bool) -> usize {
        match now {
            true => self.drain.now.cancel(),
            false => self.drain.at_safe_point.cancel(),
        }
        self.lock().len()
    }

    /// Takes a slot and enters the run among the live ones, unless its id is live already or
    /// the caller has its `max_runs` in flight.
    fn register(
        &self,
        run_id: &str,
        caller: &Principal,
    ) -> Result<(SharedState, Cancel, Handoff, OwnedSemaphorePermit), Refusal> {
        let mut live = self.lock();
        if live.contains_key(run_id) {
            return Err(Refusal::Duplicate);
        }
        if let Some(limit) = caller.max_runs
            && live.values().filter(|l| l.principal == caller.name).count() >= limit
        {
            return Err(Refusal::CallerFull(limit));
        }
        let permit = Arc::clone(&self.slots)
            .try_acquire_owned()
            .map_err(|_| Refusal::Full(self.max_runs))?;
        let mut running = RunResult::running(run_id);
        running.principal.clone_from(&caller.name);
        let state: SharedState = Arc::new(Mutex::new(running));
        let handoff = Handoff {
            at_safe_point: self.drain.at_safe_point.child_token(),
            now: self.drain.now.child_token(),
        };
        let cancel = Cancel::default();
        live.insert(
            run_id.to_owned(),
            Live {
                state: Arc::clone(&state),
                cancel: cancel.clone(),
                handoff: handoff.clone(),
                principal: caller.name.clone(),
                gone: tokio_util::sync::CancellationToken::new(),
                unparked: false,
            },
        );
        Ok((state, cancel, handoff, permit))
    }

    /// A live run's state so far, or a stored result, when `caller` may see it; `Err` when the
    /// store cannot be read.
    pub(crate) async fn get(&self, run_id: &str, caller: &Principal) -> Result<Option<RunResult>, StoreError> {
        let live = self.lock().get(run_id).map(|l| shared::sync::lock(&l.state).clone());
        let found = match live {
            Some(result) => Some(result),
            None => match self.approvals.parked(run_id) {
                Some(parked) => Some(parked),
                None => self.stored(run_id).await?,
            },
        };
        let Some(mut found) = found.filter(|r| sees(caller, &r.principal)) else {
            return Ok(None);
        };
        // Decisions reach the approval lot first: the run takes them when it parks or resumes.
        if !found.pending_approvals.is_empty()
            && let Ok(Some(waiting)) = self.approvals.waiting(run_id).await
        {
            found.pending_approvals = waiting.calls;
        }
        Ok(Some(found))
    }

    /// Whether the run is parked waiting for approvals.
    pub(crate) fn parked(&self, run_id: &str) -> bool {
        self.approvals.parked(run_id).is_some()
    }

    /// Whether the run waits for approvals, or went on here after waiting: its callers follow
    /// its log.
    pub(crate) fn waited_for_approval(&self, run_id: &str) -> bool {
        self.parked(run_id) || self.lock().get(run_id).is_some_and(|l| l.unparked)
    }

    /// Takes a slot for a parked run that is ready to go on, with its decisions in its
    /// checkpoint; gives the run back when no slot is free (or it is still leaving its old one).
    /// `Ok(None)`: its checkpoint cannot be read (it is dropped, with an error logged).
    pub(crate) async fn resume_parked(
        self: &Arc<Self>,
        ready: Ready,
    ) -> Result<Option<(Admitted, Resumed)>, Box<Ready>> {
        let checkpoint = match serde_json::from_slice::<Checkpoint>(&ready.parked.checkpoint) {
            Ok(checkpoint) => checkpoint.decided(&ready.waiting),
            Err(e) => {
                tracing::error!(run_id = %ready.run_id, "the parked run's checkpoint cannot be read: {e}; the run is dropped");
                return Ok(None);
            }
        };
        let owner = Principal::unrestricted(checkpoint.spec.principal.clone());
        let Ok(mut admitted) = self.admitted(&ready.run_id, &owner) else {
            return Err(Box::new(ready));
        };
        if let Some(live) = self.lock().get_mut(&ready.run_id) {
            live.unparked = true;
        }
        let Ready { parked, waiting, .. } = ready;
        let logged = match parked.log.as_ref() {
            Some(_) => checkpoint.seq,
            None => self.log.last(&admitted.run_id).await.map_or(checkpoint.seq, |l| l.seq),
        };
        let mut state = checkpoint.result.clone();
        state.status = RunStatus::Running;
        *shared::sync::lock(&admitted.state) = state;
        admitted._lease = admitted.persister.keep_lease();
        admitted.log = parked.log;
        if let Some(reason) = waiting.canceled {
            admitted.cancel.cancel(&reason);
        }
        Ok(Some((admitted, Resumed { checkpoint, logged })))
    }

    /// The events of a run `caller` may see (the runs `GetRun` shows it), after `after_seq`, then
    /// the live ones up to `run_finished`. With a shared store the run may live on another
    /// replica: a feed that brings nothing for a lease renewal period asks the store, and ends
    /// with [`LogError::Lost`] when the run ended without its last event reaching the log.
    pub(crate) async fn attach(
        self: &Arc<Self>,
        run_id: &str,
        after_seq: u64,
        caller: &Principal,
    ) -> Result<EventFeed, AttachError> {
        if self.get(run_id, caller).await.map_err(AttachError::Store)?.is_none() {
            return Err(AttachError::NotFound);
        }
        let permit = Arc::clone(&self.attach_slots)
            .try_acquire_owned()
            .map_err(|_| AttachError::Full(self.attach_permits))?;
        let feed = self
            .log
            .follow(run_id, after_seq)
            .await
            .map_err(AttachError::Log)?
            .ok_or(AttachError::NotFound)?;
        metrics::counter!(crate::telemetry::metric::ATTACHES).increment(1);
        let feed = match self.store.lease() {
            Some(terms) => self.watched(feed, run_id, after_seq, caller, terms.renew_every()),
            None => feed,
        };
        // The caller's permit is held as long as its feed.
        Ok(futures::StreamExt::boxed(futures::StreamExt::map(feed, move |item| {
            let _held = &permit;
            item
        })))
    }

    /// `feed`, ended with [`LogError::Lost`] when it stays quiet for two periods of `every`
    /// while the store says the run has ended (its last events never reached the log).
    fn watched(
        self: &Arc<Self>,
        feed: EventFeed,
        run_id: &str,
        after_seq: u64,
        caller: &Principal,
        every: Duration,
    ) -> EventFeed {
        use futures::StreamExt;
        struct Watch {
            feed: EventFeed,
            runs: Arc<Runs>,
            run_id: String,
            caller: Principal,
            last_seq: u64,
            quiet_after_end: u32,
        }
        let watch = Watch {
            feed,
            runs: Arc::clone(self),
            run_id: run_id.to_owned(),
            caller: caller.clone(),
            last_seq: after_seq,
            quiet_after_end: 0,
        };
        futures::stream::unfold(watch, move |mut w| async move {
            loop {
                match tokio::time::timeout(every, w.feed.next()).await {
                    Ok(Some(item)) => {
                        if let Ok(event) = &item {
                            w.last_seq = event.seq;
                            if event.is_last() {
                                w.runs.stored_end(&w.run_id, &w.caller, every).await;
                            }
                        }
                        w.quiet_after_end = 0;
                        return Some((item, w));
                    }
                    Ok(None) => return None,
                    Err(_quiet) => {
                        let ended =
                            matches!(w.runs.get(&w.run_id, &w.caller).await, Ok(Some(r)) if !r.status.is_live());
                        w.quiet_after_end = if ended { w.quiet_after_end + 1 } else { 0 };
                        if w.quiet_after_end >= 2 {
                            let lost = LogError::Lost {
                                run_id: w.run_id.clone(),
                                after_seq: w.last_seq,
                                reason: "the run has ended, and its last events are not in the log".to_owned(),
                            };
                            let mut ended = w;
                            ended.feed = futures::stream::empty().boxed();
                            return Some((Err(lost), ended));
                        }
                    }
                }
            }
        })
        .boxed()
    }

    /// Waits (at most `limit`) until the store says the run ended: a durable run's log holds its
    /// end a moment before its record does, and a follower handed `run_finished` reads the
    /// result with `GetRun` next.
    async fn stored_end(&self, run_id: &str, caller: &Principal, limit: Duration) {
        let deadline = tokio::time::Instant::now() + limit;
        while tokio::time::Instant::now() < deadline {
            if !matches!(self.get(run_id, caller).await, Ok(Some(r)) if r.status.is_live()) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Resolves once the run is not live on this replica and did not end here: at once for a
    /// run that lives elsewhere, when it moves for one live here. A run that ends here never
    /// resolves it (its last events reach its followers through the log).
    pub(crate) fn moved_away(&self, run_id: &str) -> impl Future<Output = ()> + Send + 'static {
        self.left_live(run_id, true)
    }

    /// Resolves once the run, live here now, left this replica without ending (handed over, or
    /// this replica stopped acting for it); never when it is not live here.
    pub(crate) fn moved_from_here(&self, run_id: &str) -> impl Future<Output = ()> + Send + 'static {
        self.left_live(run_id, false)
    }

    /// See [`Runs::moved_away`]; `elsewhere`: whether a run not live here counts as moved.
    fn left_live(&self, run_id: &str, elsewhere: bool) -> impl Future<Output = ()> + Send + 'static {
        let live = self
            .lock()
            .get(run_id)
            .map(|run| (run.gone.clone(), Arc::clone(&run.state)));
        async move {
            let Some((gone, state)) = live else {
                if !elsewhere {
                    std::future::pending::<()>().await;
                }
                return;
            };
            gone.cancelled().await;
            if !shared::sync::lock(&state).status.is_live() {
                std::future::pending::<()>().await;
            }
        }
    }

    /// Finished results not yet taken by the store.
    pub(crate) fn unstored(&self) -> usize {
        self.backlog.len()
    }

    /// Cancels a run of `caller`: live here, parked waiting for approvals, or (shared store)
    /// live on another replica, which is asked to; `Err` when the store, asked about a run not
    /// live here, cannot be read.
    pub(crate) async fn cancel(
        &self,
        run_id: &str,
        caller: &Principal,
        reason: &str,
    ) -> Result<CancelOutcome, StoreError> {
        if let Some(outcome) = self.cancel_here(run_id, caller, reason) {
            return Ok(outcome);
        }
        let parked = match self.approvals.parked(run_id) {
            Some(parked) => Some(parked),
            None => self.stored(run_id).await?,
        };
        if let Some(parked) = parked.filter(|p| sees(caller, &p.principal) && p.status == RunStatus::AwaitingApproval)
            && self.approvals.cancel(run_id, reason).await?
        {
            tracing::info!(run_id = %run_id, principal = %parked.principal, "a run waiting for approvals is canceled");
            return Ok(CancelOutcome::Canceled);
        }
        Ok(match self.stored(run_id).await? {
            Some(result) if !sees(caller, &result.principal) => CancelOutcome::NotFound,
            Some(result) if !result.status.is_live() => CancelOutcome::AlreadyFinished(result.status),
            Some(_) => self.cancel_elsewhere(run_id, reason).await,
            None => CancelOutcome::NotFound,
        })
    }

    /// Cancels `run_id` when it is live on this replica and `caller` may see it; `None` when it
    /// is not here (or is leaving: parking, or being handed over, so its next replica answers).
    pub(crate) fn cancel_here(&self, run_id: &str, caller: &Principal, reason: &str) -> Option<CancelOutcome> {
        let live = self.lock();
        let live = live.get(run_id).filter(|l| sees(caller, &l.principal))?;
        // Under the state lock: the loop settles the end under it too, and a cancel that came
        // first wins there, so the answer is never `canceled` for a run that completed.
        let state = shared::sync::lock(&live.state);
        if !state.status.is_live() {
            return Some(CancelOutcome::AlreadyFinished(state.status));
        }
        let leaving = live.handoff.at_safe_point.is_cancelled() || live.handoff.now.is_cancelled();
        if state.status == RunStatus::AwaitingApproval || leaving {
            return None;
        }
        live.cancel.cancel(reason);
        Some(CancelOutcome::Canceled)
    }

    /// Asks the replica running `run_id` (shared store) to cancel it.
    async fn cancel_elsewhere(&self, run_id: &str, reason: &str) -> CancelOutcome {
        let Some(journal) = &self.journal else {
            return CancelOutcome::NotFound;
        };
        match within(self.store_timeout, journal.cancel_elsewhere(run_id, reason)).await {
            Ok(Some(RemoteCancel::Canceled)) => CancelOutcome::Canceled,
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

    /// Runs live now.
    pub(crate) fn live(&self) -> usize {
        self.lock().len()
    }

    /// Resolves when no run is live.
    pub(crate) async fn wait_idle(&self) {
        loop {
            let notified = self.idle.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.live() == 0 {
                return;
            }
            notified.await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn anon() -> Principal {
        Principal::default()
    }

    fn named(name: &str, max_runs: Option<usize>) -> Principal {
        Principal {
            max_runs,
            ..Principal::unrestricted(name)
        }
    }

    #[tokio::test]
    async fn runs_belong_to_their_principal_and_max_runs_holds_per_principal() {
        let runs = runs(8, 10, Duration::from_secs(60));
        let (alice, bob) = (named("alice", Some(2)), named("bob", None));
        let a1 = runs.admit("a1", &alice, None).await.unwrap();
        let _a2 = runs.admit("a2", &alice, None).await.unwrap();
        assert!(matches!(
            runs.admit("a3", &alice, None).await,
            Err(Refusal::CallerFull(2))
        ));
        // Another principal is not held back by alice's limit, and cannot use her ids.
        let _b1 = runs.admit("b1", &bob, None).await.unwrap();
        assert!(matches!(runs.admit("a1", &bob, None).await, Err(Refusal::Foreign)));
        assert!(runs.get("a1", &bob).await.unwrap().is_none());
        assert_eq!(runs.cancel("a1", &bob, "test").await, Ok(CancelOutcome::NotFound));
        assert_eq!(
            runs.get("a1", &alice).await.unwrap().map(|r| r.principal),
            Some("alice".into())
        );
        // The anonymous caller (no authentication) sees every run.
        assert!(runs.get("a1", &anon()).await.unwrap().is_some());
        drop(a1);
        assert!(runs.admit("a3", &alice, None).await.is_ok());
    }
    use crate::store::memory::MemoryStore;

    fn runs(max_runs: usize, keep: usize, keep_for: Duration) -> Arc<Runs> {
        let bounds = crate::store::LogBounds {
            per_run_bytes: 1 << 20,
            total_bytes: 1 << 24,
            keep,
            keep_for,
        };
        let keeping = Keeping {
            store: Arc::new(MemoryStore::new(keep, keep_for)),
            log: Arc::new(crate::store::memory_log::MemoryLog::new(bounds)),
            journal: None,
            approvals: Arc::new(crate::store::memory_approvals::MemoryLot::new(100)),
        };
        Runs::new(max_runs, 2, keeping, Duration::from_secs(1), 100)
    }

    use futures::future::BoxFuture;

    /// A journal that only counts the claims it is asked for (and grants none).
    #[derive(Default)]
    struct CountingJournal {
        claims: std::sync::atomic::AtomicUsize,
    }

    impl RunJournal for CountingJournal {
        fn save(&self, _: RunResult, _: u64, _: Vec<u8>) -> BoxFuture<'static, Result<(), StoreError>> {
            Box::pin(async { Ok(()) })
        }
        fn claim_resumable(
            &self,
            _: RunResult,
            _: u64,
            _: Vec<u8>,
        ) -> BoxFuture<'static, Result<crate::domain::ports::Claim, StoreError>> {
            Box::pin(async { Ok(crate::domain::ports::Claim::Claimed) })
        }
        fn forget(&self, _: &str) -> BoxFuture<'static, Result<(), StoreError>> {
            Box::pin(async { Ok(()) })
        }
        fn orphans(&self) -> BoxFuture<'static, Result<Vec<String>, StoreError>> {
            Box::pin(async { Ok(Vec::new()) })
        }
        fn take_over(&self, _: &str) -> BoxFuture<'static, Result<Option<Vec<u8>>, StoreError>> {
            self.claims.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            Box::pin(async { Ok(None) })
        }
        fn hand_over(&self, _: &str) -> BoxFuture<'static, Result<(), StoreError>> {
            Box::pin(async { Ok(()) })
        }
        fn handovers(&self) -> BoxFuture<'static, futures::stream::BoxStream<'static, ()>> {
            Box::pin(async { futures::StreamExt::boxed(futures::stream::pending()) })
        }
        fn cancel_elsewhere(
            &self,
            _: &str,
            _: &str,
        ) -> BoxFuture<'static, Result<Option<crate::domain::ports::RemoteCancel>, StoreError>> {
            Box::pin(async { Ok(None) })
        }
        fn cancel_asks(
            &self,
        ) -> BoxFuture<'static, futures::stream::BoxStream<'static, crate::domain::ports::CancelAsk>> {
            Box::pin(async { futures::StreamExt::boxed(futures::stream::pending()) })
        }
    }

    /// A look for orphans (a hand-over announced, a record seen unchanged) never claims a run
    /// live on this replica: the claim would fence the run out of its own record.
    #[tokio::test]
    async fn a_replica_does_not_claim_a_run_live_on_it() {
        let runs = runs(4, 10, Duration::from_secs(60));
        let journal = Arc::new(CountingJournal::default());
        let runs = Arc::new(Runs {
            journal: Some(Arc::clone(&journal) as Arc<dyn RunJournal>),
            ..Arc::into_inner(runs).unwrap()
        });
        let _live = runs.admit("live", &anon(), None).await.unwrap();
        assert!(runs.take_over("live").await.unwrap().is_none());
        assert_eq!(journal.claims.load(std::sync::atomic::Ordering::SeqCst), 0);
        assert!(runs.take_over("elsewhere").await.unwrap().is_none());
        assert_eq!(
            journal.claims.load(std::sync::atomic::Ordering::SeqCst),
            1,
            "a run live elsewhere is claimed"
        );
    }

    async fn finish(runs: &Arc<Runs>, id: &str) {
        let admitted = runs.admit(id, &anon(), None).await.unwrap();
        admitted.state.lock().unwrap().status = RunStatus::Completed;
        admitted.persister.write_final().await;
    }

    #[tokio::test]
    async fn slots_on_both_sides_of_the_limit_and_released_on_drop() {
        let runs = runs(2, 10, Duration::from_secs(60));
        let a = runs.admit("a", &anon(), None).await.unwrap();
        let _b = runs.admit("b", &anon(), None).await.unwrap();
        assert!(matches!(runs.admit("c", &anon(), None).await, Err(Refusal::Full(2))));
        assert!(matches!(runs.admit("a", &anon(), None).await, Err(Refusal::Duplicate)));
        drop(a);
        assert!(runs.admit("c", &anon(), None).await.is_ok());
    }

    /// A run that has ended but whose task has not let go of its slot yet is replayed to a
    /// retry of its id, not refused as still running (its final result may not be stored yet).
    #[tokio::test]
    async fn a_retry_just_after_the_end_is_a_replay() {
        let runs = runs(2, 10, Duration::from_secs(60));
        let ending = runs.admit("a", &anon(), None).await.unwrap();
        ending.state.lock().unwrap().status = RunStatus::Completed;
        assert!(matches!(
            runs.admit("a", &anon(), None).await,
            Err(Refusal::Finished(result)) if result.status == RunStatus::Completed
        ));
        assert!(matches!(
            runs.admit("a", &named("mallory", None), None).await,
            Err(Refusal::Foreign)
        ));
    }

    #[tokio::test]
    async fn results_are_bounded_by_count() {
        let runs = runs(10, 2, Duration::from_secs(60));
        for id in ["a", "b", "c"] {
            finish(&runs, id).await;
        }
        assert!(runs.get("a", &anon()).await.unwrap().is_none());
        assert!(runs.get("b", &anon()).await.unwrap().is_some() && runs.get("c", &anon()).await.unwrap().is_some());
        assert!(matches!(
            runs.admit("c", &anon(), None).await,
            Err(Refusal::Finished(_))
        ));
    }

    #[tokio::test(start_paused = true)]
    async fn results_are_bounded_by_age() {
        let runs = runs(10, 10, Duration::from_secs(60));
        finish(&runs, "a").await;
        tokio::time::advance(Duration::from_secs(59)).await;
        assert!(runs.get("a", &anon()).await.unwrap().is_some());
        tokio::time::advance(Duration::from_secs(2)).await;
        assert!(runs.get("a", &anon()).await.unwrap().is_none());
    }

    #[tokio::test]
    async fn attached_callers_are_bounded_and_see_only_their_own_runs() {
        let runs = runs(10, 10, Duration::from_secs(60));
        let (alice, bob) = (named("alice", None), named("bob", None));
        let _run = runs.admit("a", &alice, None).await.unwrap();
        assert!(matches!(runs.attach("a", 0, &bob).await, Err(AttachError::NotFound)));
        assert!(matches!(
            runs.attach("zzz", 0, &alice).await,
            Err(AttachError::NotFound)
        ));
        let first = runs.attach("a", 0, &alice).await.unwrap();
        let _second = runs.attach("a", 0, &alice).await.unwrap();
        assert!(matches!(runs.attach("a", 0, &alice).await, Err(AttachError::Full(2))));
        drop(first);
        assert!(
            runs.attach("a", 0, &alice).await.is_ok(),
            "a finished feed frees its place"
        );
    }

    #[tokio::test]
    async fn live_state_and_cancel() {
        let runs = runs(10, 10, Duration::from_secs(60));
        let admitted = runs.admit("a", &anon(), None).await.unwrap();
        admitted.state.lock().unwrap().text.push_str("so far");
        assert_eq!(
            runs.get("a", &anon()).await.unwrap().map(|r| (r.status, r.text)),
            Some((RunStatus::Running, "so far".into()))
        );
        assert_eq!(runs.cancel("a", &anon(), "test").await, Ok(CancelOutcome::Canceled));
        assert!(admitted.cancel.is_canceled());
        assert_eq!(runs.cancel("zzz", &anon(), "test").await, Ok(CancelOutcome::NotFound));
    }

    /// A drain asks every run to move, the runs let in after it began too (a takeover that
    /// raced it): such a run would otherwise run on until the grace ends and be handed over
    /// mid-call, running that call twice.
    #[tokio::test]
    async fn a_run_let_in_while_the_replica_drains_is_asked_to_hand_over_too() {
        let runs = runs(10, 10, Duration::from_secs(60));
        let before = runs.admit("before", &anon(), None).await.unwrap();
        assert!(!before.handoff.at_safe_point.is_cancelled());
        assert_eq!(runs.hand_over_all(false), 1);
        let after = runs.admit("after", &anon(), None).await.unwrap();
        for run in [&before, &after] {
            assert!(run.handoff.at_safe_point.is_cancelled() && !run.handoff.now.is_cancelled());
        }
        runs.hand_over_all(true);
        let last = runs.admit("last", &anon(), None).await.unwrap();
        assert!(before.handoff.now.is_cancelled() && last.handoff.now.is_cancelled());
    }
}
