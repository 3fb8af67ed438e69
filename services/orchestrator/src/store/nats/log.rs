//! The event log in a NATS JetStream stream (with the NATS result store): every replica reads
//! every run's events, so a caller re-attaches anywhere. A run's events go to the subject
//! `<stream>.run.<run id escaped>`; the stream keeps them as long as the results bucket keeps
//! results (`--run-store-ttl`) and at most `--event-log-total-bytes` in all.
//!
//! Writing never slows a run: the emitter's batches go through a bounded channel to one task per
//! run, which publishes a batch that finds it idle at once and gathers what arrives while a
//! publish is under way or within `--event-log-flush-interval` after it (`run_finished` and the
//! first text of each turn go at once) into one message
//! (a `LogBatch` of `orchestrator.v1.OrchestrateEvent`s, cut below the server's largest payload),
//! never one publish per token. Each message carries `Nats-Msg-Id: <run>/<first seq>`, so a
//! retried publish is stored once; a message JetStream does not acknowledge is tried again for a
//! lease (`--run-store-lease`, at least three attempts), the batches behind it waiting. A run's log
//! is bounded by `--event-log-max-bytes`: past it the subject is purged down to its newest
//! messages. A batch the channel or JetStream did not take is a hole: it is counted and logged,
//! the writer's [`Settled`] says the log is broken from there on (a durable run's caller is sent
//! nothing past it), and **nothing is published after it**: the owner stops acting for the run,
//! which resumes (here or on another replica) from its last checkpoint, numbering on from where
//! the log ends, so the log stays gap-free. A follower that meets a gap anyway (a log trimmed, or
//! written by a version that published past a hole) is told so (`DATA_LOSS`).

use std::collections::VecDeque;
use std::time::Duration;

use std::sync::Arc;

use futures::future::BoxFuture;
use futures::{FutureExt, StreamExt};
use prost::Message;
use proto::orchestrator::v1 as pb;
use shared::jetstream::{Consistency, Deliver, Error, HEADER_ROOM, JetStream, Publish, Read, Stream, StreamConfig};
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;

use crate::domain::ports::{EventFeed, EventLog, LogError, LogWriter, Logged, Settled, StoreError};
use crate::domain::{Event, EventBatch, NumberedEvent, Ownership, Stop};
use crate::store::{Follower as _, LogBounds};
use crate::telemetry::metric;
use crate::wire::event_pb;

/// Event batches one run's writer holds for its publishing task.
const WRITER_BUFFER: usize = 4096;
/// Publish attempts of one message, at least.
const PUBLISH_ATTEMPTS: u32 = 3;
/// Longest pause between two attempts.
const MAX_BACKOFF: Duration = Duration::from_secs(1);

/// One message of the log: consecutive events of one run.
#[derive(Clone, PartialEq, prost::Message)]
struct LogBatch {
    #[prost(message, repeated, tag = "1")]
    events: Vec<pb::OrchestrateEvent>,
}

/// How the log writes (the `--event-log-*` and store settings).
#[derive(Debug, Clone, Copy)]
pub struct NatsLogOptions {
    /// What the log keeps.
    pub bounds: LogBounds,
    /// How long a run's writer gathers batches into one message.
    pub flush_interval: Duration,
    /// How long one publish waits for JetStream's acknowledgement.
    pub timeout: Duration,
    /// How long a message is tried again before it is given up (the store's lease: past it,
    /// another replica takes the run over anyway).
    pub retry_for: Duration,
    /// Copies JetStream keeps of the stream (`--nats-replicas`).
    pub replicas: usize,
    /// Streams the log is spread over by run (`--run-store-shards`; see
    /// [`shared::jetstream::shards`]).
    pub shards: usize,
}

/// See the module docs.
#[derive(Clone)]
pub struct NatsLog {
    /// One stream per shard, the first named as configured.
    streams: Arc<[(String, Arc<dyn Stream>)]>,
    options: NatsLogOptions,
    /// Largest message the server takes.
    max_message_bytes: usize,
}

