//! The in-memory event log (with the in-memory result store): each run's events, for `AttachRun`
//! on this replica. Bounded three ways: a run's log keeps at most `per_run_bytes` (its oldest
//! events are dropped past it), finished runs' logs are kept like results (count and age), and
//! all logs together hold at most `total_bytes` (the oldest finished ones go first).

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};

use futures::FutureExt;
use futures::future::BoxFuture;
use tokio::sync::watch;
use tokio::time::Instant;

use crate::domain::NumberedEvent;
use crate::domain::ports::{EventFeed, EventLog, LogError, LogWriter, Logged};
use crate::store::{Follower as _, LogBounds};

/// One run's events.
struct RunLog {
    events: VecDeque<NumberedEvent>,
    bytes: usize,
    /// The newest seq dropped to keep the run's bound (0: none dropped).
    trimmed_through: u64,
    /// `run_finished` is in the log.
    finished: bool,
    /// The writer went away without `run_finished`.
    abandoned: bool,
    /// Tells followers that the log changed.
    changed: watch::Sender<()>,
    /// Tells apart this log from a later one under the same run id.
    generation: u64,
}

#[derive(Default)]
struct Inner {
    runs: HashMap<String, RunLog>,
    /// Logs that will not grow any more, oldest first: (run id, generation, when).
    ended: VecDeque<(String, u64, Instant)>,
    total_bytes: usize,
    generations: u64,
}

/// See the module docs.
#[derive(Clone)]
pub struct MemoryLog {
    inner: Arc<Mutex<Inner>>,
    bounds: LogBounds,
}

impl MemoryLog {
    /// An empty log within `bounds`.
    pub fn new(bounds: LogBounds) -> Self {
        Self {
            inner: Arc::default(),
            bounds,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        shared::sync::lock(&self.inner)
    }
}

impl Inner {
    /// The log of `run_id`, if it is still the one of `generation` (not a later run's).
    fn log_mut(&mut self, run_id: &str, generation: u64) -> Option<&mut RunLog> {
        self.runs.get_mut(run_id).filter(|l| l.generation == generation)
    }

    /// Drops ended logs that are too old or too many, and the oldest ended ones while all logs
    /// hold more than the total bound.
    fn expire(&mut self, bounds: &LogBounds) {
        let now = Instant::now();
        while let Some((run_id, generation, at)) = self.ended.front().cloned() {
            let too_old = now.saturating_duration_since(at) > bounds.keep_for;
            let too_many = self.ended.len() > bounds.keep;
            let too_big = self.total_bytes > bounds.total_bytes;
            if !too_old && !too_many && !too_big {
                break;
            }
            self.ended.pop_front();
            if self.runs.get(&run_id).is_some_and(|log| log.generation == generation)
                && let Some(log) = self.runs.remove(&run_id)
            {
                self.total_bytes -= log.bytes;
            }
        }
    }

    /// The run's log ends (finished or abandoned): it is kept like a result from now on.
    fn ended(&mut self, run_id: &str, generation: u64, bounds: &LogBounds) {
        self.ended.push_back((run_id.to_owned(), generation, Instant::now()));
        self.expire(bounds);
    }
}

struct Writer {
    log: MemoryLog,
    run_id: String,
    generation: u64,
}

impl LogWriter for Writer {
    fn append(&mut self, events: &[NumberedEvent]) {
        let Some(last) = events.last() else { return };
        let per_run = self.log.bounds.per_run_bytes;
        let mut inner = self.log.lock();
        let Some(log) = inner.log_mut(&self.run_id, self.generation) else {
            return;
        };
        let added: usize = events.iter().map(NumberedEvent::weight).sum();
        log.events.extend(events.iter().cloned());
        log.bytes += added;
        let mut dropped = 0;
        while log.bytes > per_run && log.events.len() > 1 {
            if let Some(old) = log.events.pop_front() {
                log.bytes -= old.weight();
                dropped += old.weight();
                log.trimmed_through = old.seq;
            }
        }
        log.finished = last.is_last();
        log.changed.send_replace(());
        let finished = log.finished;
        inner.total_bytes = inner.total_bytes + added - dropped;
        if finished {
            inner.ended(&self.run_id, self.generation, &self.log.bounds);
        }
    }
}

impl Drop for Writer {
    fn drop(&mut self) {
        let mut inner = self.log.lock();
        let Some(log) = inner.log_mut(&self.run_id, self.generation) else {
            return;
        };
        if !log.finished {
            log.abandoned = true;
            log.changed.send_replace(());
            inner.ended(&self.run_id, self.generation, &self.log.bounds);
        }
    }
}

impl EventLog for MemoryLog {
    fn writer(&self, run_id: &str, logged: u64) -> Box<dyn LogWriter> {
        let mut inner = self.lock();
        inner.generations += 1;
        let generation = inner.generations;
        let log = RunLog {
            events: VecDeque::new(),
            bytes: 0,
            // Events before it are not here.
            trimmed_through: logged,
            finished: false,
            abandoned: false,
            changed: watch::Sender::new(()),
            generation,
        };
        if let Some(old) = inner.runs.insert(run_id.to_owned(), log) {
            inner.total_bytes -= old.bytes;
        }
        Box::new(Writer {
            log: self.clone(),
            run_id: run_id.to_owned(),
            generation,
        })
    }

