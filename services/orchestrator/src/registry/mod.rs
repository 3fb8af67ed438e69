//! The registry of live runs: run slots, live runs (for `GetRun` and `CancelRun`), runs parked
//! waiting for approvals (they hold no slot), the result store where finished results (and
//! checkpoints of live ones) are kept, and the runs' event logs that callers re-attach to
//! (`AttachRun`). By concern:
//!
//! * `mod.rs`: the registry itself, its slots and what it keeps ([`Keeping`]), reading a run;
//! * [`admission`]: letting a run in ([`Admitted`], [`Refusal`]), taking one over, resuming one
//!   that waited for approvals;
//! * [`attach`]: callers following a run's log, and noticing a run leave this replica;
//! * [`cancel`]: `CancelRun`, here or on the replica that runs it;
//! * [`listing`]: `ListRuns`, the runs live here given to the store's index;
//! * [`queue`]: runs waiting for a slot, woken by the share rules;
//! * [`quota`]: a run's slot among its principal's `max_runs` across the fleet;
//! * [`steering`]: `SendMessage`, here or on the replica that runs it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{Notify, Semaphore};

use shared::auth::Principal;

use crate::domain::RunResult;
use crate::domain::ports::{ApprovalStore, EventLog, Quotas, ResultStore, RunIndex, RunJournal, StoreError, within};
pub(crate) use crate::domain::visibility::sees;
use crate::run::backlog::Backlog;
use crate::run::live::{Cancel, HandOver, SharedState};
use crate::run::steering::Inbox;

mod admission;
mod attach;
mod cancel;
mod listing;
mod queue;
mod quota;
mod steering;
#[cfg(test)]
mod tests;

pub(crate) use admission::{Admitted, EndedElsewhere, Refusal, TakenOver, Unparked};
pub(crate) use attach::AttachError;
pub(crate) use cancel::CancelOutcome;
pub(crate) use queue::Queuing;
pub(crate) use steering::SteeringOutcome;

/// How often the backlog of unstored results is written again while the store is unavailable.
const BACKLOG_RETRY: Duration = Duration::from_secs(1);

struct Live {
    state: SharedState,
    cancel: Cancel,
    hand_over: HandOver,
    principal: String,
    /// Messages sent to the run (`SendMessage`), waiting for its next turn boundary.
    inbox: Inbox,
    /// Cancelled once the run leaves this replica (ended, or moved to another one).
    gone: tokio_util::sync::CancellationToken,
    /// What writes its record (a cancel after its turn is kept there before it is answered),
    /// holding this replica's ownership of the run: its end is shown once it is stored.
    persister: crate::run::persist::Persister,
}

impl Live {
    /// This replica's ownership of the run.
    fn ownership(&self) -> &crate::domain::Ownership {
        self.persister.ownership()
    }

    /// The run as readers outside it see it: an end is shown only once it is kept (logged, and
    /// the result stored); until then the run reads running, with its output so far.
    fn shown(&self) -> RunResult {
        let result = shared::sync::lock(&self.state).clone();
        if self.ownership().ended() {
            result
        } else {
            result.unended()
        }
    }
}

/// The runs live on this replica, by id.
type LiveRuns = HashMap<String, Live>;

/// See the module docs.
pub(crate) struct Runs {
    live: Mutex<LiveRuns>,
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
    approvals: Arc<dyn ApprovalStore>,
    /// Where runs are found (`ListRuns`).
    index: Arc<dyn RunIndex>,
    /// Runs waiting for a slot, by principal.
    queue: Mutex<queue::Queued>,
    /// Each principal's `max_runs` across the fleet (a shared store).
    quotas: Option<Arc<dyn Quotas>>,
    /// Runs that may wait for a slot at once (`--max-queued-runs`): all principals together, and
    /// each one's unless its `max_queued` says otherwise.
    max_queued: usize,
    /// Messages a run may be sent over its life (`--max-steering-messages`).
    max_steering: u32,
    /// The drain's request that runs move: each run's [`HandOver`] is its child, so a run let in
    /// (or taken over) while the replica drains is asked too.
    drain: HandOver,
}

