//! A simulated JetStream beneath the real NATS adapters: the seam `shared::jetstream` served by
//! one in-process cluster on the runtime's clock (the simulation's virtual one), with NATS's
//! semantics ([`stream`]: stream and subject sequences, the duplicate window, expected last
//! subject sequences, ages, bytes and per-subject limits; key-value buckets as streams of
//! `$KV.<bucket>.<key>` subjects with revisions, create/update/delete at a revision and delete
//! markers; object stores; core NATS publish, subscribe and request) and the faults a cluster
//! produces, drawn by the seed:
//!
//! * a stream without a leader (its node lost, no new leader yet) while the others answer: its
//!   requests time out unapplied, its consumers stall; direct reads are still served by followers;
//! * a follower that lags: direct reads (a key-value entry) served from what it had when it
//!   began to lag, while the leader takes writes;
//! * a request applied whose answer is lost (the caller times out not knowing);
//! * a slow cluster (every request takes seconds);
//! * a process paused, cut off or killed, through its [`Condition`]: a paused process sends and hears
//!   nothing while time runs, one cut off has its requests time out, a dead one never hears again.
//!
//! Each process holds a [`Connection`]; one connection's requests apply in the order it sent them
//! (a NATS client's one socket).

pub mod conformance;
pub mod stream;

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use futures::future::BoxFuture;
use futures::stream::BoxStream;
use futures::{FutureExt as _, StreamExt as _};
use shared::jetstream::{
    Ack, Bucket, BucketConfig, Consistency, Deliver, Entry, Error, Inbound, JetStream, Message, Object, Objects,
    ObjectsConfig, Operation, Publish, Read, Reading, Reply, State, Stream, StreamConfig,
};
use tokio::sync::{mpsc, oneshot, watch};
use tokio::time::Instant;

use crate::ports::condition::Condition;
use stream::{Limits, StreamState, matches};

/// Messages a core subscription holds for a slow reader before it drops them (as a NATS server
/// drops a slow consumer's).
const SUBSCRIPTION_BUFFER: usize = 1024;

/// The largest payload the simulated server takes (a NATS server's default).
pub const MAX_PAYLOAD: usize = 1024 * 1024;

/// One stream with its follower's view.
#[derive(Debug)]
struct Node {
    leader: StreamState,
    /// While a follower lags: what it had when it began to (direct reads see this).
    lagging: Option<(StreamState, Instant)>,
    /// Until then, the stream has no leader.
    leaderless_until: Option<Instant>,
}

impl Node {
    fn leaderless(&self) -> bool {
        self.leaderless_until.is_some_and(|until| Instant::now() < until)
    }

    /// What a direct read sees.
    fn direct(&mut self) -> &StreamState {
        if self.lagging.as_ref().is_some_and(|(_, until)| Instant::now() >= *until) {
            self.lagging = None;
        }
        match &self.lagging {
            Some((view, _)) => view,
            None => &self.leader,
        }
    }
}

/// An object as stored.
#[derive(Debug, Clone)]
struct StoredObject {
    description: Option<String>,
    bytes: Vec<u8>,
    at: Instant,
}

/// A core NATS subscription.
struct Subscription {
    pattern: String,
    tx: mpsc::Sender<Inbound>,
    condition: Condition,
}

/// The cluster's state.
struct Inner {
    streams: BTreeMap<String, Node>,
    objects: BTreeMap<String, (Duration, BTreeMap<String, StoredObject>)>,
    /// Object stores without a leader, until when (their requests time out unapplied).
    objects_leaderless: BTreeMap<String, Instant>,
    subscriptions: Vec<Subscription>,
    inboxes: HashMap<String, oneshot::Sender<Bytes>>,
    next_inbox: u64,
    rng: fastrand::Rng,
    slow_until: Option<Instant>,
    lose_answers_until: Option<Instant>,
    /// Counts stored messages: readers wait on it.
    published: watch::Sender<u64>,
    /// Watches the writes (the simulation's checks).
    observer: Option<Box<dyn Observer>>,
}

