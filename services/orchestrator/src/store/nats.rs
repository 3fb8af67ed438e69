//! Run results in a NATS JetStream key-value bucket: shared by every orchestrator replica and
//! kept across restarts. Values are `orchestrator.v1.RunResult` protobuf bytes under the key
//! `run.<run_id>`-derived key (run ids are hashed into a valid key); entries expire after the
//! bucket's TTL.

use std::time::Duration;

use async_nats::jetstream;
use futures::FutureExt;
use futures::future::BoxFuture;
use prost::Message;
use proto::orchestrator::v1 as pb;

use super::ResultStore;
use crate::run::RunResult;

/// See the module docs.
pub struct KvStore {
    kv: jetstream::kv::Store,
}

/// A valid KV key for `run_id` (keys allow `[-/_=.a-zA-Z0-9]`; anything else is hex-escaped).
fn key(run_id: &str) -> String {
    let mut key = String::with_capacity(run_id.len() + 4);
    key.push_str("run.");
    for b in run_id.bytes() {
        if b.is_ascii_alphanumeric() || b == b'-' || b == b'_' {
            key.push(b as char);
        } else {
            key.push_str(&format!("={b:02x}"));
        }
    }
    key
}

impl KvStore {
    /// Binds the bucket, creating it when missing. The bucket's stream is created in the KV
    /// layout directly (`KV_<bucket>`, subjects `$KV.<bucket>.>`, one value per key), which works
    /// with every JetStream server from 2.9 on and stays a bucket for `nats kv` tools.
    pub async fn open(js: &jetstream::Context, bucket: &str, ttl: Duration) -> Result<Self, String> {
        if let Ok(kv) = js.get_key_value(bucket).await {
            return Ok(Self { kv });
        }
        js.get_or_create_stream(jetstream::stream::Config {
            name: format!("KV_{bucket}"),
            description: Some("orchestrator run results".to_owned()),
            subjects: vec![format!("$KV.{bucket}.>")],
            max_messages_per_subject: 1,
            max_age: ttl,
            storage: jetstream::stream::StorageType::File,
            discard: jetstream::stream::DiscardPolicy::New,
            allow_rollup: true,
            deny_delete: true,
            allow_direct: true,
            ..Default::default()
        })
        .await
        .map_err(|e| format!("cannot create the key-value bucket {bucket:?}: {e}"))?;
        let kv = js
            .get_key_value(bucket)
            .await
            .map_err(|e| format!("cannot bind the key-value bucket {bucket:?}: {e}"))?;
        Ok(Self { kv })
    }
}

impl ResultStore for KvStore {
    fn put(&self, result: RunResult) -> BoxFuture<'static, Result<(), String>> {
        let kv = self.kv.clone();
        async move {
            let key = key(&result.run_id);
            let bytes = pb::RunResult::from(&result).encode_to_vec();
            kv.put(&key, bytes.into())
                .await
                .map(|_| ())
                .map_err(|e| format!("KV put {key}: {e}"))
        }
        .boxed()
    }

    fn shared(&self) -> bool {
        true
    }

    fn get(&self, run_id: &str) -> BoxFuture<'static, Result<Option<RunResult>, String>> {
        let kv = self.kv.clone();
        let key = key(run_id);
        async move {
            let Some(bytes) = kv.get(&key).await.map_err(|e| format!("KV get {key}: {e}"))? else {
                return Ok(None);
            };
            let decoded =
                pb::RunResult::decode(bytes).map_err(|e| format!("KV value of {key} is not a RunResult: {e}"))?;
            RunResult::try_from(decoded)
                .map(Some)
                .map_err(|e| format!("KV value of {key}: {e}"))
        }
        .boxed()
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn keys_are_valid_and_distinct() {
        assert_eq!(super::key("0193-abc_DEF"), "run.0193-abc_DEF");
        assert_eq!(super::key("a.b:c"), "run.a=2eb=3ac");
        assert_ne!(super::key("a.b"), super::key("a_b"));
    }
}
