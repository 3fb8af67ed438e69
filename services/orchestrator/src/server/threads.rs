//! Core's thread operations: a run takes the thread it names before it is let in (waiting,
//! interrupting or rolling back the run holding it, as its request's busy policy says), lets it
//! go when it is not let in after all, and `GetThread` / `DeleteThread`. The rules of each change
//! are the thread's (`domain::thread`); this file waits, acts on the run holding the thread, and
//! answers the caller.

use std::sync::Arc;
use std::time::Duration;

use shared::auth::Principal;

use super::Core;
use crate::Error;
use crate::domain::thread::{Begin, BusyPolicy, RunThread, Thread};
use crate::domain::{CancelMode, RunSpec};
use crate::registry::sees;
use crate::threads::{Change, Keeper};

/// A run that took a thread and never started lets it go after this long (its replica stopped
/// between taking the thread and claiming the run).
const NEVER_STARTED: Duration = Duration::from_secs(60);

/// The longest pause between two looks at a thread a run waits for.
const MAX_POLL: Duration = Duration::from_millis(500);

/// What a run asking for its thread was told, with what it sees of the thread once it holds it.
struct Asked {
    begin: Begin,
    seen: Option<(Vec<crate::domain::chat::Message>, usize)>,
    /// Since when the holder holds the thread (Unix ms).
    live_since_unix_ms: u64,
}

/// A run waiting for its thread: dropped before it holds it (its caller went away, or its
/// deadline passed), it leaves the thread's queue, so it holds up no run after it.
struct Waiting {
    threads: Arc<Keeper>,
    thread_id: String,
    run_id: String,
    armed: bool,
}

impl Drop for Waiting {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let (threads, thread_id, run_id) = (Arc::clone(&self.threads), self.thread_id.clone(), self.run_id.clone());
        tokio::spawn(async move { leave(&threads, &thread_id, &run_id).await });
    }
}

/// `run_id` leaves the thread: out of its queue, and letting it go if it held it.
async fn leave(threads: &Keeper, thread_id: &str, run_id: &str) {
    let now = shared::sync::unix_ms();
    let left = threads
        .update(thread_id, |kept| match kept {
            Some(mut thread) => {
                thread.leave(run_id, now);
                Change::Write(thread, ())
            }
            None => Change::Keep(()),
        })
        .await;
    if let Err(e) = left {
        tracing::warn!(thread_id = %thread_id, run_id = %run_id, "leaving the thread failed: {e}");
    }
}

