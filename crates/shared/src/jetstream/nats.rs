//! The seam over the async-nats client: what production runs. Streams are made when missing with
//! the configured replicas, and one that exists with another count (made before the setting
//! changed, or by hand) is brought to it, so that scaling a NATS cluster up to three nodes and
//! restarting with `--nats-replicas 3` makes every stream survive the loss of a node.

use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::{self, consumer, kv, object_store, stream};
use bytes::Bytes;
use futures::stream::BoxStream;
use futures::{FutureExt as _, StreamExt as _};

use super::{
    Ack, Bucket, BucketConfig, Consistency, Deliver, Entry, Error, Inbound, JetStream, Message, Object, Objects,
    ObjectsConfig, Operation, Publish, Read, Reading, Reply, State, Stream, StreamConfig,
};

/// A JetStream context over `client`; with `timeout`, each JetStream request waits that long for
/// its answer (else the client's default). The context is the seam's production implementation.
pub fn context(client: async_nats::Client, timeout: Option<Duration>) -> jetstream::Context {
    let mut builder = jetstream::context::ContextBuilder::new();
    if let Some(timeout) = timeout {
        builder = builder.timeout(timeout);
    }
    builder.build(client)
}

/// The stream `config.name`, made as `config` says when missing, with its replicas brought to
/// `config.num_replicas` when it exists with another count.
async fn ensure_stream(js: &jetstream::Context, config: stream::Config) -> Result<stream::Stream, Error> {
    let replicas = config.num_replicas;
    let stream = js.get_or_create_stream(config).await.map_err(Error::failed)?;
    with_replicas(js, stream, replicas).await
}

/// `stream`, brought to `replicas` copies as its info read says (nothing when it has them). A
/// server that is not part of a JetStream cluster refuses more than one; its answer is the error.
async fn with_replicas(
    js: &jetstream::Context,
    stream: stream::Stream,
    replicas: usize,
) -> Result<stream::Stream, Error> {
    let info = stream.cached_info();
    let had = info.config.num_replicas.max(1);
    if had == replicas.max(1) {
        return Ok(stream);
    }
    let mut config = info.config.clone();
    config.num_replicas = replicas;
    let name = config.name.clone();
    js.update_stream(config)
        .await
        .map_err(|e| Error::Failed(format!("changing its replicas from {had} to {replicas}: {e}")))?;
    tracing::info!(stream = %name, from = had, to = replicas, "JetStream stream replicas changed");
    js.get_stream(&name).await.map_err(Error::failed)
}

impl JetStream for jetstream::Context {
    fn handle(&self) -> Arc<dyn JetStream> {
        Arc::new(self.clone())
    }

    fn bucket(&self, config: BucketConfig) -> Reply<Arc<dyn Bucket>> {
        let js = self.clone();
        async move {
            // Made as a stream, not with the client's bucket maker: its shape (one message per
            // subject, direct reads, no deletes but markers) is what the adapters rely on, and an
            // existing bucket is brought to the replicas asked for.
            let stream = stream::Config {
                name: format!("KV_{}", config.name),
                description: Some(config.description),
                subjects: vec![format!("$KV.{}.>", config.name)],
                max_messages_per_subject: 1,
                max_age: config.max_age,
                storage: stream::StorageType::File,
                discard: stream::DiscardPolicy::New,
                allow_rollup: true,
                deny_delete: true,
                allow_direct: true,
                num_replicas: config.replicas,
                ..Default::default()
            };
            ensure_stream(&js, stream).await?;
            let kv = js.get_key_value(&config.name).await.map_err(Error::failed)?;
            Ok(Arc::new(NatsBucket { kv }) as Arc<dyn Bucket>)
        }
        .boxed()
    }

    fn bind_bucket(&self, name: &str) -> Reply<Arc<dyn Bucket>> {
        let (js, name) = (self.clone(), name.to_owned());
        async move {
            let kv = js.get_key_value(&name).await.map_err(Error::failed)?;
            Ok(Arc::new(NatsBucket { kv }) as Arc<dyn Bucket>)
        }
        .boxed()
    }

