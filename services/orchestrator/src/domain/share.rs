//! Fair shares of the run slots: runs that find no slot (their replica is full, or their
//! principal has its `max_runs` in flight) wait in a queue of their principal, and a freed slot
//! goes to the principal furthest below its share, not to whoever asked first. A principal's
//! share is its weight (tokens file, default 1) among the principals waiting: the next slot goes
//! to the waiting principal with the fewest runs in flight per unit of weight, ties to the one
//! that has waited longest. So a flood from one principal cannot starve a quiet one: the quiet
//! one's first run is next as soon as a slot frees.
//!
//! Across the fleet a principal's `max_runs` are slots in the store; [`slot_order`] is the
//! order a run tries them in.

use std::collections::{BTreeMap, VecDeque};

/// One run's place in its principal's queue for a slot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Place {
    /// Which wait this is (to take it out when it gives up).
    pub ticket: u64,
    /// When it began to wait (any monotonic count: a tie goes to the smaller).
    pub since: u64,
}

/// A principal's queue and what the share rules read of it.
#[derive(Debug, Clone, Default)]
struct Queue {
    waiting: VecDeque<Place>,
    weight: u32,
}

/// Why a run may not wait.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum QueueFull {
    /// Its principal has `max_queued` runs waiting already.
    #[error("{0} runs of this caller wait for a run slot already (its max_queued)")]
    Principal(usize),
    /// The replica has as many runs waiting as it lets wait.
    #[error("{0} runs wait for a run slot on this replica already (--max-queued-runs)")]
    Server(usize),
}

/// The queues of the runs waiting for a slot, by principal.
#[derive(Debug, Default)]
pub struct Shares {
    queues: BTreeMap<String, Queue>,
    waiting: usize,
}

impl Shares {
    /// Runs waiting, all principals together.
    pub fn waiting(&self) -> usize {
        self.waiting
    }

    /// Runs of `principal` waiting.
    pub fn waiting_of(&self, principal: &str) -> usize {
        self.queues.get(principal).map_or(0, |q| q.waiting.len())
    }

    /// Queues `place` for `principal` of `weight`, unless its queue has `max_queued` or all
    /// queues together `max_total`.
    pub fn push(
        &mut self,
        principal: &str,
        weight: u32,
        place: Place,
        (max_queued, max_total): (usize, usize),
    ) -> Result<(), QueueFull> {
        if self.waiting >= max_total {
            return Err(QueueFull::Server(max_total));
        }
        let queue = self.queues.entry(principal.to_owned()).or_default();
        if queue.waiting.len() >= max_queued {
            return Err(QueueFull::Principal(max_queued));
        }
        queue.weight = weight.max(1);
        queue.waiting.push_back(place);
        self.waiting += 1;
        Ok(())
    }

    /// Takes `ticket` out (it gave up); whether it was waiting.
    pub fn remove(&mut self, principal: &str, ticket: u64) -> bool {
        let Some(queue) = self.queues.get_mut(principal) else {
            return false;
        };
        let before = queue.waiting.len();
        queue.waiting.retain(|w| w.ticket != ticket);
        let removed = queue.waiting.len() < before;
        if removed {
            self.waiting -= 1;
        }
        if queue.waiting.is_empty() {
            self.queues.remove(principal);
        }
        removed
    }

    /// The principal whose run gets the next slot: among those waiting that `may_run` lets run
    /// one more, the one with the fewest runs in flight (`in_flight`) per unit of weight, ties
    /// to the longest waiting.
    pub fn next(&self, in_flight: impl Fn(&str) -> usize, may_run: impl Fn(&str) -> bool) -> Option<String> {
        self.queues
            .iter()
            .filter(|(principal, _)| may_run(principal))
            .filter_map(|(principal, queue)| {
                let head = queue.waiting.front()?;
                // Compared as in_flight / weight without division: a / w < b / v ⇔ a·v < b·w.
                Some((
                    principal,
                    in_flight(principal) as u128,
                    u128::from(queue.weight),
                    head.since,
                ))
            })
            .min_by(|a, b| (a.1 * b.2).cmp(&(b.1 * a.2)).then(a.3.cmp(&b.3)))
            .map(|(principal, ..)| principal.clone())
    }

    /// Takes the head of `principal`'s queue (it gets a slot).
    pub fn pop(&mut self, principal: &str) -> Option<Place> {
        let queue = self.queues.get_mut(principal)?;
        let head = queue.waiting.pop_front();
        if head.is_some() {
            self.waiting -= 1;
        }
        if queue.waiting.is_empty() {
            self.queues.remove(principal);
        }
        head
    }
}