impl NatsLog {
    /// Binds (or creates) the stream `name`, one per shard (`js` waits `options.timeout` for
    /// each answer); the shards share `--event-log-total-bytes`.
    pub async fn open(js: &dyn JetStream, name: &str, options: NatsLogOptions) -> Result<Self, StoreError> {
        let max_message_bytes = js.max_payload();
        let shards = options.shards.max(1);
        let total_bytes = u64::try_from(options.bounds.total_bytes / shards).unwrap_or(u64::MAX);
        let mut streams = Vec::with_capacity(shards);
        for shard in 0..shards {
            let name = shared::jetstream::shards::name(name, shard);
            let config = StreamConfig {
                name: name.clone(),
                description: "orchestrator run events (AttachRun)".to_owned(),
                subjects: vec![format!("{name}.run.>")],
                max_age: options.bounds.keep_for,
                max_bytes: total_bytes,
                discard_old: true,
                duplicate_window: Duration::from_secs(120),
                replicas: options.replicas,
            };
            let stream = js
                .stream(config)
                .await
                .map_err(|e| crate::store::unavailable("creating the event log stream", &name, e))?;
            streams.push((name, stream));
        }
        Ok(Self {
            streams: streams.into(),
            options,
            max_message_bytes: max_message_bytes.saturating_sub(HEADER_ROOM).max(HEADER_ROOM),
        })
    }

    /// A run's writer: its events after `logged` go to its publishing task. With `position`
    /// (where the run's subject ends, for its owner) every message must follow the last one
    /// this writer knows of; without it (a run of one replica, tests) appends are not fenced.
    fn start_writer(&self, run_id: &str, logged: u64, position: Option<u64>, owner: Ownership) -> Box<dyn LogWriter> {
        let (tx, rx) = mpsc::channel(WRITER_BUFFER);
        let start = Settled {
            kept_through: logged,
            broken: false,
        };
        let (settled_tx, settled) = watch::channel(start);
        let publisher = Publisher {
            log: self.clone(),
            stream: Arc::clone(self.stream(run_id)),
            subject: self.subject(run_id),
            run_id: run_id.to_owned(),
            kept: VecDeque::new(),
            kept_bytes: 0,
            settled: settled_tx,
            text_turn: 0,
            owner,
            position,
        };
        shared::tasks::spawn(publisher.run(rx));
        Box::new(Writer {
            tx,
            run_id: run_id.to_owned(),
            settled,
        })
    }

    /// The shard of `run_id`'s events: its stream's name, and the stream.
    fn shard(&self, run_id: &str) -> &(String, Arc<dyn Stream>) {
        let shard = shared::jetstream::shards::of_key(&super::results::key(run_id), self.streams.len());
        &self.streams[shard]
    }

    fn stream(&self, run_id: &str) -> &Arc<dyn Stream> {
        &self.shard(run_id).1
    }

    fn subject(&self, run_id: &str) -> String {
        format!("{}.{}", self.shard(run_id).0, super::results::key(run_id))
    }
}

struct Writer {
    tx: mpsc::Sender<EventBatch>,
    run_id: String,
    settled: watch::Receiver<Settled>,
}

impl LogWriter for Writer {
    fn append(&mut self, events: &[NumberedEvent]) {
        if self.settled.borrow().broken {
            // Nothing lands after a hole (see the module docs).
            metrics::counter!(metric::EVENT_LOG_DROPPED).increment(1);
            return;
        }
        if let Err(e) = self.tx.try_send(events.to_vec()) {
            metrics::counter!(metric::EVENT_LOG_DROPPED).increment(1);
            let first = events.first().map_or(0, |e| e.seq);
            tracing::warn!(run_id = %self.run_id, first_seq = first, "the event log did not take a batch: {e}");
        }
    }

