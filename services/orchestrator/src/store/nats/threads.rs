//! Threads on NATS ([`NatsThreads`]): one key-value record per thread in `<bucket>-threads`,
//! shared by the replicas; every write is compare-and-set on the record's revision. The bucket's
//! max age (`--thread-max-age`) expires a thread unchanged for that long.

use std::time::Duration;

use futures::FutureExt;
use futures::future::BoxFuture;
use shared::jetstream::{Bucket, Consistency, Error, JetStream, Operation};

use super::results::KvStore;
use crate::domain::ports::{StoreError, ThreadStore};
use crate::domain::thread::Thread;
use crate::store::unavailable;

/// See the module docs.
pub struct NatsThreads {
    kv: std::sync::Arc<dyn Bucket>,
}

impl NatsThreads {
    /// Binds (or creates) the bucket of threads beside the results bucket `bucket`.
    pub async fn open(
        js: &dyn JetStream,
        bucket: &str,
        max_age: Duration,
        replicas: usize,
    ) -> Result<Self, StoreError> {
        let name = format!("{bucket}-threads");
        let kv = KvStore::open_bucket(js, &name, max_age, "orchestrator threads", replicas).await?;
        Ok(Self { kv })
    }
}

/// A valid KV key for `thread_id`.
fn key(thread_id: &str) -> String {
    super::results::escaped_key("thread.", thread_id)
}

impl ThreadStore for NatsThreads {
    fn read(&self, thread_id: &str) -> BoxFuture<'static, Result<Option<(Thread, u64)>, StoreError>> {
        let (kv, key) = (self.kv.clone(), key(thread_id));
        async move {
            // From the leader: a thread is read to be written by compare-and-set on the revision
            // read, and a lagging follower's older revision would fail every attempt.
            let entry = kv.entry(&key, Consistency::Leader).await;
            let Some(entry) = entry.map_err(|e| unavailable("KV entry", &key, e))? else {
                return Ok(None);
            };
            if entry.operation != Operation::Put {
                return Ok(None);
            }
            let thread = serde_json::from_slice(&entry.value).map_err(|e| StoreError::Corrupt {
                key: key.clone(),
                reason: e.to_string(),
            })?;
            Ok(Some((thread, entry.revision)))
        }
        .boxed()
    }

    fn write(&self, thread: Thread, revision: u64) -> BoxFuture<'static, Result<bool, StoreError>> {
        let (kv, key) = (self.kv.clone(), key(&thread.thread_id));
        async move {
            let bytes = crate::domain::ports::json("a thread", &thread)?;
            if revision == 0 {
                return match kv.create(&key, bytes.into()).await {
                    Ok(_) => Ok(true),
                    Err(Error::Exists) => Ok(false),
                    Err(e) => Err(unavailable("KV create", &key, e)),
                };
            }
            match kv.update(&key, bytes.into(), revision).await {
                Ok(_) => Ok(true),
                Err(Error::WrongRevision) => Ok(false),
                Err(e) => Err(unavailable("KV update", &key, e)),
            }
        }
        .boxed()
    }

    fn delete(&self, thread_id: &str, revision: u64) -> BoxFuture<'static, Result<bool, StoreError>> {
        let (kv, key) = (self.kv.clone(), key(thread_id));
        async move {
            match kv.delete(&key, Some(revision)).await {
                Ok(()) => Ok(true),
                Err(Error::WrongRevision) => Ok(false),
                Err(e) => Err(unavailable("KV delete", &key, e)),
            }
        }
        .boxed()
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn keys_are_valid_for_any_printable_id() {
        assert_eq!(super::key("chat-1_a"), "thread.chat-1_a");
        assert_eq!(super::key("a.b c"), "thread.a=2eb=20c");
    }
}