/// Watches the cluster's writes as they land (the simulation's checks learn what only the order
/// of writes tells: takeovers, a principal's share after each write, spend booked unheard).
pub trait Observer: Send {
    /// Stream `stream` stored `message`; `before` was its subject's last message.
    fn stored(&mut self, stream: &str, message: &Message, before: Option<&Message>, peek: &Peek<'_>);
}

/// A look at the cluster's state from inside a write (for an [`Observer`]).
pub struct Peek<'a>(&'a Inner);

impl Peek<'_> {
    /// The value of `key` in bucket `bucket` (a delete marker reads as none).
    pub fn entry(&self, bucket: &str, key: &str) -> Option<Entry> {
        let node = self.0.streams.get(&format!("KV_{bucket}"))?;
        node.leader
            .last(&format!("$KV.{bucket}.{key}"))
            .map(entry_of)
            .filter(|e| e.operation == Operation::Put)
    }

    /// The live keys of bucket `bucket` under `filter`.
    pub fn keys(&self, bucket: &str, filter: &str) -> Vec<String> {
        self.0
            .streams
            .get(&format!("KV_{bucket}"))
            .map(|node| live_keys(&node.leader, bucket, filter))
            .unwrap_or_default()
    }

    /// The bytes of object `name` in store `store`.
    pub fn object(&self, store: &str, name: &str) -> Option<&[u8]> {
        let (_, objects) = self.0.objects.get(store)?;
        objects.get(name).map(|o| o.bytes.as_slice())
    }
}

impl Inner {
    /// A request's latency: a few milliseconds, or up to seconds while the cluster is slow.
    fn latency(&mut self) -> Duration {
        let slow = self.slow_until.is_some_and(|until| Instant::now() < until);
        match slow {
            true => Duration::from_millis(self.rng.u64(200..3000)),
            false => Duration::from_micros(self.rng.u64(200..8000)),
        }
    }

    /// Whether this answer is lost (while answers are being lost, one in three).
    fn answer_lost(&mut self) -> bool {
        self.lose_answers_until.is_some_and(|until| Instant::now() < until) && self.rng.u8(0..3) == 0
    }

    fn node(&mut self, name: &str) -> Result<&mut Node, Error> {
        let node = self
            .streams
            .get_mut(name)
            .ok_or_else(|| Error::Failed(format!("stream not found: {name}")))?;
        node.leader.expire();
        Ok(node)
    }

    fn notify(&self) {
        self.published.send_modify(|n| *n += 1);
    }

    /// Publishes `message` in stream `name` and tells the observer what was stored.
    fn store(&mut self, name: &str, message: Publish) -> Result<Ack, Error> {
        let subject = message.subject.clone();
        let node = self.node(name)?;
        let before = node.leader.last(&subject);
        let ack = node.leader.publish(message)?;
        if ack.duplicate {
            return Ok(ack);
        }
        let stored = node.leader.last(&subject);
        self.notify();
        if let (Some(stored), Some(mut observer)) = (stored, self.observer.take()) {
            observer.stored(name, &stored, before.as_ref(), &Peek(self));
            self.observer = Some(observer);
        }
        Ok(ack)
    }
}

/// A simulated JetStream cluster, shared by the processes of one seed.
#[derive(Clone)]
pub struct Cluster(Arc<Mutex<Inner>>);

impl Cluster {
    /// An empty cluster whose draws come from `seed`.
    pub fn new(seed: u64) -> Self {
        Self(Arc::new(Mutex::new(Inner {
            streams: BTreeMap::new(),
            objects: BTreeMap::new(),
            objects_leaderless: BTreeMap::new(),
            subscriptions: Vec::new(),
            inboxes: HashMap::new(),
            next_inbox: 0,
            rng: fastrand::Rng::with_seed(seed ^ 0x6a75_7374),
            slow_until: None,
            lose_answers_until: None,
            published: watch::Sender::new(0),
            observer: None,
        })))
    }