    fn settled(&self) -> Option<watch::Receiver<Settled>> {
        Some(self.settled.clone())
    }
}

impl EventLog for NatsLog {
    fn writer(&self, run_id: &str, logged: u64) -> Box<dyn LogWriter> {
        self.start_writer(run_id, logged, None, Ownership::local())
    }

    fn owned_writer(&self, run_id: &str, from: &Logged, owner: &Ownership) -> Box<dyn LogWriter> {
        self.start_writer(run_id, from.seq, Some(from.position), owner.clone())
    }

    fn last(&self, run_id: &str) -> BoxFuture<'static, Result<Logged, LogError>> {
        let (stream, subject, run_id) = (Arc::clone(self.stream(run_id)), self.subject(run_id), run_id.to_owned());
        let timeout = self.options.timeout;
        async move {
            let unavailable = |reason: String| LogError::Unavailable {
                run_id: run_id.clone(),
                reason,
            };
            let read = tokio::time::timeout(timeout, stream.last(&subject, Consistency::Leader))
                .await
                .map_err(|_| unavailable("no answer in time".to_owned()))?;
            let message = match read {
                Ok(Some(message)) => message,
                Ok(None) => return Ok(Logged::default()),
                Err(e) => return Err(unavailable(e.to_string())),
            };
            let batch = LogBatch::decode(message.payload.as_ref())
                .map_err(|e| unavailable(format!("the last log message is not a batch of events: {e}")))?;
            let position = message.sequence;
            let Some(last) = batch.events.into_iter().last() else {
                return Ok(Logged {
                    position,
                    ..Logged::default()
                });
            };
            let last = NumberedEvent::try_from(last).map_err(|e| unavailable(format!("the last logged event: {e}")))?;
            Ok(Logged {
                seq: last.seq,
                position,
                finished: last.finished().cloned(),
            })
        }
        .boxed()
    }

    fn follow(&self, run_id: &str, after_seq: u64) -> BoxFuture<'static, Result<Option<EventFeed>, LogError>> {
        let (stream, subject, run_id) = (Arc::clone(self.stream(run_id)), self.subject(run_id), run_id.to_owned());
        let max_expires = follow_expiry(self.options.timeout);
        async move {
            let unavailable = |e: String| LogError::Unavailable {
                run_id: run_id.clone(),
                reason: e,
            };
            let read = Read {
                filter: subject,
                deliver: Deliver::All,
                headers_only: false,
                expires: Some(max_expires),
            };
            let reading = stream.read(read).await.map_err(|e| unavailable(e.to_string()))?;
            let follower = Follower {
                messages: reading.messages,
                run_id: run_id.clone(),
                after_seq,
                cursor: after_seq,
                read_any: false,
                ready: VecDeque::new(),
                done: false,
            };
            Ok(Some(follower.into_feed()))
        }
        .boxed()
    }
}

/// How long one pull of a follower's consumer waits for messages. The client gives the server an
/// idle heartbeat of half of it, and makes a consumer that missed two again (one lost with its
/// node), the first looked for after two heartbeats: so a follower whose consumer was lost goes
/// on after about four store timeouts (and the new consumer's creation), not after the client's
/// default of a minute, at the price of a pull request per expiry on a quiet run.
fn follow_expiry(timeout: Duration) -> Duration {
    (timeout * 2).max(Duration::from_secs(1))
}

/// One message of a run's log: the seq of its first event, its payload, the seq of its last.
type LogMessage = (u64, Vec<u8>, u64);

/// One run's publishing task.
/// The latest turn with text or reasoning among `events` (0: none).
fn text_turn(events: &[NumberedEvent]) -> u32 {
    events
        .iter()
        .filter_map(|e| match &e.event {
            Event::TextDelta { turn, .. } | Event::ReasoningDelta { turn, .. } => Some(*turn),
            _ => None,
        })
        .max()
        .unwrap_or(0)
}

