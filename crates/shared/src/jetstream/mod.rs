//! The seam under every JetStream adapter: the few primitives the run store, the event log, the
//! run index, the approval, quota, usage, thread and sign-out buckets, the checkpoint objects, the
//! asks between replicas and the tool-runner's fence use, and nothing else. Two implementations
//! stand behind it: [`nats`] (the async-nats JetStream context, what production runs) and the simulated
//! JetStream of the `sim` crate (the same semantics on a virtual clock, with the faults a cluster
//! produces), so the simulation runs the real adapters rather than a model of them.
//!
//! The semantics are NATS's own, and each implementation keeps them:
//! * a stream numbers its messages (the stream sequence) and keeps the last sequence of each
//!   subject; a publish may name a message id (stored once within the duplicate window: a second
//!   publish is acknowledged as a duplicate with the first one's sequence) and the last sequence
//!   its subject must stand at (refused with [`Error::WrongSequence`] otherwise);
//! * a key-value bucket is a stream of `$KV.<bucket>.<key>` subjects: every write has a revision
//!   (its stream sequence); create refuses a live key ([`Error::Exists`]), update and delete at a
//!   revision refuse any other ([`Error::WrongRevision`]); a delete leaves a marker an entry read
//!   shows and a key listing skips;
//! * a read of the last message of a subject is served by the stream's leader
//!   ([`Consistency::Leader`]) or by any replica ([`Consistency::Direct`]: a follower may lag);
//! * a request whose answer is lost may have been applied: an error never says it was not.

pub mod nats;
pub mod shards;

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures::future::BoxFuture;
use futures::stream::BoxStream;

/// What a primitive answers, some time later.
pub type Reply<T> = BoxFuture<'static, Result<T, Error>>;

/// Why a primitive did not do what it was asked. Every error but the three refusals may hide a
/// write that landed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// A create found the key live.
    #[error("the key exists already")]
    Exists,
    /// An update or delete at a revision found another one.
    #[error("wrong last revision")]
    WrongRevision,
    /// A publish found its subject at another sequence than it expected.
    #[error("wrong last subject sequence")]
    WrongSequence,
    /// No answer in time (the request may have been applied).
    #[error("no answer in time")]
    TimedOut,
    /// Anything else, as the server or client said it.
    #[error("{0}")]
    Failed(String),
}

impl Error {
    /// An error of the client or server, as it reads.
    pub fn failed(e: impl std::fmt::Display) -> Self {
        Self::Failed(e.to_string())
    }
}

/// Who answers a read of a subject's last message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Consistency {
    /// The stream's leader: the read sees every write acknowledged before it was made.
    Leader,
    /// Any replica (a stream that allows direct gets): cheaper, and a follower may not have the
    /// newest writes yet.
    Direct,
}

/// What a key-value write was.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Operation {
    /// A value.
    Put,
    /// A delete marker.
    Delete,
    /// A purge marker (the key's history is gone).
    Purge,
}

impl Operation {
    /// The operation a `KV-Operation` header names (none: a put).
    pub fn from_header(value: Option<&str>) -> Self {
        match value {
            Some("DEL") => Self::Delete,
            Some("PURGE") => Self::Purge,
            _ => Self::Put,
        }
    }

    /// The header value of this operation (none for a put).
    pub fn header(self) -> Option<&'static str> {
        match self {
            Self::Put => None,
            Self::Delete => Some("DEL"),
            Self::Purge => Some("PURGE"),
        }
    }
}

/// The last write of a key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    /// Empty for a delete or purge marker.
    pub value: Bytes,
    /// The write's revision (its stream sequence): what an update or delete at a revision names.
    pub revision: u64,
    /// What the write was.
    pub operation: Operation,
}

/// A stored message of a stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    /// The subject it was published on.
    pub subject: String,
    /// Its stream sequence.
    pub sequence: u64,
    /// Its headers (`KV-Operation` marks a key-value delete).
    pub headers: Vec<(String, String)>,
    /// Empty when read as headers only.
    pub payload: Bytes,
    /// Messages of the read still to come after this one when it was delivered.
    pub pending: u64,
}

