//! The live side of a run: its state shared with `GetRun`, the handle that cancels it, the
//! emitter that numbers and sends its events, and [`AdmittedRun`], everything the loop is handed
//! when a run is let in.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::domain::ports::{LogWriter, Notices, Settled};
use crate::domain::{CancelMode, Event, EventBatch, NumberedEvent, RunSpec, ToolCallError};
use crate::run::persist::Persister;

pub use super::SharedState;

/// Cancels a run, saying why: at once, or after the turn in progress.
#[derive(Clone, Debug, Default)]
pub struct Cancel {
    token: CancellationToken,
    reason: Arc<OnceLock<String>>,
    /// Set by a cancel that lets the turn in progress end first (the loop reads it at the turn's
    /// end); an immediate cancel may still follow.
    after_turn: Arc<OnceLock<String>>,
}

impl Cancel {
    /// Cancels the run (the first reason given wins).
    pub fn cancel(&self, reason: &str) {
        let _ = self.reason.set(reason.to_owned());
        self.token.cancel();
    }

    /// Cancels the run `mode`'s way.
    pub fn cancel_with(&self, mode: CancelMode, reason: &str) {
        match mode {
            CancelMode::Immediate => self.cancel(reason),
            CancelMode::AfterTurn => {
                let _ = self.after_turn.set(reason.to_owned());
            }
        }
    }

    /// Why the run is to end once its turn has ended, if it is.
    pub(crate) fn after_turn(&self) -> Option<String> {
        self.after_turn.get().cloned()
    }

    /// Whether the run was canceled.
    pub fn is_canceled(&self) -> bool {
        self.token.is_cancelled()
    }

    /// Resolves with the reason once the run is canceled.
    pub(crate) async fn cancelled(&self) -> String {
        self.token.cancelled().await;
        self.reason()
    }

    /// Why the run was canceled.
    pub(crate) fn reason(&self) -> String {
        self.reason.get().cloned().unwrap_or_else(|| "canceled".to_owned())
    }
}

/// How events reach a caller.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EmitSettings {
    /// Longest wait for the caller to take an event; a caller that takes none for this long is
    /// given up (an attached run is then canceled, a detached one goes on without its stream).
    pub send_timeout: Duration,
    /// Largest text or tool result in one event: longer text is split over several events, a
    /// longer result is cut in its event (and flagged).
    pub max_event_bytes: usize,
}

/// Numbers events and sends them to the caller's stream (a bounded channel: a slow reader slows
/// its own run, up to [`EmitSettings::send_timeout`] per batch).
///
/// Text is added to the run's state when its event is numbered, and every numbered event is
/// sent before `run_finished` (a send that is interrupted keeps its batch for the next one), so
/// the seq numbers have no gaps and the streamed text always equals the result's text.
///
/// Events the loop produces together (a turn's signals and tool-call starts, its tool-call
/// results and end) are [queued](Self::queue) and sent as one batch, which reaches the caller
/// in one HTTP/2 write instead of one write (and one wake-up of each side) per event. Every
/// [`send`](Self::send) first sends what is queued, and the loop [flushes](Self::flush) before
/// it waits for the model or the tools, so nothing queued waits on them.
///
/// Every batch is also appended to the run's event log (when it has one) before it is sent, so
/// a caller that re-attaches (`AttachRun`) finds every event, whether or not the first caller
/// still reads.
pub struct Emitter {
    tx: Option<mpsc::Sender<EventBatch>>,
    seq: u64,
    /// Numbered, not yet sent.
    queued: EventBatch,
    state: SharedState,
    settings: EmitSettings,
    /// Canceled when the caller stops reading (`None`: a detached run, which goes on).
    on_stall: Option<Cancel>,
    /// The run's event log.
    log: Option<Box<dyn LogWriter>>,
    /// The last seq appended to the log (a flush interrupted while it waits sends its batch
    /// again, but logs it once).
    logged_through: u64,
    /// Told of each batch before the caller is: the run's webhooks.
    notices: Option<Arc<dyn Notices>>,
}

impl Emitter {
    /// The largest text one event carries.
    pub fn max_event_bytes(&self) -> usize {
        self.settings.max_event_bytes
    }