struct Publisher {
    log: NatsLog,
    /// The stream of the run's shard.
    stream: Arc<dyn Stream>,
    subject: String,
    run_id: String,
    /// Sizes of the messages of this run the stream keeps, oldest first.
    kept: VecDeque<usize>,
    kept_bytes: usize,
    settled: watch::Sender<Settled>,
    /// The last turn whose text (or reasoning) was published: the next turn's first goes at once.
    text_turn: u32,
    /// The run's owner here: nothing is published once it stopped, and a message the log
    /// refuses as out of turn stops it.
    owner: Ownership,
    /// The stream sequence of the run's last message as this owner knows it: each message must
    /// follow it (`None`: not fenced).
    position: Option<u64>,
}

/// Why a message was not kept.
enum Refused {
    /// JetStream did not take it in time.
    Unavailable(String),
    /// Another owner wrote the run's log since (or the message was there already): this owner
    /// stops.
    OutOfTurn(String),
}

impl Publisher {
    /// Publishes the writer's batches, until the writer is gone: a batch that finds the task idle
    /// goes at once; batches that arrive while a publish is under way, or within the flush
    /// interval after it, go together in the next one (a group commit). `run_finished` and the
    /// first text of each turn (which a durable run's caller waits for: time to first token) go
    /// at once. After each publish the log has kept the run's events through a later seq (which is
    /// when a durable run's caller is sent them), or is broken.
    async fn run(mut self, mut rx: mpsc::Receiver<EventBatch>) {
        let mut next_publish = Instant::now();
        while let Some(mut events) = rx.recv().await {
            while !self.urgent(&events) {
                // The flush interval first: batches arriving without a pause never hold a
                // publish back past it.
                tokio::select! {
                    biased;
                    () = tokio::time::sleep_until(next_publish) => break,
                    more = rx.recv() => match more {
                        Some(more) => events.extend(more),
                        None => break,
                    },
                }
            }
            self.text_turn = self.text_turn.max(text_turn(&events));
            for (first, payload, last) in self.messages(events) {
                let (broken, kept_through) = {
                    let settled = self.settled.borrow();
                    (settled.broken, settled.kept_through)
                };
                if broken {
                    metrics::counter!(metric::EVENT_LOG_DROPPED).increment(1);
                    continue;
                }
                // A batch the writer's buffer dropped before this one is a hole already.
                let kept = first <= kept_through + 1 && self.publish(first, payload).await;
                self.settle(first, last, kept);
            }
            next_publish = Instant::now() + self.log.options.flush_interval;
        }
    }

    /// Whether `events` go without waiting for the flush interval: the run's end, or the first
    /// text or reasoning of a turn.
    fn urgent(&self, events: &[NumberedEvent]) -> bool {
        events.last().is_some_and(NumberedEvent::is_last) || text_turn(events) > self.text_turn
    }

    /// The events as messages of at most the server's largest payload (an event larger than
    /// that alone is a message of its own, which the server refuses: a gap followers see).
    fn messages(&self, events: EventBatch) -> Vec<LogMessage> {
        let mut messages = Vec::new();
        let mut batch = LogBatch { events: Vec::new() };
        let (mut first_seq, mut last_seq) = (0, 0);
        for event in events {
            let seq = event.seq;
            let event = event_pb(&self.run_id, seq, event.event);
            if !batch.events.is_empty() && batch.encoded_len() + event.encoded_len() + 8 > self.log.max_message_bytes {
                messages.push((first_seq, std::mem::take(&mut batch).encode_to_vec(), last_seq));
            }
            if batch.events.is_empty() {
                first_seq = seq;
            }
            last_seq = seq;
            batch.events.push(event);
        }
        if !batch.events.is_empty() {
            messages.push((first_seq, batch.encode_to_vec(), last_seq));
        }
        messages
    }

