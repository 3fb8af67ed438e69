//! Runs waiting for a slot: a run that finds its replica full, or its principal at its
//! `max_runs`, waits in its principal's queue (bounded by the principal's `max_queued` and
//! `--max-queued-runs`) until its deadline, and each freed slot wakes the waiting run the share
//! rules pick ([`crate::domain::share`]), not the first that asked. A woken run tries its
//! admission again; one that still finds no slot (a run taken over took it) waits on, first in
//! its queue.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use shared::auth::Principal;
use tokio::sync::oneshot;
use tokio::time::Instant;

use super::Runs;
use super::admission::{Admitted, Refusal};
use crate::domain::RunSpec;
use crate::domain::share::{Place, Shares};

/// The queues, and how each waiting run is woken.
#[derive(Default)]
pub(crate) struct Queued {
    shares: Shares,
    /// Each waiting run's principal and waker, by ticket.
    wakers: HashMap<u64, (String, oneshot::Sender<()>)>,
    /// The `max_runs` of each principal waiting (`None`: only the replica's slots bound it).
    limits: HashMap<String, Option<usize>>,
    /// Principals whose slots across the fleet were all held, passed over until then.
    blocked: HashMap<String, Instant>,
    next_ticket: u64,
}

impl Queued {
    /// Passes `principal` over until `until`.
    pub(super) fn block(&mut self, principal: &str, until: Instant) {
        self.blocked.insert(principal.to_owned(), until);
    }

    /// Exports how many runs wait.
    fn count(&self) {
        metrics::gauge!(crate::telemetry::metric::RUNS_QUEUED).set(self.shares.waiting() as f64);
    }
}

/// An admitted run, and how long it waited for its slot.
pub(crate) struct Queuing {
    pub admitted: Admitted,
    pub waited: Duration,
}

impl Runs {
    /// Admits `run_id` as [`Runs::admit`] does, but a run that finds no slot waits for one in
    /// its principal's queue until `until` (its deadline): [`Refusal::QueueFull`] when it may
    /// not wait, [`Refusal::Waited`] when the deadline passed first.
    pub(crate) async fn admit_queued(
        self: &Arc<Self>,
        run_id: &str,
        caller: &Principal,
        spec: Option<&RunSpec>,
        until: Instant,
    ) -> Result<Queuing, Refusal> {
        let began = Instant::now();
        let mut place = None;
        loop {
            // A run goes ahead of those waiting only when none waits.
            if place.is_some() || self.nobody_waits() {
                match self.admit(run_id, caller, spec).await {
                    Err(Refusal::Full(_) | Refusal::CallerFull(_)) => {}
                    other => {
                        // Time in the queue: none for a run let in at once, however long the
                        // admission itself took.
                        let waited = place.map_or(Duration::ZERO, |_| began.elapsed());
                        return other.map(|admitted| Queuing { admitted, waited });
                    }
                }
            }
            let since = *place.get_or_insert_with(|| self.queue_clock());
            let (ticket, woken) = self.wait_in_queue(caller, since)?;
            if !self.woken_by(woken, until).await {
                self.leave_queue(&caller.name, ticket);
                return Err(Refusal::Waited(began.elapsed()));
            }
        }
    }

    /// Waits until `woken` or `until`; whether it was woken. Meanwhile the queue is looked at
    /// again now and then: a principal passed over (its slots across the fleet were held) is
    /// tried again once its block is over, which no slot freed here announces.
    async fn woken_by(&self, mut woken: oneshot::Receiver<()>, until: Instant) -> bool {
        loop {
            let look_again = (Instant::now() + super::quota::BLOCKED_FOR).min(until);
            match tokio::time::timeout_at(look_again, &mut woken).await {
                Ok(answer) => return answer.is_ok(),
                Err(_) if Instant::now() >= until => return false,
                Err(_) => self.wake_next(),
            }
        }
    }

    fn nobody_waits(&self) -> bool {
        shared::sync::lock(&self.queue).shares.waiting() == 0
    }

    /// A number that orders the waits by their beginning.
    fn queue_clock(&self) -> u64 {
        let mut queued = shared::sync::lock(&self.queue);
        queued.next_ticket += 1;
        queued.next_ticket
    }

    /// Queues a run of `caller` that began to wait at `since`: its ticket, and what tells it
    /// that its turn came. A slot may be free already: the share rules are asked at once.
    fn wait_in_queue(&self, caller: &Principal, since: u64) -> Result<(u64, oneshot::Receiver<()>), Refusal> {
        let (tx, rx) = oneshot::channel();
        let ticket = {
            let mut queued = shared::sync::lock(&self.queue);
            queued.next_ticket += 1;
            let ticket = queued.next_ticket;
            let room = (caller.max_queued.unwrap_or(self.max_queued), self.max_queued);
            let waiter = Place { ticket, since };
            queued
                .shares
                .push(&caller.name, caller.weight.unwrap_or(1), waiter, room)
                .map_err(Refusal::QueueFull)?;
            queued.wakers.insert(ticket, (caller.name.clone(), tx));
            queued.limits.insert(caller.name.clone(), caller.max_runs);
            queued.count();
            ticket
        };
        self.wake_next();
        Ok((ticket, rx))
    }

    fn leave_queue(&self, principal: &str, ticket: u64) {
        let mut queued = shared::sync::lock(&self.queue);
        queued.shares.remove(principal, ticket);
        queued.wakers.remove(&ticket);
        queued.count();
    }

    /// Wakes as many waiting runs as slots are free, each the one the share rules pick (a
    /// principal at its `max_runs` here is passed over).
    pub(crate) fn wake_next(&self) {
        let mut queued = shared::sync::lock(&self.queue);
        let now = Instant::now();
        queued.blocked.retain(|_, until| *until > now);
        let mut in_flight: HashMap<String, usize> = HashMap::new();
        for live in self.lock().values() {
            *in_flight.entry(live.principal.clone()).or_default() += 1;
        }
        let mut woken = 0;
        while woken < self.free_slots() {
            let Queued {
                shares,
                limits,
                blocked,
                ..
            } = &*queued;
            let count = |p: &str| in_flight.get(p).copied().unwrap_or(0);
            let under = |p: &str| limits.get(p).copied().flatten().is_none_or(|limit| count(p) < limit);
            let may_run = |p: &str| under(p) && !blocked.contains_key(p);
            let Some(principal) = shares.next(count, may_run) else {
                return;
            };
            let Some(waiter) = queued.shares.pop(&principal) else {
                return;
            };
            queued.count();
            // A run that gave up just now is not woken: the next one is.
            if let Some((_, wake)) = queued.wakers.remove(&waiter.ticket)
                && wake.send(()).is_ok()
            {
                woken += 1;
                *in_flight.entry(principal).or_default() += 1;
            }
        }
    }
}
