//! A replica's *incarnation*: one lease record per process start (`replica.<name>` in the run
//! store's bucket), renewed every third of the lease by one keeper for every run the process
//! holds. A run's record names the incarnation that holds it, so a quiet run writes nothing to
//! stay held: other replicas judge the incarnation, not the run, and judge it as they judged a
//! run's record before — seen unchanged for a whole lease on their own clock, it has lapsed.
//!
//! The keeper renews by compare-and-set on the revision it wrote last. When a renewal does not
//! land before the lease (less its margin) runs out (one that lands after it is not taken: a run
//! may have stopped acting meanwhile), or another replica removed the record, the
//! process stops acting for every run of that incarnation at once ([`Liveness::reincarnate`])
//! and goes on under a new one: the old incarnation's runs are orphans for every replica, this
//! one included. At a clean stop the record is marked over, so its leftovers move at once.
//!
//! Runs a replica holds in the store but no longer runs (a claim whose answer was lost, a run
//! stopped by a checkpoint the store did not take) would otherwise stay held for as long as the
//! process lives: they are *abandoned*, and the keeper hands each over (its record marked
//! handed over, as at a drain) so that any replica resumes it.

use std::collections::HashSet;
use std::sync::Mutex;
use std::time::Duration;

use prost::Message;
use shared::jetstream::{Bucket, Consistency, Error};

use crate::domain::Liveness;
use crate::domain::ports::StoreError;
use crate::store::unavailable;
use shared::fence::escaped_key;

/// Where incarnation records are kept in the bucket.
pub(super) const PREFIX: &str = "replica.";

/// An incarnation's record.
#[derive(Clone, PartialEq, prost::Message)]
pub(super) struct IncarnationRecord {
    /// The replica (its name, as runs' records give their owner).
    #[prost(string, tag = "1")]
    pub replica: String,
    /// Renewals so far: each one a new revision, which is what other replicas watch.
    #[prost(uint64, tag = "2")]
    pub renewals: u64,
    /// The process stopped holding runs under it (a clean stop, or a lapse it noticed): its runs
    /// are free to take at once.
    #[prost(bool, tag = "3")]
    pub over: bool,
    /// The incarnation's name, as runs' records name it.
    #[prost(string, tag = "4")]
    pub name: String,
}

/// The incarnation the process is in now.
struct Current {
    generation: u64,
    name: String,
    /// The revision of its record this process wrote last (`None`: not created yet).
    revision: Option<u64>,
}

/// See the module docs.
pub(super) struct Incarnation {
    replica: String,
    /// What every incarnation name of this process starts with (the replica and its start).
    stem: String,
    liveness: Liveness,
    current: Mutex<Current>,
    /// Keys of runs to hand over (see the module docs).
    abandoned: Mutex<HashSet<String>>,
}

impl Incarnation {
    /// The process's first incarnation as replica `replica` (not stored yet: see
    /// [`Incarnation::begin`]).
    pub(super) fn new(replica: &str) -> Self {
        let stem = format!("{replica}~{:x}", shared::sync::unix_ms());
        Self {
            replica: replica.to_owned(),
            current: Mutex::new(Current {
                generation: 1,
                name: stem.clone(),
                revision: None,
            }),
            stem,
            liveness: Liveness::new(tokio::time::Instant::now()),
            abandoned: Mutex::default(),
        }
    }

    /// The lease every run held here reads.
    pub(super) fn liveness(&self) -> Liveness {
        self.liveness.clone()
    }

    /// The current incarnation's name and generation.
    pub(super) fn name(&self) -> (String, u64) {
        let current = shared::sync::lock(&self.current);
        (current.name.clone(), current.generation)
    }

    /// Whether the current incarnation's record is in the store (runs claimed under one that is
    /// not could not be found by the other replicas).
    pub(super) fn stored(&self) -> bool {
        shared::sync::lock(&self.current).revision.is_some()
    }