    /// Moves the settled mark on past a message of the events `first..=last`: kept and right
    /// after what was kept before, the log holds them; otherwise (refused, or after a batch the
    /// writer's buffer dropped) the log is broken from there on: nothing more is published, and
    /// the owner stops acting for the run, which resumes from its last checkpoint where the log
    /// ends.
    fn settle(&self, first: u64, last: u64, kept: bool) {
        let mut hole = None;
        self.settled.send_modify(|settled| {
            if settled.broken {
                return;
            }
            if kept && first <= settled.kept_through + 1 {
                settled.kept_through = settled.kept_through.max(last);
            } else {
                settled.broken = true;
                hole = Some(settled.kept_through);
            }
        });
        if let Some(after_seq) = hole {
            tracing::warn!(run_id = %self.run_id, after_seq, "the run's event log lost events: nothing more is published, and the run resumes from its last checkpoint");
            self.owner.stop(Stop::Unsaved(format!(
                "the event log did not keep the events after seq {after_seq}"
            )));
        }
    }

    /// Publishes one message, trying again (with backoff) until JetStream acknowledges it or
    /// `retry_for` passed (at least [`PUBLISH_ATTEMPTS`] times), then keeps the run's log within
    /// its bound; whether it was kept. Nothing goes once the run's owner stopped, unless the run
    /// ended here (its tail must reach the log); a message the log refuses as out of turn stops
    /// it.
    async fn publish(&mut self, first_seq: u64, payload: Vec<u8>) -> bool {
        let size = payload.len();
        let payload = bytes::Bytes::from(payload);
        let give_up = Instant::now() + self.log.options.retry_for;
        let mut attempt = 0;
        let error = loop {
            if !self.owner.may_log() {
                return false;
            }
            match self.try_publish(first_seq, payload.clone()).await {
                Ok(()) => {
                    self.keep_within_bound(size).await;
                    return true;
                }
                Err(Refused::OutOfTurn(why)) => {
                    metrics::counter!(metric::EVENT_LOG_DROPPED).increment(1);
                    self.owner.stop(Stop::Fenced(format!("the run's event log: {why}")));
                    return false;
                }
                Err(Refused::Unavailable(e)) if attempt + 1 >= PUBLISH_ATTEMPTS && Instant::now() >= give_up => {
                    break e;
                }
                Err(Refused::Unavailable(_)) => {}
            }
            attempt += 1;
            tokio::time::sleep((Duration::from_millis(100) * 2u32.saturating_pow(attempt)).min(MAX_BACKOFF)).await;
        };
        metrics::counter!(metric::EVENT_LOG_DROPPED).increment(1);
        tracing::warn!(run_id = %self.run_id, first_seq, attempts = attempt + 1, "the event log did not keep a batch of events: {error}");
        false
    }

    /// One attempt. The message id names the run, the owner's epoch and the first seq; with a
    /// position the message must follow it (`Nats-Expected-Last-Subject-Sequence`). A duplicate
    /// acknowledgement is out of turn, never a success: the log held the message already, so
    /// this owner no longer knows where the log ends.
    async fn try_publish(&mut self, first_seq: u64, payload: bytes::Bytes) -> Result<(), Refused> {
        let id = format!("{}/{}/{first_seq}", self.run_id, self.owner.epoch());
        let message = Publish {
            subject: self.subject.clone(),
            payload,
            id: Some(id.clone()),
            after: self.position,
            headers: Vec::new(),
        };
        let ack = match tokio::time::timeout(self.log.options.timeout, self.stream.publish(message)).await {
            Ok(Ok(ack)) => ack,
            Ok(Err(Error::WrongSequence)) => {
                return Err(Refused::OutOfTurn(format!(
                    "another owner appended after stream sequence {}",
                    self.position.unwrap_or_default()
                )));
            }
            Ok(Err(e)) => return Err(Refused::Unavailable(e.to_string())),
            Err(_) => return Err(Refused::Unavailable("no acknowledgement in time".to_owned())),
        };
        if ack.duplicate {
            return Err(Refused::OutOfTurn(format!(
                "message {id} was in the log already (stream sequence {})",
                ack.sequence
            )));
        }
        if self.position.is_some() {
            self.position = Some(ack.sequence);
        }
        Ok(())
    }

