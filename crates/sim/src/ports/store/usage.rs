//! Each principal's spend per hour window, a key of the store as in the NATS adapter
//! (`store/nats/usage.rs`): an add is one request, atomic at the store, so a replica cut off or
//! paused in between has it applied or not, and a replica killed before it sends it loses it.
//! A window keeps how far each run booked into it ([`Window::apply`]), as the adapter does.

use futures::FutureExt as _;
use futures::future::BoxFuture;
use orchestrator::domain::ports::{StoreError, UsageBook};
use orchestrator::domain::usage::{Add, Tally, Window};

use super::ReplicaStore;

impl UsageBook for ReplicaStore {
    fn add(&self, principal: &str, window: u64, add: Add) -> BoxFuture<'static, Result<Tally, StoreError>> {
        let (this, principal) = (self.clone(), principal.to_owned());
        async move {
            this.request("KV usage add", &principal.clone(), move |shared, _| {
                let kept: &mut Window = shared.usage.entry((principal, window)).or_default();
                Ok(kept.apply(&add))
            })
            .await
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
                    .map(|((_, window), kept)| (*window, kept.total))
                    .collect())
            })
            .await
        }
        .boxed()
    }
}