    fn stream(&self, config: StreamConfig) -> Reply<Arc<dyn Stream>> {
        let js = self.clone();
        async move {
            let stream = stream::Config {
                name: config.name,
                description: Some(config.description),
                subjects: config.subjects,
                max_age: config.max_age,
                max_bytes: match config.max_bytes {
                    0 => -1,
                    bytes => i64::try_from(bytes).unwrap_or(i64::MAX),
                },
                discard: match config.discard_old {
                    true => stream::DiscardPolicy::Old,
                    false => stream::DiscardPolicy::New,
                },
                // The server refuses a window longer than what the stream keeps.
                duplicate_window: match config.max_age.is_zero() {
                    true => config.duplicate_window,
                    false => config.duplicate_window.min(config.max_age),
                },
                storage: stream::StorageType::File,
                allow_direct: true,
                num_replicas: config.replicas,
                ..Default::default()
            };
            let stream = ensure_stream(&js, stream).await?;
            Ok(Arc::new(NatsStream { js, stream }) as Arc<dyn Stream>)
        }
        .boxed()
    }

    fn objects(&self, config: ObjectsConfig) -> Reply<Arc<dyn Objects>> {
        let js = self.clone();
        async move {
            let objects = match js.get_object_store(&config.name).await {
                Ok(store) => store,
                Err(_) => js
                    .create_object_store(object_store::Config {
                        bucket: config.name.clone(),
                        description: Some(config.description),
                        max_age: config.max_age,
                        storage: stream::StorageType::File,
                        num_replicas: config.replicas,
                        ..Default::default()
                    })
                    .await
                    .map_err(Error::failed)?,
            };
            let stream = js
                .get_stream(format!("OBJ_{}", config.name))
                .await
                .map_err(Error::failed)?;
            let stream = with_replicas(&js, stream, config.replicas).await?;
            Ok(Arc::new(NatsObjects {
                objects,
                stream,
                meta_prefix: format!("$O.{}.M.", config.name),
            }) as Arc<dyn Objects>)
        }
        .boxed()
    }

    fn max_payload(&self) -> usize {
        self.client().server_info().max_payload
    }

    fn publish(&self, subject: String, payload: Bytes) -> Reply<()> {
        let client = self.client();
        async move { client.publish(subject, payload).await.map_err(Error::failed) }.boxed()
    }

    fn request(&self, subject: String, payload: Bytes) -> Reply<Option<Bytes>> {
        let client = self.client();
        async move {
            match client.request(subject, payload).await {
                Ok(reply) => Ok(Some(reply.payload)),
                Err(e)
                    if matches!(
                        e.kind(),
                        async_nats::RequestErrorKind::TimedOut | async_nats::RequestErrorKind::NoResponders
                    ) =>
                {
                    Ok(None)
                }
                Err(e) => Err(Error::failed(e)),
            }
        }
        .boxed()
    }

    fn subscribe(&self, subject: String) -> Reply<BoxStream<'static, Inbound>> {
        let client = self.client();
        async move {
            let subscriber = client.subscribe(subject).await.map_err(Error::failed)?;
            Ok(subscriber
                .map(|message| Inbound {
                    payload: message.payload,
                    reply: message.reply.map(|r| r.to_string()),
                })
                .boxed())
        }
        .boxed()
    }
}

/// A key-value bucket over async-nats.
struct NatsBucket {
    kv: kv::Store,
}

impl NatsBucket {
    /// The stream subject of `key`.
    fn subject(&self, key: &str) -> String {
        format!("{}{key}", self.kv.prefix)
    }
}

impl Bucket for NatsBucket {
    fn entry(&self, key: &str, consistency: Consistency) -> Reply<Option<Entry>> {
        let (kv, key) = (self.kv.clone(), key.to_owned());
        let subject = self.subject(&key);
        async move {
            match consistency {
                Consistency::Direct => Ok(kv.entry(key).await.map_err(Error::failed)?.map(|e| Entry {
                    value: e.value,
                    revision: e.revision,
                    operation: match e.operation {
                        kv::Operation::Put => Operation::Put,
                        kv::Operation::Delete => Operation::Delete,
                        kv::Operation::Purge => Operation::Purge,
                    },
                })),
                Consistency::Leader => Ok(leader_last(&kv.stream, &subject).await?.map(|m| Entry {
                    operation: Operation::from_header(m.header("KV-Operation")),
                    revision: m.sequence,
                    value: m.payload,
                })),
            }
        }
        .boxed()
    }

