//! The shared store as the NATS adapters use it, with the write semantics they rely on: one
//! revision sequence for every key (a JetStream stream's), create-if-absent, compare-and-set on
//! the revision, a run's event log appended only after the subject's expected last position,
//! checkpoint objects named by epoch, and the run's fence raised, never lowered. Every operation
//! is atomic where the store applies it; what the network does to requests and answers (delay,
//! loss, an answer after the caller's timeout) is the world's.

use std::collections::BTreeMap;

use orchestrator::domain::RunStatus;
use orchestrator::domain::thread::{Begin, BusyPolicy, Thread, ThreadLimits, ThreadRun};

/// A key's revision (the stream sequence of its last write).
pub type Rev = u64;

/// Whether a run's record says it runs or ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    /// It runs (or is being taken over).
    Running,
    /// Its end is stored.
    Ended,
}

/// A run's record: who acts for it, in which epoch, and which checkpoint holds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    /// The owning replica's name (replica and incarnation).
    pub owner: String,
    /// The claim's number: one more at each takeover.
    pub epoch: u64,
    /// Whether it runs.
    pub status: Status,
    /// The epoch whose checkpoint object is the run's last.
    pub checkpoint_epoch: u64,
    /// Turns the run has ended (of its final result, once ended).
    pub turns: u32,
}

/// One event of a run's log, numbered by the run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Entry {
    /// Its number in the run's stream.
    pub seq: u64,
    /// What it says.
    pub kind: Kind,
}

/// What an event says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// The call of this turn finished.
    ToolFinished(u32),
    /// This turn ended.
    TurnEnded(u32),
    /// The run ended after this many turns.
    RunFinished(u32),
}

/// A run's checkpoint: how far it got, what it numbered, and the events numbered but perhaps
/// not logged (its outbox), which the next owner logs first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Checkpoint {
    /// Turns ended.
    pub turns: u32,
    /// The next turn's call was sent (it may be running): a resumed run sends it again.
    pub call_in_flight: bool,
    /// The last seq numbered.
    pub seq: u64,
    /// Events numbered but perhaps not logged.
    pub outbox: Vec<Entry>,
}

/// An operation on the store, as one request.
#[derive(Debug, Clone)]
pub enum Op {
    /// Puts the checkpoint object of an epoch (objects are overwritten, never fenced).
    PutCheckpoint(u64, Checkpoint),
    /// Reads the checkpoint object of an epoch.
    GetCheckpoint(u64),
    /// Create-if-absent.
    CreateRecord(Record),
    /// Compare-and-set on the revision.
    UpdateRecord(Record, Rev),
    /// Every record with its revision (the takeover's look for orphans).
    ListRecords,
    /// Raises the run's fence to an epoch, never lowering it.
    RaiseFence(u64),
    /// The run's fence (0: none).
    ReadFence,
    /// Appends after the subject's last position, which must be this one (0: none).
    Append(Vec<Entry>, u64),
    /// The log's last event and its position.
    LogLast,
    /// The run takes its thread (refused while another holds it).
    ThreadBegin(String),
    /// The run joins its thread (once) and lets it go.
    ThreadEnd(String, RunStatus),
}

/// The store's answer.
#[derive(Debug, Clone)]
pub enum Reply {
    /// Done.
    Done,
    /// The checkpoint asked for, if there is one.
    Checkpoint(Option<Checkpoint>),
    /// A write's new revision, or `None`: refused (the key exists, or moved on).
    Written(Option<Rev>),
    /// The records, each with its run and revision.
    Records(Vec<(String, Record, Rev)>),
    /// The fence's epoch.
    Fence(u64),
    /// The log's new last position, or `None`: it was not at the expected one.
    Appended(Option<u64>),
    /// The log's last event and its position.
    Last(Option<(Entry, u64)>),
    /// Whether the run holds its thread now.
    Began(bool),
}

