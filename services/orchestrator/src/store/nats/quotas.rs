//! A principal's share of the fleet on the NATS store ([`Quotas`]): its `max_runs` slots are
//! keys `<principal>.<n>` (n below `max_runs`, the principal an encoded token) in the key-value
//! bucket `<bucket>-slots`, each naming the run that holds it and the admission that took it
//! (`<run id> <admission>`: a second admission of a live run's id never gives back the first's). A slot is taken with the bucket's
//! create-if-absent, or, when every slot is held, by a compare-and-set over one whose run is no
//! longer live; it is given back (a delete on the revision read) when its run ends or parks.
//!
//! The run's record decides whether a slot is held: a run that ended, or whose replica died
//! before giving its slot back, reads ended (its owner lost past its deadline), so its slot is
//! free; a run taken over reads live and keeps its slot, whichever replica runs it now. A slot
//! naming a run with no record yet (its claim on its way) is free only once this replica has
//! seen it unchanged for a whole lease, on its own clock. So the number of live runs of a
//! principal never exceeds its `max_runs`: a run is let in only once it holds a slot, and a
//! slot changes hands only by a write conditional on the revision that showed it free.

use std::sync::Arc;

use futures::FutureExt as _;
use futures::future::BoxFuture;
use shared::jetstream::{Bucket, Consistency, JetStream, Operation};

use super::kv::{token, write_at};
use super::results::{KvStore, key as run_key};
use crate::domain::ports::{Quotas, StoreError, TakenSlot};
use crate::domain::share::slot_order;
use crate::store::unavailable;

/// See the module docs.
pub struct NatsQuotas {
    slots: std::sync::Arc<dyn Bucket>,
    store: Arc<KvStore>,
}

impl NatsQuotas {
    /// Binds (or creates) the slots bucket beside the results bucket `bucket`.
    pub async fn open(
        js: &dyn JetStream,
        bucket: &str,
        ttl: std::time::Duration,
        store: Arc<KvStore>,
    ) -> Result<Self, StoreError> {
        let name = format!("{bucket}-slots");
        let description = "orchestrator run slots of each principal (max_runs across the fleet)";
        let slots = KvStore::open_bucket(js, &name, ttl, description, store.replicas).await?;
        Ok(Self { slots, store })
    }
}

/// The run a slot names, and the slot's revision.
async fn holder(slots: &dyn Bucket, key: &str) -> Result<Option<(String, u64)>, StoreError> {
    let entry = slots.entry(key, Consistency::Direct).await;
    let Some(entry) = entry.map_err(|e| unavailable("KV entry", key, e))? else {
        return Ok(None);
    };
    if entry.operation != Operation::Put {
        return Ok(None);
    }
    Ok(Some((
        String::from_utf8_lossy(&entry.value).into_owned(),
        entry.revision,
    )))
}

/// The run a slot's value names.
fn run_of(value: &str) -> &str {
    value.split_once(' ').map_or(value, |(run_id, _)| run_id)
}

/// The most slot keys a take reads at once.
const READ_AT_ONCE: usize = 8;

/// `keys` in windows of 1, 2, 4 … keys, up to [`READ_AT_ONCE`], each made only when it is
/// reached (a principal may have thousands of slots; a take most often reads one).
fn windows_doubling(mut keys: impl Iterator<Item = String>) -> impl Iterator<Item = Vec<String>> {
    let mut window = 1;
    std::iter::from_fn(move || {
        let chunk: Vec<String> = keys.by_ref().take(window).collect();
        window = (window * 2).min(READ_AT_ONCE);
        (!chunk.is_empty()).then_some(chunk)
    })
}

impl NatsQuotas {
    /// Whether the run a slot names at `revision` holds it no more: it ended, or it has no
    /// record and this replica has seen the slot unchanged for a lease. The record is read from
    /// the bucket's leader: the compare-and-set that takes the slot guards the slot, not the
    /// record, and a lagging follower may not have a claim that landed.
    async fn free(&self, key: &str, run_id: &str, revision: u64) -> Result<bool, StoreError> {
        match self.store.read_key_from(&run_key(run_id), Consistency::Leader).await? {
            Some(run) => Ok(!run.status.is_live()),
            None => Ok(self.store.seen.lapsed(&format!("slot:{key}"), revision)),
        }
    }