    /// Has `observer` watch every write from now on.
    pub fn observe(&self, observer: Box<dyn Observer>) {
        self.lock().observer = Some(observer);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A process's connection: its requests go as `condition` lets them and wait `timeout` for their answers.
    pub fn connect(&self, condition: Condition, timeout: Duration) -> Connection {
        Connection {
            cluster: self.clone(),
            condition,
            timeout,
            wire: Arc::default(),
            pipeline: None,
            object_filter: None,
        }
    }

    /// Every request is slow until `until`.
    pub fn slow_down(&self, until: Instant) {
        self.lock().slow_until = Some(until);
    }

    /// The stream (or object store) `name` has no leader until `until`.
    pub fn lose_leader(&self, name: &str, until: Instant) {
        let mut inner = self.lock();
        if let Some(node) = inner.streams.get_mut(name) {
            node.leaderless_until = Some(until);
        } else if inner.objects.contains_key(name) {
            inner.objects_leaderless.insert(name.to_owned(), until);
        }
    }

    /// A follower of stream `name` serves direct reads from what it has now until `until`.
    pub fn lag(&self, name: &str, until: Instant) {
        if let Some(node) = self.lock().streams.get_mut(name) {
            node.lagging = Some((node.leader.clone(), until));
        }
    }

    /// Until `until`, one answer in three is lost after its request was applied.
    pub fn lose_answers(&self, until: Instant) {
        self.lock().lose_answers_until = Some(until);
    }

    /// The messages stream `name` keeps under `filter`, as the leader has them (for checks).
    pub fn messages(&self, name: &str, filter: &str) -> Vec<Message> {
        let mut inner = self.lock();
        let Ok(node) = inner.node(name) else {
            return Vec::new();
        };
        node.leader
            .from(filter, 0)
            .map(|(seq, m)| stream::message(seq, m, false, 0))
            .collect()
    }

    /// The value of `key` in bucket `bucket`, as the leader has it (for checks; a delete marker
    /// reads as none).
    pub fn entry(&self, bucket: &str, key: &str) -> Option<Entry> {
        let mut inner = self.lock();
        let node = inner.node(&format!("KV_{bucket}")).ok()?;
        node.leader
            .last(&format!("$KV.{bucket}.{key}"))
            .map(entry_of)
            .filter(|e| e.operation == Operation::Put)
    }

    /// The live keys of bucket `bucket` under `filter`, as the leader has them (for checks).
    pub fn keys(&self, bucket: &str, filter: &str) -> Vec<String> {
        let mut inner = self.lock();
        let Ok(node) = inner.node(&format!("KV_{bucket}")) else {
            return Vec::new();
        };
        live_keys(&node.leader, bucket, filter)
    }
}

/// The key-value entry a stored message is.
fn entry_of(message: Message) -> Entry {
    Entry {
        operation: Operation::from_header(message.header("KV-Operation")),
        revision: message.sequence,
        value: message.payload,
    }
}

/// The live keys of `bucket` matching `filter` in `state`.
fn live_keys(state: &StreamState, bucket: &str, filter: &str) -> Vec<String> {
    let prefix = format!("$KV.{bucket}.");
    let filter = format!("{prefix}{filter}");
    let mut keys: Vec<String> = state
        .last_per_subject(&filter)
        .into_iter()
        .filter_map(|seq| state.at(seq))
        .filter(|m| {
            let op = m
                .headers
                .iter()
                .find(|(n, _)| n == "KV-Operation")
                .map(|(_, v)| v.as_str());
            Operation::from_header(op) == Operation::Put
        })
        .filter_map(|m| m.subject.strip_prefix(&prefix).map(str::to_owned))
        .collect();
    keys.sort();
    keys
}

/// Who a request goes to.
#[derive(Clone)]
enum To {
    /// A stream's leader (a leaderless stream never answers).
    Leader(String),
    /// Any replica of a stream (a direct read).
    Any,
}

/// One process's connection to the cluster.
#[derive(Clone)]
pub struct Connection {
    cluster: Cluster,
    condition: Condition,
    timeout: Duration,
    /// Held by the request on the wire: the connection's requests apply in order.
    wire: Arc<tokio::sync::Mutex<()>>,
    /// When the connection's last request arrives, for one whose requests are pipelined (sent
    /// without waiting for the answer before, arriving in order); `None`: one at a time.
    pipeline: Option<Arc<std::sync::Mutex<Instant>>>,
    /// What an object put through this connection is stored as (a faulty store, to show what
    /// breaks: see `ports::without`); as put when none.
    object_filter: Option<fn(Vec<u8>) -> Vec<u8>>,
}

impl Connection {
    /// The same connection, storing each object put through it as `filter` makes it.
    #[must_use]
    pub fn filtering_objects(mut self, filter: fn(Vec<u8>) -> Vec<u8>) -> Self {
        self.object_filter = Some(filter);
        self
    }