impl Message {
    /// The value of header `name`, if it has one.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(n, _)| n == name).map(|(_, v)| v.as_str())
    }
}

/// Room a message leaves below the server's largest payload, for its headers.
pub const HEADER_ROOM: usize = 4096;

/// A message to publish.
#[derive(Debug, Clone, Default)]
pub struct Publish {
    /// Where it goes.
    pub subject: String,
    /// What it says.
    pub payload: Bytes,
    /// Its message id: stored once within the stream's duplicate window.
    pub id: Option<String>,
    /// The stream sequence the subject's last message must have (0: the subject must be empty).
    pub after: Option<u64>,
    /// Headers of its own (a trace context, names for a reader that filters).
    pub headers: Vec<(String, String)>,
}

/// A stream's acknowledgement of a publish.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ack {
    /// Where the message is (for a duplicate, where the first one is).
    pub sequence: u64,
    /// The message id was stored already: this publish stored nothing.
    pub duplicate: bool,
}

/// Where a read of a stream starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Deliver {
    /// From the first message kept.
    All,
    /// From this stream sequence.
    From(u64),
    /// The last message of each subject.
    LastPerSubject,
    /// Only messages published after the read starts.
    New,
}

/// A read of a stream's messages, in order (an ordered consumer).
#[derive(Debug, Clone)]
pub struct Read {
    /// The subjects read (wildcards allowed).
    pub filter: String,
    /// Where it starts.
    pub deliver: Deliver,
    /// Headers only, no payloads.
    pub headers_only: bool,
    /// How long one pull waits for messages (a lost consumer is noticed after a few).
    pub expires: Option<Duration>,
}

/// A read under way.
pub struct Reading {
    /// Messages matching the read when it started: 0 means there is nothing to wait for.
    pub pending: u64,
    /// The messages, then those published later (the read never ends by itself).
    pub messages: BoxStream<'static, Result<Message, Error>>,
}

/// What a stream holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct State {
    /// Messages kept.
    pub messages: u64,
    /// The oldest message's sequence (one past the newest when none is kept).
    pub first_sequence: u64,
    /// The newest message's sequence (0: none ever).
    pub last_sequence: u64,
}

/// How a stream is made when missing (one that exists is brought to `replicas`).
#[derive(Debug, Clone)]
pub struct StreamConfig {
    /// Its name.
    pub name: String,
    /// What it is for, for operators.
    pub description: String,
    /// The subjects it stores.
    pub subjects: Vec<String>,
    /// How long a message is kept.
    pub max_age: Duration,
    /// Bytes kept in all (0: no limit).
    pub max_bytes: u64,
    /// When full, drop the oldest messages (else refuse new ones).
    pub discard_old: bool,
    /// How long a message id is remembered.
    pub duplicate_window: Duration,
    /// Copies kept.
    pub replicas: usize,
}

/// How a key-value bucket is made when missing.
#[derive(Debug, Clone)]
pub struct BucketConfig {
    /// Its name.
    pub name: String,
    /// What it is for, for operators.
    pub description: String,
    /// How long a value is kept after its last write.
    pub max_age: Duration,
    /// Copies kept.
    pub replicas: usize,
}

/// How an object store is made when missing.
#[derive(Debug, Clone)]
pub struct ObjectsConfig {
    /// Its name.
    pub name: String,
    /// What it is for, for operators.
    pub description: String,
    /// How long an object is kept.
    pub max_age: Duration,
    /// Copies kept.
    pub replicas: usize,
}

/// A stored object.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Object {
    /// The description it was put with.
    pub description: Option<String>,
    /// Its bytes.
    pub bytes: Vec<u8>,
}

/// A core NATS message a subscription received.
#[derive(Debug, Clone)]
pub struct Inbound {
    /// What it says.
    pub payload: Bytes,
    /// Where an answer goes (a request), if anywhere.
    pub reply: Option<String>,
}

