//! The outbox: a record per delivery in a key-value bucket, kept while it waits
//! (`pending.<principal>.<webhook>.<run>.<delivery>`) and after it ended
//! (`done.<principal>.<webhook>.<run>.<delivery>`, until `--webhook-keep` passes). Records are
//! written at the revision read, so of two replicas only one holds a delivery at a time; a
//! replica that dies holding one lets go when its hold passes, and another tries it. A record is
//! created once per id, so a happening noticed twice is delivered once.

use std::sync::Arc;

use shared::jetstream::{Bucket, Consistency, Operation};

use crate::domain::ports::StoreError;
use crate::domain::webhook::{DeliveryState, WebhookDelivery};
use crate::store::nats::kv::{token, write_at};
use crate::store::unavailable;

/// See the module docs.
#[derive(Clone)]
pub(crate) struct Outbox {
    bucket: Arc<dyn Bucket>,
}

/// Which deliveries a listing wants (always of one principal).
#[derive(Debug, Clone, Default)]
pub(crate) struct Narrowing {
    pub webhook_id: Option<String>,
    pub run_id: Option<String>,
}

fn key(state: &str, delivery: &WebhookDelivery) -> String {
    format!(
        "{state}.{}.{}.{}.{}",
        token(&delivery.principal),
        delivery.webhook_id,
        token(&delivery.run_id),
        delivery.id
    )
}

fn decode(key: &str, value: &[u8]) -> Result<WebhookDelivery, StoreError> {
    serde_json::from_slice(value).map_err(|e| unavailable("decode a webhook delivery", key, e))
}

fn encode(delivery: &WebhookDelivery) -> bytes::Bytes {
    serde_json::to_vec(delivery).unwrap_or_default().into()
}

impl Outbox {
    /// The outbox in `bucket`.
    pub(crate) fn new(bucket: Arc<dyn Bucket>) -> Self {
        Self { bucket }
    }

    /// Deliveries of `webhook_id` (of `principal`) waiting.
    pub(crate) async fn waiting(&self, principal: &str, webhook_id: &str) -> Result<usize, StoreError> {
        let filter = format!("pending.{}.{webhook_id}.>", token(principal));
        let keys = self.bucket.keys(&filter).await;
        Ok(keys.map_err(|e| unavailable("KV keys", &filter, e))?.len())
    }

    /// Adds `delivery` (pending, or ended already when it was dropped): its revision, or `None`
    /// when a delivery with its id is there already.
    pub(crate) async fn add(&self, delivery: &WebhookDelivery) -> Result<Option<u64>, StoreError> {
        let state = if delivery.state == DeliveryState::Pending {
            "pending"
        } else {
            "done"
        };
        let key = key(state, delivery);
        match self.bucket.create(&key, encode(delivery)).await {
            Ok(revision) => Ok(Some(revision)),
            Err(shared::jetstream::Error::Exists) => Ok(None),
            Err(e) => Err(unavailable("KV create", &key, e)),
        }
    }

    /// The keys of every delivery waiting, whoever's.
    pub(crate) async fn pending_keys(&self) -> Result<Vec<String>, StoreError> {
        let keys = self.bucket.keys("pending.>").await;
        keys.map_err(|e| unavailable("KV keys", "pending.>", e))
    }

    /// Holds the delivery under `key` until `until_ms` if it is due at `now_ms`: it and the
    /// revision of the hold, or `None` when it is not due or another replica came first.
    pub(crate) async fn hold(
        &self,
        key: &str,
        now_ms: u64,
        until_ms: u64,
    ) -> Result<Option<(WebhookDelivery, u64)>, StoreError> {
        let entry = self.bucket.entry(key, Consistency::Leader).await;
        let Some(entry) = entry.map_err(|e| unavailable("KV entry", key, e))? else {
            return Ok(None);
        };
        if entry.operation != Operation::Put {
            return Ok(None);
        }
        let mut delivery = decode(key, &entry.value)?;
        if !delivery.due(now_ms) {
            return Ok(None);
        }
        delivery.held_until_unix_ms = until_ms;
        match self.bucket.update(key, encode(&delivery), entry.revision).await {
            Ok(revision) => Ok(Some((delivery, revision))),
            Err(shared::jetstream::Error::WrongRevision) => Ok(None),
            Err(e) => Err(unavailable("KV update", key, e)),
        }
    }

    /// Records `delivery` after an attempt made under the hold at `revision`: pending again, or
    /// moved to the ended records. `false` when another replica took it over meanwhile (its hold
    /// passed): its record of the attempt is then not written over.
    pub(crate) async fn settle(&self, delivery: &WebhookDelivery, revision: u64) -> Result<bool, StoreError> {
        let pending = key("pending", delivery);
        if delivery.state == DeliveryState::Pending {
            return write_at(self.bucket.as_ref(), &pending, encode(delivery), Some(revision)).await;
        }
        let done = key("done", delivery);
        self.bucket
            .put(&done, encode(delivery))
            .await
            .map_err(|e| unavailable("KV put", &done, e))?;
        match self.bucket.delete(&pending, Some(revision)).await {
            Ok(()) | Err(shared::jetstream::Error::WrongRevision) => Ok(true),
            Err(e) => Err(unavailable("KV delete", &pending, e)),
        }
    }

    /// `principal`'s deliveries `narrowing` names, newest first, at most `limit`, from at most
    /// `max_read` records (narrow by webhook or run to see past them).
    pub(crate) async fn list(
        &self,
        principal: &str,
        narrowing: &Narrowing,
        limit: usize,
        max_read: usize,
    ) -> Result<Vec<WebhookDelivery>, StoreError> {
        let webhook = narrowing.webhook_id.as_deref().unwrap_or("*");
        let run = narrowing.run_id.as_deref().map_or_else(|| "*".to_owned(), token);
        let filter = format!("*.{}.{webhook}.{run}.*", token(principal));
        let keys = self
            .bucket
            .keys(&filter)
            .await
            .map_err(|e| unavailable("KV keys", &filter, e))?;
        let mut found = Vec::new();
        for key in keys.iter().take(max_read) {
            let value = self.bucket.get(key).await.map_err(|e| unavailable("KV get", key, e))?;
            if let Some(value) = value {
                found.push(decode(key, &value)?);
            }
        }
        let pending = |d: &WebhookDelivery| d.state == DeliveryState::Pending;
        found.sort_by(|a, b| {
            (b.created_unix_ms.cmp(&a.created_unix_ms))
                .then_with(|| a.id.cmp(&b.id))
                .then_with(|| pending(a).cmp(&pending(b)))
        });
        // A delivery moved to the ended records may still be listed as pending for a moment.
        found.dedup_by(|later, earlier| later.id == earlier.id);
        found.truncate(limit);
        Ok(found)
    }
}