    /// The same connection, its requests pipelined as a NATS client's are: each leaves without
    /// waiting for the answer to the one before, and they arrive in the order sent. (A
    /// connection carries one request at a time otherwise, which the seeds' histories were
    /// drawn with; thousands of runs a replica would measure that wire, not the services.)
    #[must_use]
    pub fn pipelined(mut self) -> Self {
        self.pipeline = Some(Arc::new(std::sync::Mutex::new(Instant::now())));
        self
    }

    /// One request: it leaves as the process's condition lets it, takes its latency, is applied by `apply` (unless
    /// its stream has no leader), and its answer is heard as the condition lets it, unless it is lost.
    /// Whatever is not answered times out after the connection's timeout. Once it left, the
    /// request is the network's (a task of no process): it arrives and is applied whatever its
    /// sender does meanwhile (stopped, or killed, as a kernel sends what it was given).
    async fn request<T: Send + 'static>(
        &self,
        to: To,
        apply: impl FnOnce(&mut Inner) -> Result<T, Error> + Send + 'static,
    ) -> Result<T, Error> {
        let started = Instant::now();
        let timed_out = || async move {
            tokio::time::sleep_until(started + self.timeout).await;
            Err(Error::TimedOut)
        };
        let wire = Arc::clone(&self.wire).lock_owned().await;
        if !self.condition.pass().await {
            drop(wire);
            return timed_out().await;
        }
        let cluster = self.cluster.clone();
        // One at a time, the latency is drawn once the request is carried (as the seeds drew it).
        let (wire, arrives) = match &self.pipeline {
            None => (Some(wire), None),
            Some(last) => {
                // Sent: the next request may leave now.
                drop(wire);
                let latency = cluster.lock().latency();
                let mut last = last.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                *last = (Instant::now() + latency).max(*last + Duration::from_micros(1));
                (None, Some(*last))
            }
        };
        let carried = tokio::spawn(async move {
            match arrives {
                Some(arrives) => tokio::time::sleep_until(arrives).await,
                None => {
                    let latency = cluster.lock().latency();
                    tokio::time::sleep(latency).await;
                }
            }
            let mut inner = cluster.lock();
            let leaderless = match &to {
                To::Leader(name) => {
                    let objects = inner
                        .objects_leaderless
                        .get(name)
                        .is_some_and(|until| Instant::now() < *until);
                    objects || inner.streams.get(name).is_some_and(Node::leaderless)
                }
                To::Any => false,
            };
            let answered = match leaderless {
                true => (None, true),
                false => {
                    let answer = apply(&mut inner);
                    (Some(answer), inner.answer_lost())
                }
            };
            drop(inner);
            drop(wire);
            answered
        });
        let (answer, lost) = carried.await.unwrap_or((None, true));
        if lost || !self.condition.pass().await || Instant::now() >= started + self.timeout {
            return timed_out().await;
        }
        answer.unwrap_or(Err(Error::TimedOut))
    }

    fn reply<T: Send + 'static>(
        &self,
        to: Option<String>,
        apply: impl FnOnce(&mut Inner) -> Result<T, Error> + Send + 'static,
    ) -> Reply<T> {
        let this = self.clone();
        async move {
            match &to {
                Some(name) => this.request(To::Leader(name.clone()), apply).await,
                None => this.request(To::Any, apply).await,
            }
        }
        .boxed()
    }

    /// Makes stream `name` with `limits` when missing.
    fn ensure(&self, name: String, limits: Limits) -> BoxFuture<'static, Result<(), Error>> {
        self.reply(None, move |inner| {
            inner.streams.entry(name).or_insert_with(|| Node {
                leader: StreamState::new(limits),
                lagging: None,
                leaderless_until: None,
            });
            Ok(())
        })
    }
}

