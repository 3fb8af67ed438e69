//! A walk down every shard of the index at once, newest first ([`Lanes`]): each shard's entries
//! are read down from its end (or the cursor's position in it) in windows that double, and the
//! walk takes, of the shards' next entries, the one admitted last. Each shard's own order is
//! kept, so a cursor of one position per shard continues exactly where a page stopped, however
//! the replicas' clocks ordered the admission times.

use std::collections::VecDeque;
use std::sync::Arc;

use futures::StreamExt as _;
use prost::Message as _;
use shared::jetstream::shards::ShardStream;
use shared::jetstream::{Deliver, Read, Stream};

use super::entry::{Entry, subject};
use crate::domain::listing::RunQuery;
use crate::domain::ports::StoreError;
use crate::store::unavailable;

/// An entry the walk took: its shard, its position there, and the entry.
pub(super) type Taken = (usize, u64, Entry);

/// What the walk found next.
pub(super) enum Next {
    /// The newest entry not taken yet that may match the query.
    Entry(Taken),
    /// Every shard was walked to its start.
    Done,
    /// The positions the walk may read (`--list-scan-max`) were read first.
    OutOfScan,
}

/// One shard's part of the walk.
struct Lane {
    stream: Arc<dyn Stream>,
    name: String,
    /// The query's subject in this shard (its principal and thread, or any).
    filter: String,
    /// The shard's first position.
    first: u64,
    /// The lowest position read: the walk has read every position from here up to where it began.
    frontier: u64,
    /// Entries read that may match the query, not taken yet, highest position first.
    fetched: VecDeque<(u64, Entry)>,
    /// Positions the next read covers, at most.
    window: u64,
}

/// See the module docs.
pub(super) struct Lanes {
    lanes: Vec<Lane>,
    /// Positions read so far, over every shard.
    walked: u64,
    scan_max: u64,
}

impl Lanes {
    /// The walk of `shards` for `query`: each shard read below its position in `below` (a
    /// cursor's; `None`: from the shard's end; a shard it does not name has nothing below), its
    /// first read `window` positions long, all of them reading at most `scan_max` positions.
    pub(super) async fn open(
        shards: &[ShardStream],
        query: &RunQuery,
        below: Option<&[u64]>,
        window: u64,
        scan_max: u64,
    ) -> Result<Self, StoreError> {
        let spans = shards.iter().enumerate().map(|(n, shard)| async move {
            let state = shard.stream.state().await.map_err(|e| failed(&shard.name, e))?;
            let end = state.last_sequence.saturating_add(1);
            let frontier = below.map_or(end, |below| below.get(n).copied().unwrap_or(0).min(end));
            Ok::<_, StoreError>(Lane {
                stream: Arc::clone(&shard.stream),
                name: shard.name.clone(),
                filter: subject(shard, query.principal.as_deref(), query.thread_id.as_deref()),
                first: state.first_sequence.max(1),
                frontier,
                fetched: VecDeque::new(),
                window: window.max(1),
            })
        });
        let lanes = futures::future::try_join_all(spans).await?;
        Ok(Self {
            lanes,
            walked: 0,
            scan_max: scan_max.max(1),
        })
    }

    /// The newest entry not taken yet, of those that `query` admits (by admission time and
    /// labels): every shard with nothing read left is read further first, so the choice sees
    /// each shard's next entry.
    pub(super) async fn next(&mut self, query: &RunQuery) -> Result<Next, StoreError> {
        loop {
            let needing = self.lanes.iter().filter(|l| l.needs_reading()).count();
            if needing == 0 {
                break;
            }
            let Some(left) = self.scan_max.checked_sub(self.walked).filter(|left| *left > 0) else {
                return Ok(Next::OutOfScan);
            };
            let share = (left / needing as u64).max(1);
            let reads = self
                .lanes
                .iter_mut()
                .filter(|l| l.needs_reading())
                .map(|l| l.read(share, query));
            self.walked += futures::future::try_join_all(reads).await?.iter().sum::<u64>();
        }
        let newest = self
            .lanes
            .iter()
            .enumerate()
            .filter_map(|(n, lane)| lane.fetched.front().map(|(_, e)| (n, (e.created_at_ms, &e.run_id))))
            .max_by(|a, b| a.1.cmp(&b.1))
            .map(|(n, _)| n);
        Ok(
            match newest.and_then(|n| Some((n, self.lanes[n].fetched.pop_front()?))) {
                Some((n, (position, entry))) => Next::Entry((n, position, entry)),
                None => Next::Done,
            },
        )
    }

    /// Where a next page continues, with `untaken` (entries taken but not shown, in the order
    /// taken) put back: in each shard, just above its highest entry not shown, or where the walk
    /// stopped reading it. `None` when every shard was walked to its start.
    pub(super) fn cursor(&self, untaken: &[Taken]) -> Option<Vec<u64>> {
        let below: Vec<u64> = self
            .lanes
            .iter()
            .enumerate()
            .map(|(n, lane)| {
                let put_back = untaken.iter().find(|(shard, _, _)| *shard == n).map(|(_, p, _)| *p);
                put_back
                    .or_else(|| lane.fetched.front().map(|(p, _)| *p))
                    .map_or(lane.frontier, |p| p + 1)
            })
            .collect();
        let more = self.lanes.iter().zip(&below).any(|(lane, below)| *below > lane.first);
        more.then_some(below)
    }
}

impl Lane {
    /// Whether the walk must read this shard further before it may choose.
    fn needs_reading(&self) -> bool {
        self.fetched.is_empty() && self.frontier > self.first
    }

    /// Reads the next window down (at most `most` positions), keeping the entries `query`
    /// admits; the positions read.
    async fn read(&mut self, most: u64, query: &RunQuery) -> Result<u64, StoreError> {
        let below = self.frontier;
        let from = below.saturating_sub(self.window.min(most)).max(self.first);
        let mut entries = self.entries(from, below).await?;
        entries.retain(|(_, e)| query.admits(e.created_at_ms, &e.labels));
        self.fetched.extend(entries.into_iter().rev());
        self.frontier = from;
        self.window = self.window.saturating_mul(2);
        Ok(below - from)
    }

    /// The entries at positions `from..below` under the lane's subject, in stream order.
    async fn entries(&self, from: u64, below: u64) -> Result<Vec<(u64, Entry)>, StoreError> {
        let read = Read {
            filter: self.filter.clone(),
            deliver: Deliver::From(from),
            headers_only: false,
            expires: None,
        };
        let mut reading = self.stream.read(read).await.map_err(|e| failed(&self.name, e))?;
        let mut entries = Vec::new();
        if reading.pending == 0 {
            return Ok(entries);
        }
        while let Some(message) = reading.messages.next().await {
            let message = message.map_err(|e| failed(&self.name, e))?;
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
}

fn failed(stream: &str, e: impl ToString) -> StoreError {
    unavailable("run index read", stream, e)
}
