//! Final results the store did not take (it was down, or slower than the store timeout). The
//! caller already has its result in `run_finished`; the backlog keeps it for `GetRun` on this
//! replica and writes it again in the background, oldest first, until the store takes it.
//!
//! Bounded by count: when full, the oldest result is dropped (logged and counted). One flusher
//! task runs while the backlog is not empty; a write that fails stops the pass, which is tried
//! again after `retry_every`.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::domain::RunResult;
use crate::domain::ports::{ResultStore, StoreError, within};
use crate::telemetry::metric;

/// Results waiting to be written again.
pub struct Backlog {
    store: Arc<dyn ResultStore>,
    pending: Mutex<VecDeque<RunResult>>,
    capacity: usize,
    timeout: Duration,
    retry_every: Duration,
    flushing: AtomicBool,
}

impl Backlog {
    /// A backlog of at most `capacity` results for `store`; one write waits at most `timeout`.
    pub fn new(store: Arc<dyn ResultStore>, capacity: usize, timeout: Duration, retry_every: Duration) -> Arc<Self> {
        Arc::new(Self {
            store,
            pending: Mutex::default(),
            capacity,
            timeout,
            retry_every,
            flushing: AtomicBool::new(false),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, VecDeque<RunResult>> {
        shared::sync::lock(&self.pending)
    }

    /// Keeps `result` to be written again, dropping the oldest one when full.
    pub fn push(self: &Arc<Self>, result: RunResult) {
        let dropped = {
            let mut pending = self.lock();
            pending.retain(|r| r.run_id != result.run_id);
            pending.push_back(result);
            let over = pending.len().saturating_sub(self.capacity);
            pending.drain(..over).map(|r| r.run_id).collect::<Vec<_>>()
        };
        for run_id in dropped {
            metrics::counter!(metric::STORE_BACKLOG_DROPPED).increment(1);
            tracing::error!(run_id = %run_id, capacity = self.capacity, "store backlog full: a finished result that was never stored is dropped");
        }
        self.set_gauge();
        if !self.flushing.swap(true, Ordering::AcqRel) {
            shared::tasks::spawn(Arc::clone(self).flush());
        }
    }

    /// A result waiting here, if any.
    pub fn get(&self, run_id: &str) -> Option<RunResult> {
        self.lock().iter().find(|r| r.run_id == run_id).cloned()
    }

    /// How many results are waiting.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// Whether nothing is waiting.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn set_gauge(&self) {
        metrics::gauge!(metric::STORE_BACKLOG).set(self.len() as f64);
    }

    /// Writes the waiting results, oldest first, until none is left.
    async fn flush(self: Arc<Self>) {
        loop {
            let next = self.lock().front().cloned();
            let Some(result) = next else {
                self.flushing.store(false, Ordering::Release);
                // A push between the check and the store above found `flushing` still set.
                if self.is_empty() || self.flushing.swap(true, Ordering::AcqRel) {
                    return;
                }
                continue;
            };
            match within(self.timeout, self.store.put(result.clone())).await {
                Ok(()) => {
                    tracing::info!(run_id = %result.run_id, "a result held back while the store was unavailable is stored now");
                    self.remove_written(&result);
                }
                Err(e @ StoreError::Fenced { .. }) => {
                    // Another replica holds the run (it moved before this end was stored, and
                    // ends it there): this end is not the run's, and no retry makes it so.
                    metrics::counter!(metric::STORE_BACKLOG_DROPPED).increment(1);
                    tracing::warn!(run_id = %result.run_id, "a held-back result is dropped: {e}");
                    self.remove_written(&result);
                }
                Err(e) => self.wait_after_failure(&result.run_id, &e).await,
            }
        }
    }

    /// Removes `written` unless a newer result of the same run replaced it meanwhile.
    fn remove_written(&self, written: &RunResult) {
        let mut pending = self.lock();
        if let Some(at) = pending.iter().position(|r| r == written) {
            pending.remove(at);
        }
        drop(pending);
        self.set_gauge();
    }

    async fn wait_after_failure(&self, run_id: &str, error: &StoreError) {
        tracing::debug!(run_id, waiting = self.len(), "store still unavailable: {error}");
        tokio::time::sleep(self.retry_every).await;
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicUsize;

    use futures::FutureExt;
    use futures::future::BoxFuture;

    use super::*;
    use crate::domain::RunStatus;
    use crate::domain::ports::Claim;
    use crate::store::memory::MemoryStore;

    /// A store that refuses writes until `up` is set and fences the run `fenced`, counting writes.
    struct Flaky {
        up: Arc<AtomicBool>,
        inner: MemoryStore,
        writes: AtomicUsize,
    }

    impl ResultStore for Flaky {
        fn put(&self, result: RunResult) -> BoxFuture<'static, Result<(), StoreError>> {
            self.writes.fetch_add(1, Ordering::Relaxed);
            if result.run_id == "fenced" {
                let run_id = result.run_id.clone();
                return async move {
                    Err(StoreError::Fenced {
                        run_id,
                        owner: "another replica".to_owned(),
                    })
                }
                .boxed();
            }
            if self.up.load(Ordering::Acquire) {
                return self.inner.put(result);
            }
            async {
                Err(StoreError::Unavailable {
                    operation: "put",
                    key: "flaky".to_owned(),
                    reason: "down".to_owned(),
                })
            }
            .boxed()
        }
        fn claim(&self, result: RunResult) -> BoxFuture<'static, Result<Claim, StoreError>> {
            self.inner.claim(result)
        }
        fn get(&self, run_id: &str) -> BoxFuture<'static, Result<Option<RunResult>, StoreError>> {
            self.inner.get(run_id)
        }
        fn lease(&self) -> Option<crate::domain::LeaseTerms> {
            None
        }
    }

