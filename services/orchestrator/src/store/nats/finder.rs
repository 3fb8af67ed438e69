//! Finding orphans by looking at incarnations, not at runs: one look reads the incarnation
//! records (one per replica process), lists the runs of those that lapsed or are over from the
//! owner index, and the parked runs due since the last look from the wake index (`owners.rs`).
//! Its cost grows with the replicas and with the runs that moved, not with the runs that exist.
//!
//! Each orphan goes first to the live incarnation its id ranks highest (rendezvous hashing, as
//! the model fleet spreads runs): the others leave it for one look, then take it too, so the
//! runs of a replica that died spread over the survivors and none waits on one that is full.
//!
//! Records from before incarnations name none: they are found by the checkpoint scan they were
//! always found by, started at a replica's first look and again for as long as any such record
//! is held. It reads every run, so it runs beside the looks, never within one: a look's budget
//! is one store timeout, which a scan of many runs outlasts.

use std::collections::HashSet;

use futures::StreamExt;
use shared::jetstream::{Consistency, Operation};

use super::incarnation::{self, PREFIX};
use super::owners::{self, MINUTE_MS};
use super::results::{Record, Sightings, holder_from};
use crate::domain::ports::StoreError;
use crate::domain::rendezvous;
use crate::store::unavailable;
use futures::future::BoxFuture;

/// Records read at once while looking.
const READ_AT_ONCE: usize = 16;
/// Runs of one gone incarnation read in one look, this replica's share first: a look fits in
/// one store timeout however many runs the incarnation held (the next look reads on, the runs
/// claimed meanwhile gone from its index).
const READ_PER_LOOK: usize = 512;
/// Leases a gone incarnation with no run left is kept before its record is removed (a claim of
/// its sent just before it lapsed lands well within them).
const FORGET_AFTER_LEASES: u32 = 3;

/// One look's view of the store.
pub(super) struct Look {
    pub(super) kv: std::sync::Arc<dyn shared::jetstream::Bucket>,
    pub(super) seen: Sightings,
    pub(super) finder: std::sync::Arc<owners::Finder>,
}

/// The incarnations a look found: the live ones' names, and the lapsed or over ones'.
struct Incarnations {
    live: Vec<String>,
    gone: Vec<(String, u64)>,
}

impl Look {
    /// One look for orphans: the run ids this replica may take over now (see the module docs);
    /// `legacy` scans the records from before incarnations.
    pub(super) async fn find_orphans(
        &self,
        legacy: BoxFuture<'static, Result<(Vec<String>, bool), StoreError>>,
    ) -> Result<Vec<String>, StoreError> {
        let incarnations = self.incarnations().await?;
        let mut found: Vec<String> = Vec::new();
        for (name, revision) in &incarnations.gone {
            found.extend(self.runs_of_gone(name, *revision, &incarnations.live).await?);
        }
        found.extend(self.wakes_due().await?);
        found.extend(self.legacy_found(legacy));
        found.sort_unstable();
        found.dedup();
        tracing::debug!(live = ?incarnations.live, gone = ?incarnations.gone, ?found, "looked for orphans");
        Ok(self.fair_share(found, &incarnations.live))
    }

    /// What the scan for records from before incarnations found since the last look; it is
    /// started (with `legacy`) when due, in the background, and never waited for.
    fn legacy_found(&self, legacy: BoxFuture<'static, Result<(Vec<String>, bool), StoreError>>) -> Vec<String> {
        use owners::LegacyScan;
        let mut state = shared::sync::lock(&self.finder.state);
        match std::mem::take(&mut state.legacy) {
            LegacyScan::Due => {
                state.legacy = LegacyScan::Running;
                let finder = std::sync::Arc::clone(&self.finder);
                shared::tasks::spawn(async move {
                    let scanned = legacy.await;
                    let mut state = shared::sync::lock(&finder.state);
                    state.legacy = match scanned {
                        Ok((orphans, held)) => LegacyScan::Found(orphans, held),
                        Err(e) => {
                            tracing::warn!(
                                "scanning for runs from before incarnations failed (again at the next look): {e}"
                            );
                            LegacyScan::Due
                        }
                    };
                });
                Vec::new()
            }
            LegacyScan::Found(orphans, held) => {
                state.legacy = if held { LegacyScan::Due } else { LegacyScan::Done };
                orphans
            }
            other => {
                state.legacy = other;
                Vec::new()
            }
        }
    }

