//! What the NATS store keeps, read from outside the adapters: the names of its buckets and
//! streams, and decoders of each value. The simulation's checks read the simulated JetStream
//! through these (its history is judged by what the store holds, in the store's own format), and
//! so may an operator's tool.

use crate::domain::ports::StoreError;
use crate::domain::thread::Thread;
use crate::domain::usage::{Tally, Window};
use crate::domain::{NumberedEvent, RunResult};
use shared::jetstream::shards;

/// Where a deployment's NATS store keeps what, for results bucket `bucket` and event stream
/// `events`.
#[derive(Debug, Clone)]
pub struct Names {
    /// Runs' records (and their fences).
    pub runs: String,
    /// Checkpoint objects.
    pub checkpoints: String,
    /// Runs waiting for a person or a task.
    pub approvals: String,
    /// Principals' run slots.
    pub slots: String,
    /// Principals' spend per hour.
    pub usage: String,
    /// Threads.
    pub threads: String,
    /// The event log stream.
    pub events: String,
    /// Shards of the runs' buckets, checkpoints and event log (`runs`, `checkpoints` and
    /// `events` name the first).
    pub shards: usize,
}

impl Names {
    /// The names beside results bucket `bucket`, with event stream `events`.
    pub fn of(bucket: &str, events: &str) -> Self {
        Self {
            runs: bucket.to_owned(),
            checkpoints: format!("{bucket}-checkpoints"),
            approvals: format!("{bucket}-approvals"),
            slots: format!("{bucket}-slots"),
            usage: format!("{bucket}-usage"),
            threads: format!("{bucket}-threads"),
            events: events.to_owned(),
            shards: 1,
        }
    }

    /// The same names over `shards` shards.
    #[must_use]
    pub fn sharded(self, shards: usize) -> Self {
        Self { shards, ..self }
    }

    /// The shard of `run_id`.
    fn shard(&self, run_id: &str) -> usize {
        shards::of_key(&run_key(run_id), self.shards)
    }

    /// The bucket holding `run_id`'s record and fence.
    pub fn runs_of(&self, run_id: &str) -> String {
        shards::name(&self.runs, self.shard(run_id))
    }

    /// The object store holding `run_id`'s checkpoints.
    pub fn checkpoints_of(&self, run_id: &str) -> String {
        format!("{}-checkpoints", self.runs_of(run_id))
    }

    /// The stream holding `run_id`'s events.
    pub fn events_of(&self, run_id: &str) -> String {
        shards::name(&self.events, self.shard(run_id))
    }

    /// Every shard's bucket of runs.
    pub fn every_runs(&self) -> Vec<String> {
        (0..self.shards).map(|s| shards::name(&self.runs, s)).collect()
    }

    /// Every shard's checkpoint store.
    pub fn every_checkpoints(&self) -> Vec<String> {
        self.every_runs().iter().map(|b| format!("{b}-checkpoints")).collect()
    }

    /// Every shard's event stream.
    pub fn every_events(&self) -> Vec<String> {
        (0..self.shards).map(|s| shards::name(&self.events, s)).collect()
    }

    /// Every shard's run index stream.
    pub fn every_index(&self) -> Vec<String> {
        self.every_runs().iter().map(|b| format!("INDEX_{b}")).collect()
    }
}

/// A run's record as stored.
#[derive(Debug, Clone)]
pub struct StoredRun {
    /// The result as a reader reads it.
    pub result: RunResult,
    /// The replica that owns (or owned) it.
    pub owner: String,
    /// The incarnation of that replica holding it (empty: a record from before incarnations).
    pub incarnation: String,
    /// The claim's epoch.
    pub epoch: u64,
    /// Parked for a person or a task.
    pub parked: bool,
    /// The checkpoint object the record names.
    pub checkpoint: String,
}

/// The subject (and key) token of `value` (a principal) in the slot and usage keys.
pub fn token(value: &str) -> String {
    super::kv::token(value)
}

/// The key of run `run_id`'s record in the runs bucket.
pub fn run_key(run_id: &str) -> String {
    super::results::key(run_id)
}

/// The key of thread `thread_id` in the threads bucket.
pub fn thread_key(thread_id: &str) -> String {
    super::results::escaped_key("thread.", thread_id)
}

/// The subject of run `run_id`'s events in event stream `events`.
pub fn log_subject(events: &str, run_id: &str) -> String {
    format!("{events}.{}", run_key(run_id))
}

/// The record under `key` (its value `bytes`).
pub fn run(key: &str, bytes: &[u8]) -> Result<StoredRun, StoreError> {
    let record = super::results::decode_record(key, bytes)?;
    let checkpoint = super::results::CheckpointName::of(&record).name(key);
    Ok(StoredRun {
        owner: record.owner.clone(),
        incarnation: record.incarnation.clone(),
        epoch: record.epoch,
        parked: record.parked,
        checkpoint,
        result: record.read(key)?,
    })
}

/// The events of one event log message.
pub fn log_events(payload: &[u8]) -> Result<Vec<NumberedEvent>, String> {
    super::log::decode_batch(payload)
}

/// The calls of a stored wait a person may still decide (none once it was canceled).
pub fn undecided(bytes: &[u8]) -> Result<Vec<String>, String> {
    super::approvals::undecided(bytes)
}

/// A stored thread.
pub fn thread(bytes: &[u8]) -> Result<Thread, String> {
    serde_json::from_slice(bytes).map_err(|e| e.to_string())
}

/// A stored spend window's total.
pub fn tally(bytes: &[u8]) -> Result<Tally, String> {
    let window: Window = serde_json::from_slice(bytes).map_err(|e| e.to_string())?;
    Ok(window.total)
}

/// The run an index entry names and its admission time (the listing shows an entry only when
/// the run's record holds the same time).
pub fn index_entry(payload: &[u8]) -> Result<(String, u64), String> {
    use prost::Message as _;
    let entry = super::index::entry::Entry::decode(payload).map_err(|e| e.to_string())?;
    Ok((entry.run_id, entry.created_at_ms))
}
