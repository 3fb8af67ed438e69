//! The run index (`ListRuns` on the NATS store): a JetStream stream `INDEX_<bucket>` with one
//! message per claimed run, on the subject `orchestrator.<bucket>.index.<principal>.<thread>`
//! (each an encoded token), holding what never changes of the run: its id, owner, thread, labels
//! and admission time. Entries are written once, before the run's claim, in the order runs are
//! admitted, and expire with the results (`--run-store-ttl`).
//!
//! A page is read newest first by walking the stream down from its end (or from the cursor, a
//! stream position) in windows that double, each read by a consumer filtered on the principal
//! and thread the query names, so the server skips other callers' runs; a run's status, turns and
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
//! * [`entry`]: what the index keeps of a run, and its writing at a claim ([`entry::IndexWriter`]).

pub(crate) mod entry;

use entry::Entry;

use std::collections::HashMap;
use std::sync::Arc;

use futures::future::BoxFuture;
use futures::{FutureExt as _, StreamExt as _};
use prost::Message as _;
use shared::jetstream::{Deliver, Read, Stream};

use super::results::{KvStore, checkpoint_of};
use crate::domain::listing::{Cursor, RunPage, RunQuery, RunSummary};
use crate::domain::ports::{RunIndex, StoreError};
use crate::store::unavailable;

/// Records read at once.
const READ_CONCURRENCY: usize = 16;
/// Records read before the page is looked at again: a full page reads at most this many more
/// than it shows.
const READ_BATCH: usize = 32;
/// The first window walked: a page's worth and some.
const MIN_WINDOW: u64 = 64;

/// See the module docs.
pub struct NatsIndex {
    store: Arc<KvStore>,
    stream: Arc<dyn Stream>,
    /// Stream positions walked per call, at most.
    scan_max: u64,
    /// Records read per call, at most.
    read_max: usize,
}

impl NatsIndex {
    /// The index of `store`'s runs, each call walking at most `scan_max` positions and reading
    /// at most `read_max` records.
    pub fn new(store: Arc<KvStore>, scan_max: u64, read_max: usize) -> Self {
        let stream = Arc::clone(&store.index_stream);
        Self {
            store,
            stream,
            scan_max: scan_max.max(1),
            read_max: read_max.max(1),
        }
    }
}

impl RunIndex for NatsIndex {
    fn list(&self, query: RunQuery, here: Vec<RunSummary>) -> BoxFuture<'static, Result<RunPage, StoreError>> {
        let walk = Walk {
            store: Arc::clone(&self.store),
            stream: Arc::clone(&self.stream),
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
    stream: Arc<dyn Stream>,
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
        let (first, end) = self.span().await?;
        let (mut below, mut walked) = (end, 0u64);
        let mut keys = Vec::new();
        while below > first && walked < self.scan_max && keys.len() < self.read_max {
            let from = below
                .saturating_sub(MIN_WINDOW.max(4 * self.read_max as u64).min(self.scan_max - walked))
                .max(first);
            walked += below - from;
            for (_, entry) in self.entries(from, below).await?.into_iter().rev() {
                let key = super::results::key(&entry.run_id);
                if keys.len() < self.read_max && live.binary_search(&key).is_ok() {
                    keys.push(key);
                }
            }
            below = from;
        }
        Ok(keys)
    }

    /// The index's first position and the one after its last.
    async fn span(&self) -> Result<(u64, u64), StoreError> {
        let state = self.stream.state().await.map_err(|e| self.failed(e))?;
        Ok((state.first_sequence.max(1), state.last_sequence.saturating_add(1)))
    }

    /// A page walked down the index from the cursor (or its end).
    async fn down(self) -> Result<RunPage, StoreError> {
        let (first, end) = self.span().await?;
        let mut below = match &self.query.after {
            Some(Cursor::Position(position)) => *position,
            _ => end,
        };
        let (mut rows, mut walked, mut read) = (Vec::new(), 0u64, 0usize);
        let mut window = MIN_WINDOW.max(2 * self.query.page_size as u64);
        while below > first && walked < self.scan_max {
            let from = below.saturating_sub(window.min(self.scan_max - walked)).max(first);
            walked += below - from;
            let admitted: Vec<(u64, Entry)> = self
                .entries(from, below)
                .await?
                .into_iter()
                .rev()
                .filter(|(_, e)| self.query.admits(e.created_at_ms, &e.labels))
                .collect();
            // Records are read a batch at a time, the batch's reads at once, in the walk's order.
            for batch in admitted.chunks(READ_BATCH) {
                let Some(room) = self.read_max.checked_sub(read).filter(|room| *room > 0) else {
                    return Ok(self.page(rows, Some(batch[0].0 + 1)));
                };
                let batch = &batch[..batch.len().min(room)];
                read += batch.len();
                let reads: Vec<_> = batch.iter().map(|(_, entry)| self.row(entry)).collect();
                let found = futures::stream::iter(reads)
                    .buffered(READ_CONCURRENCY)
                    .collect::<Vec<_>>()
                    .await;
                for ((position, _), row) in batch.iter().zip(found) {
                    let Some(row) = row?.filter(|r| self.query.matches(r)) else {
                        continue;
                    };
                    rows.push(row);
                    if rows.len() == self.query.page_size {
                        let more = *position > first;
                        return Ok(self.page(rows, more.then_some(*position)));
                    }
                }
                if let Some((position, _)) = batch.last().filter(|_| read == self.read_max) {
                    return Ok(self.page(rows, Some(*position)));
                }
            }
            below = from;
            window = window.saturating_mul(2);
        }
        let more = below > first;
        Ok(self.page(rows, more.then_some(below)))
    }

    fn page(&self, runs: Vec<RunSummary>, below: Option<u64>) -> RunPage {
        RunPage {
            runs,
            next: below.map(Cursor::Position),
        }
    }

    /// The row of `entry`'s run, when its record agrees with the entry (see the module docs);
    /// this replica's view of it when it runs here.
    fn row(&self, entry: &Entry) -> BoxFuture<'static, Result<Option<RunSummary>, StoreError>> {
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

    /// The entries at positions `from..below` under the query's subject, in stream order.
    async fn entries(&self, from: u64, below: u64) -> Result<Vec<(u64, Entry)>, StoreError> {
        let filter = self
            .store
            .index
            .subject(self.query.principal.as_deref(), self.query.thread_id.as_deref());
        let read = Read {
            filter,
            deliver: Deliver::From(from),
            headers_only: false,
            expires: None,
        };
        let mut reading = self.stream.read(read).await.map_err(|e| self.failed(e))?;
        let mut entries = Vec::new();
        if reading.pending == 0 {
            return Ok(entries);
        }
        while let Some(message) = reading.messages.next().await {
            let message = message.map_err(|e| self.failed(e))?;
            let (position, pending) = (message.sequence, message.pending);
            if position >= below {
                break;
            }
            // An entry that is not one (written by hand) is skipped, not fatal.
            if let Ok(entry) = Entry::decode(message.payload.as_ref()) {
                entries.push((position, entry));
            }
            if pending == 0 {
                break;
            }
        }
        Ok(entries)
    }

    fn failed(&self, e: impl ToString) -> StoreError {
        unavailable("run index read", &self.store.index.stream_name(), e)
    }
}