/// Where the registry keeps what outlives a run's task: results, event logs, checkpoints (a
/// shared store) and runs waiting for approvals.
pub(crate) struct Keeping {
    pub(crate) store: Arc<dyn ResultStore>,
    pub(crate) log: Arc<dyn EventLog>,
    pub(crate) journal: Option<Arc<dyn RunJournal>>,
    pub(crate) approvals: Arc<dyn ApprovalStore>,
    pub(crate) index: Arc<dyn RunIndex>,
    pub(crate) quotas: Option<Arc<dyn Quotas>>,
}

impl Runs {
    /// An empty registry of at most `max_runs` live runs and `max_attached` attached callers,
    /// over `keeping` (a store write waits at most `store_timeout`; final results the store does
    /// not take wait in a backlog of at most `backlog` results). A run may be sent
    /// `max_steering` messages.
    pub(crate) fn new(
        (max_runs, max_attached, max_steering, max_queued): (usize, usize, u32, usize),
        keeping: Keeping,
        store_timeout: Duration,
        backlog: usize,
    ) -> Arc<Self> {
        // Exported from the start: a dashboard reads it before any run waited.
        metrics::gauge!(crate::telemetry::metric::RUNS_QUEUED).set(0.0);
        let Keeping {
            store,
            log,
            journal,
            approvals,
            index,
            quotas,
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
            index,
            queue: Mutex::default(),
            quotas,
            max_queued,
            max_steering,
            drain: HandOver::default(),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, LiveRuns> {
        shared::sync::lock(&self.live)
    }

    /// A result in the store, or in the backlog of ends the store has not taken yet; `Err` when
    /// the store cannot be read. An end in the backlog reads unended (its output so far): it is
    /// not kept until the store takes it, and every other replica reads the run as running.
    async fn stored(&self, run_id: &str) -> Result<Option<RunResult>, StoreError> {
        if let Some(result) = self.backlog.get(run_id) {
            return Ok(Some(result.unended()));
        }
        within(self.store_timeout, self.store.get(run_id)).await
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

    /// Asks every run, live now or let in from now on (a takeover racing the drain), to hand over
    /// at its next safe point, or at once (`now`) (drain, durable runs); how many are live.
    pub(crate) fn hand_over_all(&self, now: bool) -> usize {
        match now {
            true => self.drain.now.cancel(),
            false => self.drain.at_safe_point.cancel(),
        }
        self.lock().len()
    }

    /// A run parked in this process's approval store, as readers see it (`None` with a shared
    /// store, whose parked runs the run store answers for).
    pub(super) fn parked_here(&self, run_id: &str) -> Option<RunResult> {
        self.approvals.local()?.parked(run_id)
    }

    /// A live run's state so far, or a stored result, when `caller` may read it (its owner, or an
    /// operator); `Err` when the store cannot be read.
    pub(crate) async fn get(&self, run_id: &str, caller: &Principal) -> Result<Option<RunResult>, StoreError> {
        // Under the registry's lock: a parked run resuming leaves the approval store under it too.
        let here = {
            let live = self.lock();
            live.get(run_id).map(Live::shown).or_else(|| self.parked_here(run_id))
        };
        let found = match here {
            Some(result) => Some(result),
            None => self.stored(run_id).await?,
        };
        let Some(mut found) = found.filter(|r| crate::domain::visibility::reads(caller, &r.principal)) else {
            return Ok(None);
        };
        // Decisions reach the approval store first: the run takes them when it parks or resumes.
        if !found.pending_approvals.is_empty()
            && let Ok(Some(waiting)) = self.approvals.parked_calls(run_id).await
        {
            found.pending_approvals = waiting.calls;
        }
        Ok(Some(found))
    }

    /// Finished results not yet taken by the store.
    pub(crate) fn unstored(&self) -> usize {
        self.backlog.len()
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
