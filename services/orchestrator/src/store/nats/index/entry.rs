//! What the run index keeps of a run ([`Entry`]: what never changes of it) and its writing, once,
//! before the run's claim ([`IndexWriter`]), on a subject naming the run's principal and thread.

use std::collections::BTreeMap;

use async_nats::jetstream;
use futures::FutureExt as _;
use futures::future::BoxFuture;
use prost::Message as _;

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
    js: jetstream::Context,
    /// `orchestrator.<bucket>.index.`
    prefix: String,
}

impl IndexWriter {
    /// Creates the index stream beside the results bucket `bucket` when missing.
    pub(crate) async fn open(
        js: &jetstream::Context,
        bucket: &str,
        ttl: std::time::Duration,
        replicas: usize,
    ) -> Result<(Self, jetstream::stream::Stream), StoreError> {
        let prefix = format!("orchestrator.{bucket}.index.");
        let stream = crate::nats::ensure_stream(
            js,
            jetstream::stream::Config {
                name: format!("INDEX_{bucket}"),
                description: Some("orchestrator run index (ListRuns)".to_owned()),
                subjects: vec![format!("{prefix}>")],
                max_age: ttl,
                storage: jetstream::stream::StorageType::File,
                discard: jetstream::stream::DiscardPolicy::Old,
                num_replicas: replicas,
                ..Default::default()
            },
        )
        .await
        .map_err(|e| unavailable("creating the run index stream", bucket, e))?;
        let writer = Self { js: js.clone(), prefix };
        Ok((writer, stream))
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
        let js = self.js.clone();
        async move {
            let failed = |e: String| unavailable("run index publish", &subject, e);
            let ack = js
                .publish(subject.clone(), entry.encode_to_vec().into())
                .await
                .map_err(|e| failed(e.to_string()))?;
            ack.await.map(|_| ()).map_err(|e| failed(e.to_string()))
        }
        .boxed()
    }
}
