//! The event streams of a run's callers: the caller that started it (which follows the run's
//! log when the run parked for approvals and went on), callers that attach (`AttachRun`), and
//! the replay of a finished run. A stream that must end before `run_finished` ends with an
//! error naming the run and the last seq sent, so its caller attaches again.

use std::pin::Pin;
use std::sync::Arc;

use futures::{Stream, StreamExt};
use shared::auth::Principal;

use tokio_util::sync::CancellationToken;

use crate::Error;
use crate::domain::ports::EventFeed;
use crate::domain::{Event, NumberedEvent, RunResult};
use crate::registry::{AttachError, Runs};
use crate::run::SharedState;

/// A run's events for one caller: numbered events until `run_finished`, or an error that ends
/// the stream (the run moved away, its log lost events).
pub(crate) type RunEvents = Pin<Box<dyn Stream<Item = Result<NumberedEvent, Error>> + Send>>;

/// What a caller's stream needs of the server: the registry, and the drain's signal.
#[derive(Clone)]
pub(super) struct StreamDeps {
    pub runs: Arc<Runs>,
    pub stopping: CancellationToken,
}

/// Why a caller cannot follow a run's log.
pub(super) fn attach_error(run_id: &str, error: AttachError) -> Error {
    match error {
        AttachError::NotFound => no_run(run_id),
        AttachError::Store(e) => Error::Store(e),
        AttachError::Log(e) => Error::Log(e),
        AttachError::Full(max) => Error::AttachBusy(max),
    }
}

/// The answer for a run the caller cannot see, whether or not it exists.
pub(super) fn no_run(run_id: &str) -> Error {
    Error::NotFound(format!("no run {run_id:?} (unknown, or its result has expired)"))
}

/// A run's events, for the caller that started it. When they end before `run_finished`, the run
/// either parked waiting for approvals (its `state` says so; the stream goes on from the run's
/// log, as `AttachRun` would, until the run ends wherever it goes on) or it moved to another
/// replica (the stream ends with `UNAVAILABLE` naming the run and the last seq sent, so the caller
/// attaches again).
pub(super) fn caller_stream(
    deps: StreamDeps,
    run_id: String,
    caller: Arc<Principal>,
    state: SharedState,
    events: impl Stream<Item = NumberedEvent> + Send + 'static,
) -> RunEvents {
    enum Phase {
        Direct(Pin<Box<dyn Stream<Item = NumberedEvent> + Send>>),
        Following(RunEvents),
        Done,
    }
    struct Tail {
        phase: Phase,
        deps: StreamDeps,
        caller: Arc<Principal>,
        run_id: String,
        state: SharedState,
        last_seq: u64,
    }
    let tail = Tail {
        phase: Phase::Direct(Box::pin(events)),
        deps,
        caller,
        run_id,
        state,
        last_seq: 0,
    };
    futures::stream::unfold(tail, |mut t| async move {
        loop {
            let direct = match &mut t.phase {
                Phase::Done => return None,
                Phase::Following(feed) => return feed.next().await.map(|item| (item, t)),
                Phase::Direct(events) => events.next().await,
            };
            match direct {
                Some(e) => {
                    t.last_seq = e.seq;
                    if e.is_last() {
                        t.phase = Phase::Done;
                    }
                    return Some((Ok(e), t));
                }
                // The loop marks the run's own state once it parked, before its events end.
                None if shared::sync::lock(&t.state).status.is_parked() => {
                    match t.deps.runs.follow(&t.run_id, t.last_seq, &t.caller).await {
                        Ok(feed) => t.phase = Phase::Following(attached(&t.deps, t.run_id.clone(), t.last_seq, feed)),
                        Err(e) => {
                            t.phase = Phase::Done;
                            return Some((Err(attach_error(&t.run_id, e)), t));
                        }
                    }
                }
                None => {
                    t.phase = Phase::Done;
                    let moved = Error::Moved {
                        run_id: t.run_id.clone(),
                        after_seq: t.last_seq,
                    };
                    return Some((Err(moved), t));
                }
            }
        }
    })
    .boxed()
}

/// How an `Orchestrate` call replays a run that had ended under its id (its
/// [`proto::REPLAY_HEADER`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Replayed {
    /// Its events as logged, from seq 1.
    Log,
    /// Its log no longer holds it whole: its result as one delta each.
    Result,
}

impl Replayed {
    /// The header's value.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Self::Log => "log",
            Self::Result => "result",
        }
    }
}

/// Idempotent replay: the run with this id already finished. Its whole text (and reasoning) comes
/// as one delta each, so the replayed stream keeps the stream invariants.
pub(super) fn replay(result: RunResult) -> RunEvents {
    let mut events = Vec::with_capacity(3);
    if !result.reasoning.is_empty() {
        events.push(Event::ReasoningDelta {
            text: result.reasoning.clone(),
            turn: result.turns,
        });
    }
    if !result.text.is_empty() {
        events.push(Event::TextDelta {
            text: result.text.clone(),
            turn: result.turns,
        });
    }
    events.push(Event::RunFinished(Box::new(result)));
    let events: Vec<_> = events
        .into_iter()
        .zip(1..)
        .map(|(event, seq)| Ok(NumberedEvent { seq, event }))
        .collect();
    futures::stream::iter(events).boxed()
}

/// An attached caller's stream: the run's logged events. A run that moves away from here (a durable
/// run handed over, or one this replica stopped acting for), or that runs elsewhere while this
/// replica drains, ends its attached streams with `UNAVAILABLE` naming the run and the last seq
/// sent, so the caller attaches again elsewhere; a run that ends here keeps its followers until its
/// end, within the drain's grace.
pub(super) fn attached(deps: &StreamDeps, run_id: String, after_seq: u64, feed: EventFeed) -> RunEvents {
    struct Follow {
        feed: EventFeed,
        /// Resolves once the stream must end for the caller to attach elsewhere: looked up once
        /// per stream, not per event.
        left: futures::future::BoxFuture<'static, ()>,
        run_id: String,
        last_seq: u64,
        done: bool,
    }
    let (stopping, runs) = (deps.stopping.clone(), Arc::clone(&deps.runs));
    let moved = deps.runs.moved_from_here(&run_id);
    let left = {
        let run_id = run_id.clone();
        async move {
            tokio::select! {
                biased;
                () = moved => {}
                () = async {
                    stopping.cancelled().await;
                    runs.moved_away(&run_id).await;
                } => {}
            }
        }
    };
    let follow = Follow {
        feed,
        left: Box::pin(left),
        run_id,
        last_seq: after_seq,
        done: false,
    };
    futures::stream::unfold(follow, |mut f| async move {
        if f.done {
            return None;
        }
        let item = tokio::select! {
            biased;
            item = f.feed.next() => item?,
            () = &mut f.left => {
                f.done = true;
                let left = Error::LeftReplica {
                    run_id: f.run_id.clone(),
                    after_seq: f.last_seq,
                };
                return Some((Err(left), f));
            }
        };
        let item = match item {
            Ok(event) => {
                f.last_seq = event.seq;
                Ok(event)
            }
            Err(e) => {
                f.done = true;
                Err(Error::Log(e))
            }
        };
        Some((item, f))
    })
    .boxed()
}