    /// An emitter writing to `tx` (`None`: nobody listens, e.g. a detached run whose caller left).
    /// `on_stall` is canceled when the caller stops taking events.
    pub fn new(
        tx: Option<mpsc::Sender<EventBatch>>,
        state: SharedState,
        settings: EmitSettings,
        on_stall: Option<Cancel>,
    ) -> Self {
        Self {
            tx,
            seq: 0,
            queued: Vec::new(),
            state,
            settings,
            on_stall,
            log: None,
            logged_through: 0,
            notices: None,
        }
    }

    /// The emitter, telling `notices` of every batch before the caller.
    pub(crate) fn with_notices(mut self, notices: Arc<dyn Notices>) -> Self {
        self.notices = Some(notices);
        self
    }

    /// The emitter, appending every event to `log` too.
    pub fn with_log(mut self, log: Option<Box<dyn LogWriter>>) -> Self {
        self.log = log;
        self
    }

    /// The emitter of a run taken over: its log holds the events through `logged`, the run's
    /// checkpoint numbered events through `seq`, of which `outbox` may not have reached the log;
    /// those after `logged` are queued again, with their numbers.
    pub(crate) fn continue_from(&mut self, logged: u64, seq: u64, outbox: Vec<NumberedEvent>) {
        self.seq = seq.max(logged);
        self.logged_through = logged;
        self.queued = outbox.into_iter().filter(|e| e.seq > logged).collect();
    }

    /// Takes the run's event-log writer (a run parked for approvals keeps it for its resumption).
    pub(crate) fn take_log(&mut self) -> Option<Box<dyn LogWriter>> {
        self.log.take()
    }

    /// Gives the run's event-log writer back (the run did not park after all).
    pub(crate) fn restore_log(&mut self, log: Option<Box<dyn LogWriter>>) {
        self.log = log;
    }

    /// The last seq numbered.
    pub(crate) fn seq(&self) -> u64 {
        self.seq
    }

    /// The events numbered and not sent yet.
    pub(crate) fn queued(&self) -> &[NumberedEvent] {
        &self.queued
    }

    /// What waits (at most `timeout`) until the log keeps every event sent so far, so a
    /// checkpoint taken then never numbers past what the log holds.
    pub(crate) fn settler(&self, timeout: Duration) -> Settler {
        Settler {
            settled: self.log.as_ref().and_then(|log| log.settled()),
            through: self.logged_through,
            timeout,
        }
    }

    /// Appends the queued events not logged yet to the run's event log now (they go to the
    /// caller with the next flush).
    pub(crate) fn log_queued(&mut self) {
        let (Some(log), Some(last)) = (&mut self.log, self.queued.last()) else {
            return;
        };
        if last.seq <= self.logged_through {
            return;
        }
        let start = self.queued.partition_point(|e| e.seq <= self.logged_through);
        log.append(&self.queued[start..]);
        self.logged_through = last.seq;
    }

    /// Numbers `event` and queues it behind the events already queued. Text longer than one
    /// event may carry is split; a call's arguments, a tool result or an error message is cut.
    pub fn queue(&mut self, event: Event) {
        match event {
            Event::TextDelta { text, turn } => self.queue_text(&text, turn),
            Event::ReasoningDelta { text, turn } => self.queue_reasoning(&text, turn),
            Event::ToolCallStarted {
                call_id,
                name,
                arguments_json,
                turn,
                arguments_truncated,
            } => {
                let (arguments_json, cut) = shared::text::truncate_owned(arguments_json, self.settings.max_event_bytes);
                self.number(Event::ToolCallStarted {
                    call_id,
                    name,
                    arguments_json,
                    turn,
                    arguments_truncated: arguments_truncated || cut,
                });
            }
            Event::ApprovalRequested {
                call_id,
                name,
                arguments_json,
                turn,
                expires_at_unix_ms,
                arguments_truncated,
                in_doubt,
            } => {
                let (arguments_json, cut) = shared::text::truncate_owned(arguments_json, self.settings.max_event_bytes);
                self.number(Event::ApprovalRequested {
                    call_id,
                    name,
                    arguments_json,
                    turn,
                    expires_at_unix_ms,
                    arguments_truncated: arguments_truncated || cut,
                    in_doubt,
                });
            }
            Event::ToolCallFinished {
                call_id,
                name,
                content_json,
                content_truncated,
                error,
                duration_ms,
            } => {
                let max = self.settings.max_event_bytes;
                let (content_json, cut) = match content_json.map(|c| shared::text::truncate_owned(c, max)) {
                    Some((content, cut)) => (Some(content), cut),
                    None => (None, false),
                };
                self.number(Event::ToolCallFinished {
                    call_id,
                    name,
                    content_json,
                    content_truncated: content_truncated || cut,
                    error: error.map(|e| ToolCallError {
                        message: shared::text::truncate_owned(e.message, max).0,
                        ..e
                    }),
                    duration_ms,
                });
            }
            Event::CallDecided {
                call_id,
                name,
                turn,
                mut decision,
                waited_ms,
            } => {
                let cut = |text: String| shared::text::truncate_owned(text, self.settings.max_event_bytes).0;
                decision.message = cut(std::mem::take(&mut decision.message));
                decision.original_arguments_json = cut(std::mem::take(&mut decision.original_arguments_json));
                decision.edited_arguments_json = cut(std::mem::take(&mut decision.edited_arguments_json));
                self.number(Event::CallDecided {
                    call_id,
                    name,
                    turn,
                    decision,
                    waited_ms,
                });
            }
            Event::MessageAdded { turn, content, name } => self.number(Event::MessageAdded {
                turn,
                content: shared::text::truncate_owned(content, self.settings.max_event_bytes).0,
                name,
            }),
            event => self.number(event),
        }
    }

