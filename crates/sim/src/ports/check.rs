//! The invariants a history of the simulation over the services' code must keep:
//!
//! - **epoch order**: a run's tool calls start in non-decreasing epoch order as the runners
//!   saw them (a replaced owner runs nothing after the new owner's first call), every one of
//!   them with an epoch (every run here is durable), and none below its run's fence as it stood
//!   when the runner's read of it began (not only below later starts' epochs);
//! - **again only when unrecorded**: a call id runs at most once in each epoch, and in a later
//!   epoch only when the checkpoint its run was taken over from held neither its outcome nor the
//!   task its server made of it (it was in flight, or its turn had not ended, when the run
//!   moved): a task's work starts once, however often the run moves while it is followed;
//! - **once per call**: a call id's tool starts at most once, however often the call is sent
//!   (by a new owner after its run moved, or again after a lost answer): a runner answers a call
//!   that started before from its record, or in doubt when the runner that started it went away
//!   before keeping its outcome (the tool here is not idempotent, so nothing runs again);
//! - **one owner acting**: no tool call leaves a replica under a run's epoch once a claim of a
//!   later epoch was taken (the owner stops on its own clock before anyone may claim the run:
//!   its incarnation's lease less the margin ran out first; the fences only catch what leaks);
//! - **the log**: a run's events are seqs 1..N without gap or duplicate, with one `run_finished`,
//!   the last;
//! - **the end, once and kept**: every run claimed ends, its record holds the end its log holds,
//!   and no reader was shown an end before both held it;
//! - **the thread**: once every run ended, the thread (which must exist once a run of it was
//!   claimed) holds each of its runs that ended exactly once, and no run holds it or waits for
//!   it;
//! - **the listing**: once every run ended, `ListRuns` on every replica, page after page, shows
//!   each run claimed exactly once, newest first, with the status its record holds.
//! - **the share**: no write ever leaves a principal with more runs live (their records) than
//!   its `max_runs`, and once every run ended each slot left names a run that ended;
//! - **the spend**: once every run ended, each principal's usage book holds at least the tokens
//!   its runs' results count, and all books together no more than the model served, each turn
//!   of a run counted once however often it was served (an add made again adds only what its
//!   window had not had of its run);
//! - **one answer per question**: of the answers sent to one round of a tool's questions, from
//!   any replica and however many at once, at most one is taken, and none the question's schema
//!   refuses;
//! - **the answer as given**: a call comes back to its tool with a round's answer only as the
//!   person gave it (the one taken, or one whose taking went unheard), or `cancel` when none
//!   was taken (the question expired), and the same whichever replica resumed it;
//! - **no question left**: once every run ended, no call of theirs waits for a person;
//! - **the stream**: a caller following each run with `AttachRun` from replica to replica
//!   (attaching again after its last seq whenever its stream broke off) was sent the run's log
//!   exactly, gap-free and in order, ending in `run_finished` with the end the record holds;
//! - **the replay**: a retry of `Orchestrate` with an ended run's id replays its log exactly;
//! - **a cancel kept**: a run a cancel was answered `CANCELED` for (at once, or parked) ends
//!   canceled, however often it moves after; one answered that it ends after its turn asks the
//!   model for no turn past the last it had asked for when the answer came;
//! - **a message once**: a message sent to a run (`SendMessage`) joins its conversation
//!   (`message_added` in its log) at most once, and only one that was sent to it; without a
//!   fault, each one the run took joins a run that completed (one it took after its last
//!   checkpoint may be lost with its replica);
//! - **a signal once**: the signal stream holds each exit call at most once (its message id keeps
//!   a publish retried, or made again by the run's next owner, out), and each run's stored end
//!   carries each of its signals at most once, one the topic confirmed being in the stream.

use std::collections::{BTreeMap, HashMap};

use orchestrator::domain::listing::RunSummary;
use orchestrator::domain::{NumberedEvent, RunResult};

use super::actors::Runners;
use super::person::{Given, Person};
use super::view::View;