    /// Whether `name` is one of this process's incarnations (any generation).
    pub(super) fn is_mine(&self, name: &str) -> bool {
        name.strip_prefix(self.stem.as_str())
            .is_some_and(|rest| rest.is_empty() || rest.starts_with('.'))
    }

    /// Remembers that the run under `key` may be held here while nothing runs it.
    pub(super) fn abandon(&self, key: &str) {
        shared::sync::lock(&self.abandoned).insert(key.to_owned());
    }

    /// The runs abandoned since the last call (see [`Incarnation::abandon`]).
    pub(super) fn take_abandoned(&self) -> Vec<String> {
        shared::sync::lock(&self.abandoned).drain().collect()
    }

    /// Creates the current incarnation's record (before any run is claimed under it).
    pub(super) async fn begin(&self, kv: &dyn Bucket) -> Result<(), StoreError> {
        let (name, generation) = self.name();
        let sent = tokio::time::Instant::now();
        let record = IncarnationRecord {
            replica: self.replica.clone(),
            renewals: 0,
            over: false,
            name: name.clone(),
        };
        let key = key_of(&name);
        let (revision, confirmed) = match kv.create(&key, record.encode_to_vec().into()).await {
            Ok(revision) => (revision, true),
            // An earlier create landed with its answer lost: its revision is taken as the last
            // one (the lease runs from the next renewal, whose send is known).
            Err(Error::Exists) => (self.landed(kv, &key, &name).await?, false),
            Err(e) => return Err(unavailable("KV create", &key, e)),
        };
        let mut current = shared::sync::lock(&self.current);
        if current.generation == generation {
            current.revision = Some(revision);
            if confirmed {
                self.liveness.confirmed(generation, sent);
            }
        }
        Ok(())
    }

    /// The revision of incarnation `name`'s record under `key`, created by this process (not
    /// over); refused otherwise.
    async fn landed(&self, kv: &dyn Bucket, key: &str, name: &str) -> Result<u64, StoreError> {
        let entry = kv.entry(key, Consistency::Leader).await;
        match entry.map_err(|e| unavailable("KV entry", key, e))? {
            Some(entry) => {
                let record = decode(key, &entry.value)?;
                match record.name == name && !record.over {
                    true => Ok(entry.revision),
                    false => Err(unavailable("KV create", key, "the incarnation is over")),
                }
            }
            None => Err(unavailable("KV create", key, "created, then gone")),
        }
    }

    /// Brings the incarnation up to hold runs now, for a claim that finds it cannot: a lapsed
    /// one ends and the next begins, one not stored yet is stored. The keeper does the same at
    /// its next tick; a process resumed from a pause is asked for runs before that.
    pub(super) async fn come_up(&self, kv: &dyn Bucket, acting: Duration) -> Result<(), StoreError> {
        let (name, generation) = self.name();
        if tokio::time::Instant::now() >= self.liveness.acts_until(generation, acting) {
            self.reincarnate(kv, &name, generation).await;
        }
        match self.stored() {
            true => Ok(()),
            false => self.begin(kv).await,
        }
    }

    /// One renewal of the current incarnation (its creation, when that has not landed yet); a
    /// lease run out, or a record another replica removed, starts the next incarnation.
    pub(super) async fn renew(&self, kv: &dyn Bucket, acting: Duration) {
        let (name, generation, revision) = {
            let current = shared::sync::lock(&self.current);
            (current.name.clone(), current.generation, current.revision)
        };
        if tokio::time::Instant::now() >= self.liveness.acts_until(generation, acting) {
            return self.reincarnate(kv, &name, generation).await;
        }
        let Some(revision) = revision else {
            if let Err(e) = self.begin(kv).await {
                tracing::warn!(incarnation = %name, "storing the replica's incarnation failed: {e}");
            }
            return;
        };
        let sent = tokio::time::Instant::now();
        let record = IncarnationRecord {
            replica: self.replica.clone(),
            renewals: revision,
            over: false,
            name: name.clone(),
        };
        match kv.update(&key_of(&name), record.encode_to_vec().into(), revision).await {
            Ok(revision) => {
                let in_time = {
                    let mut current = shared::sync::lock(&self.current);
                    if current.generation != generation {
                        return;
                    }
                    current.revision = Some(revision);
                    self.liveness.confirmed_in_time(generation, sent, acting)
                };
                if !in_time {
                    // The lease ran out while the renewal was on its way: runs under it may have
                    // stopped meanwhile, and they must not stay held by a live incarnation.
                    self.reincarnate(kv, &name, generation).await;
                }
            }
            Err(Error::WrongRevision) => {
                tracing::warn!(incarnation = %name, "the replica's incarnation was ended by another replica; its runs are theirs now");
                self.reincarnate(kv, &name, generation).await;
            }
            Err(e) => tracing::warn!(incarnation = %name, "renewing the replica's incarnation failed: {e}"),
        }
    }

