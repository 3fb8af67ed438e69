//! The run index (`ListRuns` on the NATS store): a JetStream stream per shard of the store
//! (`INDEX_<bucket>`, then `INDEX_<bucket>-shard-<i>`) with one message per claimed run, in its
//! run's shard, on the subject `orchestrator.<bucket shard>.index.<principal>.<thread>` (each an
//! encoded token), holding what never changes of the run: its id, owner, thread, labels and
//! admission time. Entries are written once, before the run's claim, in the order runs are
//! admitted, and expire with the results (`--run-store-ttl`).
//!
//! A page is read newest first by walking every shard's stream down from its end (or from the
//! cursor: a stream position per shard) in windows that double, each read by a consumer filtered
//! on the principal and thread the query names, so the server skips other callers' runs; of the
//! shards' next entries the walk takes the one admitted last ([`lanes`]). A run's status, turns and
//! usage come from its record, read for the entries that pass the query's times and labels. A
//! query for live runs only (running, waiting for approval) lists the fleet's live runs from
//! their checkpoints instead: they are few, however many runs are stored.
//!
//! The index never decides who sees a run: an entry is shown only when the run's record agrees
//! with it (same owner, same admission time). So an entry left by an admission that lost the race
//! for its id, or by a claim that failed, names a run that is not its own and is skipped.
//!
//! Every call is bounded: at most `--list-scan-max` stream positions walked and
//! `--list-read-max` records read; a page cut short by either is returned with a cursor that
//! continues below where it stopped (it may hold fewer rows than asked, even none).
//!
//! * `mod.rs`: reading a page ([`NatsIndex`]);
//! * [`lanes`]: the walk down every shard at once;
//! * [`entry`]: what the index keeps of a run, and its writing at a claim ([`entry::IndexWriter`]).

pub(crate) mod entry;
mod lanes;

use lanes::{Lanes, Next, Taken};

use std::collections::HashMap;
use std::sync::Arc;

use futures::future::BoxFuture;
use futures::{FutureExt as _, StreamExt as _};

use super::results::{KvStore, checkpoint_of};
use crate::domain::listing::{Cursor, RunPage, RunQuery, RunSummary};
use crate::domain::ports::{RunIndex, StoreError};
use crate::store::unavailable;

/// Records read at once.
const READ_CONCURRENCY: usize = 16;
/// Records read before the page is looked at again: a full page reads at most this many more
/// than it shows.
const READ_BATCH: usize = 32;
/// The first window walked in each shard: a page's worth and some.
const MIN_WINDOW: u64 = 64;

/// See the module docs.
pub struct NatsIndex {
    store: Arc<KvStore>,
    /// Stream positions walked per call, at most.
    scan_max: u64,
    /// Records read per call, at most.
    read_max: usize,
}

impl NatsIndex {
    /// The index of `store`'s runs, each call walking at most `scan_max` positions and reading
    /// at most `read_max` records.
    pub fn new(store: Arc<KvStore>, scan_max: u64, read_max: usize) -> Self {
        Self {
            store,
            scan_max: scan_max.max(1),
            read_max: read_max.max(1),
        }
    }
}

impl RunIndex for NatsIndex {
    fn list(&self, query: RunQuery, here: Vec<RunSummary>) -> BoxFuture<'static, Result<RunPage, StoreError>> {
        let walk = Walk {
            store: Arc::clone(&self.store),
            scan_max: self.scan_max,
            read_max: self.read_max,
            here: here.into_iter().map(|r| (r.run_id.clone(), r)).collect(),
            query,
        };
        async move {
            match walk.query.live_only() {
                true => walk.live().await,
                false => walk.down().await,
            }
        }
        .boxed()
    }
}

/// One listing call.
struct Walk {
    store: Arc<KvStore>,
    scan_max: u64,
    read_max: usize,
    /// The runs live on this replica, fresher than their records.
    here: HashMap<String, RunSummary>,
    query: RunQuery,
}