/// A connection to JetStream (and core NATS, for the asks between replicas).
pub trait JetStream: Send + Sync + 'static {
    /// This connection, to keep.
    fn handle(&self) -> Arc<dyn JetStream>;
    /// The bucket `config.name`, made as `config` says when missing.
    fn bucket(&self, config: BucketConfig) -> Reply<Arc<dyn Bucket>>;
    /// The bucket `name` as someone else made it (a reader that must not create it).
    fn bind_bucket(&self, name: &str) -> Reply<Arc<dyn Bucket>>;
    /// The stream `config.name`, made as `config` says when missing.
    fn stream(&self, config: StreamConfig) -> Reply<Arc<dyn Stream>>;
    /// The object store `config.name`, made as `config` says when missing.
    fn objects(&self, config: ObjectsConfig) -> Reply<Arc<dyn Objects>>;
    /// The largest payload the server takes.
    fn max_payload(&self) -> usize;
    /// Publishes on core NATS (no acknowledgement, no storage).
    fn publish(&self, subject: String, payload: Bytes) -> Reply<()>;
    /// Asks whoever subscribes to `subject`; `None` when nobody answered in time.
    fn request(&self, subject: String, payload: Bytes) -> Reply<Option<Bytes>>;
    /// The messages published on `subject` from now on.
    fn subscribe(&self, subject: String) -> Reply<BoxStream<'static, Inbound>>;
}

/// A key-value bucket.
pub trait Bucket: Send + Sync + 'static {
    /// The last write of `key` (a delete marker included), read as `consistency` says.
    fn entry(&self, key: &str, consistency: Consistency) -> Reply<Option<Entry>>;
    /// Writes `key` unless it is live: the new revision, or [`Error::Exists`].
    fn create(&self, key: &str, value: Bytes) -> Reply<u64>;
    /// Writes `key` if its last write is `revision`: the new revision, or [`Error::WrongRevision`].
    fn update(&self, key: &str, value: Bytes, revision: u64) -> Reply<u64>;
    /// Writes `key` whatever it holds: the new revision.
    fn put(&self, key: &str, value: Bytes) -> Reply<u64>;
    /// Leaves a delete marker on `key`; with `revision`, only if its last write is that one.
    fn delete(&self, key: &str, revision: Option<u64>) -> Reply<()>;
    /// The live keys matching `filter` (`>` for all), as of the read's start.
    fn keys(&self, filter: &str) -> Reply<Vec<String>>;
}

impl dyn Bucket {
    /// The value of `key` (none for a delete marker), from any replica.
    pub fn get(&self, key: &str) -> Reply<Option<Bytes>> {
        let entry = self.entry(key, Consistency::Direct);
        Box::pin(async move { Ok(entry.await?.filter(|e| e.operation == Operation::Put).map(|e| e.value)) })
    }
}

/// A stream.
pub trait Stream: Send + Sync + 'static {
    /// Stores a message: where it is, or a refusal.
    fn publish(&self, message: Publish) -> Reply<Ack>;
    /// The last message of `subject`, read as `consistency` says.
    fn last(&self, subject: &str, consistency: Consistency) -> Reply<Option<Message>>;
    /// Reads messages in order.
    fn read(&self, read: Read) -> Reply<Reading>;
    /// Drops the messages of `subject` but its newest `keep`.
    fn purge(&self, subject: &str, keep: u64) -> Reply<()>;
    /// What it holds now.
    fn state(&self) -> Reply<State>;
}

/// An object store.
pub trait Objects: Send + Sync + 'static {
    /// Stores `bytes` as `name` (replacing what is there), described by `description`.
    fn put(&self, name: &str, description: Option<String>, bytes: Vec<u8>) -> Reply<()>;
    /// The object `name`, if there is one.
    fn get(&self, name: &str) -> Reply<Option<Object>>;
    /// Deletes the object `name` (nothing when there is none), leaving nothing a listing meets.
    fn remove(&self, name: &str) -> Reply<()>;
    /// The names of the objects stored when the listing starts.
    fn names(&self) -> Reply<Vec<String>>;
}
