//! A run's event stream, typed: [`Event`]s in order, checked against the contract (`seq` 1, 2,
//! 3 … without gaps; `run_finished` last), and canceled when dropped before the end.
//!
//! After `run_finished` the stream is read to its real end (the call's trailers) before it says
//! `None`: a call dropped before its trailers is reset on the wire, and an HTTP/2 server closes a
//! connection that sees many such resets, which would fail the client's later calls.

use std::pin::Pin;
use std::task::{Context, Poll};

use futures::{Stream, StreamExt};
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
    /// The run ended; always the last event.
    Finished(pb::RunResult),
}

impl Event {
    fn from_proto(event: E) -> Self {
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
            E::RunFinished(e) => Self::Finished(e.result.unwrap_or_default()),
        }
    }
}

/// The events of one run. Dropped before `run_finished`, it cancels the run (`CancelRun`, in the
/// background, when a Tokio runtime is there to run it).
pub struct RunStream {
    events: tonic::Streaming<pb::OrchestrateEvent>,
    client: Client,
    run_id: Option<String>,
    last_seq: u64,
    /// `run_finished` (or an error) was yielded; nothing more is.
    finished: bool,
    /// The call itself ended (trailers read, or it broke off).
    ended: bool,
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
        }
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
                result = Some(finished);
            }
        }
        result.ok_or_else(|| Error::Protocol("the stream ended without run_finished".into()))
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
        self.run_id.get_or_insert_with(|| event.run_id.clone());
        let kind = event
            .event
            .ok_or_else(|| Error::Protocol(format!("event {} carries nothing", event.seq)))?;
        let event = Event::from_proto(kind);
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
            return match polled {
                Poll::Ready(Some(Ok(event))) => Poll::Ready(Some(self.accept(event))),
                Poll::Ready(Some(Err(status))) => {
                    (self.finished, self.ended) = (true, true);
                    Poll::Ready(Some(Err(status.into())))
                }
                Poll::Ready(None) => {
                    (self.finished, self.ended) = (true, true);
                    Poll::Ready(Some(Err(Error::Protocol(
                        "the stream ended without run_finished".into(),
                    ))))
                }
                Poll::Pending => Poll::Pending,
            };
        }
    }
}

impl Drop for RunStream {
    fn drop(&mut self) {
        if self.finished {
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
