//! The in-memory result store: bounded by count and by age, lost on restart, local to one replica.
//! Its listing reads every result it keeps (at most `--keep-results`) with the runs live here.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;
use std::time::Duration;

use futures::future::BoxFuture;
use tokio::time::Instant;

use crate::domain::RunResult;
use crate::domain::listing::{RunPage, RunQuery, RunSummary};
use crate::domain::ports::{Claim, ResultStore, RunIndex, StoreError};

#[derive(Default)]
struct Inner {
    results: HashMap<String, (RunResult, Instant)>,
    /// Insertion order (run id, when), for eviction.
    order: VecDeque<(String, Instant)>,
}

/// See the module docs.
pub struct MemoryStore {
    inner: Mutex<Inner>,
    max_count: usize,
    max_age: Duration,
}

impl MemoryStore {
    /// Keeps at most `max_count` results, each at most `max_age`.
    pub fn new(max_count: usize, max_age: Duration) -> Self {
        Self {
            inner: Mutex::default(),
            max_count,
            max_age,
        }
    }

    fn expire(&self, inner: &mut Inner) {
        let now = Instant::now();
        while let Some((run_id, at)) = inner.order.front().cloned() {
            let too_many = inner.results.len() > self.max_count;
            let too_old = now.saturating_duration_since(at) > self.max_age;
            if !too_many && !too_old {
                break;
            }
            inner.order.pop_front();
            if inner.results.get(&run_id).is_some_and(|(_, stored)| *stored == at) {
                inner.results.remove(&run_id);
            }
        }
    }
}

impl ResultStore for MemoryStore {
    fn put(&self, result: RunResult) -> BoxFuture<'static, Result<(), StoreError>> {
        let mut inner = shared::sync::lock(&self.inner);
        let now = Instant::now();
        // A run written again keeps its place in the eviction order.
        let at = inner.results.get(&result.run_id).map_or(now, |(_, at)| *at);
        if at == now {
            inner.order.push_back((result.run_id.clone(), now));
        }
        inner.results.insert(result.run_id.clone(), (result, at));
        self.expire(&mut inner);
        Box::pin(futures::future::ready(Ok(())))
    }

    fn lease(&self) -> Option<crate::domain::LeaseTerms> {
        None
    }

    /// One replica: the registry of live runs already refuses a taken id.
    fn claim(&self, _result: RunResult) -> BoxFuture<'static, Result<Claim, StoreError>> {
        Box::pin(std::future::ready(Ok(Claim::Claimed)))
    }

    fn get(&self, run_id: &str) -> BoxFuture<'static, Result<Option<RunResult>, StoreError>> {
        let mut inner = shared::sync::lock(&self.inner);
        self.expire(&mut inner);
        let found = inner.results.get(run_id).map(|(r, _)| r.clone());
        Box::pin(futures::future::ready(Ok(found)))
    }
}

impl RunIndex for MemoryStore {
    /// The results kept, and the runs live here (this replica is the whole fleet), one row per
    /// run, the live one's where both have it.
    fn list(&self, query: RunQuery, here: Vec<RunSummary>) -> BoxFuture<'static, Result<RunPage, StoreError>> {
        let mut inner = shared::sync::lock(&self.inner);
        self.expire(&mut inner);
        let live: std::collections::HashSet<&str> = here.iter().map(|r| r.run_id.as_str()).collect();
        let stored: Vec<RunSummary> = inner
            .results
            .values()
            .filter(|(r, _)| !live.contains(r.run_id.as_str()))
            .map(|(r, _)| RunSummary::from(r))
            .collect();
        let page = query.page_of(here.into_iter().chain(stored));
        Box::pin(futures::future::ready(Ok(page)))
    }
}
