//! Letting a run in: a slot, a live entry and the claim of its id in the store (or a replay of
//! the finished run with that id); taking an orphan over; resuming a run whose approvals were
//! decided. An [`Admitted`] run holds its slot until the loop drops it.

use std::sync::{Arc, Mutex};

use tokio::sync::OwnedSemaphorePermit;
use tokio::time::Instant;

use shared::auth::Principal;
use shared::runtime::AbortOnDrop;

use super::quota::HeldQuota;
use super::{Live, LiveRuns, Runs, sees};
use crate::domain::ports::{Claim, Claimed, LogWriter, Logged, Ready, RunJournal, within};
use crate::domain::{EventBatch, Ownership, RunResult, RunSpec, RunStatus};
use crate::run::chunks;
use crate::run::live::{AdmittedRun, Cancel, Emitter, HandOver, SharedState};
use crate::run::persist::Persister;
use crate::run::steering::Inbox;
use crate::run::tool_loop::{Checkpoint, Resumed, Segmented};

type EventSender = tokio::sync::mpsc::Sender<EventBatch>;

/// What a takeover found.
pub(crate) enum TakenOver {
    /// The run goes on here from its checkpoint.
    Resumed(Box<(Admitted, Resumed)>),
    /// Its log held its end (its replica stopped between logging and storing it): the end is
    /// stored, and the run is to join its thread.
    Ended(Box<EndedElsewhere>),
}

/// A run whose end its log held when it was taken over: what its thread takes.
pub(crate) struct EndedElsewhere {
    /// What it was asked.
    pub spec: RunSpec,
    /// Its turns: those of its last checkpoint, and the answer that ended it, if it came after.
    pub conversation: Vec<crate::domain::chat::Message>,
    /// How it ended.
    pub status: RunStatus,
}

impl EndedElsewhere {
    /// The run of `checkpoint` that ended with `result`.
    fn of(checkpoint: &Checkpoint, result: &RunResult) -> Self {
        let mut conversation = checkpoint.conversation.clone();
        let answer = result
            .text
            .strip_prefix(checkpoint.result.text.as_str())
            .unwrap_or_default();
        if result.turns > checkpoint.progress.turns_done && !answer.is_empty() {
            conversation.push(crate::domain::chat::Message::Assistant {
                content: answer.to_owned(),
                tool_calls: Vec::new(),
                reasoning: None,
            });
        }
        Self {
            spec: checkpoint.spec.clone(),
            conversation,
            status: result.status,
        }
    }
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
    /// The store did not take the claim of the id: the run does not start (the caller retries).
    Unclaimed(crate::domain::ports::StoreError),
    /// No slot was free and the run may not wait for one.
    QueueFull(crate::domain::share::QueueFull),
    /// The run's deadline passed while it waited this long for a slot.
    Waited(std::time::Duration),
}

/// A run's live entry, as [`Runs::register`] made it.
struct Registered {
    state: SharedState,
    cancel: Cancel,
    hand_over: HandOver,
    inbox: Inbox,
    permit: OwnedSemaphorePermit,
    persister: Persister,
}

/// A started run's place in the registry; dropping it frees the slot and the live entry.
pub(crate) struct Admitted {
    pub(super) runs: Arc<Runs>,
    pub(super) run_id: String,
    /// The run's live state.
    pub state: SharedState,
    /// Cancels the run.
    pub cancel: Cancel,
    /// Asks the run to move to another replica (drain).
    pub hand_over: HandOver,
    /// Messages sent to the run.
    pub inbox: Inbox,
    /// Writes the run's state to the store.
    pub persister: Persister,
    /// Appends the run's events to its log (taken by the run's emitter).
    pub log: Option<Box<dyn LogWriter>>,
    /// Renews the run's lease in a shared store while the run is admitted.
    _lease: Option<AbortOnDrop>,
    /// The run's slot among its principal's `max_runs` across the fleet.
    pub(super) quota: Option<super::quota::HeldQuota>,
    /// Its caller, when the run must take a slot among its `max_runs` again before it goes on:
    /// it was taken over after it parked (and so gave its slot back).
    retake: Option<Principal>,
    /// The run started here (claimed, taken over or resumed): a run that did not gives its
    /// slot back whatever its state says.
    pub(super) started: bool,
    permit: Option<OwnedSemaphorePermit>,
}

