//! A run's event stream, typed: [`Event`]s in order, checked against the contract (`seq` 1, 2,
//! 3 … without gaps; `run_finished` last), and canceled when dropped before the end.
//!
//! The stream follows its run across orchestrator replicas: when it ends `UNAVAILABLE` (the
//! replica is draining) or breaks off (the connection died: `UNKNOWN` or `INTERNAL`) before
//! `run_finished`, it calls
//! `AttachRun` from the last seq it yielded, under the client's [`Retry`](crate::Retry) policy,
//! and goes on, so the caller sees one stream without gaps or duplicates across any number of
//! moves. Re-attaching gives up after one attempt fewer in a row than the policy's attempts
//! without a new event (so [`Retry::none`](crate::Retry::none) never re-attaches).
//!
//! After `run_finished` the stream is read to its real end (the call's trailers) before it says
//! `None`: a call dropped before its trailers is reset on the wire, and an HTTP/2 server closes a
//! connection that sees many such resets, which would fail the client's later calls.

use std::pin::Pin;
use std::task::{Context, Poll};

use futures::future::BoxFuture;
use futures::{FutureExt, Stream, StreamExt};
use proto::orchestrator::v1 as pb;
use proto::orchestrator::v1::orchestrate_event::Event as E;

use crate::{Client, Error};

/// One event of a run.
#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    /// The run started: model, tools offered, limits in force.
    Started(pb::RunStarted),
    /// User-visible text.
    Text {
        /// The piece of text.
        text: String,
        /// Its turn (1-based).
        turn: u32,
    },
    /// The model's reasoning (not part of the text).
    Reasoning {
        /// The piece of reasoning.
        text: String,
        /// Its turn (1-based).
        turn: u32,
    },
    /// A normal tool call went to a tool-runner.
    ToolCallStarted(pb::ToolCallStarted),
    /// A normal tool call finished (`ok`, or its `error`).
    ToolCallFinished(pb::ToolCallFinished),
    /// The model emitted an exit tool call.
    Signal(pb::Signal),
    /// A turn ended.
    TurnFinished(pb::TurnFinished),
    /// The turn starts again (the run moved to another replica while the model streamed it): the
    /// text and reasoning of this turn yielded before no longer count. [`RunStream::text`] and
    /// [`Transcript`] apply the rule.
    TurnRestarted(pb::TurnRestarted),
    /// A normal tool call waits for a person's decision ([`Client::decide`]); the run parks
    /// (the stream goes on when it resumes).
    ApprovalRequested(pb::ApprovalRequested),
    /// A user message sent with [`Client::send_message`] joined the conversation.
    MessageAdded(pb::MessageAdded),
    /// A normal tool call asks a person questions before it can finish; the run parks until
    /// they are answered (`AnswerToolInput`) or expire.
    ToolInputRequested(pb::ToolInputRequested),
    /// A normal tool call still running says how it gets on (its MCP server runs it as a
    /// task); never part of what the model sees.
    ToolCallProgress(pb::ToolCallProgress),
    /// A call that waited for a person was decided (or its wait expired): who, when, after how
    /// long, and what.
    CallDecided(pb::CallDecided),
    /// The run ended; always the last event.
    Finished(Box<pb::RunResult>),
}

impl Event {
    /// The typed event of a proto one.
    pub fn from_proto(event: E) -> Self {
        match event {
            E::RunStarted(e) => Self::Started(e),
            E::TextDelta(e) => Self::Text {
                text: e.text,
                turn: e.turn,
            },
            E::ReasoningDelta(e) => Self::Reasoning {
                text: e.text,
                turn: e.turn,
            },
            E::ToolCallStarted(e) => Self::ToolCallStarted(e),
            E::ToolCallFinished(e) => Self::ToolCallFinished(e),
            E::Signal(e) => Self::Signal(e),
            E::TurnFinished(e) => Self::TurnFinished(e),
            E::TurnRestarted(e) => Self::TurnRestarted(e),
            E::ApprovalRequested(e) => Self::ApprovalRequested(e),
            E::MessageAdded(e) => Self::MessageAdded(e),
            E::ToolInputRequested(e) => Self::ToolInputRequested(e),
            E::ToolCallProgress(e) => Self::ToolCallProgress(e),
            E::CallDecided(e) => Self::CallDecided(e),
            E::RunFinished(e) => Self::Finished(Box::new(e.result.unwrap_or_default())),
        }
    }

