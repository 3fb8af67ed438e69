//! The busy policies: a run takes the thread it names before it is let in, and while another run
//! holds it, the run's `on_busy` decides: `reject` refuses it, `enqueue` waits its turn,
//! `interrupt` asks the holder to end after its turn and waits, `rollback` marks the holder's
//! messages dropped and cancels it at once. The thread's own rules (who holds it, its queue, what
//! the model sees) are `domain::thread`'s; this file waits within the run's deadline and acts on
//! the holder through [`Holders`].

use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use shared::auth::Principal;

use super::{Change, Keeper};
use crate::Error;
use crate::domain::chat::Message;
use crate::domain::thread::{Begin, BusyPolicy, RunThread, Thread};
use crate::domain::visibility::sees;
use crate::domain::{CancelMode, RunSpec, RunStatus};

/// A run that took a thread and never started lets it go after this long (its replica stopped
/// between taking the thread and claiming the run).
const NEVER_STARTED: Duration = Duration::from_secs(60);

/// The longest pause between two looks at a thread a run waits for.
const MAX_POLL: Duration = Duration::from_millis(500);

/// What the busy policies ask of the runs: how one stands, and to stop one.
pub(crate) trait Holders: Sync {
    /// The status of `run_id` as `caller` sees it (`None`: unknown to it, or not found).
    fn status<'a>(&'a self, run_id: &'a str, caller: &'a Principal) -> BoxFuture<'a, Result<Option<RunStatus>, Error>>;

    /// Asks `run_id` to stop (`mode`) for `reason`; what became of it, said for a log.
    fn stop<'a>(&'a self, run_id: &'a str, reason: &'a str, mode: CancelMode) -> BoxFuture<'a, Result<String, Error>>;
}

/// What a run asking for its thread was told, with what it sees of the thread once it holds it.
struct Asked {
    begin: Begin,
    seen: Option<(Vec<Message>, usize)>,
    /// Since when the holder holds the thread (Unix ms).
    live_since_unix_ms: u64,
}

/// A run waiting for its thread: dropped before it holds it (its caller went away, or its
/// deadline passed), it leaves the thread's queue, so it holds up no run after it.
struct ThreadWait {
    threads: Arc<Keeper>,
    thread_id: String,
    run_id: String,
    armed: bool,
}

impl Drop for ThreadWait {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let (threads, thread_id, run_id) = (Arc::clone(&self.threads), self.thread_id.clone(), self.run_id.clone());
        shared::tasks::spawn(async move { threads.leave(&thread_id, &run_id).await });
    }
}

/// The run of `spec` takes the thread it names (created on first use, owned by `caller`),
/// following its busy policy while another run holds it, within the run's deadline. The spec
/// comes back with what the model sees of the thread, and whether the run took the thread now
/// (so it lets it go if it is not let in).
pub(crate) async fn take(
    threads: &Arc<Keeper>,
    holders: &dyn Holders,
    mut spec: RunSpec,
    caller: &Principal,
) -> Result<(RunSpec, bool), Error> {
    if spec.thread.is_none() {
        return Ok((spec, false));
    }
    // A run id known already is answered by its admission (a replay, or a run live already),
    // whoever holds the thread now.
    if holders.status(&spec.run_id, caller).await.ok().flatten().is_some() {
        return Ok((spec, false));
    }
    let Some(thread) = spec.thread.take() else {
        return Ok((spec, false));
    };
    let mut waiting = ThreadWait {
        threads: Arc::clone(threads),
        thread_id: thread.thread_id.clone(),
        run_id: spec.run_id.clone(),
        armed: false,
    };
    let mut acted_on: Option<String> = None;
    let mut pause = Duration::from_millis(25);
    loop {
        let asked = ask(threads, &spec, &thread, caller).await?;
        match asked.begin {
            Begin::Started | Begin::Holding => {
                waiting.armed = false;
                let took = asked.begin == Begin::Started;
                let (history, left_out) = asked.seen.unwrap_or_default();
                spec.thread = Some(Box::new(RunThread {
                    history,
                    turns_left_out: u32::try_from(left_out).unwrap_or(u32::MAX),
                    ..*thread
                }));
                return Ok((spec, took));
            }
            Begin::Busy(live) => {
                return Err(Error::ThreadBusy {
                    thread_id: thread.thread_id,
                    live,
                });
            }
            Begin::QueueFull(max) => {
                return Err(Error::ThreadQueueFull {
                    thread_id: thread.thread_id,
                    max,
                });
            }
            Begin::Wait { live } => {
                waiting.armed = true;
                if let Some(live) = live {
                    let holder = (live.as_str(), asked.live_since_unix_ms);
                    act_on_holder(threads, holders, (&spec, &thread), holder, &mut acted_on).await;
                }
            }
        }
        let left = spec.deadline.at.saturating_duration_since(tokio::time::Instant::now());
        if left.is_zero() {
            return Err(Error::ThreadWait(thread.thread_id));
        }
        tokio::time::sleep(pause.min(left)).await;
        pause = (pause * 2).min(MAX_POLL);
    }
}