    /// Every incarnation record: live, or lapsed (seen unchanged for a lease) or over.
    async fn incarnations(&self) -> Result<Incarnations, StoreError> {
        let keys = self.kv.keys(&format!("{PREFIX}>")).await;
        let keys = keys.map_err(|e| unavailable("KV keys", PREFIX, e))?;
        let (mine, _) = self.seen.incarnation.name();
        let mut found = Incarnations {
            live: vec![mine.clone()],
            gone: Vec::new(),
        };
        let mut seen = HashSet::new();
        for key in keys {
            // From the leader: a lagging copy would show an old revision standing still while
            // its replica renews it.
            let entry = self.kv.entry(&key, Consistency::Leader).await;
            let Some(entry) = entry.map_err(|e| unavailable("KV entry", &key, e))? else {
                continue;
            };
            if entry.operation != Operation::Put {
                continue;
            }
            let record = incarnation::decode(&key, &entry.value)?;
            let name = record.name.clone();
            seen.insert(key.clone());
            if name == mine {
                continue;
            }
            // Seen first, so the time it has been gone counts from this look on.
            let lapsed = self.seen.lapsed(&key, entry.revision);
            match record.over || lapsed {
                true => found.gone.push((name, entry.revision)),
                false => found.live.push(name),
            }
        }
        self.seen.keep_prefixed(PREFIX, &seen);
        Ok(found)
    }

    /// The runs of the gone incarnation `name` (its record at `revision`) that may be taken
    /// over, at most [`READ_PER_LOOK`] of them, those the `live` incarnations leave to this
    /// replica first; entries whose run is not its any more are removed, and the incarnation's
    /// record too once it holds none.
    async fn runs_of_gone(&self, name: &str, revision: u64, live: &[String]) -> Result<Vec<String>, StoreError> {
        let filter = owners::owner_filter(name);
        let entries = self.kv.keys(&filter).await;
        let mut entries = entries.map_err(|e| unavailable("KV keys", &filter, e))?;
        let (mine, _) = self.seen.incarnation.name();
        entries.sort_by_cached_key(|entry| {
            let key = owners::record_key_of(entry).unwrap_or_default();
            first_of(&key, live, &mine) != mine
        });
        entries.truncate(READ_PER_LOOK);
        tracing::debug!(incarnation = name, ?entries, "runs of a gone incarnation");
        // Gone long enough that no claim of its can still be on its way.
        let key = incarnation::key_of(name);
        let settled = self.seen.unchanged_for(&key, revision) >= self.seen.lease * FORGET_AFTER_LEASES;
        if entries.is_empty() {
            // Nothing left under it: its record goes (only as read: a renewal since keeps it).
            if settled {
                let _ = self.kv.delete(&key, Some(revision)).await;
            }
            return Ok(Vec::new());
        }
        let kv = self.kv.clone();
        let orphans = futures::stream::iter(entries)
            .map(|entry| {
                let kv = kv.clone();
                async move {
                    let key = owners::record_key_of(&entry)?;
                    let epoch = owners::entry_epoch(&kv.get(&entry).await.ok()??);
                    match holder_from(kv.as_ref(), &key, Consistency::Leader).await.ok()? {
                        Some((record, _)) if record.incarnation == name && record.held() => {
                            return record.resumable().then(|| run_id(&record)).flatten();
                        }
                        // Its claim in that epoch may still land.
                        Some((record, _)) if record.epoch < epoch && !settled => return None,
                        None if !settled => return None,
                        _ => {}
                    }
                    owners::leave(kv.as_ref(), &entry).await;
                    None
                }
            })
            .buffer_unordered(READ_AT_ONCE)
            .filter_map(std::future::ready)
            .collect()
            .await;
        Ok(orphans)
    }

