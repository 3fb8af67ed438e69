//! Parked runs in this process (with the in-memory store): each parked run's pending approvals
//! and decisions, and once it left its slot its checkpoint, state and event-log writer. At most
//! `max_parked` runs at once (`--max-parked-runs`); a parked run holds no run slot.

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;

use futures::FutureExt;
use futures::future::{BoxFuture, ready};
use tokio::sync::Notify;

use crate::domain::RunResult;
use crate::domain::approval::{
    DecideError, Decider, Decision, PendingApproval, expire_calls, record_decisions, wait_decided,
};
use crate::domain::ports::{ApprovalStore, LocalApprovals, ParkOutcome, Parked, ParkedCalls, Ready, StoreError, Wait};

/// One run's wait.
struct Entry {
    principal: String,
    calls: Vec<PendingApproval>,
    schemas: BTreeMap<String, serde_json::Value>,
    /// Set once the run left its slot.
    parked: Option<Parked>,
    canceled: Option<String>,
    /// Its deadline (or a timeout) passed while it was parked.
    woke: bool,
    /// Order of opening, so the oldest waits are listed (and resumed) first.
    opened: u64,
}

impl Entry {
    fn parked_calls(&self) -> ParkedCalls {
        ParkedCalls {
            calls: self.calls.clone(),
            canceled: self.canceled.clone(),
            parked_at_unix_ms: self.parked.as_ref().map_or(0, |p| p.parked_at_unix_ms),
        }
    }
}

impl Entry {
    fn decided(&self) -> bool {
        wait_decided(&self.calls)
    }

    /// A parked run goes on once decided, woken or canceled.
    fn ready(&self) -> bool {
        self.parked.is_some() && (self.decided() || self.woke || self.canceled.is_some())
    }
}

#[derive(Default)]
struct Inner {
    runs: HashMap<String, Entry>,
    /// Ready runs by opening order.
    ready: BTreeMap<u64, String>,
    opened: u64,
}

impl Inner {
    fn mark_if_ready(&mut self, run_id: &str) -> bool {
        match self.runs.get(run_id) {
            Some(entry) if entry.ready() => {
                self.ready.insert(entry.opened, run_id.to_owned());
                true
            }
            _ => false,
        }
    }
}

/// See the module docs.
pub struct MemoryApprovals {
    inner: Mutex<Inner>,
    max_parked: usize,
    changed: std::sync::Arc<Notify>,
}

impl MemoryApprovals {
    /// An empty approval store for at most `max_parked` parked runs.
    pub fn new(max_parked: usize) -> Self {
        Self {
            inner: Mutex::default(),
            max_parked,
            changed: std::sync::Arc::new(Notify::new()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        shared::sync::lock(&self.inner)
    }
}

impl MemoryApprovals {
    fn open_now(&self, wait: Wait) -> Result<(), String> {
        let mut inner = self.lock();
        if !inner.runs.contains_key(&wait.run_id) && inner.runs.len() >= self.max_parked {
            return Err(format!(
                "this orchestrator has {} parked runs already, its limit (--max-parked-runs)",
                self.max_parked
            ));
        }
        inner.opened += 1;
        let (run_id, principal) = (wait.run_id.clone(), wait.principal.clone());
        let (calls, schemas) = wait.into_calls();
        let entry = Entry {
            principal,
            calls,
            schemas,
            parked: None,
            canceled: None,
            woke: false,
            opened: inner.opened,
        };
        inner.runs.insert(run_id, entry);
        Ok(())
    }

    fn park_now(&self, run_id: &str, parked: Parked) -> ParkOutcome {
        let mut inner = self.lock();
        let Some(entry) = inner.runs.get_mut(run_id) else {
            // Nothing waits (the wait was never opened): the run goes on with no decision.
            return ParkOutcome::Decided(Vec::new(), Box::new(parked));
        };
        if entry.decided() {
            let calls = entry.calls.clone();
            inner.runs.remove(run_id);
            return ParkOutcome::Decided(calls, Box::new(parked));
        }
        entry.parked = Some(parked);
        drop(inner);
        metrics::gauge!(crate::telemetry::metric::RUNS_AWAITING_APPROVAL).increment(1.0);
        ParkOutcome::Parked
    }

    fn decide_now(
        &self,
        run_id: &str,
        decider: &Decider,
        decisions: &[Decision],
    ) -> Result<Vec<PendingApproval>, DecideError> {
        let mut inner = self.lock();
        let entry = inner
            .runs
            .get_mut(run_id)
            .filter(|e| e.canceled.is_none())
            .ok_or_else(|| DecideError::NotFound(run_id.to_owned()))?;
        record_decisions(
            run_id,
            &entry.principal,
            &mut entry.calls,
            &entry.schemas,
            decider,
            decisions,
        )?;
        let calls = entry.calls.clone();
        if inner.mark_if_ready(run_id) {
            self.changed.notify_one();
        }
        Ok(calls)
    }

    fn pending_now(&self, decider: &Decider, run_id: Option<&str>, limit: usize) -> (Vec<PendingApproval>, bool) {
        let inner = self.lock();
        let mut entries: Vec<&Entry> = inner
            .runs
            .iter()
            .filter(|(id, e)| {
                run_id.is_none_or(|r| r == id.as_str()) && e.canceled.is_none() && decider.may_decide(&e.principal)
            })
            .map(|(_, e)| e)
            .collect();
        entries.sort_by_key(|e| e.opened);
        let mut waiting = entries
            .into_iter()
            .flat_map(|e| e.calls.iter().filter(|c| c.decision.is_none()).cloned());
        let listed: Vec<PendingApproval> = waiting.by_ref().take(limit).collect();
        let more = waiting.next().is_some();
        (listed, more)
    }

    fn cancel_now(&self, run_id: &str, reason: &str) -> bool {
        let mut inner = self.lock();
        let Some(entry) = inner.runs.get_mut(run_id).filter(|e| e.parked.is_some()) else {
            return false;
        };
        entry.canceled = Some(reason.to_owned());
        inner.mark_if_ready(run_id);
        self.changed.notify_one();
        true
    }
}

impl ApprovalStore for MemoryApprovals {
    fn open(&self, wait: Wait) -> BoxFuture<'static, Result<(), String>> {
        ready(self.open_now(wait)).boxed()
    }

    fn park(&self, run_id: &str, parked: Parked) -> BoxFuture<'static, Result<ParkOutcome, StoreError>> {
        ready(Ok(self.park_now(run_id, parked))).boxed()
    }