    fn number(&mut self, event: Event) {
        self.seq += 1;
        self.queued.push(NumberedEvent { seq: self.seq, event });
    }

    /// Text: added to the run's output now, sent in pieces of at most `max_event_bytes`.
    fn queue_text(&mut self, text: &str, turn: u32) {
        shared::sync::lock(&self.state).text.push_str(text);
        for piece in shared::text::pieces(text, self.settings.max_event_bytes) {
            self.number(Event::TextDelta {
                text: piece.to_owned(),
                turn,
            });
        }
    }

    /// Reasoning: added to the run's reasoning now, sent in pieces as text is.
    fn queue_reasoning(&mut self, text: &str, turn: u32) {
        shared::sync::lock(&self.state).reasoning.push_str(text);
        for piece in shared::text::pieces(text, self.settings.max_event_bytes) {
            self.number(Event::ReasoningDelta {
                text: piece.to_owned(),
                turn,
            });
        }
    }

    /// Sends what is queued, as one batch. Waits at most `send_timeout` for room in the caller's
    /// stream; dropped while it waits, the batch stays queued.
    pub async fn flush(&mut self) {
        if self.queued.is_empty() {
            return;
        }
        self.log_queued();
        if let Some(notices) = &self.notices {
            notices.notice(&self.state, &self.queued).await;
        }
        let Some(tx) = self.tx.clone() else {
            self.queued.clear();
            return;
        };
        match tokio::time::timeout(self.settings.send_timeout, tx.reserve_owned()).await {
            Ok(Ok(permit)) => {
                permit.send(std::mem::take(&mut self.queued));
            }
            Ok(Err(_closed)) => {
                self.tx = None;
                self.queued.clear();
            }
            Err(_elapsed) => self.give_up_on_caller(),
        }
    }