    fn last(&self, run_id: &str) -> BoxFuture<'static, Result<Logged, LogError>> {
        let last = self
            .lock()
            .runs
            .get(run_id)
            .map_or_else(Logged::default, |log| match log.events.back() {
                Some(event) => Logged {
                    seq: event.seq,
                    finished: event.finished().cloned(),
                    ..Logged::default()
                },
                None => Logged {
                    seq: log.trimmed_through,
                    ..Logged::default()
                },
            });
        futures::future::ready(Ok(last)).boxed()
    }

    fn follow(&self, run_id: &str, after_seq: u64) -> BoxFuture<'static, Result<Option<EventFeed>, LogError>> {
        let opened = {
            let mut inner = self.lock();
            inner.expire(&self.bounds);
            inner.runs.get(run_id).map(|log| {
                if after_seq < log.trimmed_through {
                    return Err(LogError::Trimmed {
                        run_id: run_id.to_owned(),
                        after_seq,
                        first_kept: log.trimmed_through + 1,
                    });
                }
                Ok((log.changed.subscribe(), log.generation))
            })
        };
        let feed = match opened {
            None => Ok(None),
            Some(Err(e)) => Err(e),
            Some(Ok((changed, generation))) => Ok(Some(
                Follower {
                    log: self.clone(),
                    run_id: run_id.to_owned(),
                    generation,
                    cursor: after_seq,
                    changed,
                    ready: VecDeque::new(),
                    done: false,
                }
                .into_feed(),
            )),
        };
        Box::pin(std::future::ready(feed))
    }
}

/// One follower's place in a run's log.
struct Follower {
    log: MemoryLog,
    run_id: String,
    generation: u64,
    /// The last seq handed out.
    cursor: u64,
    changed: watch::Receiver<()>,
    /// Read from the log, not yet handed out.
    ready: VecDeque<NumberedEvent>,
    done: bool,
}

/// What a look at the log found.
enum Look {
    Events(Vec<NumberedEvent>),
    End,
    Wait,
    Failed(LogError),
}

impl crate::store::Follower for Follower {
    async fn next(&mut self) -> Option<Result<NumberedEvent, LogError>> {
        loop {
            if let Some(event) = self.ready.pop_front() {
                self.cursor = event.seq;
                self.done = event.is_last();
                return Some(Ok(event));
            }
            if self.done {
                return None;
            }
            match self.look() {
                Look::Events(events) => self.ready.extend(events),
                Look::End => return None,
                Look::Failed(e) => {
                    self.done = true;
                    return Some(Err(e));
                }
                // A dropped sender means the log was evicted: the next look says so.
                Look::Wait => {
                    let _ = self.changed.changed().await;
                }
            }
        }
    }
}