impl Walk {
    /// A page of live runs only: the fleet's live runs are those with a checkpoint. A listing
    /// of one principal's keeps theirs only before it bounds what it reads (its own live runs
    /// are never crowded out by other principals').
    async fn live(mut self) -> Result<RunPage, StoreError> {
        let mut live: Vec<String> = self
            .store
            .checkpoints
            .names()
            .await
            .map_err(|e| unavailable("checkpoint list", "", e))?
            .iter()
            .map(|name| checkpoint_of(name).0.to_owned())
            .collect();
        live.sort();
        live.dedup();
        let keys = match self.query.principal.is_some() {
            true => self.principals_among(&live).await?,
            false => {
                live.truncate(self.read_max);
                live
            }
        };
        let store = Arc::clone(&self.store);
        let mut rows: Vec<RunSummary> = futures::stream::iter(keys)
            .map(|key| {
                let store = Arc::clone(&store);
                async move { store.read_key(&key).await }
            })
            .buffer_unordered(READ_CONCURRENCY)
            .filter_map(|read| std::future::ready(read.ok().flatten()))
            .map(|run| self.here.remove(&run.run_id).unwrap_or_else(|| RunSummary::from(&run)))
            .collect()
            .await;
        rows.extend(self.here.into_values());
        Ok(self.query.page_of(rows))
    }

    /// The record keys among `live` (sorted) of runs the query's principal started, found by
    /// walking its index entries newest first (at most `--list-scan-max` of the index), at most
    /// `--list-read-max`.
    async fn principals_among(&self, live: &[String]) -> Result<Vec<String>, StoreError> {
        let window = MIN_WINDOW.max(4 * self.read_max as u64);
        let mut lanes = Lanes::open(self.store.index.shards(), &self.query, None, window, self.scan_max).await?;
        let mut keys = Vec::new();
        while keys.len() < self.read_max {
            let Next::Entry((_, _, entry)) = lanes.next(&self.query).await? else {
                break;
            };
            let key = super::results::key(&entry.run_id);
            if live.binary_search(&key).is_ok() {
                keys.push(key);
            }
        }
        Ok(keys)
    }

    /// A page walked down the index from the cursor (or its end), newest first.
    async fn down(self) -> Result<RunPage, StoreError> {
        let below = match &self.query.after {
            Some(Cursor::Positions(positions)) => Some(positions.as_slice()),
            _ => None,
        };
        let window = MIN_WINDOW.max(2 * self.query.page_size as u64);
        let shards = self.store.index.shards();
        let mut lanes = Lanes::open(shards, &self.query, below, window, self.scan_max).await?;
        let (mut rows, mut read) = (Vec::new(), 0usize);
        loop {
            let room = self.read_max.saturating_sub(read).min(READ_BATCH);
            let (batch, stopped) = self.batch(&mut lanes, room).await?;
            read += batch.len();
            // The batch's records are read at once, and looked at in the walk's order.
            let reads: Vec<_> = batch.iter().map(|(_, _, entry)| self.row(entry)).collect();
            let found = futures::stream::iter(reads)
                .buffered(READ_CONCURRENCY)
                .collect::<Vec<_>>()
                .await;
            for (n, row) in found.into_iter().enumerate() {
                let Some(row) = row?.filter(|r| self.query.matches(r)) else {
                    continue;
                };
                rows.push(row);
                if rows.len() == self.query.page_size {
                    return Ok(self.page(rows, lanes.cursor(&batch[n + 1..])));
                }
            }
            if stopped || batch.is_empty() || read >= self.read_max {
                return Ok(self.page(rows, lanes.cursor(&[])));
            }
        }
    }

    /// Up to `room` entries taken in the walk's order, and whether the walk stopped while taking
    /// them (every shard walked to its start, or out of positions to walk).
    async fn batch(&self, lanes: &mut Lanes, room: usize) -> Result<(Vec<Taken>, bool), StoreError> {
        let mut batch = Vec::with_capacity(room);
        while batch.len() < room {
            match lanes.next(&self.query).await? {
                Next::Entry(taken) => batch.push(taken),
                Next::Done | Next::OutOfScan => return Ok((batch, true)),
            }
        }
        Ok((batch, false))
    }

    fn page(&self, runs: Vec<RunSummary>, below: Option<Vec<u64>>) -> RunPage {
        RunPage {
            runs,
            next: below.map(Cursor::Positions),
        }
    }

    /// The row of `entry`'s run, when its record agrees with the entry (see the module docs);
    /// this replica's view of it when it runs here.
    fn row(&self, entry: &entry::Entry) -> BoxFuture<'static, Result<Option<RunSummary>, StoreError>> {
        let agrees = {
            let (principal, created_at_ms) = (entry.principal.clone(), entry.created_at_ms);
            move |r: &RunSummary| r.principal == principal && r.created_at_ms == created_at_ms
        };
        if let Some(live) = self.here.get(&entry.run_id) {
            return futures::future::ready(Ok(Some(live.clone()).filter(agrees))).boxed();
        }
        let read = self.store.read_key(&super::results::key(&entry.run_id));
        async move { Ok(read.await?.map(|r| RunSummary::from(&r)).filter(agrees)) }.boxed()
    }
}