    /// The parked runs due (ready, or their wake time passed) among those entered under the
    /// minutes since the last look (every one at the first look).
    async fn wakes_due(&self) -> Result<Vec<String>, StoreError> {
        let now = shared::sync::unix_ms();
        let this_minute = now / MINUTE_MS;
        let from = shared::sync::lock(&self.finder.state).wake_from;
        let filters: Vec<String> = match from {
            None => vec!["wake.>".to_owned()],
            // The minute before too: an entry written just as the minute turned.
            Some(from) => (from.saturating_sub(1)..=this_minute)
                .map(owners::wake_filter)
                .collect(),
        };
        let mut entries = Vec::new();
        for filter in filters {
            let keys = self.kv.keys(&filter).await;
            entries.extend(keys.map_err(|e| unavailable("KV keys", &filter, e))?);
        }
        self.seen.keep_prefixed("wake.", &entries.iter().cloned().collect());
        let due = futures::stream::iter(entries)
            .map(|entry| self.wake_entry(entry, now))
            .buffer_unordered(READ_AT_ONCE)
            .filter_map(std::future::ready)
            .collect()
            .await;
        shared::sync::lock(&self.finder.state).wake_from = Some(this_minute);
        Ok(due)
    }

    /// The run of wake entry `entry` if it is due now; an entry whose run is not parked any
    /// more is removed, one whose run wakes later is moved to its minute. An entry is removed
    /// only at the revision read (one written again since stays).
    async fn wake_entry(&self, entry: String, now: u64) -> Option<String> {
        let key = owners::record_key_of(&entry)?;
        // From the leader, as every read that may remove an entry: a lagging copy's older
        // record (or older entry) would have it removed while its run needs it.
        let written = self.kv.entry(&entry, Consistency::Leader).await.ok()??.revision;
        let record = holder_from(self.kv.as_ref(), &key, Consistency::Leader).await.ok()?;
        let Some((record, _)) = record.filter(|(r, _)| r.parked || (r.held() && r.handed_over)) else {
            // Not parked or handed over (any more, or not yet: the entry goes first): removed
            // once it has stood so for long enough that none can still be on its way.
            if self.stale(&entry, written) {
                owners::leave_at(self.kv.as_ref(), &entry, written).await;
            }
            return None;
        };
        // Due: handed over, or parked and ready or past its wake time (a lapse is the owner
        // index's to find, not a wake entry's).
        if record.orphaned(now, false) {
            // It stays listed (moved to this minute) until a replica takes it.
            self.move_entry(&entry, written, owners::wake_key(now, &key)).await;
            return run_id(&record);
        }
        if record.parked {
            self.move_entry(&entry, written, owners::wake_key(record.wake_at_unix_ms, &key))
                .await;
        }
        None
    }

    /// Whether index entry `entry`, at `revision`, has stood so, as this replica saw it, for
    /// [`FORGET_AFTER_LEASES`] leases.
    fn stale(&self, entry: &str, revision: u64) -> bool {
        self.seen.lapsed(entry, revision);
        self.seen.unchanged_for(entry, revision) >= self.seen.lease * FORGET_AFTER_LEASES
    }

    /// Moves wake entry `entry` (at `revision`) to `to` (nothing when it is there already).
    async fn move_entry(&self, entry: &str, revision: u64, to: String) {
        if to != entry && owners::enter(self.kv.as_ref(), &to).await.is_ok() {
            owners::leave_at(self.kv.as_ref(), entry, revision).await;
        }
    }

    /// `found`, less those another live incarnation ranks first and that were not left to it
    /// at the last look already.
    fn fair_share(&self, found: Vec<String>, live: &[String]) -> Vec<String> {
        let (mine, _) = self.seen.incarnation.name();
        let mut state = shared::sync::lock(&self.finder.state);
        let deferred = std::mem::take(&mut state.deferred);
        let mut mine_now = Vec::with_capacity(found.len());
        for run_id in found {
            let first = first_of(&super::results::key(&run_id), live, &mine);
            if first == mine || deferred.contains(&run_id) {
                mine_now.push(run_id);
            } else {
                state.deferred.insert(run_id);
            }
        }
        mine_now
    }
}

/// The live incarnation that ranks first for the run whose record is under `key` (rendezvous
/// hashing; `mine` when none is known).
fn first_of<'a>(key: &str, live: &'a [String], mine: &'a str) -> &'a str {
    live.iter()
        .max_by(|a, b| {
            let (wa, wb) = (rendezvous::weight(key, a), rendezvous::weight(key, b));
            wa.cmp(&wb).then_with(|| b.cmp(a))
        })
        .map_or(mine, String::as_str)
}

/// The id of the run `record` holds (its key holds it escaped).
fn run_id(record: &Record) -> Option<String> {
    record.result.as_ref().map(|result| result.run_id.clone())
}