    fn finished(id: &str) -> RunResult {
        let mut result = RunResult::running(id);
        result.status = RunStatus::Completed;
        result
    }

    #[tokio::test]
    async fn results_wait_while_the_store_is_down_and_land_when_it_is_back() {
        let up = Arc::new(AtomicBool::new(false));
        let store = Arc::new(Flaky {
            up: Arc::clone(&up),
            inner: MemoryStore::new(100, Duration::from_secs(60)),
            writes: AtomicUsize::new(0),
        });
        let backlog = Backlog::new(store.clone(), 2, Duration::from_secs(1), Duration::from_millis(10));
        for id in ["a", "b", "c"] {
            backlog.push(finished(id));
        }
        // Capacity 2: the oldest is dropped; the others answer from here while the store is down.
        assert_eq!(backlog.get("a"), None);
        assert_eq!(backlog.get("c").map(|r| r.status), Some(RunStatus::Completed));
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(store.writes.load(Ordering::Relaxed) >= 2, "retried while down");
        up.store(true, Ordering::Release);
        for _ in 0..200 {
            if backlog.is_empty() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(backlog.is_empty());
        for id in ["b", "c"] {
            assert!(store.get(id).await.ok().flatten().is_some(), "{id} stored");
        }
        // Empty again: the flusher stopped, and a later push starts it again.
        backlog.push(finished("d"));
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(backlog.is_empty());
    }

    /// A result the store fences (another replica holds its run) is dropped at the first refusal,
    /// not retried, and the results behind it are written.
    #[tokio::test]
    async fn a_fenced_result_is_dropped_and_blocks_nothing_behind_it() {
        let store = Arc::new(Flaky {
            up: Arc::new(AtomicBool::new(true)),
            inner: MemoryStore::new(100, Duration::from_secs(60)),
            writes: AtomicUsize::new(0),
        });
        let backlog = Backlog::new(store.clone(), 4, Duration::from_secs(1), Duration::from_secs(3600));
        backlog.push(finished("fenced"));
        backlog.push(finished("behind"));
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while !backlog.is_empty() {
            assert!(tokio::time::Instant::now() < deadline, "the backlog never emptied");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert!(store.get("behind").await.ok().flatten().is_some());
        assert_eq!(store.writes.load(Ordering::Relaxed), 2, "one write each: no retry");
    }
}
