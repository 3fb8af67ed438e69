//! Writing one run's state to the result store: checkpoints of a live run, its lease in a shared
//! store, and its final result (which waits in the [`Backlog`] when the store does not take it).
//! The snapshot is taken inside a per-run lock, so the last write is always the newest state even
//! when writes race (e.g. a signal confirmed late).

use std::sync::Arc;
use std::time::Duration;

use super::backlog::Backlog;
use super::live::SharedState;
use crate::domain::ports::{Claim, ResultStore, within};
use crate::domain::result::RunResult;

/// Writes one run's state to the store, newest state last.
#[derive(Clone)]
pub struct Persister {
    store: Arc<dyn ResultStore>,
    state: SharedState,
    lock: Arc<tokio::sync::Mutex<()>>,
    timeout: Duration,
    backlog: Arc<Backlog>,
}

impl Persister {
    /// A persister of `state` into `store`; one write waits at most `timeout`; a final result
    /// the store does not take waits in `backlog`.
    pub fn new(store: Arc<dyn ResultStore>, state: SharedState, timeout: Duration, backlog: Arc<Backlog>) -> Self {
        Self {
            store,
            state,
            lock: Arc::default(),
            timeout,
            backlog,
        }
    }

    /// Writes the current state now; whether the store took it.
    pub async fn write(&self) -> bool {
        let _serialized = self.lock.lock().await;
        let snapshot = self.snapshot();
        let run_id = snapshot.run_id.clone();
        match within(self.timeout, self.store.put(snapshot)).await {
            Ok(()) => true,
            Err(e) => {
                tracing::warn!(run_id = %run_id, "storing the run's state failed: {e}");
                false
            }
        }
    }

    /// Writes the final result; if the store does not take it, it waits in the backlog (answered
    /// by GetRun here, written again until the store takes it).
    pub async fn write_final(&self) {
        if !self.write().await {
            self.backlog.push(self.snapshot());
        }
    }

    fn snapshot(&self) -> RunResult {
        shared::sync::lock(&self.state).clone()
    }

    /// Writes a live run's state in the background for other replicas (nothing to do when the
    /// store is local: the registry answers for live runs).
    pub fn checkpoint(&self) {
        if self.store.shared().is_some() {
            let this = self.clone();
            tokio::spawn(async move {
                let _ = this.write().await;
            });
        }
    }

    /// Claims the run's id in the store (see [`ResultStore::claim`]). A store that cannot be
    /// reached does not stop the run: it is logged, and the run goes on unclaimed.
    pub async fn claim(&self) -> Claim {
        let snapshot = self.snapshot();
        let run_id = snapshot.run_id.clone();
        within(self.timeout, self.store.claim(snapshot))
            .await
            .unwrap_or_else(|e| {
                tracing::warn!(run_id = %run_id, "claiming the run id in the store failed (running unclaimed): {e}");
                Claim::Claimed
            })
    }

    /// Renews the run's lease in a shared store until the returned guard is dropped: the state is
    /// written every `renew_every`.
    pub fn keep_lease(&self) -> Option<shared::runtime::AbortOnDrop> {
        let every = self.store.shared()?;
        let this = self.clone();
        Some(shared::runtime::AbortOnDrop(tokio::spawn(async move {
            loop {
                tokio::time::sleep(every).await;
                let _ = this.write().await;
            }
        })))
    }

    /// Writes the final result again in the background (off the run's path), e.g. after a late
    /// signal confirmation changed it.
    pub fn write_final_soon(&self) {
        let this = self.clone();
        tokio::spawn(async move { this.write_final().await });
    }
}