impl JetStream for Connection {
    fn handle(&self) -> Arc<dyn JetStream> {
        Arc::new(self.clone())
    }

    fn bucket(&self, config: BucketConfig) -> Reply<Arc<dyn Bucket>> {
        let this = self.clone();
        async move {
            let limits = Limits {
                subjects: vec![format!("$KV.{}.>", config.name)],
                max_age: config.max_age,
                max_bytes: 0,
                discard_old: false,
                per_subject: 1,
                duplicate_window: Duration::from_secs(120).min(config.max_age),
            };
            this.ensure(format!("KV_{}", config.name), limits).await?;
            Ok(Arc::new(SimBucket {
                connection: this,
                name: config.name,
            }) as Arc<dyn Bucket>)
        }
        .boxed()
    }

    fn bind_bucket(&self, name: &str) -> Reply<Arc<dyn Bucket>> {
        let (this, name) = (self.clone(), name.to_owned());
        async move {
            let stream = format!("KV_{name}");
            this.reply(None, move |inner| inner.node(&stream).map(drop)).await?;
            Ok(Arc::new(SimBucket { connection: this, name }) as Arc<dyn Bucket>)
        }
        .boxed()
    }

    fn stream(&self, config: StreamConfig) -> Reply<Arc<dyn Stream>> {
        let this = self.clone();
        async move {
            let limits = Limits {
                subjects: config.subjects,
                max_age: config.max_age,
                max_bytes: config.max_bytes,
                discard_old: config.discard_old,
                per_subject: 0,
                duplicate_window: match config.max_age.is_zero() {
                    true => config.duplicate_window,
                    false => config.duplicate_window.min(config.max_age),
                },
            };
            this.ensure(config.name.clone(), limits).await?;
            Ok(Arc::new(SimStream {
                connection: this,
                name: config.name,
            }) as Arc<dyn Stream>)
        }
        .boxed()
    }

    fn objects(&self, config: ObjectsConfig) -> Reply<Arc<dyn Objects>> {
        let this = self.clone();
        async move {
            let (name, max_age) = (config.name.clone(), config.max_age);
            this.reply(None, move |inner| {
                inner.objects.entry(name).or_insert_with(|| (max_age, BTreeMap::new()));
                Ok(())
            })
            .await?;
            Ok(Arc::new(SimObjects {
                connection: this,
                name: config.name,
            }) as Arc<dyn Objects>)
        }
        .boxed()
    }

    fn max_payload(&self) -> usize {
        MAX_PAYLOAD
    }

    fn publish(&self, subject: String, payload: Bytes) -> Reply<()> {
        self.reply(None, move |inner| {
            deliver(inner, &subject, payload, None);
            Ok(())
        })
    }

    fn request(&self, subject: String, payload: Bytes) -> Reply<Option<Bytes>> {
        let this = self.clone();
        async move {
            let (tx, rx) = oneshot::channel();
            let asked = this
                .request(To::Any, move |inner| {
                    inner.next_inbox += 1;
                    let inbox = format!("_INBOX.{}", inner.next_inbox);
                    inner.inboxes.insert(inbox.clone(), tx);
                    Ok(deliver(inner, &subject, payload, Some(inbox)))
                })
                .await?;
            if asked == 0 {
                return Ok(None);
            }
            match tokio::time::timeout(this.timeout, rx).await {
                Ok(Ok(answer)) if this.condition.pass().await => Ok(Some(answer)),
                _ => Ok(None),
            }
        }
        .boxed()
    }

