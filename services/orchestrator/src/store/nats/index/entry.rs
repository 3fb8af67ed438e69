//! What the run index keeps of a run ([`Entry`]: what never changes of it) and its writing, once,
//! before the run's claim ([`IndexWriter`]), to the index's shard of the run (the store's shard
//! of its id) on a subject naming the run's principal and thread.

use std::collections::BTreeMap;

use std::sync::Arc;

use futures::FutureExt as _;
use futures::future::BoxFuture;
use prost::Message as _;
use shared::jetstream::shards::ShardStream;
use shared::jetstream::{JetStream, Publish};

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

/// The subject of the runs of `principal` on `thread` (`None`: any) in the index's `shard`.
pub(crate) fn subject(shard: &ShardStream, principal: Option<&str>, thread: Option<&str>) -> String {
    let part = |value: Option<&str>| value.map_or_else(|| "*".to_owned(), token);
    format!("{}{}.{}", shard.prefix, part(principal), part(thread))
}

/// Writes index entries (the claim's side of the index), each to its run's shard.
#[derive(Clone)]
pub(crate) struct IndexWriter {
    shards: Arc<[ShardStream]>,
}

impl IndexWriter {
    /// Creates the index's streams beside the results bucket `bucket` when missing, one per
    /// shard of the store (the first `INDEX_<bucket>`, the others after the bucket's shards).
    pub(crate) async fn open(
        js: &dyn JetStream,
        bucket: &str,
        ttl: std::time::Duration,
        replicas: usize,
        shards: usize,
    ) -> Result<Self, StoreError> {
        let what = ("INDEX", "index", "orchestrator run index (ListRuns)");
        let opened = shared::jetstream::shards::streams(js, (bucket, shards), what, (ttl, replicas))
            .await
            .map_err(|(name, e)| unavailable("creating the run index stream", &name, e))?;
        Ok(Self { shards: opened.into() })
    }

    /// The index's shards, in shard order.
    pub(super) fn shards(&self) -> &[ShardStream] {
        &self.shards
    }

    /// Enters the run `result` describes (before its claim: a claimed run is always found).
    pub(crate) fn enter(&self, result: &RunResult) -> BoxFuture<'static, Result<(), StoreError>> {
        let run = shared::fence::escaped_key("", &result.run_id);
        let shard = &self.shards[shared::jetstream::shards::of_run(&run, self.shards.len())];
        let subject = subject(shard, Some(&result.principal), Some(&result.thread_id));
        let entry = Entry {
            run_id: result.run_id.clone(),
            principal: result.principal.clone(),
            thread_id: result.thread_id.clone(),
            labels: result.labels.clone(),
            created_at_ms: result.created_at_ms,
        };
        let stream = Arc::clone(&shard.stream);
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
