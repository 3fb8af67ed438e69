//! The principals' run slots as the NATS adapter keeps them (`store/nats/quotas.rs`): keys
//! `<principal>.<n>` for `n` below `max_runs`, each naming the run and admission holding it; a
//! take creates the first key `slot_order` gives, else reads the keys one request at a time (the
//! adapter reads a few at once), creates an absent one, or writes over one whose
//! run reads ended (or has no record, unchanged for a lease on this replica's clock) on the
//! revision that showed it free; a give-back deletes the key on the revision it read. Every
//! read, create, write and delete is a request of its own, so faults fall between them.

use futures::FutureExt as _;
use futures::future::BoxFuture;
use orchestrator::domain::ports::{Quotas, StoreError, TakenSlot};
use tokio::time::Instant;

use super::{ReplicaStore, Shared};

/// The run a slot's value names.
fn run_of(value: &str) -> &str {
    value.split_once(' ').map_or(value, |(run_id, _)| run_id)
}

impl ReplicaStore {
    /// The value a slot holds and its revision (`None`: absent).
    async fn read_slot(&self, key: &str) -> Result<Option<(String, u64)>, StoreError> {
        let key = key.to_owned();
        self.request("KV entry", &key.clone(), move |shared, _| {
            Ok(shared.slots.get(&key).cloned())
        })
        .await
    }

    /// Writes `value` under `key` when its revision is still `over` (`None`: absent); whether
    /// this write won.
    async fn write_slot(&self, key: &str, value: &str, over: Option<u64>) -> Result<bool, StoreError> {
        let (key, value) = (key.to_owned(), value.to_owned());
        self.request("KV slot write", &key.clone(), move |shared, _| {
            if shared.slots.get(&key).map(|(_, revision)| *revision) != over {
                return Ok(false);
            }
            let revision = next_revision(shared);
            shared.slots.insert(key, (value, revision));
            Ok(true)
        })
        .await
    }

    /// Whether the run a slot names at `revision` holds it no more.
    async fn slot_free(&self, key: &str, run_id: &str, revision: u64) -> Result<bool, StoreError> {
        let run_id = run_id.to_owned();
        let record = self
            .request("KV get", &run_id.clone(), move |shared, _| {
                Ok(shared.records.get(&run_id).map(|r| r.result.status.is_live()))
            })
            .await?;
        Ok(match record {
            Some(live) => !live,
            None => self.lapsed(key, revision),
        })
    }

    /// Whether this replica has seen `key` at `revision`, and no later one, for a whole lease.
    fn lapsed(&self, key: &str, revision: u64) -> bool {
        let now = Instant::now();
        let mut seen = self.sightings.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        match seen.get(key) {
            Some((seen_revision, since)) if *seen_revision == revision => {
                now.duration_since(*since) >= self.terms.length
            }
            _ => {
                seen.insert(key.to_owned(), (revision, now));
                false
            }
        }
    }

    async fn take_slot(&self, principal: &str, max: usize, value: &str) -> Result<Option<String>, StoreError> {
        let keys: Vec<String> = orchestrator::domain::share::slot_order(run_of(value), max)
            .map(|n| format!("{principal}.{n}"))
            .collect();
        match keys.first() {
            Some(first) if self.write_slot(first, value, None).await? => return Ok(Some(first.clone())),
            _ => {}
        }
        let mut held = Vec::new();
        for key in keys {
            match self.read_slot(&key).await? {
                Some((holding, _)) if holding == value => return Ok(Some(key)),
                Some((holding, revision)) => held.push((key, holding, revision)),
                None => {
                    if self.write_slot(&key, value, None).await? {
                        return Ok(Some(key));
                    }
                }
            }
        }
        for (key, holding, revision) in held {
            if self.slot_free(&key, run_of(&holding), revision).await?
                && self.write_slot(&key, value, Some(revision)).await?
            {
                return Ok(Some(key));
            }
        }
        Ok(None)
    }

    /// Deletes `key` when the value it holds is `ours`.
    async fn give_back_slot(
        &self,
        key: &str,
        ours: impl Fn(&str) -> bool + Send + 'static,
    ) -> Result<bool, StoreError> {
        let key = key.to_owned();
        self.request("KV slot delete", &key.clone(), move |shared, _| {
            match shared.slots.get(&key) {
                Some((holding, _)) if ours(holding) => {
                    shared.slots.remove(&key);
                    Ok(true)
                }
                _ => Ok(false),
            }
        })
        .await
    }

    async fn give_back_of(&self, principal: &str, run_id: &str, taken: Option<TakenSlot>) -> Result<(), StoreError> {
        if let Some(TakenSlot { slot, admission }) = taken {
            let value = format!("{run_id} {admission}");
            return self
                .give_back_slot(&slot, move |holding| holding == value)
                .await
                .map(drop);
        }
        let prefix = format!("{principal}.");
        let keys = self
            .request("KV keys", &prefix.clone(), move |shared, _| {
                Ok(shared
                    .slots
                    .keys()
                    .filter(|k| k.starts_with(&prefix))
                    .cloned()
                    .collect::<Vec<_>>())
            })
            .await?;
        for key in keys {
            let run_id = run_id.to_owned();
            if self
                .give_back_slot(&key, move |holding| run_of(holding) == run_id)
                .await?
            {
                return Ok(());
            }
        }
        Ok(())
    }
}

pub(super) fn next_revision(shared: &mut Shared) -> u64 {
    let revision = shared.next_revision;
    shared.next_revision += 1;
    revision
}

impl Quotas for ReplicaStore {
    fn take(
        &self,
        principal: &str,
        max: usize,
        run_id: &str,
        admission: &str,
    ) -> BoxFuture<'static, Result<Option<TakenSlot>, StoreError>> {
        let (this, principal, value) = (self.clone(), principal.to_owned(), format!("{run_id} {admission}"));
        let admission = admission.to_owned();
        async move {
            let slot = this.take_slot(&principal, max, &value).await?;
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
        let (this, principal, run_id) = (self.clone(), principal.to_owned(), run_id.to_owned());
        async move { this.give_back_of(&principal, &run_id, taken).await }.boxed()
    }
}