/// See the module docs.
#[derive(Default)]
pub struct Store {
    rev: Rev,
    /// Each run's record and its revision.
    pub records: BTreeMap<String, (Record, Rev)>,
    /// Each run's fence.
    pub fences: BTreeMap<String, u64>,
    /// The threads, as the services' domain keeps them.
    pub threads: BTreeMap<String, Thread>,
    checkpoints: BTreeMap<(String, u64), Checkpoint>,
    /// Each run's events with their stream positions.
    pub logs: BTreeMap<String, Vec<(Entry, u64)>>,
}

/// Threads keep every run here: the simulation checks membership, not bounds.
const LIMITS: ThreadLimits = ThreadLimits {
    max_runs: usize::MAX,
    max_bytes: usize::MAX,
    max_queue: 16,
};

impl Store {
    fn next(&mut self) -> Rev {
        self.rev += 1;
        self.rev
    }

    /// Applies `op` of run `run` (its thread `thread`) at time `now`.
    pub fn apply(&mut self, run: &str, thread: &str, op: Op, now: u64) -> Reply {
        match op {
            Op::PutCheckpoint(epoch, checkpoint) => {
                self.checkpoints.insert((run.to_owned(), epoch), checkpoint);
                Reply::Done
            }
            Op::GetCheckpoint(epoch) => Reply::Checkpoint(self.checkpoints.get(&(run.to_owned(), epoch)).cloned()),
            Op::CreateRecord(record) => {
                if self.records.contains_key(run) {
                    return Reply::Written(None);
                }
                let rev = self.next();
                self.records.insert(run.to_owned(), (record, rev));
                Reply::Written(Some(rev))
            }
            Op::UpdateRecord(record, expected) => match self.records.get(run) {
                Some((_, rev)) if *rev == expected => {
                    let rev = self.next();
                    self.records.insert(run.to_owned(), (record, rev));
                    Reply::Written(Some(rev))
                }
                _ => Reply::Written(None),
            },
            Op::ListRecords => Reply::Records(
                self.records
                    .iter()
                    .map(|(run, (record, rev))| (run.clone(), record.clone(), *rev))
                    .collect(),
            ),
            Op::RaiseFence(epoch) => {
                let fence = self.fences.entry(run.to_owned()).or_default();
                *fence = (*fence).max(epoch);
                Reply::Done
            }
            Op::ReadFence => Reply::Fence(self.fences.get(run).copied().unwrap_or(0)),
            Op::Append(entries, expected) => self.append(run, entries, expected),
            Op::LogLast => Reply::Last(self.logs.get(run).and_then(|log| log.last().copied())),
            Op::ThreadBegin(run_id) => {
                let thread = self.thread(thread, now);
                let began = thread.begin(&run_id, BusyPolicy::Reject, (now, u64::MAX), &LIMITS);
                Reply::Began(matches!(began, Begin::Started | Begin::Holding))
            }
            Op::ThreadEnd(run_id, status) => {
                let run = ThreadRun {
                    run_id,
                    status,
                    messages: Vec::new(),
                    ended_at_unix_ms: now,
                };
                self.thread(thread, now).end(run, &LIMITS);
                Reply::Done
            }
        }
    }

    fn thread(&mut self, thread: &str, now: u64) -> &mut Thread {
        self.threads
            .entry(thread.to_owned())
            .or_insert_with(|| Thread::new(thread, "", now))
    }

    /// The log's expected-last-position check, then the entries, each at a new position.
    fn append(&mut self, run: &str, entries: Vec<Entry>, expected: u64) -> Reply {
        let last = self
            .logs
            .get(run)
            .and_then(|log| log.last())
            .map_or(0, |(_, position)| *position);
        if last != expected {
            return Reply::Appended(None);
        }
        let mut position = last;
        for entry in entries {
            position = self.next();
            self.logs.entry(run.to_owned()).or_default().push((entry, position));
        }
        Reply::Appended(Some(position))
    }

    /// Whether the run's log holds its end.
    pub fn logged_end(&self, run: &str) -> bool {
        self.logs
            .get(run)
            .is_some_and(|log| log.iter().any(|(e, _)| matches!(e.kind, Kind::RunFinished(_))))
    }

    /// Whether the run's record says it ended.
    pub fn stored_end(&self, run: &str) -> bool {
        self.records.get(run).is_some_and(|(r, _)| r.status == Status::Ended)
    }
}