    /// Takes `key` for `run_id`: created when absent, or written over `revision`; whether this
    /// write won.
    async fn claim(&self, key: &str, holder: &str, over: Option<u64>) -> Result<bool, StoreError> {
        write_at(&*self.slots, key, bytes::Bytes::from(holder.to_owned()), over).await
    }

    /// The slot `holder_value` holds now, or one it takes; `None` when live runs hold them all.
    /// The keys are read from one the run's id picks (runs of a principal spread over its
    /// slots, so a take seldom meets the slot a run just ended with, not given back yet), in
    /// windows read at once that double (1, 2, 4, 8, 8…), after a create of the first: a take
    /// that finds the first key free costs that one write.
    async fn take_one(&self, principal: &str, max: usize, holder_value: &str) -> Result<Option<String>, StoreError> {
        let prefix = token(principal);
        let keys = || slot_order(run_of(holder_value), max).map(|n| format!("{prefix}.{n}"));
        // The first key is most often free: a create alone takes it.
        match keys().next() {
            Some(first) if self.claim(&first, holder_value, None).await? => return Ok(Some(first)),
            _ => {}
        }
        let mut held = Vec::new();
        for keys in windows_doubling(keys()) {
            let read = futures::future::join_all(keys.iter().map(|key| holder(&*self.slots, key))).await;
            for (key, found) in keys.iter().zip(read) {
                match found? {
                    Some((holding, _)) if holding == holder_value => return Ok(Some(key.clone())),
                    Some((holding, revision)) => held.push((key.clone(), holding, revision)),
                    None => {
                        if self.claim(key, holder_value, None).await? {
                            return Ok(Some(key.clone()));
                        }
                    }
                }
            }
        }
        for (key, holding, revision) in held {
            if self.free(&key, run_of(&holding), revision).await?
                && self.claim(&key, holder_value, Some(revision)).await?
            {
                tracing::info!(principal, slot = %key, ended = %run_of(&holding), "a run slot whose run ended is taken");
                return Ok(Some(key));
            }
        }
        Ok(None)
    }

    /// Deletes `key` when it still holds `holder_value` (over the revision that showed it).
    async fn give_back_slot(&self, key: &str, ours: impl Fn(&str) -> bool) -> Result<bool, StoreError> {
        let Some((holding, revision)) = holder(&*self.slots, key).await? else {
            return Ok(false);
        };
        if !ours(&holding) {
            return Ok(false);
        }
        self.slots
            .delete(key, Some(revision))
            .await
            .map(|()| true)
            .map_err(|e| unavailable("KV slot delete", key, e))
    }

    /// Gives back the slot `taken` names, or (a run taken over) looks for the run's among the
    /// principal's slots.
    async fn give_back_one(&self, principal: &str, run_id: &str, taken: Option<TakenSlot>) -> Result<(), StoreError> {
        if let Some(TakenSlot { slot, admission }) = taken {
            let holder_value = format!("{run_id} {admission}");
            return self
                .give_back_slot(&slot, |holding| holding == holder_value)
                .await
                .map(drop);
        }
        let prefix = format!("{}.", token(principal));
        let keys = self
            .slots
            .keys(&format!("{prefix}>"))
            .await
            .map_err(|e| unavailable("KV keys", &prefix, e))?;
        for key in keys {
            if self.give_back_slot(&key, |holding| run_of(holding) == run_id).await? {
                return Ok(());
            }
        }
        Ok(())
    }
}

impl Quotas for Arc<NatsQuotas> {
    fn take(
        &self,
        principal: &str,
        max: usize,
        run_id: &str,
        admission: &str,
    ) -> BoxFuture<'static, Result<Option<TakenSlot>, StoreError>> {
        let (this, principal, holder) = (Arc::clone(self), principal.to_owned(), format!("{run_id} {admission}"));
        let admission = admission.to_owned();
        async move {
            let slot = this.take_one(&principal, max, &holder).await?;
            Ok(slot.map(|slot| TakenSlot { slot, admission }))
        }
        .boxed()
    }

    fn give_back(
        &self,
        principal: &str,
        run_id: &str,
        taken: Option<TakenSlot>,
    ) -> BoxFuture<'static, Result<(), StoreError>> {
        let (this, principal, run_id) = (Arc::clone(self), principal.to_owned(), run_id.to_owned());
        async move { this.give_back_one(&principal, &run_id, taken).await }.boxed()
    }
}
