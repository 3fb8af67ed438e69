//! The live side of a run: its state shared with `GetRun`, the handle that cancels it, the
//! emitter that numbers and sends its events, and [`AdmittedRun`], everything the loop is handed
//! when a run is let in.

use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError};

use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::{Event, EventBatch, NumberedEvent, RunResult, RunSpec};
use crate::store::Persister;

/// The live state of a run, shared with `GetRun`.
pub type SharedState = Arc<Mutex<RunResult>>;

/// Locks a run's state. A panic while holding the lock cannot leave a `RunResult` half-written in
/// a harmful way, so a poisoned lock is used as it is.
pub(crate) fn lock(state: &SharedState) -> MutexGuard<'_, RunResult> {
    state.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Cancels a run, saying why.
#[derive(Clone, Debug, Default)]
pub struct Cancel {
    token: CancellationToken,
    reason: Arc<OnceLock<String>>,
}

impl Cancel {
    /// Cancels the run (the first reason given wins).
    pub fn cancel(&self, reason: &str) {
        let _ = self.reason.set(reason.to_owned());
        self.token.cancel();
    }

    /// Whether the run was canceled.
    pub fn is_canceled(&self) -> bool {
        self.token.is_cancelled()
    }

    /// Resolves with the reason once the run is canceled.
    pub(crate) async fn cancelled(&self) -> String {
        self.token.cancelled().await;
        self.reason.get().cloned().unwrap_or_else(|| "canceled".to_owned())
    }
}

/// Numbers events and sends them to the caller's stream (a bounded channel: a slow reader slows
/// its own run). Text is added to the run's state only once its event is sent, so the streamed
/// text always equals the result's text.
///
/// Events the loop produces together (a turn's signals and tool-call starts, its tool-call
/// results and end) are [queued](Self::queue) and sent as one batch, which reaches the caller
/// in one HTTP/2 write instead of one write (and one wake-up of each side) per event. Every
/// [`send`](Self::send) first sends what is queued, and the loop [flushes](Self::flush) before
/// it waits for the model or the tools, so nothing queued waits on them.
pub struct Emitter {
    tx: Option<mpsc::Sender<EventBatch>>,
    seq: u64,
    /// Numbered, not yet sent.
    queued: EventBatch,
    state: SharedState,
}

impl Emitter {
    /// An emitter writing to `tx` (`None`: nobody listens, e.g. a detached run whose caller left).
    pub fn new(tx: Option<mpsc::Sender<EventBatch>>, state: SharedState) -> Self {
        Self {
            tx,
            seq: 0,
            queued: Vec::new(),
            state,
        }
    }

    /// Numbers `event` and queues it behind the events already queued.
    pub fn queue(&mut self, event: Event) {
        self.seq += 1;
        self.queued.push(NumberedEvent { seq: self.seq, event });
    }

    /// Sends what is queued, as one batch.
    pub async fn flush(&mut self) {
        if self.queued.is_empty() {
            return;
        }
        let batch = std::mem::take(&mut self.queued);
        if let Some(tx) = &self.tx
            && tx.send(batch).await.is_err()
        {
            self.tx = None;
        }
    }

    /// Sends one event (after what is queued).
    pub async fn send(&mut self, event: Event) {
        self.queue(event);
        self.flush().await;
    }

    /// Sends visible text and adds it to the run's output.
    pub(crate) async fn text(&mut self, text: &str, turn: u32) {
        if text.is_empty() {
            return;
        }
        self.send(Event::TextDelta {
            text: text.to_owned(),
            turn,
        })
        .await;
        lock(&self.state).text.push_str(text);
    }
}

/// A run that was let in: its spec and everything live about it, handed to the loop as one value.
pub struct AdmittedRun {
    /// What to run.
    pub spec: RunSpec,
    /// The output so far, read by `GetRun`.
    pub state: SharedState,
    /// The caller's event stream.
    pub emitter: Emitter,
    /// Set by `CancelRun` and the drain.
    pub cancel: Cancel,
    /// A sender of the caller's stream, watched to end a run whose caller went away; `None` for a
    /// detached run, which keeps going without its caller.
    pub caller: Option<mpsc::Sender<EventBatch>>,
    /// Writes checkpoints and the final result to the result store.
    pub persister: Option<Persister>,
    /// The run's slot: dropped once the result is stored and sent, which frees it for the next run.
    pub slot: Option<Box<dyn Send>>,
}
