//! What a history must satisfy, checked once a seed's fleet is quiet: the invariants of the run
//! fencing protocol, each with the evidence when it breaks.

use std::collections::BTreeMap;

use crate::store::{Kind, Status, Store};

/// A tool call starting on a runner: what the tools see.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Start {
    /// When (virtual ms).
    pub at: u64,
    /// Of which run.
    pub run: String,
    /// The call id (its turn: a call keeps its id across takeovers).
    pub call: u32,
    /// The sender's claim.
    pub epoch: u64,
    /// Where it ran.
    pub runner: usize,
}

/// A reader's look at a run (GetRun, a retried Orchestrate, an attach), and what was kept then.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Read {
    /// When (virtual ms).
    pub at: u64,
    /// Which run.
    pub run: String,
    /// It read as ended.
    pub saw_end: bool,
    /// The log held `run_finished` then.
    pub logged: bool,
    /// The store held the end then.
    pub stored: bool,
}

/// What a seed's fleet did that the invariants look at.
#[derive(Debug, Default)]
pub struct History {
    /// Every tool call start, in the order the tools saw them.
    pub starts: Vec<Start>,
    /// Every read.
    pub reads: Vec<Read>,
    /// The runs admitted, with their threads.
    pub admitted: BTreeMap<String, String>,
}

/// Every invariant `history` and the store break, each as a sentence with its evidence.
pub fn violations(history: &History, store: &Store, turns: u32) -> Vec<String> {
    let mut found = Vec::new();
    epochs_never_go_down(history, &mut found);
    a_call_runs_once_per_epoch(history, &mut found);
    for run in history.admitted.keys() {
        the_log_is_whole(store, run, turns, &mut found);
        the_run_ended_once(store, run, turns, &mut found);
    }
    no_end_is_seen_before_it_is_kept(history, &mut found);
    threads_hold_their_runs_once(history, store, &mut found);
    found
}

/// The calls of a run start in non-decreasing epoch order as the tools see them: no replaced
/// owner runs anything after the new owner's first call.
fn epochs_never_go_down(history: &History, found: &mut Vec<String>) {
    let mut newest: BTreeMap<&str, &Start> = BTreeMap::new();
    for start in &history.starts {
        match newest.get(start.run.as_str()) {
            Some(before) if before.epoch > start.epoch => found.push(format!(
                "run {}: call {} of epoch {} started at {} ms on runner {}, after call {} of epoch {} started at {} ms",
                start.run, start.call, start.epoch, start.at, start.runner, before.call, before.epoch, before.at
            )),
            _ => {
                newest.insert(&start.run, start);
            }
        }
    }
}

/// A call id runs at most once in each epoch: twice only when it was in flight at a move, and
/// then in a newer epoch.
fn a_call_runs_once_per_epoch(history: &History, found: &mut Vec<String>) {
    let mut seen: BTreeMap<(&str, u32, u64), u64> = BTreeMap::new();
    for start in &history.starts {
        if let Some(first) = seen.insert((&start.run, start.call, start.epoch), start.at) {
            found.push(format!(
                "run {}: call {} ran twice in epoch {} (at {first} ms and {} ms)",
                start.run, start.call, start.epoch, start.at
            ));
        }
    }
}

/// The log's seqs are 1..N with no gap or duplicate, each turn's call and end once and in order,
/// and `run_finished` last.
fn the_log_is_whole(store: &Store, run: &str, turns: u32, found: &mut Vec<String>) {
    let log: Vec<_> = store
        .logs
        .get(run)
        .map(|l| l.iter().map(|(e, _)| *e).collect())
        .unwrap_or_default();
    let seqs: Vec<u64> = log.iter().map(|e| e.seq).collect();
    if seqs.iter().zip(1..).any(|(seq, expected)| *seq != expected) {
        found.push(format!("run {run}: the log's seqs are {seqs:?}, not 1..{}", seqs.len()));
        return;
    }
    let mut expected = Vec::new();
    for turn in 1..=turns {
        expected.push(Kind::ToolFinished(turn));
        expected.push(Kind::TurnEnded(turn));
    }
    expected.push(Kind::RunFinished(turns));
    let kinds: Vec<Kind> = log.iter().map(|e| e.kind).collect();
    if kinds != expected {
        found.push(format!("run {run}: the log holds {kinds:?}"));
    }
}

/// Every admitted run ended, once: its record is final, with the turns its log ended with.
fn the_run_ended_once(store: &Store, run: &str, turns: u32, found: &mut Vec<String>) {
    match store.records.get(run) {
        Some((record, _)) if record.status == Status::Ended && record.turns == turns => {}
        Some((record, _)) => found.push(format!(
            "run {run} never ended as its log did: its record is {record:?}"
        )),
        None => found.push(format!("run {run} was admitted but has no record")),
    }
}

/// No reader sees an end that is not both in the log and stored.
fn no_end_is_seen_before_it_is_kept(history: &History, found: &mut Vec<String>) {
    for read in history.reads.iter().filter(|r| r.saw_end && !(r.logged && r.stored)) {
        found.push(format!(
            "run {} read as ended at {} ms while its end was {}",
            read.run,
            read.at,
            match (read.logged, read.stored) {
                (false, false) => "neither logged nor stored",
                (false, true) => "stored but not logged",
                _ => "logged but not stored",
            }
        ));
    }
}

/// A thread holds each of its runs once, in the order they ended, and no ended run holds it.
fn threads_hold_their_runs_once(history: &History, store: &Store, found: &mut Vec<String>) {
    let end_of = |run: &str| {
        store.logs.get(run).and_then(|log| {
            log.iter()
                .find(|(e, _)| matches!(e.kind, Kind::RunFinished(_)))
                .map(|(_, position)| *position)
        })
    };
    let mut by_thread: BTreeMap<&str, Vec<(u64, &str)>> = BTreeMap::new();
    for (run, thread) in &history.admitted {
        if let Some(end) = end_of(run) {
            by_thread.entry(thread).or_default().push((end, run));
        }
    }
    for (thread, mut runs) in by_thread {
        runs.sort_unstable();
        let expected: Vec<&str> = runs.into_iter().map(|(_, run)| run).collect();
        let Some(kept) = store.threads.get(thread) else {
            found.push(format!("thread {thread} was never written"));
            continue;
        };
        let held: Vec<&str> = kept.runs.iter().map(|r| r.run_id.as_str()).collect();
        if held != expected {
            found.push(format!(
                "thread {thread} holds {held:?}; its runs ended as {expected:?}"
            ));
        }
        if let Some(live) = kept.live.as_deref().filter(|live| end_of(live).is_some()) {
            found.push(format!("thread {thread} is still held by run {live}, which ended"));
        }
    }
}
