//! Console sessions people ended, shared by the replicas ([`SignOuts`]): a key per session id in
//! the key-value bucket `<bucket>-sign-outs`, whose entries expire after the longest session
//! (`--console-session-ttl`'s cap), so the bucket holds only sessions that could still be used.

use futures::FutureExt as _;
use futures::future::BoxFuture;
use shared::jetstream::{Bucket, Consistency, JetStream, Operation};

use super::kv::token;
use super::results::KvStore;
use crate::domain::ports::{SignOuts, StoreError};
use crate::store::unavailable;

/// See the module docs.
#[derive(Clone)]
pub struct NatsSignOuts {
    ended: std::sync::Arc<dyn Bucket>,
}

impl NatsSignOuts {
    /// Binds (or creates) the bucket beside the results bucket `bucket`, keeping each ended
    /// session `keep_for`.
    pub async fn open(
        js: &dyn JetStream,
        bucket: &str,
        keep_for: std::time::Duration,
        replicas: usize,
    ) -> Result<Self, StoreError> {
        let name = format!("{bucket}-sign-outs");
        let description = "console sessions people signed out of";
        let ended = KvStore::open_bucket(js, &name, keep_for, description, replicas).await?;
        Ok(Self { ended })
    }
}

/// The key of session `id`.
fn key(id: &str) -> String {
    format!("s.{}", token(id))
}

impl SignOuts for NatsSignOuts {
    fn end(&self, id: &str, until_unix_s: u64) -> BoxFuture<'static, Result<(), StoreError>> {
        let (ended, key) = (self.ended.clone(), key(id));
        async move {
            ended
                .put(&key, until_unix_s.to_string().into())
                .await
                .map(|_| ())
                .map_err(|e| unavailable("KV put", &key, e))
        }
        .boxed()
    }

    fn ended(&self, id: &str) -> BoxFuture<'static, Result<bool, StoreError>> {
        let (ended, key) = (self.ended.clone(), key(id));
        async move {
            let entry = ended.entry(&key, Consistency::Direct).await;
            let entry = entry.map_err(|e| unavailable("KV entry", &key, e))?;
            Ok(entry.is_some_and(|e| e.operation == Operation::Put))
        }
        .boxed()
    }
}
