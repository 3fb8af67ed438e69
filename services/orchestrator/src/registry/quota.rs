//! A run's slot among its principal's `max_runs` across the fleet (a shared store's
//! [`Quotas`]): taken before a new run is let in, given back when the run ends here or parks,
//! kept when it moves to another replica (the slot is the run's). A principal whose slots are
//! all held is passed over by the queue's wake-ups for a while ([`BLOCKED_FOR`]), then tried
//! again: slots are given back on other replicas, which this one does not hear of. (Taking and
//! giving back are `Admitted`'s, in `admission.rs`.)

use std::sync::Arc;
use std::time::Duration;

use super::Runs;
use crate::domain::ports::{Quotas, TakenSlot, within};

/// How long a principal whose slots were all held is not woken for a slot here.
pub(crate) const BLOCKED_FOR: Duration = Duration::from_millis(500);

/// The slot a run holds, and how it is given back.
pub(crate) struct HeldQuota {
    quotas: Arc<dyn Quotas>,
    principal: String,
    /// The slot its admission took (`None`: a run taken over or resumed here).
    taken: Option<TakenSlot>,
    timeout: Duration,
}

impl HeldQuota {
    /// The slot an admission of a run of `principal` took.
    pub(super) fn taken(quotas: Arc<dyn Quotas>, principal: &str, taken: TakenSlot, timeout: Duration) -> Self {
        Self {
            quotas,
            principal: principal.to_owned(),
            taken: Some(taken),
            timeout,
        }
    }

    /// The slot of a run of `principal` taken over or resumed here (its admission was
    /// another's), when the store keeps quotas.
    pub(crate) fn of_run(runs: &Runs, principal: &str) -> Option<Self> {
        runs.quotas.as_ref().map(|quotas| Self {
            quotas: Arc::clone(quotas),
            principal: principal.to_owned(),
            taken: None,
            timeout: runs.store_timeout,
        })
    }

    /// Gives the slot of `run_id` back, in the background (a run's end does not wait for it).
    pub(super) fn give_back(self, run_id: &str) {
        if tokio::runtime::Handle::try_current().is_err() {
            return;
        }
        let give_back = self.quotas.give_back(&self.principal, run_id, self.taken);
        let (run_id, timeout) = (run_id.to_owned(), self.timeout);
        shared::tasks::spawn(async move {
            if let Err(e) = within(timeout, give_back).await {
                // The slot is free anyway once its run reads ended; the next take finds it so.
                tracing::warn!(run_id = %run_id, "giving the run's slot back failed: {e}");
            }
        });
    }
}

impl Runs {
    /// Passes `principal` over for [`BLOCKED_FOR`]: its slots across the fleet are all held.
    pub(super) fn block(&self, principal: &str) {
        let until = tokio::time::Instant::now() + BLOCKED_FOR;
        shared::sync::lock(&self.queue).block(principal, until);
    }
}