    /// The caller took no event for `send_timeout`: its stream is dropped, and an attached run
    /// is canceled.
    fn give_up_on_caller(&mut self) {
        self.tx = None;
        self.queued.clear();
        let waited = humantime::format_duration(self.settings.send_timeout);
        metrics::counter!(crate::telemetry::metric::CALLER_STALLS).increment(1);
        tracing::warn!("the caller read no event for {waited}; its stream is dropped");
        if let Some(cancel) = &self.on_stall {
            cancel.cancel(&format!(
                "the caller stopped reading its event stream (nothing read for {waited})"
            ));
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
    }

    /// Sends reasoning and adds it to the run's reasoning.
    pub(crate) async fn reasoning(&mut self, text: &str, turn: u32) {
        if text.is_empty() {
            return;
        }
        self.send(Event::ReasoningDelta {
            text: text.to_owned(),
            turn,
        })
        .await;
    }
}

/// Waits until a run's log keeps its events through a seq (or is broken), within a timeout.
#[derive(Clone)]
pub(crate) struct Settler {
    settled: Option<tokio::sync::watch::Receiver<Settled>>,
    through: u64,
    timeout: Duration,
}

impl Settler {
    /// Waits; a log that takes longer is logged and not waited for. Whether the log keeps every
    /// event through the last one sent (always, without a log).
    pub(crate) async fn wait(&self) -> bool {
        let (Some(mut settled), through) = (self.settled.clone(), self.through) else {
            return true;
        };
        match tokio::time::timeout(self.timeout, settled.wait_for(|s| s.resolved(through))).await {
            Ok(Ok(now)) => now.kept_through >= through,
            Ok(Err(_)) => false,
            Err(_) => {
                tracing::warn!(through, "the event log did not settle in time; going on");
                false
            }
        }
    }
}

/// The caller's end of a durable run's stream: batches reach `caller` only once the run's event
/// log keeps them (`settled`), so a caller never holds an event that a replica taking the run
/// over would number differently. Once the log is broken the caller is sent what it keeps and its
/// stream ends (re-attaching, it is told of the loss). A caller that takes nothing for
/// `send_timeout` is dropped.
pub fn gated(
    caller: mpsc::Sender<EventBatch>,
    mut settled: tokio::sync::watch::Receiver<Settled>,
    send_timeout: Duration,
) -> mpsc::Sender<EventBatch> {
    let (tx, mut rx) = mpsc::channel::<EventBatch>(caller.max_capacity());
    shared::tasks::spawn(async move {
        while let Some(mut batch) = rx.recv().await {
            let last = batch.last().map_or(0, |e| e.seq);
            let Ok(now) = settled.wait_for(|s| s.resolved(last)).await.map(|s| *s) else {
                return;
            };
            batch.retain(|e| e.seq <= now.kept_through);
            if !batch.is_empty() && !matches!(tokio::time::timeout(send_timeout, caller.send(batch)).await, Ok(Ok(())))
            {
                return;
            }
            if now.kept_through < last {
                return;
            }
        }
    });
    tx
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
    /// The run's slot: dropped once the result is stored (before `run_finished` is delivered), which
    /// frees it for the next run.
    pub slot: Option<Box<dyn Send>>,
    /// Set by a draining replica: a durable run hands over to another replica.
    pub hand_over: HandOver,
    /// Messages sent to the run (`SendMessage`), taken at its turn boundaries.
    pub inbox: super::steering::Inbox,
}

/// A draining replica's request that a durable run move to another replica: at its next safe
/// point, or at once (from its last checkpoint) once the hand_over grace is over.
#[derive(Clone, Debug, Default)]
pub struct HandOver {
    /// Hand over at the next safe point.
    pub at_safe_point: CancellationToken,
    /// Hand over now.
    pub now: CancellationToken,
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tokio::sync::{mpsc, watch};

    use super::gated;
    use crate::domain::ports::Settled;
    use crate::domain::{Event, NumberedEvent};

    fn text(seq: u64) -> NumberedEvent {
        NumberedEvent {
            seq,
            event: Event::TextDelta {
                text: seq.to_string(),
                turn: 1,
            },
        }
    }

    fn kept(through: u64, broken: bool) -> Settled {
        Settled {
            kept_through: through,
            broken,
        }
    }

    /// A durable run's caller gets a batch once the log keeps it; once the log is broken, what
    /// it keeps of the batch and then the end of the stream (never an event the log lacks).
    #[tokio::test]
    async fn the_gate_sends_what_the_log_keeps_and_ends_at_a_hole() {
        let (caller, mut received) = mpsc::channel(8);
        let (settled, rx) = watch::channel(kept(0, false));
        let gate = gated(caller, rx, Duration::from_secs(5));
        gate.send(vec![text(1), text(2)]).await.unwrap();
        gate.send(vec![text(3), text(4)]).await.unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(received.try_recv().is_err(), "nothing before the log keeps it");
        settled.send_replace(kept(2, false));
        let first = tokio::time::timeout(Duration::from_secs(5), received.recv())
            .await
            .unwrap();
        assert_eq!(first.map(|b| b.len()), Some(2));
        settled.send_replace(kept(3, true));
        let rest = tokio::time::timeout(Duration::from_secs(5), received.recv())
            .await
            .unwrap();
        assert_eq!(rest.map(|b| b.iter().map(|e| e.seq).collect::<Vec<_>>()), Some(vec![3]));
        let end = tokio::time::timeout(Duration::from_secs(5), received.recv())
            .await
            .unwrap();
        assert!(end.is_none(), "the stream ends at the hole");
    }
}