impl Follower {
    /// The events after the cursor, or why there are none.
    fn look(&mut self) -> Look {
        let log = self.log.clone();
        let inner = log.lock();
        let found = inner.runs.get(&self.run_id).filter(|l| l.generation == self.generation);
        let reason = match found {
            None => "the log expired while it was followed",
            Some(log) if self.cursor < log.trimmed_through => "the follower fell behind the log's bound",
            Some(log) => {
                self.changed.mark_unchanged();
                // Seqs in the log are consecutive: the cursor's successor is found by subtraction.
                let first = log.events.front().map_or(1, |e| e.seq);
                let start = usize::try_from((self.cursor + 1).saturating_sub(first)).unwrap_or(usize::MAX);
                let events: Vec<_> = log.events.iter().skip(start).cloned().collect();
                match (events.is_empty(), log.finished, log.abandoned) {
                    (false, _, _) => return Look::Events(events),
                    // The caller has every event already.
                    (true, true, _) => return Look::End,
                    (true, false, false) => return Look::Wait,
                    (true, false, true) => "the run's writer went away before run_finished",
                }
            }
        };
        Look::Failed(LogError::Lost {
            run_id: self.run_id.clone(),
            after_seq: self.cursor,
            reason: reason.to_owned(),
        })
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use futures::StreamExt;

    use super::*;
    use crate::domain::{Event, RunResult};

    fn bounds(per_run_bytes: usize) -> LogBounds {
        LogBounds {
            per_run_bytes,
            total_bytes: 1 << 30,
            keep: 100,
            keep_for: Duration::from_secs(60),
        }
    }

    fn text(seq: u64, bytes: usize) -> NumberedEvent {
        NumberedEvent {
            seq,
            event: Event::TextDelta {
                text: "x".repeat(bytes),
                turn: 1,
            },
        }
    }

    fn finished(seq: u64) -> NumberedEvent {
        NumberedEvent {
            seq,
            event: Event::RunFinished(Box::new(RunResult::running("r"))),
        }
    }

    async fn seqs(feed: EventFeed) -> Vec<Result<u64, LogError>> {
        feed.map(|item| item.map(|e| e.seq)).collect().await
    }

    #[tokio::test]
    async fn a_follower_gets_what_was_logged_then_what_comes_up_to_run_finished() {
        let log = MemoryLog::new(bounds(1 << 20));
        let mut writer = log.writer("r", 0);
        writer.append(&[text(1, 3), text(2, 3)]);
        let feed = log.follow("r", 1).await.unwrap().unwrap();
        let collected = shared::tasks::spawn(seqs(feed));
        tokio::time::sleep(Duration::from_millis(20)).await;
        writer.append(&[text(3, 3)]);
        writer.append(&[finished(4)]);
        assert_eq!(collected.await.unwrap(), vec![Ok(2), Ok(3), Ok(4)]);
        // A finished run replays; a caller that has it all gets an empty stream.
        assert_eq!(
            seqs(log.follow("r", 0).await.unwrap().unwrap()).await,
            vec![Ok(1), Ok(2), Ok(3), Ok(4)]
        );
        assert!(seqs(log.follow("r", 4).await.unwrap().unwrap()).await.is_empty());
        assert!(log.follow("unknown", 0).await.unwrap().is_none());
    }

    #[tokio::test]
    async fn past_its_bound_a_runs_log_drops_its_oldest_events_and_says_so() {
        // Each event weighs 64 + 1000 bytes: three fit in 4 KiB, four do not.
        let log = MemoryLog::new(bounds(4096));
        let mut writer = log.writer("r", 0);
        for seq in 1..=3 {
            writer.append(&[text(seq, 1000)]);
        }
        assert!(log.follow("r", 0).await.is_ok(), "within the bound, everything is kept");
        writer.append(&[text(4, 1000)]);
        writer.append(&[finished(5)]);
        let trimmed = log.follow("r", 0).await.err();
        assert!(
            matches!(trimmed, Some(LogError::Trimmed { first_kept: 2, .. })),
            "{trimmed:?}"
        );
        assert_eq!(
            seqs(log.follow("r", 1).await.unwrap().unwrap()).await,
            vec![Ok(2), Ok(3), Ok(4), Ok(5)]
        );
    }

    #[tokio::test]
    async fn a_writer_gone_without_run_finished_ends_its_followers_with_an_error() {
        let log = MemoryLog::new(bounds(1 << 20));
        let mut writer = log.writer("r", 0);
        writer.append(&[text(1, 3)]);
        let feed = log.follow("r", 0).await.unwrap().unwrap();
        drop(writer);
        let got = seqs(feed).await;
        assert_eq!(got.len(), 2);
        assert!(matches!(got[1], Err(LogError::Lost { after_seq: 1, .. })), "{got:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn finished_logs_are_kept_like_results_by_count_age_and_total_bytes() {
        let log = MemoryLog::new(LogBounds {
            per_run_bytes: 1 << 20,
            total_bytes: 3 * 1064 + 100,
            keep: 2,
            keep_for: Duration::from_secs(60),
        });
        for id in ["a", "b", "c"] {
            log.writer(id, 0).append(&[text(1, 1000)]);
        }
        // Only two ended logs are kept.
        assert!(log.follow("a", 0).await.unwrap().is_none());
        assert!(log.follow("b", 0).await.unwrap().is_some());
        tokio::time::advance(Duration::from_secs(61)).await;
        assert!(log.follow("c", 0).await.unwrap().is_none(), "older than keep_for");
        // Live logs count toward the total: the oldest ended one goes first.
        let mut live = log.writer("live", 0);
        log.writer("ended", 0).append(&[text(1, 1000), finished(2)]);
        live.append(&[text(1, 1000)]);
        live.append(&[text(2, 1000)]);
        live.append(&[text(3, 1000)]);
        assert!(log.follow("ended", 0).await.unwrap().is_none(), "over the total bytes");
        assert!(log.follow("live", 0).await.unwrap().is_some());
    }
}