    /// The proto event this one was typed from (for printing it as the contract names it).
    pub fn into_proto(self) -> E {
        match self {
            Self::Started(e) => E::RunStarted(e),
            Self::Text { text, turn } => E::TextDelta(pb::TextDelta { text, turn }),
            Self::Reasoning { text, turn } => E::ReasoningDelta(pb::ReasoningDelta { text, turn }),
            Self::ToolCallStarted(e) => E::ToolCallStarted(e),
            Self::ToolCallFinished(e) => E::ToolCallFinished(e),
            Self::Signal(e) => E::Signal(e),
            Self::TurnFinished(e) => E::TurnFinished(e),
            Self::TurnRestarted(e) => E::TurnRestarted(e),
            Self::ApprovalRequested(e) => E::ApprovalRequested(e),
            Self::MessageAdded(e) => E::MessageAdded(e),
            Self::ToolInputRequested(e) => E::ToolInputRequested(e),
            Self::ToolCallProgress(e) => E::ToolCallProgress(e),
            Self::CallDecided(e) => E::CallDecided(e),
            Self::Finished(result) => E::RunFinished(pb::RunFinished { result: Some(*result) }),
        }
    }
}

/// The text and reasoning of a run as its events tell them, with the `turn_restarted` rule
/// applied: a restarted turn's earlier deltas are dropped, so [`Transcript::text`] equals the
/// run's `RunResult.text` at its end.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Transcript {
    /// Text of the turns before the current one.
    text: String,
    reasoning: String,
    /// Where the current turn's text and reasoning begin.
    turn: u32,
    turn_text_at: usize,
    turn_reasoning_at: usize,
}

impl Transcript {
    /// Takes one event into account.
    pub fn apply(&mut self, event: &Event) {
        match event {
            Event::Text { text, turn } => {
                self.enter(*turn);
                self.text.push_str(text);
            }
            Event::Reasoning { text, turn } => {
                self.enter(*turn);
                self.reasoning.push_str(text);
            }
            Event::TurnRestarted(restart) if restart.turn == self.turn => {
                self.text.truncate(self.turn_text_at);
                self.reasoning.truncate(self.turn_reasoning_at);
            }
            _ => {}
        }
    }

    fn enter(&mut self, turn: u32) {
        if turn != self.turn {
            (self.turn, self.turn_text_at, self.turn_reasoning_at) = (turn, self.text.len(), self.reasoning.len());
        }
    }

    /// The visible text so far.
    pub fn text(&self) -> &str {
        &self.text
    }

    /// The reasoning so far.
    pub fn reasoning(&self) -> &str {
        &self.reasoning
    }
}

/// The events of one run. A stream from [`Client::orchestrate`] dropped before `run_finished`
/// cancels the run (`CancelRun`, in the background, when a Tokio runtime is there to run it); one
/// from [`Client::attach`] only stops following it.
pub struct RunStream {
    events: tonic::Streaming<pb::OrchestrateEvent>,
    client: Client,
    run_id: Option<String>,
    last_seq: u64,
    /// `run_finished` (or an error) was yielded; nothing more is.
    finished: bool,
    /// The call itself ended (trailers read, or it broke off).
    ended: bool,
    /// Dropped before `run_finished`, the run is canceled.
    cancel_on_drop: bool,
    /// An `AttachRun` under way, after the call broke off.
    reattaching: Option<BoxFuture<'static, Result<tonic::Streaming<pb::OrchestrateEvent>, tonic::Status>>>,
    /// Re-attaches in a row that brought no new event.
    reattaches_without_progress: u32,
    /// How many times the stream re-attached.
    reattached: u32,
    /// The text and reasoning yielded so far, restarted turns dropped.
    transcript: Transcript,
    /// The call replays a run that had ended under its id.
    replay: Option<Replay>,
}

/// How an `Orchestrate` call replays a run that had ended under its id (a retry of a call whose
/// run finished), from the answer's [`proto::REPLAY_HEADER`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Replay {
    /// The run's events as logged, from seq 1.
    Log,
    /// The run's log no longer holds it whole: its result's reasoning and text as one delta
    /// each, then `run_finished`.
    Result,
}

