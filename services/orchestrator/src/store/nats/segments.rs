//! Transcript segments of durable runs: a JetStream stream per shard of the store
//! (`SEGMENTS_<bucket>`, then `SEGMENTS_<bucket>-shard-<i>`), a run's segments on its own
//! subject `orchestrator.<bucket shard>.segments.<run key>` in its shard. A segment is a run of
//! the transcript's messages that never changes once kept; checkpoints name segments by their
//! stream positions instead of holding those messages, so a checkpoint writes what changed since
//! the last one.
//!
//! A segment is only ever read at the positions a checkpoint names: one written by an owner that
//! was replaced (fenced) is never named by the record's checkpoint, and is read past. A run's
//! segments are purged once its end is stored ([`Segments::forget`]) and expire with the results
//! (`--run-store-ttl`) otherwise.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use futures::{FutureExt as _, StreamExt as _};
use shared::jetstream::shards::{self, ShardStream};
use shared::jetstream::{Deliver, HEADER_ROOM, JetStream, Publish, Read};

use crate::domain::ports::StoreError;
use crate::store::unavailable;

/// See the module docs.
#[derive(Clone)]
pub(crate) struct Segments {
    shards: Arc<[ShardStream]>,
    /// Largest segment kept; a longer one is not kept (its checkpoint holds the messages).
    max_bytes: usize,
}

impl Segments {
    /// Binds (or creates) the segment streams beside the results bucket `bucket`, one per shard.
    pub(crate) async fn open(
        js: &dyn JetStream,
        bucket: &str,
        ttl: Duration,
        replicas: usize,
        shards: usize,
    ) -> Result<Self, StoreError> {
        let what = (
            "SEGMENTS",
            "segments",
            "orchestrator transcript segments of durable runs",
        );
        let opened = shards::streams(js, (bucket, shards), what, (ttl, replicas))
            .await
            .map_err(|(name, e)| unavailable("creating the transcript segment stream", &name, e))?;
        Ok(Self {
            shards: opened.into(),
            max_bytes: js.max_payload().saturating_sub(HEADER_ROOM),
        })
    }

    /// The shard of the run under `key`, and its subject there.
    fn of(&self, key: &str) -> (&ShardStream, String) {
        let shard = &self.shards[shards::of_key(key, self.shards.len())];
        let subject = format!("{}{key}", shard.prefix);
        (shard, subject)
    }

    /// Keeps `segment` of the run under `key`: its position, `None` when it is longer than a
    /// message may be.
    pub(crate) fn keep(&self, key: &str, segment: Vec<u8>) -> BoxFuture<'static, Result<Option<u64>, StoreError>> {
        if segment.len() > self.max_bytes {
            return futures::future::ready(Ok(None)).boxed();
        }
        let (shard, subject) = self.of(key);
        let stream = Arc::clone(&shard.stream);
        async move {
            let message = Publish {
                subject: subject.clone(),
                payload: segment.into(),
                ..Publish::default()
            };
            let ack = stream
                .publish(message)
                .await
                .map_err(|e| unavailable("segment publish", &subject, e))?;
            Ok(Some(ack.sequence))
        }
        .boxed()
    }

    /// The segments of the run under `key` at `positions`, in that order: one read from the
    /// first, taking those named (an error when one is missing).
    pub(crate) fn read(&self, key: &str, positions: Vec<u64>) -> BoxFuture<'static, Result<Vec<Vec<u8>>, StoreError>> {
        let (shard, subject) = self.of(key);
        let (stream, name) = (Arc::clone(&shard.stream), shard.name.clone());
        async move {
            let Some(first) = positions.iter().min().copied() else {
                return Ok(Vec::new());
            };
            let failed = |e: &dyn std::fmt::Display| unavailable("segment read", &name, e.to_string());
            let read = Read {
                filter: subject.clone(),
                deliver: Deliver::From(first),
                headers_only: false,
                expires: None,
            };
            let mut reading = stream.read(read).await.map_err(|e| failed(&e))?;
            let mut found: HashMap<u64, Vec<u8>> = HashMap::with_capacity(positions.len());
            let mut pending = reading.pending;
            while pending > 0 && found.len() < positions.len() {
                let Some(message) = reading.messages.next().await else {
                    break;
                };
                let message = message.map_err(|e| failed(&e))?;
                pending = message.pending;
                if positions.contains(&message.sequence) {
                    found.insert(message.sequence, message.payload.to_vec());
                }
            }
            positions
                .iter()
                .map(|position| {
                    found.remove(position).ok_or_else(|| StoreError::Corrupt {
                        key: subject.clone(),
                        reason: format!("the segment at {position} is gone"),
                    })
                })
                .collect()
        }
        .boxed()
    }

    /// Purges the segments of the run under `key` (its end is stored: nothing reads them again).
    pub(crate) fn forget(&self, key: &str) -> BoxFuture<'static, Result<(), StoreError>> {
        let (shard, subject) = self.of(key);
        let stream = Arc::clone(&shard.stream);
        async move {
            stream
                .purge(&subject, 0)
                .await
                .map_err(|e| unavailable("segment purge", &subject, e))
        }
        .boxed()
    }
}
