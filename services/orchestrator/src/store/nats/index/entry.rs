//! What the run index keeps of a run ([`Entry`]: what never changes of it) and its writing, once,
//! before the run's claim ([`IndexWriter`]), on a subject naming the run's principal and thread.

use std::collections::BTreeMap;

use std::sync::Arc;

use futures::FutureExt as _;
use futures::future::BoxFuture;
use prost::Message as _;
use shared::jetstream::{JetStream, Publish, Stream, StreamConfig};

use crate::domain::RunResult;
use crate::domain::ports::StoreError;
use crate::store::nats::kv::token;
use crate::store::unavailable;

/// What the index keeps of a run.
#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct Entry {
    #[prost(string, tag = "1")]
    pub run_id: String,
    #[prost(string, tag = "2")]
    pub principal: String,
    #[prost(string, tag = "3")]
    pub thread_id: String,
    #[prost(btree_map = "string, string", tag = "4")]
    pub labels: BTreeMap<String, String>,
    #[prost(uint64, tag = "5")]
    pub created_at_ms: u64,
}

/// Writes index entries (the claim's side of the index).
#[derive(Clone)]
pub(crate) struct IndexWriter {
    stream: Arc<dyn Stream>,
    /// `INDEX_<bucket>`
    name: String,
    /// `orchestrator.<bucket>.index.`
    prefix: String,
}

impl IndexWriter {
    /// Creates the index stream beside the results bucket `bucket` when missing.
    pub(crate) async fn open(
        js: &dyn JetStream,
        bucket: &str,
        ttl: std::time::Duration,
        replicas: usize,
    ) -> Result<(Self, Arc<dyn Stream>), StoreError> {
        let prefix = format!("orchestrator.{bucket}.index.");
        let name = format!("INDEX_{bucket}");
        let config = StreamConfig {
            name: name.clone(),
            description: "orchestrator run index (ListRuns)".to_owned(),
            subjects: vec![format!("{prefix}>")],
            max_age: ttl,
            max_bytes: 0,
            discard_old: true,
            duplicate_window: std::time::Duration::from_secs(120),
            replicas,
        };
        let stream = js
            .stream(config)
            .await
            .map_err(|e| unavailable("creating the run index stream", bucket, e))?;
        let writer = Self {
            stream: Arc::clone(&stream),
            name,
            prefix,
        };
        Ok((writer, stream))
    }

    /// The index stream's name (for errors).
    pub(super) fn stream_name(&self) -> String {
        self.name.clone()
    }

    /// The subject of the runs of `principal` on `thread` (`None`: any).
    pub(super) fn subject(&self, principal: Option<&str>, thread: Option<&str>) -> String {
        let part = |value: Option<&str>| value.map_or_else(|| "*".to_owned(), token);
        format!("{}{}.{}", self.prefix, part(principal), part(thread))
    }

    /// Enters the run `result` describes (before its claim: a claimed run is always found).
    pub(crate) fn enter(&self, result: &RunResult) -> BoxFuture<'static, Result<(), StoreError>> {
        let subject = self.subject(Some(&result.principal), Some(&result.thread_id));
        let entry = Entry {
            run_id: result.run_id.clone(),
            principal: result.principal.clone(),
            thread_id: result.thread_id.clone(),
            labels: result.labels.clone(),
            created_at_ms: result.created_at_ms,
        };
        let stream = Arc::clone(&self.stream);
        async move {
            let message = Publish {
                subject: subject.clone(),
                payload: entry.encode_to_vec().into(),
                ..Publish::default()
            };
            stream
                .publish(message)
                .await
                .map(|_| ())
                .map_err(|e| unavailable("run index publish", &subject, e))
        }
        .boxed()
    }
}