    fn subscribe(&self, subject: String) -> Reply<BoxStream<'static, Inbound>> {
        let condition = self.condition.clone();
        let this = self.clone();
        async move {
            let (tx, rx) = mpsc::channel(SUBSCRIPTION_BUFFER);
            this.request(To::Any, move |inner| {
                inner.subscriptions.push(Subscription {
                    pattern: subject,
                    tx,
                    condition,
                });
                Ok(())
            })
            .await?;
            let condition = this.condition.clone();
            Ok(tokio_stream_of(rx)
                .then(move |inbound| {
                    let condition = condition.clone();
                    async move {
                        condition.running().await;
                        inbound
                    }
                })
                .boxed())
        }
        .boxed()
    }
}

/// The messages of `rx` as a stream.
fn tokio_stream_of<T: Send + 'static>(rx: mpsc::Receiver<T>) -> BoxStream<'static, T> {
    futures::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|item| (item, rx)) }).boxed()
}

/// Delivers a core message to the inbox or the live subscriptions `subject` reaches; how many.
fn deliver(inner: &mut Inner, subject: &str, payload: Bytes, reply: Option<String>) -> usize {
    if let Some(inbox) = inner.inboxes.remove(subject) {
        return usize::from(inbox.send(payload).is_ok());
    }
    inner.subscriptions.retain(|s| !s.tx.is_closed());
    let mut reached = 0;
    for subscription in &inner.subscriptions {
        let alive = !matches!(
            subscription.condition.mode(),
            crate::ports::condition::Mode::Dead | crate::ports::condition::Mode::CutOff
        );
        if alive && matches(&subscription.pattern, subject) {
            let inbound = Inbound {
                payload: payload.clone(),
                reply: reply.clone(),
            };
            reached += usize::from(subscription.tx.try_send(inbound).is_ok());
        }
    }
    reached
}

/// A simulated key-value bucket.
#[derive(Clone)]
struct SimBucket {
    connection: Connection,
    name: String,
}

impl SimBucket {
    fn stream(&self) -> String {
        format!("KV_{}", self.name)
    }

    fn subject(&self, key: &str) -> String {
        format!("$KV.{}.{key}", self.name)
    }

    /// Writes `value` (or a marker, `operation`) under `key`, expecting its last write at `after`.
    fn write(&self, key: &str, value: Bytes, operation: Operation, after: Option<u64>) -> Reply<u64> {
        let (stream, subject) = (self.stream(), self.subject(key));
        let message = Publish {
            subject,
            payload: value,
            id: None,
            after,
            headers: operation
                .header()
                .map(|op| vec![("KV-Operation".to_owned(), op.to_owned())])
                .unwrap_or_default(),
        };
        self.connection.reply(Some(stream.clone()), move |inner| {
            let ack = inner.store(&stream, message).map_err(|e| match e {
                Error::WrongSequence => Error::WrongRevision,
                e => e,
            })?;
            Ok(ack.sequence)
        })
    }
}

impl Bucket for SimBucket {
    fn entry(&self, key: &str, consistency: Consistency) -> Reply<Option<Entry>> {
        let (stream, subject) = (self.stream(), self.subject(key));
        let to = match consistency {
            Consistency::Leader => Some(stream.clone()),
            Consistency::Direct => None,
        };
        self.connection.reply(to, move |inner| {
            let node = inner.node(&stream)?;
            let state = match consistency {
                Consistency::Leader => &node.leader,
                Consistency::Direct => node.direct(),
            };
            Ok(state.last(&subject).map(entry_of))
        })
    }

    fn create(&self, key: &str, value: Bytes) -> Reply<u64> {
        // As the client does: a create expecting no write, and over a delete marker one
        // expecting the marker.
        let (this, key) = (self.clone(), key.to_owned());
        async move {
            match this.write(&key, value.clone(), Operation::Put, Some(0)).await {
                Err(Error::WrongRevision) => {}
                other => return other,
            }
            match this.entry(&key, Consistency::Leader).await? {
                Some(entry) if entry.operation != Operation::Put => this
                    .write(&key, value, Operation::Put, Some(entry.revision))
                    .await
                    .map_err(|e| match e {
                        Error::WrongRevision => Error::Exists,
                        e => e,
                    }),
                _ => Err(Error::Exists),
            }
        }
        .boxed()
    }

