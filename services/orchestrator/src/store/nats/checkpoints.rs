//! The checkpoint objects of durable runs (`<bucket>-checkpoints`, a JetStream object store), kept
//! so that listing them costs the live runs only.
//!
//! The takeover lists the store every third of the lease. An object store keeps a metadata message
//! per object name, and deleting an object leaves that message behind as a "deleted" marker until
//! the store's age limit, so a listing would walk every run that ended within `--run-store-ttl`
//! (hundreds of thousands on a busy day) and outlast the store timeout, and no run would be taken
//! over any more. So removing a checkpoint also purges its metadata message. (Markers left by
//! versions before this one are walked until the store's age limit drops them.)

use std::time::Duration;

use async_nats::jetstream;
use async_nats::jetstream::object_store::{DeleteErrorKind, ObjectStore};
use base64::Engine as _;

use crate::domain::ports::StoreError;
use crate::store::unavailable;

/// The checkpoint object store and its stream (whose metadata subjects it purges).
#[derive(Clone)]
pub(crate) struct Checkpoints {
    objects: ObjectStore,
    stream: jetstream::stream::Stream,
    /// `$O.<store>.M.`: the subject of an object's metadata, less its encoded name.
    meta_prefix: String,
}

impl std::ops::Deref for Checkpoints {
    type Target = ObjectStore;

    fn deref(&self) -> &ObjectStore {
        &self.objects
    }
}

impl Checkpoints {
    /// Binds (or creates) the object store of the checkpoints beside the results bucket
    /// `bucket`, with `replicas` copies.
    pub(crate) async fn open(
        js: &jetstream::Context,
        bucket: &str,
        ttl: Duration,
        replicas: usize,
    ) -> Result<Self, StoreError> {
        let name = format!("{bucket}-checkpoints");
        let failed = |e: String| unavailable("creating the checkpoint object store", &name, e);
        let objects = match js.get_object_store(&name).await {
            Ok(store) => store,
            Err(_) => js
                .create_object_store(jetstream::object_store::Config {
                    bucket: name.clone(),
                    description: Some("orchestrator checkpoints of live runs".to_owned()),
                    max_age: ttl,
                    storage: jetstream::stream::StorageType::File,
                    num_replicas: replicas,
                    ..Default::default()
                })
                .await
                .map_err(|e| failed(e.to_string()))?,
        };
        let stream = crate::nats::ensure_replicas(js, &format!("OBJ_{name}"), replicas)
            .await
            .map_err(failed)?;
        Ok(Self {
            objects,
            stream,
            meta_prefix: format!("$O.{name}.M."),
        })
    }

    /// The names of the objects stored when the listing starts. The object store's own listing
    /// reads until no message is pending, which under the churn of many live runs (each putting
    /// its checkpoints) may never come; this one stops at the stream's last message as of its
    /// start.
    pub(crate) async fn names(&self) -> Result<Vec<String>, StoreError> {
        use async_nats::jetstream::consumer::{DeliverPolicy, pull};
        use futures::StreamExt as _;
        let failed = |e: String| unavailable("checkpoint list", &self.meta_prefix, e);
        let state = self
            .stream
            .clone()
            .info()
            .await
            .map_err(|e| failed(e.to_string()))?
            .state
            .clone();
        if state.messages == 0 {
            return Ok(Vec::new());
        }
        let consumer = self
            .stream
            .create_consumer(pull::OrderedConfig {
                filter_subject: format!("{}>", self.meta_prefix),
                deliver_policy: DeliverPolicy::All,
                ..Default::default()
            })
            .await
            .map_err(|e| failed(e.to_string()))?;
        let mut messages = consumer.messages().await.map_err(|e| failed(e.to_string()))?;
        let mut names = Vec::new();
        while let Some(message) = messages.next().await {
            let message = message.map_err(|e| failed(e.to_string()))?;
            let info = message.info().map_err(|e| failed(e.to_string()))?;
            let (sequence, pending) = (info.stream_sequence, info.pending);
            let object: jetstream::object_store::ObjectInfo =
                serde_json::from_slice(&message.payload).map_err(|e| failed(e.to_string()))?;
            if !object.deleted {
                names.push(object.name);
            }
            if pending == 0 || sequence >= state.last_sequence {
                break;
            }
        }
        Ok(names)
    }

    /// Deletes the object `name` (nothing when there is none) and purges its metadata, so that
    /// no listing meets it again.
    pub(crate) async fn remove(&self, name: &str) -> Result<(), StoreError> {
        match self.objects.delete(name).await {
            Ok(()) => {}
            Err(e) if e.kind() == DeleteErrorKind::NotFound => {}
            Err(e) => return Err(unavailable("checkpoint delete", name, e)),
        }
        self.purge_meta(name).await
    }

    /// Purges the metadata message of the object `name` (a deleted object's marker).
    async fn purge_meta(&self, name: &str) -> Result<(), StoreError> {
        let encoded = base64::engine::general_purpose::URL_SAFE.encode(name);
        self.stream
            .purge()
            .filter(format!("{}{encoded}", self.meta_prefix))
            .await
            .map(|_| ())
            .map_err(|e| unavailable("checkpoint metadata purge", name, e))
    }
}