/// The order run `run_id` tries its principal's `max` slots in: all of them, from one its id
/// picks (FNV-1a), so a principal's runs spread over its slots instead of all trying slot 0.
pub fn slot_order(run_id: &str, max: usize) -> impl Iterator<Item = usize> {
    let hash = shared::text::fnv1a(run_id.as_bytes());
    let start = usize::try_from(hash % u64::try_from(max.max(1)).unwrap_or(1)).unwrap_or(0);
    (0..max).map(move |n| (start + n) % max)
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    const ROOM: (usize, usize) = (1000, 10_000);

    fn place(ticket: u64) -> Place {
        Place { ticket, since: ticket }
    }

    /// Hands out `slots` slots one at a time to the queues, each run holding its slot: the
    /// principals served, in order.
    fn serve(shares: &mut Shares, slots: usize, limit: impl Fn(&str) -> usize) -> Vec<String> {
        let mut in_flight: HashMap<String, usize> = HashMap::new();
        let mut served = Vec::new();
        for _ in 0..slots {
            let count = |p: &str| in_flight.get(p).copied().unwrap_or(0);
            let Some(next) = shares.next(count, |p| count(p) < limit(p)) else {
                break;
            };
            shares.pop(&next);
            *in_flight.entry(next.clone()).or_default() += 1;
            served.push(next);
        }
        served
    }

    #[test]
    fn a_flood_does_not_starve_a_quiet_principal() {
        let mut shares = Shares::default();
        for t in 0..200 {
            shares.push("flood", 1, place(t), ROOM).unwrap();
        }
        for t in 200..205 {
            shares.push("quiet", 1, place(t), ROOM).unwrap();
        }
        let served = serve(&mut shares, 10, |_| usize::MAX);
        assert_eq!(served.iter().filter(|p| *p == "quiet").count(), 5, "{served:?}");
        assert_eq!(&served[..2], ["flood", "quiet"], "ties go to the longest waiting");
    }

    #[test]
    fn slots_follow_the_weights() {
        let mut shares = Shares::default();
        for t in 0..100 {
            shares.push("gold", 3, place(t), ROOM).unwrap();
            shares.push("bronze", 1, place(1000 + t), ROOM).unwrap();
        }
        let served = serve(&mut shares, 40, |_| usize::MAX);
        assert_eq!(served.iter().filter(|p| *p == "gold").count(), 30, "{served:?}");
    }

    #[test]
    fn a_principal_at_its_limit_lets_the_others_go_first() {
        let mut shares = Shares::default();
        for t in 0..10 {
            shares.push("capped", 1, place(t), ROOM).unwrap();
            shares.push("free", 1, place(100 + t), ROOM).unwrap();
        }
        let served = serve(&mut shares, 8, |p| if p == "capped" { 2 } else { usize::MAX });
        assert_eq!(served.iter().filter(|p| *p == "capped").count(), 2, "{served:?}");
        assert_eq!(shares.waiting_of("capped"), 8);
    }

    #[test]
    fn queues_are_bounded_on_both_sides() {
        let mut shares = Shares::default();
        shares.push("a", 1, place(1), (2, 3)).unwrap();
        shares.push("a", 1, place(2), (2, 3)).unwrap();
        assert_eq!(shares.push("a", 1, place(3), (2, 3)), Err(QueueFull::Principal(2)));
        shares.push("b", 1, place(4), (2, 3)).unwrap();
        assert_eq!(shares.push("c", 1, place(5), (2, 3)), Err(QueueFull::Server(3)));
        assert!(shares.remove("a", 1));
        assert!(!shares.remove("a", 1), "once");
        assert_eq!((shares.waiting(), shares.waiting_of("a")), (2, 1));
        shares.push("c", 1, place(6), (2, 3)).unwrap();
    }

    #[test]
    fn a_run_tries_every_slot_once_from_the_one_its_id_picks() {
        let order: Vec<usize> = super::slot_order("run-1", 5).collect();
        let mut sorted = order.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, [0, 1, 2, 3, 4]);
        assert!(order.windows(2).all(|w| w[1] == (w[0] + 1) % 5), "{order:?}");
        let starts: std::collections::BTreeSet<usize> = (0..100)
            .filter_map(|n| super::slot_order(&format!("run-{n}"), 8).next())
            .collect();
        assert!(starts.len() > 4, "runs spread over the slots: {starts:?}");
        assert_eq!(super::slot_order("x", 0).count(), 0);
        assert_eq!(super::slot_order("x", 1).collect::<Vec<_>>(), [0]);
    }
}