/// One look at the thread: `begin` applied and written (see [`Thread::begin`]).
async fn ask(threads: &Keeper, spec: &RunSpec, thread: &RunThread, caller: &Principal) -> Result<Asked, Error> {
    let now = shared::sync::unix_ms();
    let left = spec.deadline.at.saturating_duration_since(tokio::time::Instant::now());
    let until = now.saturating_add(u64::try_from(left.as_millis()).unwrap_or(u64::MAX));
    let limits = *threads.limits();
    let answer = threads
        .update(&thread.thread_id, |kept| {
            let mut kept = match kept {
                Some(kept) if !sees(caller, &kept.principal) => return Change::Keep(None),
                Some(kept) => kept,
                None => Thread::new(&thread.thread_id, &caller.name, now),
            };
            let before = kept.clone();
            let begin = kept.begin(&spec.run_id, thread.on_busy, (now, until), &limits);
            let seen = matches!(begin, Begin::Started | Begin::Holding).then(|| kept.transcript(thread.window));
            let asked = Asked {
                begin,
                seen,
                live_since_unix_ms: kept.live_since_unix_ms,
            };
            match kept == before {
                true => Change::Keep(Some(asked)),
                false => Change::Write(kept, Some(asked)),
            }
        })
        .await?;
    answer.ok_or_else(|| Error::NotFound(format!("thread {:?} not found", thread.thread_id)))
}

/// While the run waits: a holder that has ended (its end never reached the thread) or never
/// started is let go; otherwise, once per holder, the policy acts on it: `Interrupt` asks it to
/// end after its turn, `Rollback` marks its messages dropped and cancels it at once.
async fn act_on_holder(
    threads: &Keeper,
    holders: &dyn Holders,
    (spec, thread): (&RunSpec, &RunThread),
    (live, since): (&str, u64),
    acted_on: &mut Option<String>,
) {
    if holder_is_gone(holders, live, since).await {
        tracing::info!(thread_id = %thread.thread_id, run_id = %live, "the run holding the thread has ended; the thread is let go");
        threads.leave(&thread.thread_id, live).await;
        return;
    }
    if acted_on.as_deref() == Some(live) {
        return;
    }
    *acted_on = Some(live.to_owned());
    let (mode, why) = match thread.on_busy {
        BusyPolicy::Interrupt => (CancelMode::AfterTurn, "interrupted"),
        BusyPolicy::Rollback => {
            threads.mark_rolled_back(&thread.thread_id, live).await;
            (CancelMode::Immediate, "rolled back")
        }
        BusyPolicy::Enqueue | BusyPolicy::Reject => return,
    };
    let reason = format!("{why} by run {} on thread {}", spec.run_id, thread.thread_id);
    match holders.stop(live, &reason, mode).await {
        Ok(outcome) => {
            tracing::info!(thread_id = %thread.thread_id, run_id = %live, by = %spec.run_id, outcome, "{why}");
        }
        Err(e) => {
            tracing::warn!(thread_id = %thread.thread_id, run_id = %live, "{why}: the cancel failed: {e}; trying again");
            *acted_on = None;
        }
    }
}

/// Whether the run holding the thread (`since` then, Unix ms) has ended (its result says so) or
/// never started (unknown long after it took the thread).
async fn holder_is_gone(holders: &dyn Holders, live: &str, since: u64) -> bool {
    match holders.status(live, &Principal::anonymous()).await {
        Ok(Some(status)) => !status.is_live(),
        Ok(None) => {
            let limit = u64::try_from(NEVER_STARTED.as_millis()).unwrap_or(u64::MAX);
            since.saturating_add(limit) <= shared::sync::unix_ms()
        }
        Err(_) => false,
    }
}