    /// Past the run's bound, the subject is purged down to its newest messages.
    async fn keep_within_bound(&mut self, size: usize) {
        self.kept.push_back(size);
        self.kept_bytes += size;
        let bound = self.log.options.bounds.per_run_bytes;
        if self.kept_bytes <= bound || self.kept.len() <= 1 {
            return;
        }
        while self.kept_bytes > bound && self.kept.len() > 1 {
            self.kept_bytes -= self.kept.pop_front().unwrap_or(0);
        }
        let keep = u64::try_from(self.kept.len()).unwrap_or(u64::MAX);
        let purge = self.stream.purge(&self.subject, keep);
        match tokio::time::timeout(self.log.options.timeout, purge).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::warn!(run_id = %self.run_id, "trimming the run's event log failed: {e}"),
            Err(_) => tracing::warn!(run_id = %self.run_id, "trimming the run's event log timed out"),
        }
    }
}

/// One follower of a run's subject.
struct Follower {
    messages: futures::stream::BoxStream<'static, Result<shared::jetstream::Message, Error>>,
    run_id: String,
    /// Where the follower asked to start.
    after_seq: u64,
    /// The last seq handed out.
    cursor: u64,
    /// An event was read from the log: a gap after it is a loss, not the log's trimmed start.
    read_any: bool,
    ready: VecDeque<NumberedEvent>,
    done: bool,
}

impl crate::store::Follower for Follower {
    async fn next(&mut self) -> Option<Result<NumberedEvent, LogError>> {
        loop {
            if self.done {
                return None;
            }
            if let Some(event) = self.ready.pop_front() {
                let checked = self.check(&event);
                self.read_any = true;
                match checked {
                    Ok(true) => {
                        self.cursor = event.seq;
                        self.done = event.is_last();
                        return Some(Ok(event));
                    }
                    // A log read past its end by a caller that has it all.
                    Ok(false) if event.is_last() => return None,
                    Ok(false) => continue,
                    Err(e) => {
                        self.done = true;
                        return Some(Err(e));
                    }
                }
            }
            let read = match self.messages.next().await {
                None => Err("the stream ended".to_owned()),
                Some(Err(e)) => Err(e.to_string()),
                Some(Ok(message)) => decode_batch(&message.payload),
            };
            match read {
                Ok(events) => self.ready.extend(events),
                Err(reason) => {
                    self.done = true;
                    return Some(Err(LogError::Unavailable {
                        run_id: self.run_id.clone(),
                        reason,
                    }));
                }
            }
        }
    }
}

impl Follower {
    /// Whether `event` is the next one to hand out (`Ok(false)`: already handed out, or before
    /// where the follower started), or what its gap means.
    fn check(&self, event: &NumberedEvent) -> Result<bool, LogError> {
        if event.seq <= self.cursor {
            return Ok(false);
        }
        if event.seq == self.cursor + 1 {
            return Ok(true);
        }
        if !self.read_any {
            return Err(LogError::Trimmed {
                run_id: self.run_id.clone(),
                after_seq: self.after_seq,
                first_kept: event.seq,
            });
        }
        Err(LogError::Lost {
            run_id: self.run_id.clone(),
            after_seq: self.cursor,
            reason: format!("the next event kept is seq {}", event.seq),
        })
    }
}

/// The events of one log message.
pub(super) fn decode_batch(payload: &[u8]) -> Result<Vec<NumberedEvent>, String> {
    let batch = LogBatch::decode(payload).map_err(|e| format!("a log message is not a batch of events: {e}"))?;
    batch
        .events
        .into_iter()
        .map(|e| NumberedEvent::try_from(e).map_err(|e| format!("a logged event cannot be read: {e}")))
        .collect()
}