    fn create(&self, key: &str, value: Bytes) -> Reply<u64> {
        let (kv, key) = (self.kv.clone(), key.to_owned());
        async move {
            kv.create(&key, value).await.map_err(|e| match e.kind() {
                kv::CreateErrorKind::AlreadyExists => Error::Exists,
                _ => Error::failed(e),
            })
        }
        .boxed()
    }

    fn update(&self, key: &str, value: Bytes, revision: u64) -> Reply<u64> {
        let (kv, key) = (self.kv.clone(), key.to_owned());
        async move {
            kv.update(&key, value, revision).await.map_err(|e| match e.kind() {
                kv::UpdateErrorKind::WrongLastRevision => Error::WrongRevision,
                _ => Error::failed(e),
            })
        }
        .boxed()
    }

    fn put(&self, key: &str, value: Bytes) -> Reply<u64> {
        let (kv, key) = (self.kv.clone(), key.to_owned());
        async move { kv.put(&key, value).await.map_err(Error::failed) }.boxed()
    }

    fn delete(&self, key: &str, revision: Option<u64>) -> Reply<()> {
        let (kv, key) = (self.kv.clone(), key.to_owned());
        async move {
            kv.delete_expect_revision(&key, revision)
                .await
                .map_err(|e| match e.kind() {
                    kv::DeleteErrorKind::WrongLastRevision => Error::WrongRevision,
                    _ => Error::failed(e),
                })
        }
        .boxed()
    }

    fn keys(&self, filter: &str) -> Reply<Vec<String>> {
        let (stream, prefix) = (self.kv.stream.clone(), self.kv.prefix.clone());
        let filter = self.subject(filter);
        async move {
            let read = Read {
                filter,
                deliver: Deliver::LastPerSubject,
                headers_only: true,
                expires: None,
            };
            let mut keys = std::collections::BTreeSet::new();
            // A key written while the listing reads comes again: each is listed once.
            for message in read_through(&stream, read).await? {
                let live = Operation::from_header(message.header("KV-Operation")) == Operation::Put;
                if let Some(key) = message.subject.strip_prefix(&prefix)
                    && live
                {
                    keys.insert(key.to_owned());
                }
            }
            Ok(keys.into_iter().collect())
        }
        .boxed()
    }
}

/// The last message of `subject`, read from the stream's leader.
async fn leader_last(stream: &stream::Stream, subject: &str) -> Result<Option<Message>, Error> {
    match stream.get_last_raw_message_by_subject(subject).await {
        Ok(message) => Ok(Some(stored(message))),
        Err(e) if e.kind() == stream::LastRawMessageErrorKind::NoMessageFound => Ok(None),
        Err(e) => Err(Error::failed(e)),
    }
}

/// A message read by its stream sequence, as the seam gives it.
fn stored(message: jetstream::message::StreamMessage) -> Message {
    Message {
        subject: message.subject.to_string(),
        sequence: message.sequence,
        headers: headers(&message.headers),
        payload: message.payload,
        pending: 0,
    }
}

/// A message's headers as name and value pairs.
fn headers(map: &async_nats::HeaderMap) -> Vec<(String, String)> {
    map.iter()
        .flat_map(|(name, values)| values.iter().map(move |v| (name.to_string(), v.as_str().to_owned())))
        .collect()
}

