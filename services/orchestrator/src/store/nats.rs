//! Run results in a NATS JetStream key-value bucket: shared by every orchestrator replica and
//! kept across restarts. Each value is a [`Record`]: the `orchestrator.v1.RunResult`, the replica
//! that owns the run and, while it runs, the end of its lease, under a `run.<run_id>`-derived key
//! (run ids are escaped into a valid key); entries expire after the bucket's TTL.
//!
//! A live run's owner renews its lease by writing the run's state (a checkpoint) every third of
//! the lease. A RUNNING record whose lease has expired belongs to a replica that crashed or lost
//! the store: it reads as FAILED `ORCHESTRATOR_LOST`, with the output of its last checkpoint. A
//! run is claimed with the bucket's create-if-absent, so of two replicas starting the same id at
//! once exactly one runs it.

use std::time::Duration;

use async_nats::jetstream;
use futures::FutureExt;
use futures::future::BoxFuture;
use prost::Message;
use proto::orchestrator::v1 as pb;

use crate::domain::ports::{Claim, ResultStore, StoreError};
use crate::domain::{FailureReason, RunResult, RunStatus};

/// See the module docs.
pub struct KvStore {
    kv: jetstream::kv::Store,
    /// This replica, written into the records of its runs.
    owner: String,
    lease: Duration,
}

/// A stored run.
#[derive(Clone, PartialEq, prost::Message)]
struct Record {
    #[prost(message, optional, tag = "1")]
    result: Option<pb::RunResult>,
    /// The replica running (or that ran) the run.
    #[prost(string, tag = "2")]
    owner: String,
    /// While RUNNING: the record counts only until then (Unix ms) unless renewed.
    #[prost(uint64, tag = "3")]
    lease_expires_unix_ms: u64,
}

impl Record {
    /// The result as it reads now: a RUNNING run whose lease expired is lost.
    fn read(self, key: &str) -> Result<RunResult, StoreError> {
        let corrupt = |reason: String| StoreError::Corrupt {
            key: key.to_owned(),
            reason,
        };
        let stored = self.result.ok_or_else(|| corrupt("it holds no result".to_owned()))?;
        let mut result = RunResult::try_from(stored).map_err(|e| corrupt(e.to_string()))?;
        if result.status == RunStatus::Running && self.lease_expires_unix_ms < shared::sync::unix_ms() {
            result.status = RunStatus::Failed;
            result.failure_reason = Some(FailureReason::OrchestratorLost);
            result.failure_detail = format!(
                "the orchestrator replica {} running this run stopped renewing its lease; the output is its last checkpoint",
                self.owner
            );
        }
        Ok(result)
    }
}

/// A valid KV key for `run_id` (keys allow `[-/_=.a-zA-Z0-9]`; anything else is hex-escaped).
pub(super) fn key(run_id: &str) -> String {
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
    pub async fn open(
        js: &jetstream::Context,
        bucket: &str,
        ttl: Duration,
        owner: String,
        lease: Duration,
    ) -> Result<Self, StoreError> {
        if let Ok(kv) = js.get_key_value(bucket).await {
            return Ok(Self { kv, owner, lease });
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
        .map_err(|e| unavailable("creating the key-value bucket", bucket, e))?;
        let kv = js
            .get_key_value(bucket)
            .await
            .map_err(|e| unavailable("binding the key-value bucket", bucket, e))?;
        Ok(Self { kv, owner, lease })
    }

    /// The record of `result` as this replica writes it now.
    fn record(&self, result: &RunResult) -> Vec<u8> {
        let lease = u64::try_from(self.lease.as_millis()).unwrap_or(u64::MAX);
        Record {
            result: Some(pb::RunResult::from(result)),
            owner: self.owner.clone(),
            lease_expires_unix_ms: shared::sync::unix_ms().saturating_add(lease),
        }
        .encode_to_vec()
    }
}

fn decode(key: &str, bytes: &[u8]) -> Result<RunResult, StoreError> {
    Record::decode(bytes)
        .map_err(|e| StoreError::Corrupt {
            key: key.to_owned(),
            reason: e.to_string(),
        })?
        .read(key)
}

/// The store's refusal of `operation` on `key`.
fn unavailable(operation: &'static str, key: &str, reason: impl ToString) -> StoreError {
    StoreError::Unavailable {
        operation,
        key: key.to_owned(),
        reason: reason.to_string(),
    }
}

impl ResultStore for KvStore {
    fn put(&self, result: RunResult) -> BoxFuture<'static, Result<(), StoreError>> {
        let kv = self.kv.clone();
        let key = key(&result.run_id);
        let bytes = self.record(&result);
        async move {
            kv.put(&key, bytes.into())
                .await
                .map(|_| ())
                .map_err(|e| unavailable("KV put", &key, e))
        }
        .boxed()
    }

    fn claim(&self, result: RunResult) -> BoxFuture<'static, Result<Claim, StoreError>> {
        let kv = self.kv.clone();
        let key = key(&result.run_id);
        let bytes = self.record(&result);
        async move {
            match kv.create(&key, bytes.into()).await {
                Ok(_) => Ok(Claim::Claimed),
                Err(e) if e.kind() == jetstream::kv::CreateErrorKind::AlreadyExists => {
                    let bytes = kv.get(&key).await.map_err(|e| unavailable("KV get", &key, e))?;
                    match bytes {
                        Some(bytes) => Ok(Claim::Taken(Box::new(decode(&key, &bytes)?))),
                        None => Err(unavailable("KV create", &key, "taken, then gone")),
                    }
                }
                Err(e) => Err(unavailable("KV create", &key, e)),
            }
        }
        .boxed()
    }

    fn shared(&self) -> Option<Duration> {
        Some(self.lease / 3)
    }

    fn get(&self, run_id: &str) -> BoxFuture<'static, Result<Option<RunResult>, StoreError>> {
        let kv = self.kv.clone();
        let key = key(run_id);
        async move {
            let Some(bytes) = kv.get(&key).await.map_err(|e| unavailable("KV get", &key, e))? else {
                return Ok(None);
            };
            decode(&key, &bytes).map(Some)
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
