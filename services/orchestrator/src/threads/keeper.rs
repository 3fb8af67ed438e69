//! The thread keeper: every change of a thread is read, applied by the thread's rules
//! ([`Thread`]) and written back compare-and-set on the [`ThreadStore`] (tried again when another
//! replica wrote in between), each store operation within the store timeout. [`Keeper::end_run`]
//! is the loop's: a run's messages join its thread as it ends; `GetThread` and `DeleteThread` are
//! answered here, for the callers who may see the thread.

use std::sync::Arc;
use std::time::Duration;

use shared::auth::Principal;

use crate::Error;
use crate::domain::RunSpec;
use crate::domain::RunStatus;
use crate::domain::chat::Message;
use crate::domain::ports::{StoreError, ThreadStore, within};
use crate::domain::thread::{RunThread, Thread, ThreadLimits, ThreadRun};
use crate::domain::visibility::sees;

/// Compare-and-set attempts before a change gives up (others kept writing the thread).
const CAS_ATTEMPTS: usize = 32;

/// What a change does to the thread it read.
pub(crate) enum Change<T> {
    /// Writes the thread, and answers `T`.
    Write(Thread, T),
    /// Deletes it.
    Delete(T),
    /// Leaves it as it is.
    Keep(T),
}

/// The threads of this deployment, with their limits.
pub struct Keeper {
    store: Arc<dyn ThreadStore>,
    limits: ThreadLimits,
    timeout: Duration,
}

impl Keeper {
    /// Threads kept in `store` within `limits`, each store operation given `timeout`.
    pub fn new(store: Arc<dyn ThreadStore>, limits: ThreadLimits, timeout: Duration) -> Self {
        Self { store, limits, timeout }
    }

    /// The limits.
    pub fn limits(&self) -> &ThreadLimits {
        &self.limits
    }

    /// The thread as kept.
    pub(crate) async fn read(&self, thread_id: &str) -> Result<Option<Thread>, StoreError> {
        Ok(within(self.timeout, self.store.read(thread_id)).await?.map(|(t, _)| t))
    }

    /// Applies `change` to the thread (`None`: not kept) until its write lands.
    pub(crate) async fn update<T>(
        &self,
        thread_id: &str,
        mut change: impl FnMut(Option<Thread>) -> Change<T>,
    ) -> Result<T, StoreError> {
        for _ in 0..CAS_ATTEMPTS {
            let read = within(self.timeout, self.store.read(thread_id)).await?;
            let revision = read.as_ref().map_or(0, |(_, r)| *r);
            let written = match change(read.map(|(t, _)| t)) {
                Change::Keep(answer) => return Ok(answer),
                Change::Write(thread, answer) => {
                    (within(self.timeout, self.store.write(thread, revision)).await?).then_some(answer)
                }
                Change::Delete(answer) if revision == 0 => Some(answer),
                Change::Delete(answer) => {
                    (within(self.timeout, self.store.delete(thread_id, revision)).await?).then_some(answer)
                }
            };
            if let Some(answer) = written {
                return Ok(answer);
            }
        }
        Err(StoreError::Unavailable {
            operation: "thread update",
            key: thread_id.to_owned(),
            reason: "the thread kept changing under this write".to_owned(),
        })
    }

    /// The run of `spec` ended with `status`: its request messages and its `conversation` join
    /// its thread (see [`Thread::end`]), and it lets the thread go. A store that refuses is
    /// tried again for a while; the thread then stays held by the run, and the next run on it
    /// finds the run ended and takes the thread (without its messages; logged here).
    pub async fn end_run(&self, spec: &RunSpec, thread: &RunThread, conversation: Vec<Message>, status: RunStatus) {
        let mut messages = spec.messages.clone();
        messages.extend(conversation);
        let run = ThreadRun {
            run_id: spec.run_id.clone(),
            status,
            messages,
            ended_at_unix_ms: shared::sync::unix_ms(),
        };
        let limits = self.limits;
        let principal = spec.principal.clone();
        let mut delay = Duration::from_millis(50);
        for attempt in 1..=4 {
            let ended = self
                .update(&thread.thread_id, |kept| {
                    let mut kept =
                        kept.unwrap_or_else(|| Thread::new(&thread.thread_id, &principal, run.ended_at_unix_ms));
                    kept.end(run.clone(), &limits);
                    Change::Write(kept, ())
                })
                .await;
            match ended {
                Ok(()) => return,
                Err(e) if attempt == 4 => {
                    tracing::error!(thread_id = %thread.thread_id, "the run's messages could not be added to its thread: {e}");
                }
                Err(e) => {
                    tracing::warn!(thread_id = %thread.thread_id, attempt, "adding the run's messages to its thread failed: {e}; trying again");
                    tokio::time::sleep(delay).await;
                    delay *= 2;
                }
            }
        }
    }

    /// `run_id` leaves the thread: out of its queue, and letting it go if it held it.
    pub(crate) async fn leave(&self, thread_id: &str, run_id: &str) {
        let now = shared::sync::unix_ms();
        let left = self
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

    /// The messages of `live`, the run holding the thread, are marked dropped (a rollback).
    pub(crate) async fn mark_rolled_back(&self, thread_id: &str, live: &str) {
        let marked = self
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

    /// The thread, when `caller` may read it (`GetThread`: its owner, or an operator).
    pub(crate) async fn get(&self, thread_id: &str, caller: &Principal) -> Result<Thread, Error> {
        self.read(thread_id)
            .await?
            .filter(|t| crate::domain::visibility::reads(caller, &t.principal))
            .ok_or_else(|| Error::NotFound(format!("thread {thread_id:?} not found")))
    }

    /// Deletes the thread of `caller`, unless a run holds it or waits for it (`DeleteThread`).
    pub(crate) async fn delete(&self, thread_id: &str, caller: &Principal) -> Result<bool, Error> {
        let deleted = self
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