/// An ordered read of `stream` as `read` says.
async fn open_read(stream: &stream::Stream, read: Read) -> Result<Reading, Error> {
    let consumer = stream
        .create_consumer(consumer::pull::OrderedConfig {
            filter_subject: read.filter,
            deliver_policy: match read.deliver {
                Deliver::All => consumer::DeliverPolicy::All,
                Deliver::From(start_sequence) => consumer::DeliverPolicy::ByStartSequence { start_sequence },
                Deliver::LastPerSubject => consumer::DeliverPolicy::LastPerSubject,
                Deliver::New => consumer::DeliverPolicy::New,
            },
            headers_only: read.headers_only,
            max_expires: read.expires.unwrap_or_default(),
            ..Default::default()
        })
        .await
        .map_err(Error::failed)?;
    let pending = consumer.cached_info().num_pending;
    let messages = consumer.messages().await.map_err(Error::failed)?;
    let messages = messages
        .map(|message| {
            let message = message.map_err(Error::failed)?;
            let info = message.info().map_err(Error::failed)?;
            let (sequence, pending) = (info.stream_sequence, info.pending);
            let message = message.message;
            Ok(Message {
                subject: message.subject.to_string(),
                sequence,
                headers: message.headers.as_ref().map(headers).unwrap_or_default(),
                payload: message.payload,
                pending,
            })
        })
        .boxed();
    Ok(Reading { pending, messages })
}

/// How long a read through waits for its next message before it ends with what it has: a
/// message counted as pending when the read began may be gone before it is delivered (a key of a
/// bucket written again replaces its last value), and then none says that nothing is pending.
const READ_THROUGH_IDLE: std::time::Duration = std::time::Duration::from_secs(2);

/// The messages `read` finds when it starts: read until none is pending (or none comes for
/// [`READ_THROUGH_IDLE`]).
async fn read_through(stream: &stream::Stream, read: Read) -> Result<Vec<Message>, Error> {
    let mut reading = open_read(stream, read).await?;
    let mut found = Vec::new();
    if reading.pending == 0 {
        return Ok(found);
    }
    while let Ok(Some(message)) = tokio::time::timeout(READ_THROUGH_IDLE, reading.messages.next()).await {
        let message = message?;
        let pending = message.pending;
        found.push(message);
        if pending == 0 {
            break;
        }
    }
    Ok(found)
}

/// A stream over async-nats.
struct NatsStream {
    js: jetstream::Context,
    stream: stream::Stream,
}

impl Stream for NatsStream {
    fn publish(&self, message: Publish) -> Reply<Ack> {
        let js = self.js.clone();
        async move {
            let mut headers = async_nats::HeaderMap::new();
            if let Some(id) = &message.id {
                headers.insert(async_nats::header::NATS_MESSAGE_ID, id.as_str());
            }
            for (name, value) in &message.headers {
                headers.insert(name.as_str(), value.as_str());
            }
            if let Some(after) = message.after {
                headers.insert(
                    async_nats::header::NATS_EXPECTED_LAST_SUBJECT_SEQUENCE,
                    after.to_string().as_str(),
                );
            }
            let refused = |e: jetstream::context::PublishError| match e.kind() {
                jetstream::context::PublishErrorKind::WrongLastSequence => Error::WrongSequence,
                jetstream::context::PublishErrorKind::TimedOut => Error::TimedOut,
                _ => Error::failed(e),
            };
            let ack = js
                .publish_with_headers(message.subject, headers, message.payload)
                .await
                .map_err(refused)?
                .await
                .map_err(refused)?;
            Ok(Ack {
                sequence: ack.sequence,
                duplicate: ack.duplicate,
            })
        }
        .boxed()
    }

    fn last(&self, subject: &str, consistency: Consistency) -> Reply<Option<Message>> {
        let (stream, subject) = (self.stream.clone(), subject.to_owned());
        async move {
            match consistency {
                Consistency::Leader => leader_last(&stream, &subject).await,
                Consistency::Direct => match stream.direct_get_last_for_subject(&subject).await {
                    Ok(message) => Ok(Some(stored(message))),
                    Err(e) if e.kind() == stream::DirectGetErrorKind::NotFound => Ok(None),
                    Err(e) => Err(Error::failed(e)),
                },
            }
        }
        .boxed()
    }

    fn read(&self, read: Read) -> Reply<Reading> {
        let stream = self.stream.clone();
        async move { open_read(&stream, read).await }.boxed()
    }