    fn update(&self, key: &str, value: Bytes, revision: u64) -> Reply<u64> {
        self.write(key, value, Operation::Put, Some(revision))
    }

    fn put(&self, key: &str, value: Bytes) -> Reply<u64> {
        self.write(key, value, Operation::Put, None)
    }

    fn delete(&self, key: &str, revision: Option<u64>) -> Reply<()> {
        let write = self.write(key, Bytes::new(), Operation::Delete, revision);
        async move { write.await.map(drop) }.boxed()
    }

    fn keys(&self, filter: &str) -> Reply<Vec<String>> {
        let (stream, bucket, filter) = (self.stream(), self.name.clone(), filter.to_owned());
        self.connection.reply(Some(stream.clone()), move |inner| {
            Ok(live_keys(&inner.node(&stream)?.leader, &bucket, &filter))
        })
    }
}

/// A simulated stream.
struct SimStream {
    connection: Connection,
    name: String,
}

impl Stream for SimStream {
    fn publish(&self, message: Publish) -> Reply<Ack> {
        let name = self.name.clone();
        self.connection.reply(Some(name.clone()), move |inner| {
            if message.payload.len() > MAX_PAYLOAD {
                return Err(Error::Failed("maximum payload exceeded".to_owned()));
            }
            inner.store(&name, message)
        })
    }

    fn last(&self, subject: &str, consistency: Consistency) -> Reply<Option<Message>> {
        let (name, subject) = (self.name.clone(), subject.to_owned());
        let to = match consistency {
            Consistency::Leader => Some(name.clone()),
            Consistency::Direct => None,
        };
        self.connection.reply(to, move |inner| {
            let node = inner.node(&name)?;
            let state = match consistency {
                Consistency::Leader => &node.leader,
                Consistency::Direct => node.direct(),
            };
            Ok(state.last(&subject))
        })
    }

    fn read(&self, read: Read) -> Reply<Reading> {
        let (connection, name) = (self.connection.clone(), self.name.clone());
        async move {
            let filter = read.filter.clone();
            let (start, pending) = connection
                .request(To::Leader(name.clone()), {
                    let (name, filter) = (name.clone(), filter.clone());
                    move |inner| {
                        let state = &inner.node(&name)?.leader;
                        let start = match read.deliver {
                            Deliver::All => Start::From(0),
                            Deliver::From(seq) => Start::From(seq),
                            Deliver::New => Start::From(state.last_sequence() + 1),
                            Deliver::LastPerSubject => {
                                Start::Last(state.last_per_subject(&filter), state.last_sequence() + 1)
                            }
                        };
                        let pending = start.pending(state, &filter);
                        Ok((start, pending))
                    }
                })
                .await?;
            let reader = Reader {
                connection,
                name,
                filter,
                headers_only: read.headers_only,
                start,
            };
            Ok(Reading {
                pending,
                messages: reader.into_stream(),
            })
        }
        .boxed()
    }

    fn purge(&self, subject: &str, keep: u64) -> Reply<()> {
        let (name, subject) = (self.name.clone(), subject.to_owned());
        self.connection.reply(Some(name.clone()), move |inner| {
            inner.node(&name)?.leader.purge(&subject, keep);
            Ok(())
        })
    }

    fn state(&self) -> Reply<State> {
        let name = self.name.clone();
        self.connection
            .reply(Some(name.clone()), move |inner| Ok(inner.node(&name)?.leader.state()))
    }
}

/// Where an ordered read stands.
#[derive(Debug, Clone)]
enum Start {
    /// The next message from this sequence on.
    From(u64),
    /// The last message of each subject (these sequences), then the messages from the sequence.
    Last(Vec<u64>, u64),
}

impl Start {
    /// Messages still to deliver from here.
    fn pending(&self, state: &StreamState, filter: &str) -> u64 {
        match self {
            Self::From(seq) => state.from(filter, *seq).count() as u64,
            Self::Last(seqs, then) => seqs.len() as u64 + state.from(filter, *then).count() as u64,
        }
    }
}

/// An ordered consumer: its messages in stream order, then the ones published later.
struct Reader {
    connection: Connection,
    name: String,
    filter: String,
    headers_only: bool,
    start: Start,
}