impl Replay {
    /// The replay an answer's `metadata` announces (`None`: the call started a run).
    pub(crate) fn of(metadata: &tonic::metadata::MetadataMap) -> Option<Self> {
        match metadata.get(proto::REPLAY_HEADER)?.to_str().ok()? {
            "log" => Some(Self::Log),
            "result" => Some(Self::Result),
            _ => None,
        }
    }
}

impl std::fmt::Debug for RunStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RunStream")
            .field("run_id", &self.run_id)
            .field("last_seq", &self.last_seq)
            .field("finished", &self.finished)
            .finish_non_exhaustive()
    }
}

impl RunStream {
    pub(crate) fn new(events: tonic::Streaming<pb::OrchestrateEvent>, client: Client) -> Self {
        Self {
            events,
            client,
            run_id: None,
            last_seq: 0,
            finished: false,
            ended: false,
            cancel_on_drop: true,
            reattaching: None,
            reattaches_without_progress: 0,
            reattached: 0,
            transcript: Transcript::default(),
            replay: None,
        }
    }

    /// The same stream, replaying a run that had ended (`None`: a run it started).
    pub(crate) fn replaying(mut self, replay: Option<Replay>) -> Self {
        self.replay = replay;
        self
    }

    /// Whether (and how) the call replays a run that had ended under its id instead of starting
    /// one.
    pub fn replay(&self) -> Option<Replay> {
        self.replay
    }

    /// A stream attached to `run_id` after `after_seq` (it does not cancel the run when dropped).
    pub(crate) fn attached(
        events: tonic::Streaming<pb::OrchestrateEvent>,
        client: Client,
        run_id: &str,
        after_seq: u64,
    ) -> Self {
        let mut stream = Self::new(events, client);
        stream.run_id = Some(run_id.to_owned());
        stream.last_seq = after_seq;
        stream.cancel_on_drop = false;
        stream
    }

    /// The seq of the last event yielded (the `after_seq` to attach again from).
    pub fn last_seq(&self) -> u64 {
        self.last_seq
    }

    /// The run's visible text so far, as the events yielded tell it (a restarted turn's earlier
    /// text left out): equal to `RunResult.text` once `run_finished` was yielded.
    pub fn text(&self) -> &str {
        self.transcript.text()
    }

    /// How many times the stream re-attached to its run after its call broke off.
    pub fn reattached(&self) -> u32 {
        self.reattached
    }

    /// Whether a call that ended with `status` before `run_finished` is worth following on
    /// another replica: it was drained (`UNAVAILABLE`) or broke off (`UNKNOWN`, `INTERNAL` or
    /// `CANCELLED`, what a dead connection or a stream reset by the server reads as in gRPC
    /// libraries; the orchestrator never ends a stream with `CANCELLED` itself, a canceled run
    /// ends with `run_finished`), and the stream knows its run and has attempts left. `AttachRun`
    /// only reads, so trying it is always safe.
    fn may_reattach(&self, status: Option<&tonic::Status>) -> bool {
        let code = status.map_or(tonic::Code::Unavailable, tonic::Status::code);
        matches!(
            code,
            tonic::Code::Unavailable | tonic::Code::Unknown | tonic::Code::Internal | tonic::Code::Cancelled
        ) && self.run_id.is_some()
            && self.reattaches_without_progress + 1 < self.client.retry.attempts
    }

    /// Starts `AttachRun` from the last seq yielded.
    fn reattach(&mut self) {
        let (client, run_id, after_seq) = (
            self.client.clone(),
            self.run_id.clone().unwrap_or_default(),
            self.last_seq,
        );
        self.reattaches_without_progress += 1;
        self.reattached += 1;
        self.reattaching = Some(async move { client.attach_call(&run_id, after_seq).await }.boxed());
    }

    /// The call broke off with `status` (`None`: it ended without trailers' error but before
    /// `run_finished`): re-attach, or yield the error.
    fn broke_off(&mut self, status: Option<tonic::Status>) -> Option<Result<Event, Error>> {
        if self.may_reattach(status.as_ref()) {
            self.reattach();
            return None;
        }
        (self.finished, self.ended) = (true, true);
        Some(Err(match status {
            Some(status) => status.into(),
            None => Error::Unfinished,
        }))
    }

    /// The run's id, once its first event arrived.
    pub fn run_id(&self) -> Option<&str> {
        self.run_id.as_deref()
    }

    /// The next event; `None` once the call has ended after `run_finished`.
    pub async fn next_event(&mut self) -> Result<Option<Event>, Error> {
        self.next().await.transpose()
    }