    fn decide(
        &self,
        run_id: &str,
        decider: &Decider,
        decisions: &[Decision],
    ) -> BoxFuture<'static, Result<Vec<PendingApproval>, DecideError>> {
        ready(self.decide_now(run_id, decider, decisions)).boxed()
    }

    fn pending(
        &self,
        decider: &Decider,
        run_id: Option<&str>,
        limit: usize,
    ) -> BoxFuture<'static, Result<(Vec<PendingApproval>, bool), StoreError>> {
        ready(Ok(self.pending_now(decider, run_id, limit))).boxed()
    }

    fn parked_calls(&self, run_id: &str) -> BoxFuture<'static, Result<Option<ParkedCalls>, StoreError>> {
        ready(Ok(self.lock().runs.get(run_id).map(Entry::parked_calls))).boxed()
    }

    fn cancel(&self, run_id: &str, reason: &str) -> BoxFuture<'static, Result<bool, StoreError>> {
        ready(Ok(self.cancel_now(run_id, reason))).boxed()
    }

    fn close(&self, run_id: &str, _epoch: u64) -> BoxFuture<'static, ()> {
        let mut inner = self.lock();
        if let Some(entry) = inner.runs.remove(run_id) {
            inner.ready.remove(&entry.opened);
            if entry.parked.is_some() {
                metrics::gauge!(crate::telemetry::metric::RUNS_AWAITING_APPROVAL).decrement(1.0);
            }
        }
        ready(()).boxed()
    }

    fn close_decided(&self, run_id: &str, epoch: u64) -> BoxFuture<'static, Option<String>> {
        // A run of this process is taken from its wait under the registry's lock, and a cancel
        // after that finds it live: no cancel reaches a wait its run was taken from.
        self.close(run_id, epoch).map(|()| None).boxed()
    }

    fn local(&self) -> Option<&dyn LocalApprovals> {
        Some(self)
    }
}

impl LocalApprovals for MemoryApprovals {
    fn parked(&self, run_id: &str) -> Option<RunResult> {
        let inner = self.lock();
        let entry = inner.runs.get(run_id)?;
        let mut result = entry.parked.as_ref()?.result.clone();
        result.pending_approvals.clone_from(&entry.calls);
        Some(result)
    }

    fn parked_runs(&self) -> Vec<RunResult> {
        let inner = self.lock();
        let ids: Vec<String> = inner
            .runs
            .iter()
            .filter(|(_, e)| e.parked.is_some())
            .map(|(id, _)| id.clone())
            .collect();
        drop(inner);
        ids.iter().filter_map(|id| self.parked(id)).collect()
    }

    fn expire(&self, now_unix_ms: u64) {
        let mut inner = self.lock();
        let mut woken = Vec::new();
        for (run_id, entry) in &mut inner.runs {
            let Some(parked) = &entry.parked else { continue };
            if parked.wake_at_unix_ms > now_unix_ms || entry.woke {
                continue;
            }
            expire_calls(&mut entry.calls, now_unix_ms);
            entry.woke = true;
            woken.push(run_id.clone());
        }
        // Every woken run is marked (no short cut).
        let marked = woken.iter().filter(|id| inner.mark_if_ready(id)).count();
        if marked > 0 {
            self.changed.notify_one();
        }
    }

    fn take_ready(&self) -> Option<Ready> {
        let mut inner = self.lock();
        let (_, run_id) = inner.ready.pop_first()?;
        let entry = inner.runs.remove(&run_id)?;
        let calls = entry.parked_calls();
        let parked = entry.parked?;
        metrics::gauge!(crate::telemetry::metric::RUNS_AWAITING_APPROVAL).decrement(1.0);
        Some(Ready { run_id, parked, calls })
    }