fn lock<T>(mutex: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The listing's invariant, for the rows one replica's `ListRuns` pages showed in order.
pub fn listing_whole(shared: &View, replica: &str, rows: &[RunSummary]) -> Vec<String> {
    let mut broken = Vec::new();
    let mut seen = BTreeMap::new();
    for row in rows {
        if let Some(again) = seen.insert(row.run_id.as_str(), row) {
            broken.push(format!(
                "the listing on {replica} shows {} twice: {again:?}",
                row.run_id
            ));
        }
        match shared.records.get(&row.run_id) {
            Some(record) if record.result.status != row.status => broken.push(format!(
                "the listing on {replica} shows {} {:?}, its record {:?}",
                row.run_id, row.status, record.result.status
            )),
            Some(_) => {}
            None => broken.push(format!(
                "the listing on {replica} shows {}, which has no record",
                row.run_id
            )),
        }
    }
    for run_id in shared.records.keys().filter(|id| !seen.contains_key(id.as_str())) {
        broken.push(format!("the listing on {replica} misses {run_id}"));
    }
    broken.extend(newest_first(shared, replica, rows));
    broken
}

/// Newest first: each shard's runs in the index's order there (the order the fleet admitted them,
/// which two admissions at once may take apart from their admission times), and a run not in the
/// index after its neighbour by admission time. Runs of two shards are ordered by the walk's merge
/// of their admission times, which each shard's order may overrule, so not checked against each
/// other.
fn newest_first(shared: &View, replica: &str, rows: &[RunSummary]) -> Vec<String> {
    let place = |row: &RunSummary| shared.index_order.get(&row.run_id).copied();
    let by_admission = |newer: &RunSummary, older: &RunSummary| {
        (newer.created_at_ms, &newer.run_id) > (older.created_at_ms, &older.run_id)
    };
    let mut pairs: Vec<(&RunSummary, &RunSummary, bool)> = Vec::new();
    let mut last_in_shard: HashMap<usize, (&RunSummary, usize)> = HashMap::new();
    for (n, row) in rows.iter().enumerate() {
        if let Some(before) = n
            .checked_sub(1)
            .map(|b| &rows[b])
            .filter(|b| place(b).is_none() || place(row).is_none())
        {
            pairs.push((before, row, by_admission(before, row)));
        }
        if let Some((shard, at)) = place(row)
            && let Some((before, was_at)) = last_in_shard.insert(shard, (row, at))
        {
            pairs.push((before, row, was_at > at));
        }
    }
    pairs
        .into_iter()
        .filter(|(_, _, in_order)| !in_order)
        .map(|(first, second, _)| {
            format!(
                "the listing on {replica} shows {} before the newer {} (created at {} and {})",
                first.run_id, second.run_id, first.created_at_ms, second.created_at_ms
            )
        })
        .collect()
}

/// What one caller following a run was sent.
pub struct Followed {
    /// The run.
    pub run_id: String,
    /// Its events, in the order sent.
    pub events: Vec<NumberedEvent>,
}

/// The stream's invariant, once every run ended: each follower was sent its run's log exactly,
/// ending in the end its record holds.
pub fn streams_whole(shared: &View, followed: &[Followed]) -> Vec<String> {
    let mut broken = Vec::new();
    for follower in followed {
        let log = shared.events(&follower.run_id);
        let sent: Vec<u64> = follower.events.iter().map(|e| e.seq).collect();
        let logged: Vec<u64> = log.iter().map(|e| e.seq).collect();
        if sent != logged {
            broken.push(format!(
                "the stream: {}'s follower was sent seqs {sent:?}, its log holds {logged:?}",
                follower.run_id
            ));
            continue;
        }
        if follower.events.iter().zip(&log).any(|(sent, logged)| sent != *logged) {
            broken.push(format!(
                "the stream: {}'s follower was sent events its log does not hold",
                follower.run_id
            ));
        }
        let end = follower.events.last().and_then(NumberedEvent::finished);
        let stored = shared.records.get(&follower.run_id).map(|r| &r.result);
        match (end, stored) {
            (Some(end), Some(stored)) if end.status == stored.status && end.text == stored.text => {}
            (end, stored) => broken.push(format!(
                "the stream: {}'s follower ended with {:?}, its record holds {:?}",
                follower.run_id,
                end.map(|e| e.status),
                stored.map(|s| s.status)
            )),
        }
    }
    broken
}

/// Every invariant broken, with its evidence.
/// Every invariant over what the store, the runners and the person saw, for `runs` runs (the
/// odd ones on the thread, unless they are `quiet`) the model served `served` tokens to.
pub fn violations(
    shared: &View,
    runners: &Runners,
    person: &Person,
    (runs, quiet): (usize, bool),
    served: u64,
) -> Vec<String> {
    let mut broken = epoch_order(runners);
    broken.extend(fenced_at_start(runners));
    broken.extend(answers_as_given(runners, &lock(person)));
    broken.extend(questions_left(shared));
    broken.extend(again_only_when_unrecorded(runners, &shared.takeovers));
    broken.extend(once_per_call(runners));
    broken.extend(one_owner_acting(runners, &shared.takeovers));
    for run in 0..runs {
        let run_id = format!("run-{run}");
        let Some(record) = shared.records.get(&run_id) else {
            continue;
        };
        let events = shared.events(&run_id);
        broken.extend(log_whole(&run_id, &events));
        broken.extend(end_kept(&run_id, &record.result, &events));
    }
    if !quiet {
        broken.extend(thread_whole(shared, runs));
    }
    broken.extend(shared.quota_breaches.iter().map(|b| format!("the share: {b}")));
    broken.extend(slots_free(shared));
    broken.extend(spend_counted(shared));
    broken.extend(spend_served(shared, served));
    broken.extend(signals_once(shared));
    broken
}

/// The invariant of one owner acting (see the module docs): no call leaves a replica under an
/// epoch after a claim of a later one was taken.
fn one_owner_acting(runners: &Runners, takeovers: &[super::view::Takeover]) -> Vec<String> {
    let sent = lock(&runners.sent);
    sent.iter()
        .filter_map(|call| {
            let claim = takeovers
                .iter()
                .find(|t| t.run_id == call.run_id && t.epoch > call.epoch && t.at < call.at)?;
            Some(format!(
                "one owner acting: call {} of {} left {} under epoch {} {:?} after epoch {} was claimed",
                call.call_id,
                call.run_id,
                call.replica,
                call.epoch,
                call.at.duration_since(claim.at),
                claim.epoch
            ))
        })
        .collect()
}

/// A message sent to a run.
pub struct Sent {
    /// The run.
    pub run_id: String,
    /// Its text (unique over the seed).
    pub content: String,
    /// The run took it (`SendMessage` answered how many wait).
    pub taken: bool,
}

/// The messages' invariant (see the module docs); `fault_free`: no fault could lose one.
pub fn messages_once(shared: &View, sent: &[Sent], fault_free: bool) -> Vec<String> {
    let mut broken = Vec::new();
    for run_id in shared.records.keys() {
        let mut joined: BTreeMap<&str, usize> = BTreeMap::new();
        for event in shared.events(run_id) {
            if let orchestrator::domain::Event::MessageAdded { content, .. } = &event.event {
                *joined.entry(content.as_str()).or_default() += 1;
            }
        }
        for (content, times) in &joined {
            if !sent.iter().any(|s| &s.run_id == run_id && s.content == *content) {
                broken.push(format!("a message once: {run_id} took {content:?}, never sent to it"));
            }
            if *times > 1 {
                broken.push(format!("a message once: {run_id} took {content:?} {times} times"));
            }
        }
        let completed = shared.records[run_id].result.status == orchestrator::domain::RunStatus::Completed;
        for lost in sent.iter().filter(|s| &s.run_id == run_id && s.taken) {
            if fault_free && completed && !joined.contains_key(lost.content.as_str()) {
                broken.push(format!(
                    "a message once: {run_id} took {:?} and completed without it",
                    lost.content
                ));
            }
        }
    }
    broken
}

/// The signals' invariant (see the module docs).
fn signals_once(shared: &View) -> Vec<String> {
    let mut broken = Vec::new();
    let mut streamed = BTreeMap::new();
    for (run_id, call_id) in &shared.signals {
        *streamed.entry((run_id.as_str(), call_id.as_str())).or_insert(0) += 1;
    }
    for ((run_id, call_id), times) in &streamed {
        if *times > 1 {
            broken.push(format!(
                "a signal once: the stream holds {run_id}'s {call_id} {times} times"
            ));
        }
    }
    for (run_id, record) in &shared.records {
        let mut carried = BTreeMap::new();
        for signal in &record.result.signals {
            *carried.entry(signal.call_id.as_str()).or_insert(0) += 1;
            let confirmed = signal.delivery == orchestrator::domain::Delivery::Delivered;
            if confirmed && !streamed.contains_key(&(run_id.as_str(), signal.call_id.as_str())) {
                broken.push(format!(
                    "a signal once: {run_id}'s {} reads delivered, and the stream lacks it",
                    signal.call_id
                ));
            }
        }
        for (call_id, times) in carried.into_iter().filter(|(_, times)| *times > 1) {
            broken.push(format!("a signal once: {run_id}'s end carries {call_id} {times} times"));
        }
    }
    broken
}

/// The runs told canceled whose record holds another end.
pub fn cancels_kept(shared: &View, canceled: &[String]) -> Vec<String> {
    canceled
        .iter()
        .filter_map(|run_id| {
            let record = &shared.records.get(run_id)?.result;
            (record.status != orchestrator::domain::RunStatus::Canceled).then(|| {
                format!(
                    "a cancel kept: {run_id} was answered canceled, and its record ends {:?}",
                    record.status
                )
            })
        })
        .collect()
}

/// A run answered that it ends after its turn asks the model for no later turn: of the
/// `answered` cancels (the run, and when the answer came), the model's requests after the answer
/// name no turn past the last it was asked before it (a run that moves meanwhile resumes from an
/// earlier turn, and must not go on past the turn the cancel let end).
pub fn after_turn_kept(
    answered: &[(String, tokio::time::Instant)],
    asked: &[(String, usize, tokio::time::Instant)],
) -> Vec<String> {
    answered
        .iter()
        .filter_map(|(run_id, at)| {
            let of_run = asked.iter().filter(|(run, _, _)| run == run_id);
            let last = of_run.clone().filter(|(_, _, when)| when <= at).map(|(_, turn, _)| *turn).max();
            let later = of_run.filter(|(_, _, when)| when > at).map(|(_, turn, _)| *turn).max();
            match (last, later) {
                (Some(last), Some(later)) if later > last => Some(format!(
                    "a cancel kept: {run_id} was answered it ends after its turn (turn {last} asked), and the model was asked turn {later} after",
                )),
                (None, Some(later)) => Some(format!(
                    "a cancel kept: {run_id} was answered it ends after its turn before any turn was asked, and the model was asked turn {later} after",
                )),
                _ => None,
            }
        })
        .collect()
}

/// Every start carried an epoch, and none started below its run's fence as it stood when the
/// runner's fence read began (a raise that lands during the read, or between the read and the
/// start, is what the new owner's fence grace waits out).
fn fenced_at_start(runners: &Runners) -> Vec<String> {
    lock(&runners.starts)
        .iter()
        .filter_map(|start| {
            if start.epoch == 0 {
                return Some(format!(
                    "epoch order: {} call {} of a durable run started with no epoch",
                    start.run_id, start.call_id
                ));
            }
            (start.epoch < start.fence).then(|| {
                format!(
                    "epoch order: {} call {} of epoch {} started though its run's fence stood at {} when the runner read it ({} at the start)",
                    start.run_id, start.call_id, start.epoch, start.fence, start.fence_at_start
                )
            })
        })
        .collect()
}

/// All books together hold no more tokens than the model served, each turn of a run counted
/// once however often it was served: an add made again (its answer lost, or a takeover booking
/// what its checkpoint did not hold, or a turn served again after its run moved) adds only what
/// its window had not had of its run.
fn spend_served(shared: &View, served: u64) -> Option<String> {
    let booked: u64 = shared
        .usage
        .values()
        .map(|tally| tally.prompt_tokens + tally.completion_tokens)
        .sum();
    (booked > served).then(|| format!("the spend: the books hold {booked} tokens, the model served {served}"))
}

/// Once every run ended, each slot left names a run whose record reads ended (the next take
/// finds it free): none is held by a run that never was, or still is.
fn slots_free(shared: &View) -> Vec<String> {
    shared
        .slots
        .iter()
        .filter_map(|(key, value)| {
            let run_id = value.split_once(' ').map_or(value.as_str(), |(run_id, _)| run_id);
            match shared.records.get(run_id) {
                Some(record) if !record.result.status.is_live() => None,
                Some(record) => Some(format!(
                    "the share: slot {key} is held by {run_id}, {:?} after every run ended",
                    record.result.status
                )),
                None => Some(format!(
                    "the share: slot {key} is held by {run_id}, which has no record"
                )),
            }
        })
        .collect()
}

/// Each principal's book holds at least the tokens its runs' results count (a turn done is never
/// missing).
fn spend_counted(shared: &View) -> Vec<String> {
    let mut spent: BTreeMap<&str, u64> = BTreeMap::new();
    for record in shared.records.values() {
        let usage = &record.result.usage;
        *spent.entry(record.result.principal.as_str()).or_default() += usage.prompt_tokens + usage.completion_tokens;
    }
    spent
        .into_iter()
        .filter_map(|(principal, results)| {
            let booked: u64 = shared
                .usage
                .iter()
                .filter(|((p, _), _)| p == principal)
                .map(|(_, tally)| tally.prompt_tokens + tally.completion_tokens)
                .sum();
            (booked < results)
                .then(|| format!("the spend: {principal:?}'s book holds {booked} tokens, its runs' results {results}"))
        })
        .collect()
}

/// One answer per question, and the answer as given.
fn answers_as_given(runners: &Runners, person: &super::person::Record) -> Vec<String> {
    let mut broken: Vec<String> = person
        .wrongly_taken
        .iter()
        .map(|w| format!("one answer per question: {w}"))
        .collect();
    let mut rounds: BTreeMap<&str, Vec<&Given>> = BTreeMap::new();
    for given in &person.given {
        rounds.entry(given.request_state.as_str()).or_default().push(given);
    }
    for (round, given) in &rounds {
        let taken: Vec<&serde_json::Value> = given.iter().filter(|g| g.taken).map(|g| &g.response).collect();
        if taken.len() > 1 {
            broken.push(format!(
                "one answer per question: round {round} took {} answers: {taken:?}",
                taken.len()
            ));
        }
    }
    let mut seen: BTreeMap<&str, &serde_json::Value> = BTreeMap::new();
    for answered in lock(&runners.answered).iter() {
        let round = answered.request_state.as_str();
        let given = rounds.get(round).map(Vec::as_slice).unwrap_or_default();
        let as_given = match given.iter().find(|g| g.taken) {
            Some(taken) => taken.response == answered.response,
            None => answered.response["action"] == "cancel" || given.iter().any(|g| g.response == answered.response),
        };
        if !as_given {
            broken.push(format!(
                "the answer as given: {} call {} came back with {} for round {round}; the person sent {:?}",
                answered.run_id,
                answered.call_id,
                answered.response,
                given.iter().map(|g| (&g.response, g.taken)).collect::<Vec<_>>()
            ));
        }
        if let Some(before) = seen.insert(round, &answered.response)
            && *before != answered.response
        {
            broken.push(format!(
                "the answer as given: round {round} came back with {before} and then with {}",
                answered.response
            ));
        }
    }
    broken
}

/// Once every run ended, no call of theirs waits for a person.
fn questions_left(shared: &View) -> Vec<String> {
    shared
        .waits
        .iter()
        .filter(|(run_id, _)| shared.records.get(*run_id).is_none_or(|r| !r.result.status.is_live()))
        .flat_map(|(run_id, undecided)| {
            undecided
                .iter()
                .map(move |call_id| format!("no question left: {run_id} ended and its call {call_id} still waits"))
        })
        .collect()
}

fn epoch_order(runners: &Runners) -> Vec<String> {
    let mut last: BTreeMap<&str, (u64, &str)> = BTreeMap::new();
    let starts = lock(&runners.starts);
    let mut broken = Vec::new();
    for start in starts.iter() {
        if let Some((epoch, call)) = last.get(start.run_id.as_str())
            && start.epoch < *epoch
        {
            broken.push(format!(
                "epoch order: {} call {} of epoch {} started after call {call} of epoch {epoch} (fence read {})",
                start.run_id, start.call_id, start.epoch, start.fence
            ));
        }
        let newest = last.get(start.run_id.as_str()).map_or(0, |(e, _)| *e);
        if start.epoch >= newest {
            last.insert(&start.run_id, (start.epoch, &start.call_id));
        }
    }
    broken
}

fn once_per_call(runners: &Runners) -> Vec<String> {
    let mut epochs: BTreeMap<(&str, &str), Vec<u64>> = BTreeMap::new();
    let starts = lock(&runners.starts);
    for start in starts.iter() {
        epochs
            .entry((&start.run_id, &start.call_id))
            .or_default()
            .push(start.epoch);
    }
    epochs
        .into_iter()
        .filter(|(_, started)| started.len() > 1)
        .map(|((run_id, call_id), started)| {
            format!(
                "once per call: {run_id} call {call_id} started {} times, in epochs {started:?}",
                started.len()
            )
        })
        .collect()
}

fn again_only_when_unrecorded(runners: &Runners, takeovers: &[super::view::Takeover]) -> Vec<String> {
    let mut broken = Vec::new();
    let mut runs: BTreeMap<(&str, &str), Vec<u64>> = BTreeMap::new();
    for start in lock(&runners.starts).iter() {
        let epochs = runs.entry((&start.run_id, &start.call_id)).or_default();
        if epochs.contains(&start.epoch) {
            broken.push(format!(
                "again only when unrecorded: {} call {} ran twice in epoch {}",
                start.run_id, start.call_id, start.epoch
            ));
        }
        epochs.push(start.epoch);
        let recorded = takeovers
            .iter()
            .find(|t| t.run_id == start.run_id && t.epoch == start.epoch)
            .is_some_and(|t| t.checkpointed_calls.contains(&start.call_id));
        if recorded {
            broken.push(format!(
                "again only when unrecorded: {} call {} ran in epoch {} though the checkpoint it was taken over from held its outcome or its task",
                start.run_id, start.call_id, start.epoch
            ));
        }
    }
    broken
}

fn log_whole(run_id: &str, events: &[&NumberedEvent]) -> Vec<String> {
    let mut broken = Vec::new();
    let seqs: Vec<u64> = events.iter().map(|e| e.seq).collect();
    if seqs != (1..=seqs.len() as u64).collect::<Vec<_>>() {
        broken.push(format!("the log: {run_id} holds seqs {seqs:?}"));
    }
    let ends = events.iter().filter(|e| e.finished().is_some()).count();
    if ends > 1 || (ends == 1 && events.last().is_some_and(|e| e.finished().is_none())) {
        broken.push(format!(
            "the log: {run_id} holds {ends} run_finished, the last at the end: {}",
            ends == 1
        ));
    }
    broken
}

fn end_kept(run_id: &str, record: &RunResult, events: &[&NumberedEvent]) -> Option<String> {
    let logged = events.iter().find_map(|e| e.finished());
    match logged {
        Some(end) if record.status != end.status || record.text != end.text => Some(format!(
            "the end: {run_id} is stored {:?} {:?} but logged {:?} {:?}",
            record.status, record.text, end.status, end.text
        )),
        None if !record.status.is_live() => Some(format!(
            "the end: {run_id} is stored {:?} but its log holds no end",
            record.status
        )),
        _ => None,
    }
}

/// Why a reader shown `seen` (ended) saw an end not kept yet: the log or the store lacked it.
pub fn end_not_kept(shared: &View, seen: &RunResult) -> Option<String> {
    let stored = shared.records.get(&seen.run_id).map(|r| r.result.status);
    let logged = shared.events(&seen.run_id).iter().any(|e| e.finished().is_some());
    let kept = logged && stored.is_some_and(|s| !s.is_live());
    (!kept).then(|| {
        format!(
            "the end: a reader was shown {} {:?} while the log held its end: {logged}, the store: {stored:?}",
            seen.run_id, seen.status
        )
    })
}

/// The runs claimed that have not ended in the store.
pub fn unended(shared: &View, runs: usize) -> Vec<String> {
    (0..runs)
        .map(|run| format!("run-{run}"))
        .filter(|run_id| shared.records.get(run_id).is_none_or(|r| r.result.status.is_live()))
        .collect()
}

/// The threads still held, or with runs waiting, as "thread by run".
pub fn held_threads(shared: &View) -> Vec<String> {
    shared
        .threads
        .values()
        .filter(|(t, _)| t.live.is_some() || !t.queue.is_empty())
        .map(|(t, _)| format!("{} held by {:?} ({} waiting)", t.thread_id, t.live, t.queue.len()))
        .collect()
}

/// The thread's invariants once every run ended.
fn thread_whole(shared: &View, runs: usize) -> Vec<String> {
    let mut broken = Vec::new();
    let Some((thread, _)) = shared.threads.get(super::THREAD) else {
        let claimed: Vec<String> = (1..runs)
            .step_by(2)
            .map(|run| format!("run-{run}"))
            .filter(|run_id| shared.records.contains_key(run_id))
            .collect();
        if !claimed.is_empty() {
            broken.push(format!(
                "the thread: it is missing, and its runs {claimed:?} were claimed"
            ));
        }
        return broken;
    };
    let on_thread: Vec<&str> = thread.runs.iter().map(|r| r.run_id.as_str()).collect();
    for run in (1..runs).step_by(2) {
        let run_id = format!("run-{run}");
        let ended = shared.records.get(&run_id).is_some_and(|r| !r.result.status.is_live());
        let times = on_thread.iter().filter(|id| **id == run_id).count();
        if ended && times != 1 {
            broken.push(format!(
                "the thread: {run_id} ended and is on its thread {times} times: {on_thread:?}"
            ));
        }
    }
    broken
}

/// Takeovers: the epochs past the first, over every run.
pub fn takeovers(shared: &View) -> u64 {
    shared.records.values().map(|r| r.epoch.saturating_sub(1)).sum()
}

/// The history: every tool start (its time from `begun`), every call that came back with a
/// person's answers, and each run's log and record, a line each.
pub fn history(shared: &View, runners: &Runners, begun: tokio::time::Instant) -> Vec<String> {
    let mut lines: Vec<String> = lock(&runners.starts)
        .iter()
        .map(|s| {
            format!(
                "{:>8.3}s start {} {} epoch {} (fence {})",
                s.at.duration_since(begun).as_secs_f64(),
                s.run_id,
                s.call_id,
                s.epoch,
                s.fence
            )
        })
        .collect();
    lines.extend(lock(&runners.answered).iter().map(|a| {
        format!(
            "answered {} {} round {}: {}",
            a.run_id, a.call_id, a.request_state, a.response
        )
    }));
    lines.extend(shared.spend.iter().cloned());
    for (run_id, record) in &shared.records {
        let seqs: Vec<u64> = shared.events(run_id).iter().map(|e| e.seq).collect();
        let streamed = shared.signals.iter().filter(|(run, _)| run == run_id).count();
        lines.push(format!(
            "{run_id}: {:?} by {} ({}) in epoch {}, {} turns, log {} events, {} signals ({streamed} in the stream)",
            record.result.status,
            record.owner,
            record.incarnation,
            record.epoch,
            record.result.turns,
            seqs.len(),
            record.result.signals.len(),
        ));
    }
    for (thread, revision) in shared.threads.values() {
        let runs: Vec<&str> = thread.runs.iter().map(|r| r.run_id.as_str()).collect();
        lines.push(format!(
            "{} (revision {revision}): runs {runs:?}, held by {:?}, {} waiting",
            thread.thread_id,
            thread.live,
            thread.queue.len()
        ));
    }
    lines
}