    /// Reads the stream to its end and returns the run's result (whatever its status).
    pub async fn result(mut self) -> Result<pb::RunResult, Error> {
        let mut result = None;
        while let Some(event) = self.next_event().await? {
            if let Event::Finished(finished) = event {
                result = Some(*finished);
            }
        }
        result.ok_or(Error::Unfinished)
    }

    /// Checks one raw event against the contract and types it.
    fn accept(&mut self, event: pb::OrchestrateEvent) -> Result<Event, Error> {
        if event.seq != self.last_seq + 1 {
            return Err(Error::Protocol(format!(
                "event seq {} after {}: events are numbered without gaps",
                event.seq, self.last_seq
            )));
        }
        self.last_seq = event.seq;
        self.reattaches_without_progress = 0;
        self.run_id.get_or_insert_with(|| event.run_id.clone());
        let kind = event
            .event
            .ok_or_else(|| Error::Protocol(format!("event {} carries nothing", event.seq)))?;
        let event = Event::from_proto(kind);
        self.transcript.apply(&event);
        self.finished = matches!(event, Event::Finished(_));
        Ok(event)
    }
}

impl Stream for RunStream {
    type Item = Result<Event, Error>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        loop {
            if self.ended {
                return Poll::Ready(None);
            }
            if let Some(reattaching) = self.reattaching.as_mut() {
                let attached = std::task::ready!(reattaching.poll_unpin(cx));
                self.reattaching = None;
                match attached {
                    Ok(events) => self.events = events,
                    Err(status) => match self.broke_off(Some(status)) {
                        Some(error) => return Poll::Ready(Some(error)),
                        None => continue,
                    },
                }
            }
            let polled = self.events.poll_next_unpin(cx);
            if self.finished {
                // Past run_finished: read to the trailers, yielding nothing more.
                match polled {
                    Poll::Ready(Some(_)) => continue,
                    Poll::Ready(None) => self.ended = true,
                    Poll::Pending => return Poll::Pending,
                }
                continue;
            }
            let broke_off = match polled {
                Poll::Pending => return Poll::Pending,
                // An event already yielded, sent again by a replica the stream re-attached to.
                Poll::Ready(Some(Ok(event))) if event.seq <= self.last_seq && self.reattached > 0 => continue,
                Poll::Ready(Some(Ok(event))) => return Poll::Ready(Some(self.accept(event))),
                Poll::Ready(Some(Err(status))) => self.broke_off(Some(status)),
                Poll::Ready(None) => self.broke_off(None),
            };
            if let Some(error) = broke_off {
                return Poll::Ready(Some(error));
            }
        }
    }
}

impl Drop for RunStream {
    fn drop(&mut self) {
        if self.finished || !self.cancel_on_drop {
            return;
        }
        let (Some(run_id), Ok(runtime)) = (self.run_id.take(), tokio::runtime::Handle::try_current()) else {
            return;
        };
        let client = self.client.clone();
        runtime.spawn(async move {
            let _ = client.cancel_run(&run_id).await;
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_event_turns_back_into_the_proto_event_it_was_typed_from() {
        let events = [
            E::RunStarted(pb::RunStarted {
                model: "m".into(),
                ..Default::default()
            }),
            E::TextDelta(pb::TextDelta {
                text: "hi".into(),
                turn: 2,
            }),
            E::ReasoningDelta(pb::ReasoningDelta {
                text: "hm".into(),
                turn: 1,
            }),
            E::ToolCallStarted(pb::ToolCallStarted::default()),
            E::ToolCallFinished(pb::ToolCallFinished::default()),
            E::Signal(pb::Signal::default()),
            E::TurnFinished(pb::TurnFinished::default()),
            E::TurnRestarted(pb::TurnRestarted::default()),
            E::ApprovalRequested(pb::ApprovalRequested::default()),
            E::MessageAdded(pb::MessageAdded::default()),
            E::ToolInputRequested(pb::ToolInputRequested::default()),
            E::ToolCallProgress(pb::ToolCallProgress::default()),
            E::RunFinished(pb::RunFinished {
                result: Some(pb::RunResult {
                    text: "done".into(),
                    ..Default::default()
                }),
            }),
        ];
        for event in events {
            assert_eq!(Event::from_proto(event.clone()).into_proto(), event);
        }
    }
}