impl Core {
    /// The run of `spec` takes the thread it names (created on first use, owned by `caller`),
    /// following its busy policy while another run holds it, within the run's deadline. The
    /// spec comes back with what the model sees of the thread, and whether the run took the
    /// thread now (so it lets it go if it is not let in).
    pub(crate) async fn take_thread(&self, mut spec: RunSpec, caller: &Principal) -> Result<(RunSpec, bool), Error> {
        if spec.thread.is_none() {
            return Ok((spec, false));
        }
        // A run id known already is answered by its admission (a replay, or a run live
        // already), whoever holds the thread now.
        if self.runs.get(&spec.run_id, caller).await.ok().flatten().is_some() {
            return Ok((spec, false));
        }
        let Some(thread) = spec.thread.take() else {
            return Ok((spec, false));
        };
        let mut waiting = Waiting {
            threads: Arc::clone(&self.threads),
            thread_id: thread.thread_id.clone(),
            run_id: spec.run_id.clone(),
            armed: false,
        };
        let mut acted_on: Option<String> = None;
        let mut pause = Duration::from_millis(25);
        loop {
            let asked = self.ask_for_thread(&spec, &thread, caller).await?;
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
                        self.act_on_holder(&spec, &thread, holder, &mut acted_on).await;
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

    /// A run taken over whose log held its end joins its thread, as its own replica would have
    /// had it not stopped between logging the end and adding the run (the thread joins a run
    /// once, whoever adds it).
    pub(crate) async fn end_on_thread(&self, ended: crate::registry::EndedElsewhere) {
        if let Some(thread) = &ended.spec.thread {
            self.threads
                .end_run(&ended.spec, thread, ended.conversation, ended.status)
                .await;
        }
    }

    /// One look at the thread: `begin` applied and written (see [`Thread::begin`]).
    async fn ask_for_thread(&self, spec: &RunSpec, thread: &RunThread, caller: &Principal) -> Result<Asked, Error> {
        let now = shared::sync::unix_ms();
        let left = spec.deadline.at.saturating_duration_since(tokio::time::Instant::now());
        let until = now.saturating_add(u64::try_from(left.as_millis()).unwrap_or(u64::MAX));
        let limits = *self.threads.limits();
        let answer = self
            .threads
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
    /// started is let go; otherwise, once per holder, the policy acts on it: `Interrupt` asks it
    /// to end after its turn, `Rollback` marks its messages dropped and cancels it at once.
    async fn act_on_holder(
        &self,
        spec: &RunSpec,
        thread: &RunThread,
        (live, since): (&str, u64),
        acted_on: &mut Option<String>,
    ) {
        if self.holder_is_gone(live, since).await {
            tracing::info!(thread_id = %thread.thread_id, run_id = %live, "the run holding the thread has ended; the thread is let go");
            leave(&self.threads, &thread.thread_id, live).await;
            return;
        }
        if acted_on.as_deref() == Some(live) {
            return;
        }
        *acted_on = Some(live.to_owned());
        let server = Principal::default();
        let (mode, why) = match thread.on_busy {
            BusyPolicy::Interrupt => (CancelMode::AfterTurn, "interrupted"),
            BusyPolicy::Rollback => {
                self.mark_rolled_back(&thread.thread_id, live).await;
                (CancelMode::Immediate, "rolled back")
            }
            BusyPolicy::Enqueue | BusyPolicy::Reject => return,
        };
        let reason = format!("{why} by run {} on thread {}", spec.run_id, thread.thread_id);
        match self.runs.cancel(live, &server, &reason, mode).await {
            Ok(outcome) => {
                tracing::info!(thread_id = %thread.thread_id, run_id = %live, by = %spec.run_id, ?outcome, "{why}");
            }
            Err(e) => {
                tracing::warn!(thread_id = %thread.thread_id, run_id = %live, "{why}: the cancel failed: {e}; trying again");
                *acted_on = None;
            }
        }
    }

    /// Whether the run holding the thread (`since` then, Unix ms) has ended (its result says so)
    /// or never started (unknown long after it took the thread).
    async fn holder_is_gone(&self, live: &str, since: u64) -> bool {
        match self.runs.get(live, &Principal::default()).await {
            Ok(Some(run)) => !run.status.is_live(),
            Ok(None) => {
                let limit = u64::try_from(NEVER_STARTED.as_millis()).unwrap_or(u64::MAX);
                since.saturating_add(limit) <= shared::sync::unix_ms()
            }
            Err(_) => false,
        }
    }

    async fn mark_rolled_back(&self, thread_id: &str, live: &str) {
        let marked = self
            .threads
            .update(thread_id, |kept| match kept {
                Some(mut thread) if thread.live.as_deref() == Some(live) => {
                    thread.roll_back(live);
                    Change::Write(thread, ())
                }
                _ => Change::Keep(()),
            })
            .await;
        if let Err(e) = marked {
            tracing::warn!(thread_id = %thread_id, run_id = %live, "marking the run rolled back failed: {e}");
        }
    }

    /// The run of `spec` took its thread and was not let in: it lets the thread go.
    pub(crate) async fn leave_thread(&self, spec: &RunSpec) {
        if let Some(thread) = &spec.thread {
            leave(&self.threads, &thread.thread_id, &spec.run_id).await;
        }
    }

    /// The thread, when `caller` may see it.
    pub(crate) async fn get_thread(&self, thread_id: &str, caller: &Principal) -> Result<Thread, Error> {
        self.threads
            .read(thread_id)
            .await?
            .filter(|t| sees(caller, &t.principal))
            .ok_or_else(|| Error::NotFound(format!("thread {thread_id:?} not found")))
    }

    /// Deletes the thread of `caller`, unless a run holds it or waits for it.
    pub(crate) async fn delete_thread(&self, thread_id: &str, caller: &Principal) -> Result<bool, Error> {
        let deleted = self
            .threads
            .update(thread_id, |kept| match kept {
                Some(t) if !sees(caller, &t.principal) => Change::Keep(Ok(false)),
                Some(t) if t.live.is_some() || !t.queue.is_empty() => Change::Keep(Err(t.live.unwrap_or_default())),
                Some(_) => Change::Delete(Ok(true)),
                None => Change::Keep(Ok(false)),
            })
            .await?;
        match deleted {
            Ok(true) => Ok(true),
            Ok(false) => Err(Error::NotFound(format!("thread {thread_id:?} not found"))),
            Err(live) => Err(Error::NotNow(format!(
                "thread {thread_id:?} is held by run {live:?} or has runs waiting for it; cancel them, then delete it"
            ))),
        }
    }
}