    fn put_back(&self, ready: Ready) {
        let mut inner = self.lock();
        inner.opened += 1;
        let entry = Entry {
            principal: ready.parked.result.principal.clone(),
            calls: ready.calls.calls,
            schemas: BTreeMap::new(),
            parked: Some(ready.parked),
            canceled: ready.calls.canceled,
            woke: true,
            opened: inner.opened,
        };
        inner.ready.insert(entry.opened, ready.run_id.clone());
        inner.runs.insert(ready.run_id, entry);
        metrics::gauge!(crate::telemetry::metric::RUNS_AWAITING_APPROVAL).increment(1.0);
    }

    fn changed(&self) -> BoxFuture<'static, ()> {
        let changed = std::sync::Arc::clone(&self.changed);
        async move { changed.notified().await }.boxed()
    }
}

/// The memory approval store with faults a test puts in: a park the store refuses, and a hook run right
/// after a ready run was handed out.
#[cfg(test)]
pub(crate) struct HookedApprovals {
    pub(crate) inner: MemoryApprovals,
    /// Every park is refused (a store that does not take the parked record).
    pub(crate) refuse_park: bool,
    /// Every wait opened is kept, and its answer lost (the opener hears no answer in time).
    pub(crate) lose_open_answers: bool,
    /// Runs after `take_ready` handed a run out, before the caller has it.
    pub(crate) after_take: Option<Box<dyn Fn() + Send + Sync>>,
    /// A look at a run's wait answers once this is notified (a store slow to answer).
    pub(crate) slow_waiting: Option<std::sync::Arc<tokio::sync::Notify>>,
}

#[cfg(test)]
impl HookedApprovals {
    /// An approval store of at most 16 waiting runs, without faults.
    pub(crate) fn new() -> Self {
        Self {
            inner: MemoryApprovals::new(16),
            refuse_park: false,
            lose_open_answers: false,
            after_take: None,
            slow_waiting: None,
        }
    }
}

#[cfg(test)]
impl ApprovalStore for HookedApprovals {
    fn open(&self, wait: Wait) -> BoxFuture<'static, Result<(), String>> {
        let opened = self.inner.open(wait);
        match self.lose_open_answers {
            false => opened,
            true => opened
                .map(|_| Err("the approvals bucket did not take the wait: no answer in time".to_owned()))
                .boxed(),
        }
    }
    fn park(&self, run_id: &str, parked: Parked) -> BoxFuture<'static, Result<ParkOutcome, StoreError>> {
        if !self.refuse_park {
            return self.inner.park(run_id, parked);
        }
        let refused = StoreError::Unavailable {
            operation: "KV update",
            key: format!("wait.{run_id}"),
            reason: "the store is restarting".into(),
        };
        ready(Err(refused)).boxed()
    }
    fn decide(
        &self,
        run_id: &str,
        decider: &Decider,
        decisions: &[Decision],
    ) -> BoxFuture<'static, Result<Vec<PendingApproval>, DecideError>> {
        self.inner.decide(run_id, decider, decisions)
    }
    fn pending(
        &self,
        decider: &Decider,
        run_id: Option<&str>,
        limit: usize,
    ) -> BoxFuture<'static, Result<(Vec<PendingApproval>, bool), StoreError>> {
        self.inner.pending(decider, run_id, limit)
    }
    fn parked_calls(&self, run_id: &str) -> BoxFuture<'static, Result<Option<ParkedCalls>, StoreError>> {
        let (waiting, slow) = (self.inner.parked_calls(run_id), self.slow_waiting.clone());
        async move {
            if let Some(slow) = slow {
                slow.notified().await;
            }
            waiting.await
        }
        .boxed()
    }
    fn cancel(&self, run_id: &str, reason: &str) -> BoxFuture<'static, Result<bool, StoreError>> {
        self.inner.cancel(run_id, reason)
    }
    fn close(&self, run_id: &str, epoch: u64) -> BoxFuture<'static, ()> {
        self.inner.close(run_id, epoch)
    }
    fn close_decided(&self, run_id: &str, epoch: u64) -> BoxFuture<'static, Option<String>> {
        self.inner.close_decided(run_id, epoch)
    }

    fn local(&self) -> Option<&dyn LocalApprovals> {
        Some(self)
    }
}

#[cfg(test)]
impl LocalApprovals for HookedApprovals {
    fn parked(&self, run_id: &str) -> Option<RunResult> {
        self.inner.parked(run_id)
    }

    fn parked_runs(&self) -> Vec<RunResult> {
        self.inner.parked_runs()
    }

    fn expire(&self, now_unix_ms: u64) {
        self.inner.expire(now_unix_ms);
    }

    fn take_ready(&self) -> Option<Ready> {
        let ready = self.inner.take_ready()?;
        if let Some(hook) = &self.after_take {
            hook();
        }
        Some(ready)
    }

    fn put_back(&self, ready: Ready) {
        self.inner.put_back(ready);
    }

    fn changed(&self) -> BoxFuture<'static, ()> {
        self.inner.changed()
    }
}
