//! The runs registry: run slots, live runs (for `GetRun` and `CancelRun`), and finished results
//! kept for `GetRun`, bounded by count and by age.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;

use crate::run::tool_loop::{Cancel, SharedState};
use crate::run::{RunResult, RunStatus};

/// Bounds of the registry.
#[derive(Debug, Clone, Copy)]
pub struct RunsConfig {
    /// Runs live at once; one more is refused with `RESOURCE_EXHAUSTED`.
    pub max_runs: usize,
    /// Finished results kept.
    pub keep_results: usize,
    /// How long a finished result is kept.
    pub keep_results_for: Duration,
}

struct Live {
    state: SharedState,
    cancel: Cancel,
}

#[derive(Default)]
struct Inner {
    live: HashMap<String, Live>,
    finished: HashMap<String, (RunResult, Instant)>,
    order: VecDeque<(String, Instant)>,
}

/// See the module docs.
pub struct Runs {
    inner: Mutex<Inner>,
    slots: Arc<Semaphore>,
    idle: Notify,
    config: RunsConfig,
}

/// Why a run cannot start.
#[derive(Debug)]
pub enum Refusal {
    /// A live run has this id.
    Duplicate,
    /// No slot is free.
    Full(usize),
    /// The run already finished; here is its result (idempotent replay).
    Finished(Box<RunResult>),
}

/// A started run's place in the registry; dropping it frees the slot and the live entry.
pub struct Admitted {
    runs: Arc<Runs>,
    run_id: String,
    /// The run's live state.
    pub state: SharedState,
    /// Cancels the run.
    pub cancel: Cancel,
    _permit: OwnedSemaphorePermit,
}

impl Drop for Admitted {
    fn drop(&mut self) {
        let mut inner = self.runs.lock();
        inner.live.remove(&self.run_id);
        if inner.live.is_empty() {
            self.runs.idle.notify_waiters();
        }
    }
}

/// Outcome of a cancel request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CancelOutcome {
    /// A live run was canceled.
    Canceled,
    /// The run had already finished with this status.
    AlreadyFinished(RunStatus),
    /// No such run.
    NotFound,
}