impl Drop for Admitted {
    fn drop(&mut self) {
        self.leave_quota();
        {
            let mut live = self.runs.lock();
            if let Some(run) = live.remove(&self.run_id) {
                run.gone.cancel();
            }
            if live.is_empty() {
                self.runs.idle.notify_waiters();
            }
        }
        // The slot is free before the next waiting run is woken for it.
        drop(self.permit.take());
        self.runs.wake_next();
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
        let claim = match claim {
            Ok(claim) => claim,
            Err(e) => {
                self.keep_quota_when_unanswered(&e);
                return Err(Refusal::Unclaimed(e));
            }
        };
        match claim {
            Claim::Claimed => {
                self.started = true;
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

    /// A claim the store never answered may have landed: the run's record is then taken over
    /// once its lease lapses, and resumed holding the slot its admission took. So that slot is
    /// not given back: it is free once its run reads ended, or once a lease passed with no
    /// record naming it (see the quotas). Giving it back would let the resumed run live beside
    /// `max_runs` others.
    fn keep_quota_when_unanswered(&mut self, error: &crate::domain::ports::StoreError) {
        use crate::domain::ports::StoreError;
        let unanswered = matches!(error, StoreError::Unavailable { .. } | StoreError::Timeout(_));
        if unanswered && self.quota.take().is_some() {
            tracing::info!(run_id = %self.run_id, "the claim went unanswered: its slot stays until its run reads ended or a lease passes with no record of it");
        }
    }

    /// Writes what a listing finds the run by into its state, before its claim stores it.
    fn describe(&self, spec: &RunSpec) {
        let mut state = shared::sync::lock(&self.state);
        state.labels.clone_from(&spec.labels);
        state.agent.clone_from(&spec.agent);
        state.request_digests.clone_from(&spec.request_digests);
        state.prompt = spec.prompt();
        if let Some(thread) = &spec.thread {
            state.thread_id.clone_from(&thread.thread_id);
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
            hand_over: self.hand_over.clone(),
            inbox: self.inbox.clone(),
            slot: Some(Box::new(self)),
        }
    }
}

impl Admitted {
    /// Takes a slot of `caller`'s `max_runs` across the fleet for this new run (nothing to take
    /// without a limit or a shared store): [`Refusal::CallerFull`] when live runs hold them all.
    pub(crate) async fn take_quota(&mut self, caller: &Principal) -> Result<(), Refusal> {
        let (Some(quotas), Some(max)) = (self.runs.quotas.clone(), caller.max_runs) else {
            return Ok(());
        };
        let admission = uuid::Uuid::now_v7().to_string();
        let take = quotas.take(&caller.name, max, &self.run_id, &admission);
        match within(self.runs.store_timeout, take).await {
            Ok(Some(taken)) => {
                self.quota = Some(HeldQuota::taken(quotas, &caller.name, taken, self.runs.store_timeout));
                Ok(())
            }
            Ok(None) => {
                self.runs.block(&caller.name);
                Err(Refusal::CallerFull(max))
            }
            Err(e) => Err(Refusal::Unclaimed(e)),
        }
    }

    /// Takes a slot of its caller's `max_runs` across the fleet again for a run taken over
    /// after it parked; while the caller's runs hold them all it waits, its record still
    /// reading parked, until `until` (its deadline: it then goes on to end). `false`: the run
    /// is no longer this replica's (another took it over meanwhile), and must not go on here.
    pub(crate) async fn retake_quota(&mut self, until: Instant) -> bool {
        let (Some(caller), Some(quotas)) = (self.retake.take(), self.runs.quotas.clone()) else {
            return true;
        };
        // It holds none: only a slot taken here is given back when it leaves (by its
        // admission, never another owner's).
        self.quota = None;
        let owner = self.persister.ownership().clone();
        loop {
            // One it holds already (a take whose answer was lost) goes back first, so it never
            // waits for itself; a replaced owner touches no slot.
            if !owner.holds() {
                return false;
            }
            let _ = within(
                self.runs.store_timeout,
                quotas.give_back(&caller.name, &self.run_id, None),
            )
            .await;
            if !owner.holds() {
                return false;
            }
            match self.take_quota(&caller).await {
                Ok(()) => break,
                Err(refusal) if Instant::now() < until => {
                    tracing::debug!(run_id = %self.run_id, ?refusal, "the run waits for a slot of its caller to go on");
                    tokio::time::sleep(super::quota::BLOCKED_FOR).await;
                }
                Err(refusal) => {
                    tracing::warn!(run_id = %self.run_id, ?refusal, "no slot of its caller before the run's deadline: it goes on to end");
                    break;
                }
            }
        }
        shared::sync::lock(&self.state).status = RunStatus::Running;
        true
    }

    /// Gives back the run's slot when the run leaves it: it ended here (its result stored), it
    /// parked, or it never started (its claim failed); not when it moved to another replica.
    pub(crate) fn leave_quota(&mut self) {
        let Some(quota) = self.quota.take() else { return };
        let status = shared::sync::lock(&self.state).status;
        let ended = self.persister.ownership().ended() || status.is_parked();
        if ended || !self.started {
            quota.give_back(&self.run_id);
        }
    }
}

impl Runs {
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
        match self.parked_here(run_id) {
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
        let mut admitted = self.admitted(run_id, caller)?;
        if let Some(spec) = spec {
            admitted.describe(spec);
        }
        admitted.take_quota(caller).await?;
        admitted.claim(caller, spec).await
    }

    /// Why `run_id` cannot start when it is live on this replica. A run that has just ended
    /// here keeps its entry until its task is done: it is replayed like a stored result.
    fn refusal_here(&self, run_id: &str, caller: &Principal) -> Option<Refusal> {
        let live = self.lock();
        let live = live.get(run_id)?;
        if !sees(caller, &live.principal) {
            return Some(Refusal::Foreign);
        }
        let result = live.shown();
        Some(if result.status.is_live() {
            Refusal::Duplicate
        } else {
            Refusal::Finished(Box::new(result))
        })
    }

    /// A slot and a live entry for `run_id`, with its persister (not claimed in the store yet).
    fn admitted(self: &Arc<Self>, run_id: &str, caller: &Principal) -> Result<Admitted, Refusal> {
        let mut live = self.lock();
        self.admitted_in(&mut live, run_id, caller)
    }

    /// [`Self::admitted`], with the registry's lock held by the caller.
    fn admitted_in(
        self: &Arc<Self>,
        live: &mut LiveRuns,
        run_id: &str,
        caller: &Principal,
    ) -> Result<Admitted, Refusal> {
        let Registered {
            state,
            cancel,
            hand_over,
            inbox,
            permit,
            persister,
        } = self.register(live, run_id, caller)?;
        Ok(Admitted {
            runs: Arc::clone(self),
            run_id: run_id.to_owned(),
            state,
            cancel,
            hand_over,
            inbox,
            _lease: None,
            quota: None,
            retake: None,
            started: false,
            log: None,
            persister,
            permit: Some(permit),
        })
    }

    /// [`Self::admitted_in`] for a run that goes on from `result` (taken over, or woken after
    /// it parked): from the moment it is live here, readers find it with its output so far and
    /// its admission time, never as a new run (a listing would skip it: its index entry would
    /// not agree with it).
    fn admitted_from(
        self: &Arc<Self>,
        live: &mut LiveRuns,
        run_id: &str,
        owner: &Principal,
        result: &RunResult,
    ) -> Result<Admitted, Refusal> {
        let admitted = self.admitted_in(live, run_id, owner)?;
        let mut state = result.clone();
        state.status = RunStatus::Running;
        *shared::sync::lock(&admitted.state) = state;
        Ok(admitted)
    }

    /// Takes a slot and enters the run among the live ones, unless its id is live already or
    /// the caller has its `max_runs` in flight.
    fn register(&self, live: &mut LiveRuns, run_id: &str, caller: &Principal) -> Result<Registered, Refusal> {
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
        running.created_at_ms = shared::sync::unix_ms();
        running.updated_at_ms = running.created_at_ms;
        let state: SharedState = Arc::new(Mutex::new(running));
        let hand_over = HandOver {
            at_safe_point: self.drain.at_safe_point.child_token(),
            now: self.drain.now.child_token(),
        };
        let cancel = Cancel::default();
        let inbox = Inbox::new(self.max_steering);
        let ownership = Ownership::held_by(self.store.lease(), self.store.liveness(), Instant::now());
        let persister = Persister::new(
            Arc::clone(&self.store),
            Arc::clone(&state),
            self.store_timeout,
            Arc::clone(&self.backlog),
        )
        .with_journal(self.journal.clone())
        .with_ownership(ownership);
        live.insert(
            run_id.to_owned(),
            Live {
                state: Arc::clone(&state),
                cancel: cancel.clone(),
                hand_over: hand_over.clone(),
                principal: caller.name.clone(),
                inbox: inbox.clone(),
                gone: tokio_util::sync::CancellationToken::new(),
                persister: persister.clone(),
            },
        );
        Ok(Registered {
            state,
            cancel,
            hand_over,
            inbox,
            permit,
            persister,
        })
    }

    /// Takes over the orphan `run_id` when a slot is free and this replica wins its claim: its
    /// slot here (with its lease kept and its log continued), its checkpoint and the last seq its
    /// log holds. `Ok(None)`: no slot, or another replica won.
    pub(crate) async fn take_over(self: &Arc<Self>, run_id: &str) -> Result<Option<TakenOver>, String> {
        let Some(journal) = self.journal.clone() else {
            return Ok(None);
        };
        if self.free_slots() == 0 || self.lock().contains_key(run_id) {
            // A run live here is not claimed again here, whatever its record says (a hand-over
            // announced while it runs, a record seen unchanged): its claim would fence the run
            // out of its own record, and the admission that follows would fail and hand it over.
            return Ok(None);
        }
        let sent = Instant::now();
        let Claimed {
            checkpoint: bytes,
            parked,
            ends_after_turn,
        } = match within(self.store_timeout, journal.take_over(run_id)).await {
            Ok(Some(claimed)) => claimed,
            Ok(None) => return Ok(None),
            Err(e) => return Err(e.to_string()),
        };
        let claimed = Claimed {
            checkpoint: bytes,
            parked,
            ends_after_turn,
        };
        let resumed = self.resume_claimed(run_id, sent, claimed).await;
        if resumed.is_err() {
            // The run is this replica's in the store, yet does not run here: it goes back for
            // any replica (one whose lease is kept by its incarnation is never found otherwise).
            let _ = within(self.store_timeout, journal.hand_over(run_id)).await;
        }
        resumed
    }

    /// Resumes the run `run_id` this replica claimed (the claim sent at `sent`): see
    /// [`Runs::take_over`].
    async fn resume_claimed(
        self: &Arc<Self>,
        run_id: &str,
        sent: Instant,
        claimed: Claimed,
    ) -> Result<Option<TakenOver>, String> {
        let Some(journal) = self.journal.clone() else {
            return Ok(None);
        };
        let Claimed {
            checkpoint: bytes,
            parked,
            ends_after_turn,
        } = claimed;
        let (mut checkpoint, mut chunks) = self.unfolded(&journal, run_id, &bytes).await?;
        let owner = Principal::unrestricted(checkpoint.spec.principal.clone());
        let Ok(mut admitted) = self.admitted_from(&mut self.lock(), run_id, &owner, &checkpoint.result) else {
            // The slot went to a new run meanwhile: the run goes back for another replica.
            let _ = within(self.store_timeout, journal.hand_over(run_id)).await;
            return Ok(None);
        };
        admitted
            .persister
            .taken(sent, self.store.epoch(run_id), self.store.generation(run_id));
        admitted.started = true;
        admitted.quota = super::quota::HeldQuota::of_run(self, &checkpoint.spec.principal);
        // A run that parked goes on once it holds a slot again; till then it reads parked.
        let parked_as = (parked && checkpoint.spec.max_runs.is_some()).then(|| {
            admitted.retake = Some(Principal {
                max_runs: checkpoint.spec.max_runs,
                ..owner
            });
            checkpoint.parked_as()
        });
        let logged = self.log.last(run_id).await.map_err(|e| e.to_string())?;
        if let Some(result) = logged.finished {
            // Its thread takes its conversation: the transcript is kept until the end is stored.
            if let Err(e) = self.transcript(&journal, run_id, &mut checkpoint, &mut chunks).await {
                tracing::warn!(run_id, "{e}; its thread takes the turns its checkpoint holds");
            }
            let ended = EndedElsewhere::of(&checkpoint, &result);
            admitted.store_ended(result).await;
            return Ok(Some(TakenOver::Ended(Box::new(ended))));
        }
        let segmented = self.transcript(&journal, run_id, &mut checkpoint, &mut chunks).await?;
        admitted.persister.knows_chunks(chunks);
        let (mut checkpoint, canceled) = self.taken_from_wait(run_id, checkpoint).await?;
        if let Some(reason) = ends_after_turn {
            checkpoint.end_after_turn(reason);
        }
        let mut state = checkpoint.result.clone();
        state.status = parked_as.unwrap_or(state.status);
        *shared::sync::lock(&admitted.state) = state;
        admitted._lease = admitted.persister.keep_lease();
        // The log kept everything the checkpoint sent; should it end earlier (its oldest
        // messages aged out while the run waited) the run's next event follows on all the same.
        let from = Logged {
            seq: logged.seq.max(checkpoint.sent_through()),
            ..logged.clone()
        };
        admitted.log = Some(self.log.owned_writer(run_id, &from, admitted.persister.ownership()));
        if let Some(reason) = canceled {
            admitted.cancel.cancel(&reason);
        }
        let logged = logged.seq;
        let resumed = Resumed {
            checkpoint,
            logged,
            segmented,
        };
        Ok(Some(TakenOver::Resumed(Box::new((admitted, resumed)))))
    }

    /// The checkpoint `bytes` of the run `run_id`, the chunks it names read from `journal` and
    /// put in place; the chunks read.
    async fn unfolded(
        &self,
        journal: &Arc<dyn RunJournal>,
        run_id: &str,
        bytes: &[u8],
    ) -> Result<(Checkpoint, chunks::Kept), String> {
        let mut chunks = chunks::Kept::default();
        let read = |positions| self.read_kept(journal, run_id, positions);
        let checkpoint = Checkpoint::unfolded(bytes, &mut chunks, read)
            .await
            .map_err(|e| format!("the checkpoint of run {run_id} cannot be read: {e}"))?;
        Ok((checkpoint, chunks))
    }

    /// The conversation of `checkpoint` whole, its transcript's segments read from `journal`;
    /// what they hold.
    async fn transcript(
        &self,
        journal: &Arc<dyn RunJournal>,
        run_id: &str,
        checkpoint: &mut Checkpoint,
        chunks: &mut chunks::Kept,
    ) -> Result<Segmented, String> {
        let read = |positions| self.read_kept(journal, run_id, positions);
        checkpoint
            .read_transcript(chunks, read)
            .await
            .map_err(|e| format!("the transcript of run {run_id} cannot be read: {e}"))
    }

    /// What `journal` keeps of the run `run_id` (segments and chunks) at `positions`, in order.
    fn read_kept(
        &self,
        journal: &Arc<dyn RunJournal>,
        run_id: &str,
        positions: Vec<u64>,
    ) -> impl Future<Output = Result<Vec<Vec<u8>>, String>> + use<> {
        let read = within(self.store_timeout, journal.segments(run_id, positions));
        async move { read.await.map_err(|e| e.to_string()) }
    }

    /// A run taken over with its wait: one parked for approvals goes on with its decisions (or
    /// to end, canceled); one that had taken its decisions still reads a cancel its wait kept
    /// (one that reached the wait after an earlier owner took the run from it).
    async fn taken_from_wait(
        &self,
        run_id: &str,
        checkpoint: Checkpoint,
    ) -> Result<(Checkpoint, Option<String>), String> {
        if !checkpoint.awaits_decisions() {
            let waiting = self.approvals.parked_calls(run_id).await.map_err(|e| e.to_string())?;
            return Ok((checkpoint, waiting.and_then(|w| w.canceled)));
        }
        let woken = self.approvals.wake(run_id, shared::sync::unix_ms());
        Ok(match woken.await.map_err(|e| e.to_string())? {
            Some(waiting) => {
                let canceled = waiting.canceled.clone();
                (checkpoint.decided(&waiting), canceled)
            }
            None => (checkpoint, None),
        })
    }

    /// Takes the oldest parked run that is ready to go on off the approval store and gives it a
    /// slot, with its decisions in its checkpoint. Both happen under the registry's lock, so a
    /// reader ([`Runs::get`]) finds the run in the approval store or among the live ones, never in neither.
    /// With no slot free (or the run still leaving its old one) the run stays in the approval store.
    pub(crate) async fn resume_parked(self: &Arc<Self>) -> Unparked {
        let (mut admitted, checkpoint, ready) = {
            let mut live = self.lock();
            let Some(local) = self.approvals.local() else {
                return Unparked::Nothing;
            };
            let Some(ready) = local.take_ready() else {
                return Unparked::Nothing;
            };
            let checkpoint = match serde_json::from_slice::<Checkpoint>(&ready.parked.checkpoint) {
                Ok(checkpoint) => checkpoint.decided(&ready.calls),
                Err(e) => {
                    tracing::error!(run_id = %ready.run_id, "the parked run's checkpoint cannot be read: {e}; the run is dropped");
                    return Unparked::Dropped;
                }
            };
            // Held to its caller's `max_runs` again (it gave its slot back when it parked).
            let owner = Principal {
                max_runs: checkpoint.spec.max_runs,
                ..Principal::unrestricted(checkpoint.spec.principal.clone())
            };
            match self.admitted_from(&mut live, &ready.run_id, &owner, &checkpoint.result) {
                Ok(admitted) => (admitted, checkpoint, ready),
                Err(_) => {
                    local.put_back(ready);
                    return Unparked::Nothing;
                }
            }
        };
        let Ready { parked, calls, .. } = ready;
        let logged = match parked.log.as_ref() {
            Some(_) => checkpoint.seq,
            None => self.log.last(&admitted.run_id).await.map_or(checkpoint.seq, |l| l.seq),
        };
        admitted._lease = admitted.persister.keep_lease();
        admitted.started = true;
        admitted.log = parked.log;
        if let Some(reason) = calls.canceled {
            admitted.cancel.cancel(&reason);
        }
        // The wait holds the whole checkpoint: the run keeps its conversation anew.
        let resumed = Resumed {
            checkpoint,
            logged,
            segmented: Segmented::default(),
        };
        Unparked::Resumed(Box::new((admitted, resumed)))
    }
}

/// What [`Runs::resume_parked`] did.
pub(crate) enum Unparked {
    /// No parked run is ready, or none found a slot (it waits in the approval store).
    Nothing,
    /// A ready run's checkpoint could not be read: it is dropped (an error is logged).
    Dropped,
    /// The run goes on from its checkpoint.
    Resumed(Box<(Admitted, Resumed)>),
}