    /// Ends incarnation `name` (of `generation`): every run under it stops here, its record is
    /// marked over when the store takes it, and the process goes on under the next one.
    async fn reincarnate(&self, kv: &dyn Bucket, name: &str, generation: u64) {
        {
            let mut current = shared::sync::lock(&self.current);
            if current.generation != generation {
                return;
            }
            let next = self.liveness.reincarnate(tokio::time::Instant::now());
            *current = Current {
                generation: next,
                name: format!("{}.{next}", self.stem),
                revision: None,
            };
        }
        tracing::warn!(incarnation = %name, "the replica's incarnation lapsed: it stops acting for every run it held, which any replica now takes over");
        let _ = self.mark_over(kv, name).await;
        if let Err(e) = self.begin(kv).await {
            tracing::warn!("storing the replica's next incarnation failed (tried again at the next renewal): {e}");
        }
    }

    /// Marks incarnation `name`'s record over (its runs move at once).
    async fn mark_over(&self, kv: &dyn Bucket, name: &str) -> Result<(), StoreError> {
        let key = key_of(name);
        let record = IncarnationRecord {
            replica: self.replica.clone(),
            renewals: 0,
            over: true,
            name: name.to_owned(),
        };
        kv.put(&key, record.encode_to_vec().into())
            .await
            .map(|_| ())
            .map_err(|e| unavailable("KV put", &key, e))
    }

    /// Ends the current incarnation at a clean stop: every run under it stops here, then its
    /// record is marked over (what it held moves at once).
    pub(super) async fn retire(&self, kv: &dyn Bucket) {
        let name = {
            let mut current = shared::sync::lock(&self.current);
            // Every run under it stops before its record says over (a renewal in flight finds
            // the generation ended and leaves it so).
            let next = self.liveness.reincarnate(tokio::time::Instant::now());
            let name = std::mem::replace(&mut current.name, format!("{}.{next}", self.stem));
            current.generation = next;
            current.revision = None;
            name
        };
        if let Err(e) = self.mark_over(kv, &name).await {
            tracing::warn!(incarnation = %name, "marking the replica's incarnation over failed (it lapses instead): {e}");
        }
    }
}

/// The key of incarnation `name`'s record.
pub(super) fn key_of(name: &str) -> String {
    escaped_key(PREFIX, name)
}

/// An incarnation's record as stored under `key`.
pub(super) fn decode(key: &str, bytes: &[u8]) -> Result<IncarnationRecord, StoreError> {
    IncarnationRecord::decode(bytes).map_err(|e| StoreError::Corrupt {
        key: key.to_owned(),
        reason: e.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::Incarnation;

    #[test]
    fn a_process_knows_its_incarnations_and_only_those() {
        let incarnation = Incarnation::new("orch-0");
        let (name, generation) = incarnation.name();
        assert_eq!(generation, 1);
        assert!(incarnation.is_mine(&name));
        assert!(incarnation.is_mine(&format!("{name}.2")));
        assert!(!incarnation.is_mine(&format!("{name}0")));
        assert!(!incarnation.is_mine("orch-0"));
        assert!(!incarnation.is_mine(""));
    }
}