impl Runs {
    /// An empty registry.
    pub fn new(config: RunsConfig) -> Arc<Self> {
        Arc::new(Self {
            inner: Mutex::new(Inner::default()),
            slots: Arc::new(Semaphore::new(config.max_runs)),
            idle: Notify::new(),
            config,
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Takes a slot for `run_id`.
    pub fn admit(self: &Arc<Self>, run_id: &str) -> Result<Admitted, Refusal> {
        let mut inner = self.lock();
        if inner.live.contains_key(run_id) {
            return Err(Refusal::Duplicate);
        }
        self.expire(&mut inner);
        if let Some((result, _)) = inner.finished.get(run_id) {
            return Err(Refusal::Finished(Box::new(result.clone())));
        }
        let permit = Arc::clone(&self.slots)
            .try_acquire_owned()
            .map_err(|_| Refusal::Full(self.config.max_runs))?;
        let state: SharedState = Arc::new(Mutex::new(RunResult::running(run_id)));
        let cancel = Cancel::default();
        inner.live.insert(
            run_id.to_owned(),
            Live {
                state: Arc::clone(&state),
                cancel: cancel.clone(),
            },
        );
        Ok(Admitted {
            runs: Arc::clone(self),
            run_id: run_id.to_owned(),
            state,
            cancel,
            _permit: permit,
        })
    }

    /// Keeps a finished result (called before the stream's last event).
    pub fn store(&self, result: &RunResult) {
        let mut inner = self.lock();
        let now = Instant::now();
        inner.finished.insert(result.run_id.clone(), (result.clone(), now));
        inner.order.push_back((result.run_id.clone(), now));
        self.expire(&mut inner);
    }

    /// A finished result, or a live run's state so far.
    pub fn get(&self, run_id: &str) -> Option<RunResult> {
        let mut inner = self.lock();
        self.expire(&mut inner);
        if let Some((result, _)) = inner.finished.get(run_id) {
            return Some(result.clone());
        }
        inner
            .live
            .get(run_id)
            .map(|live| live.state.lock().unwrap_or_else(PoisonError::into_inner).clone())
    }

    /// Cancels a live run.
    pub fn cancel(&self, run_id: &str, reason: &str) -> CancelOutcome {
        let inner = self.lock();
        if let Some(live) = inner.live.get(run_id) {
            live.cancel.cancel(reason);
            return CancelOutcome::Canceled;
        }
        match inner.finished.get(run_id) {
            Some((result, _)) => CancelOutcome::AlreadyFinished(result.status),
            None => CancelOutcome::NotFound,
        }
    }

    /// Cancels every live run (the drain's last step).
    pub fn cancel_all(&self, reason: &str) -> usize {
        let inner = self.lock();
        for live in inner.live.values() {
            live.cancel.cancel(reason);
        }
        inner.live.len()
    }

    /// Runs live now.
    pub fn live(&self) -> usize {
        self.lock().live.len()
    }

    /// Resolves when no run is live.
    pub async fn wait_idle(&self) {
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

    /// Drops results beyond the count bound or older than the age bound.
    fn expire(&self, inner: &mut Inner) {
        let now = Instant::now();
        while let Some((run_id, at)) = inner.order.front().cloned() {
            let too_many = inner.finished.len() > self.config.keep_results;
            let too_old = now.saturating_duration_since(at) > self.config.keep_results_for;
            if !too_many && !too_old {
                break;
            }
            inner.order.pop_front();
            if inner.finished.get(&run_id).is_some_and(|(_, stored)| *stored == at) {
                inner.finished.remove(&run_id);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn runs(max_runs: usize, keep: usize, keep_for: Duration) -> Arc<Runs> {
        Runs::new(RunsConfig {
            max_runs,
            keep_results: keep,
            keep_results_for: keep_for,
        })
    }

    fn finished(id: &str) -> RunResult {
        RunResult {
            status: RunStatus::Completed,
            ..RunResult::running(id)
        }
    }

    #[test]
    fn slots_on_both_sides_of_the_limit_and_released_on_drop() {
        let runs = runs(2, 10, Duration::from_secs(60));
        let a = runs.admit("a").unwrap();
        let _b = runs.admit("b").unwrap();
        assert!(matches!(runs.admit("c"), Err(Refusal::Full(2))));
        assert!(matches!(runs.admit("a"), Err(Refusal::Duplicate)));
        drop(a);
        assert!(runs.admit("c").is_ok());
    }

    #[test]
    fn results_are_bounded_by_count() {
        let runs = runs(10, 2, Duration::from_secs(60));
        for id in ["a", "b", "c"] {
            runs.store(&finished(id));
        }
        assert!(runs.get("a").is_none());
        assert!(runs.get("b").is_some() && runs.get("c").is_some());
        assert!(matches!(runs.admit("c"), Err(Refusal::Finished(_))));
    }

    #[tokio::test(start_paused = true)]
    async fn results_are_bounded_by_age() {
        let runs = runs(10, 10, Duration::from_secs(60));
        runs.store(&finished("a"));
        tokio::time::advance(Duration::from_secs(59)).await;
        assert!(runs.get("a").is_some());
        tokio::time::advance(Duration::from_secs(2)).await;
        assert!(runs.get("a").is_none());
    }

    #[test]
    fn live_state_and_cancel() {
        let runs = runs(10, 10, Duration::from_secs(60));
        let admitted = runs.admit("a").unwrap();
        admitted.state.lock().unwrap().text.push_str("so far");
        assert_eq!(
            runs.get("a").map(|r| (r.status, r.text)),
            Some((RunStatus::Running, "so far".into()))
        );
        assert_eq!(runs.cancel("a", "test"), CancelOutcome::Canceled);
        assert!(admitted.cancel.is_canceled());
        assert_eq!(runs.cancel("zzz", "test"), CancelOutcome::NotFound);
    }
}