    fn purge(&self, subject: &str, keep: u64) -> Reply<()> {
        let (stream, subject) = (self.stream.clone(), subject.to_owned());
        async move {
            let purge = stream.purge().filter(subject);
            let purged = match keep {
                0 => purge.await,
                keep => purge.keep(keep).await,
            };
            purged.map(|_| ()).map_err(Error::failed)
        }
        .boxed()
    }

    fn state(&self) -> Reply<State> {
        let mut stream = self.stream.clone();
        async move {
            let state = &stream.info().await.map_err(Error::failed)?.state;
            Ok(State {
                messages: state.messages,
                first_sequence: state.first_sequence,
                last_sequence: state.last_sequence,
            })
        }
        .boxed()
    }
}

/// An object store over async-nats, with its stream (whose metadata subjects it purges).
///
/// An object store keeps a metadata message per object name, and deleting an object leaves that
/// message behind as a "deleted" marker until the store's age limit, so a listing would walk
/// every object removed within the age limit; so removing an object also purges its metadata
/// message. Its listing stops at the stream's last message as of its start: the client's own
/// reads until no message is pending, which under the churn of many writers may never come.
struct NatsObjects {
    objects: object_store::ObjectStore,
    stream: stream::Stream,
    /// `$O.<store>.M.`: the subject of an object's metadata, less its encoded name.
    meta_prefix: String,
}

impl Objects for NatsObjects {
    fn put(&self, name: &str, description: Option<String>, bytes: Vec<u8>) -> Reply<()> {
        let (objects, name) = (self.objects.clone(), name.to_owned());
        async move {
            let meta = object_store::ObjectMetadata {
                name,
                description,
                ..Default::default()
            };
            objects
                .put(meta, &mut bytes.as_slice())
                .await
                .map(|_| ())
                .map_err(Error::failed)
        }
        .boxed()
    }

    fn get(&self, name: &str) -> Reply<Option<Object>> {
        let (objects, name) = (self.objects.clone(), name.to_owned());
        async move {
            use tokio::io::AsyncReadExt as _;
            let mut object = match objects.get(&name).await {
                Ok(object) => object,
                Err(e) if e.kind() == object_store::GetErrorKind::NotFound => return Ok(None),
                Err(e) => return Err(Error::failed(e)),
            };
            let description = object.info().description.clone();
            let mut bytes = Vec::new();
            object.read_to_end(&mut bytes).await.map_err(Error::failed)?;
            Ok(Some(Object { description, bytes }))
        }
        .boxed()
    }

    fn remove(&self, name: &str) -> Reply<()> {
        let (objects, stream, name) = (self.objects.clone(), self.stream.clone(), name.to_owned());
        let meta_prefix = self.meta_prefix.clone();
        async move {
            use base64::Engine as _;
            match objects.delete(&name).await {
                Ok(()) => {}
                Err(e) if e.kind() == object_store::DeleteErrorKind::NotFound => {}
                Err(e) => return Err(Error::failed(e)),
            }
            let encoded = base64::engine::general_purpose::URL_SAFE.encode(&name);
            stream
                .purge()
                .filter(format!("{meta_prefix}{encoded}"))
                .await
                .map(|_| ())
                .map_err(Error::failed)
        }
        .boxed()
    }

    fn names(&self) -> Reply<Vec<String>> {
        let (mut stream, meta_prefix) = (self.stream.clone(), self.meta_prefix.clone());
        async move {
            let state = stream.info().await.map_err(Error::failed)?.state.clone();
            if state.messages == 0 {
                return Ok(Vec::new());
            }
            let read = Read {
                filter: format!("{meta_prefix}>"),
                deliver: Deliver::All,
                headers_only: false,
                expires: None,
            };
            let mut reading = open_read(&stream, read).await?;
            let mut names = Vec::new();
            if reading.pending == 0 {
                return Ok(names);
            }
            while let Some(message) = reading.messages.next().await {
                let message = message?;
                let object: object_store::ObjectInfo =
                    serde_json::from_slice(&message.payload).map_err(Error::failed)?;
                if !object.deleted {
                    names.push(object.name);
                }
                if message.pending == 0 || message.sequence >= state.last_sequence {
                    break;
                }
            }
            Ok(names)
        }
        .boxed()
    }
}
