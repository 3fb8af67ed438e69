//! Each principal's spend per hour window, a key of the store as in the NATS adapter
//! (`store/nats/usage.rs`): an add is one request, atomic at the store, so a replica cut off or
//! paused in between has it applied or not, and a replica killed before it sends it loses it.

use futures::FutureExt as _;
use futures::future::BoxFuture;
use orchestrator::domain::ports::{StoreError, UsageBook};
use orchestrator::domain::usage::Tally;

use super::ReplicaStore;

impl UsageBook for ReplicaStore {
    fn add(&self, principal: &str, window: u64, spend: Tally) -> BoxFuture<'static, Result<Tally, StoreError>> {
        let (this, principal) = (self.clone(), principal.to_owned());
        async move {
            // Counted unconfirmed unless its success is heard: the replica's wait for it may also
            // be given up (dropped), before or after the book applied it.
            let mut unconfirmed = Unconfirmed {
                store: this.store.clone(),
                tokens: spend.tokens(),
                heard: false,
            };
            let added = this
                .request("KV usage add", &principal.clone(), move |shared, _| {
                    let total = shared.usage.entry((principal, window)).or_default();
                    total.add(&spend);
                    Ok(*total)
                })
                .await;
            unconfirmed.heard = added.is_ok();
            added
        }
        .boxed()
    }

    fn read(&self, principal: &str, from: u64, to: u64) -> BoxFuture<'static, Result<Vec<(u64, Tally)>, StoreError>> {
        let (this, principal) = (self.clone(), principal.to_owned());
        async move {
            this.request("KV usage read", &principal.clone(), move |shared, _| {
                Ok(shared
                    .usage
                    .iter()
                    .filter(|((p, window), _)| *p == principal && (from..=to).contains(window))
                    .map(|((_, window), spend)| (*window, *spend))
                    .collect())
            })
            .await
        }
        .boxed()
    }
}

/// An add on its way: dropped without its success heard, its tokens count as unconfirmed.
struct Unconfirmed {
    store: super::Store,
    tokens: u64,
    heard: bool,
}

impl Drop for Unconfirmed {
    fn drop(&mut self) {
        if !self.heard {
            super::lock(&self.store).usage_unconfirmed += self.tokens;
        }
    }
}