impl Reader {
    /// The next message, once there is one the reader may take.
    fn next(&mut self) -> Option<Result<Message, Error>> {
        let mut inner = self.connection.cluster.lock();
        let node = match inner.node(&self.name) {
            Ok(node) => node,
            Err(e) => return Some(Err(e)),
        };
        if node.leaderless() {
            return None;
        }
        let state = &node.leader;
        loop {
            let (seq, rest) = match &mut self.start {
                Start::Last(seqs, then) => match seqs.first().copied() {
                    Some(seq) => {
                        seqs.remove(0);
                        (seq, Start::Last(std::mem::take(seqs), *then))
                    }
                    None => {
                        self.start = Start::From(*then);
                        continue;
                    }
                },
                Start::From(from) => {
                    let seq = state.from(&self.filter, *from).map(|(seq, _)| seq).next()?;
                    (seq, Start::From(seq + 1))
                }
            };
            self.start = rest;
            // A message purged since the read began is skipped.
            let Some(stored) = state.at(seq) else {
                continue;
            };
            let pending = self.start.pending(state, &self.filter);
            return Some(Ok(stream::message(seq, stored, self.headers_only, pending)));
        }
    }

    fn into_stream(self) -> BoxStream<'static, Result<Message, Error>> {
        futures::stream::unfold(self, |mut reader| async move {
            let mut published = reader.connection.cluster.lock().published.subscribe();
            loop {
                // A paused or cut-off process hears nothing until it is back.
                while !reader.connection.condition.pass().await {
                    tokio::time::sleep(reader.connection.timeout).await;
                }
                if let Some(message) = reader.next() {
                    return Some((message, reader));
                }
                let wait = tokio::time::timeout(reader.connection.timeout, published.changed());
                if let Ok(Err(_)) = wait.await {
                    return None;
                }
            }
        })
        .boxed()
    }
}

/// A simulated object store.
struct SimObjects {
    connection: Connection,
    name: String,
}

impl SimObjects {
    /// The store's objects, past their age dropped.
    fn objects<'a>(inner: &'a mut Inner, name: &str) -> Result<&'a mut BTreeMap<String, StoredObject>, Error> {
        let (max_age, objects) = inner
            .objects
            .get_mut(name)
            .ok_or_else(|| Error::Failed(format!("object store not found: {name}")))?;
        if !max_age.is_zero() {
            let now = Instant::now();
            objects.retain(|_, o| now.duration_since(o.at) < *max_age);
        }
        Ok(objects)
    }
}

impl Objects for SimObjects {
    fn put(&self, name: &str, description: Option<String>, bytes: Vec<u8>) -> Reply<()> {
        let (store, name) = (self.name.clone(), name.to_owned());
        let bytes = match self.connection.object_filter {
            Some(filter) => filter(bytes),
            None => bytes,
        };
        self.connection.reply(Some(store.clone()), move |inner| {
            let object = StoredObject {
                description,
                bytes,
                at: Instant::now(),
            };
            Self::objects(inner, &store)?.insert(name, object);
            Ok(())
        })
    }

    fn get(&self, name: &str) -> Reply<Option<Object>> {
        let (store, name) = (self.name.clone(), name.to_owned());
        self.connection.reply(Some(store.clone()), move |inner| {
            Ok(Self::objects(inner, &store)?.get(&name).map(|o| Object {
                description: o.description.clone(),
                bytes: o.bytes.clone(),
            }))
        })
    }

    fn remove(&self, name: &str) -> Reply<()> {
        let (store, name) = (self.name.clone(), name.to_owned());
        self.connection.reply(Some(store.clone()), move |inner| {
            Self::objects(inner, &store)?.remove(&name);
            Ok(())
        })
    }

    fn names(&self) -> Reply<Vec<String>> {
        let store = self.name.clone();
        self.connection.reply(Some(store.clone()), move |inner| {
            Ok(Self::objects(inner, &store)?.keys().cloned().collect())
        })
    }
}

#[cfg(test)]
mod tests;
