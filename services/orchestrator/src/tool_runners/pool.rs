//! The tool-runner endpoint pool: one lazily connected gRPC channel per runner endpoint, chosen
//! by "power of two choices" on calls in flight. An endpoint that refused a call (over its
//! concurrency limit, draining) or could not be reached is ejected for a moment: skipped
//! while others are available, so a retry lands on another endpoint. Members are added and
//! removed as DNS answers change; unchanged endpoints keep their connection.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use tokio::time::Instant;
use tonic::transport::{Channel, Endpoint};

/// One runner endpoint.
pub(super) struct Member {
    /// `http://host:port`.
    pub uri: String,
    /// Its channel (connects on first use, reconnects after failures).
    pub channel: Channel,
    in_flight: AtomicUsize,
    /// Milliseconds since the pool's epoch until which the member is skipped (0: not ejected).
    ejected_until_ms: AtomicU64,
}

/// A call's hold on a member (counts as in flight until dropped).
pub(super) struct Checkout {
    /// The member.
    pub member: Arc<Member>,
}

impl Drop for Checkout {
    fn drop(&mut self) {
        self.member.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

/// See the module docs.
pub(super) struct Pool {
    members: RwLock<BTreeMap<String, Arc<Member>>>,
    epoch: Instant,
    seed: AtomicU64,
}

impl Pool {
    /// An empty pool.
    pub(super) fn new() -> Self {
        let seed = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0x9E37_79B9_7F4A_7C15, |d| d.as_nanos() as u64);
        Self {
            members: RwLock::default(),
            epoch: Instant::now(),
            seed: AtomicU64::new(seed),
        }
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, BTreeMap<String, Arc<Member>>> {
        shared::sync::read(&self.members)
    }

    /// The endpoints now.
    pub(super) fn uris(&self) -> Vec<String> {
        self.read().keys().cloned().collect()
    }

    /// Makes the pool hold exactly `endpoints` (by URI), keeping members that stay unless
    /// `renew` (then they get a new channel; calls in flight keep the old one to their end).
    pub(super) fn set(&self, endpoints: Vec<(String, Endpoint)>, renew: bool) -> (Vec<String>, Vec<String>) {
        let mut members = shared::sync::write(&self.members);
        let wanted: BTreeMap<String, Endpoint> = endpoints.into_iter().collect();
        let removed: Vec<String> = members.keys().filter(|k| !wanted.contains_key(*k)).cloned().collect();
        for uri in &removed {
            members.remove(uri);
        }
        let mut added = Vec::new();
        for (uri, endpoint) in wanted {
            let present = members.contains_key(&uri);
            if !present || renew {
                let member = Member {
                    uri: uri.clone(),
                    channel: endpoint.connect_lazy(),
                    in_flight: AtomicUsize::new(0),
                    ejected_until_ms: AtomicU64::new(0),
                };
                members.insert(uri.clone(), Arc::new(member));
                if !present {
                    added.push(uri);
                }
            }
        }
        (added, removed)
    }

    fn now_ms(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// Skips `member` for `for_how_long` while other members are available.
    pub(super) fn eject(&self, member: &Member, for_how_long: Duration) {
        let until = self
            .now_ms()
            .saturating_add(u64::try_from(for_how_long.as_millis()).unwrap_or(u64::MAX));
        member.ejected_until_ms.store(until.max(1), Ordering::Release);
    }

    fn random(&self) -> u64 {
        // splitmix64 over a shared counter: cheap, lock-free, good enough to pick endpoints.
        let mut z = self
            .seed
            .fetch_add(0x9E37_79B9_7F4A_7C15, Ordering::Relaxed)
            .wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// The member at `uri`, for a call only it can take (a task held in its child process);
    /// `None` when the pool no longer has it.
    pub(super) fn pick_only(&self, uri: &str) -> Option<Checkout> {
        let members = self.read();
        let member = members.get(uri)?;
        member.in_flight.fetch_add(1, Ordering::AcqRel);
        Some(Checkout {
            member: Arc::clone(member),
        })
    }

    /// Picks a member: not in `tried`, not ejected (unless nothing else is left), the less
    /// loaded of two random candidates. `None` when the pool is empty.
    pub(super) fn pick(&self, tried: &[String]) -> Option<Checkout> {
        let members = self.read();
        let now = self.now_ms();
        let all: Vec<&Arc<Member>> = members.values().collect();
        let fresh: Vec<&Arc<Member>> = all.iter().copied().filter(|m| !tried.contains(&m.uri)).collect();
        let warm: Vec<&Arc<Member>> = fresh
            .iter()
            .copied()
            .filter(|m| m.ejected_until_ms.load(Ordering::Acquire) <= now)
            .collect();
        let candidates = if !warm.is_empty() {
            warm
        } else if !fresh.is_empty() {
            fresh
        } else {
            all
        };
        let chosen = match candidates.len() {
            0 => return None,
            1 => candidates[0],
            n => {
                // Two *different* members: drawing the same one twice would pick it whatever its
                // load (a third of the draws with three members).
                let r = self.random();
                let first = (r % n as u64) as usize;
                let second = (first + 1 + ((r >> 32) % (n as u64 - 1)) as usize) % n;
                let (a, b) = (candidates[first], candidates[second]);
                if b.in_flight.load(Ordering::Acquire) < a.in_flight.load(Ordering::Acquire) {
                    b
                } else {
                    a
                }
            }
        };
        chosen.in_flight.fetch_add(1, Ordering::AcqRel);
        Some(Checkout {
            member: Arc::clone(chosen),
        })
    }
}

impl Default for Pool {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(n: usize) -> Pool {
        let pool = Pool::new();
        let endpoints = (0..n)
            .map(|i| {
                let uri = format!("http://127.0.0.1:{}", 40000 + i);
                (uri.clone(), Endpoint::from_shared(uri).unwrap())
            })
            .collect();
        pool.set(endpoints, false);
        pool
    }

    #[tokio::test]
    async fn spreads_over_members_and_prefers_the_less_loaded() {
        let pool = pool(3);
        let mut counts = BTreeMap::new();
        for _ in 0..300 {
            let checkout = pool.pick(&[]).unwrap();
            *counts.entry(checkout.member.uri.clone()).or_insert(0) += 1;
        }
        assert_eq!(counts.len(), 3, "{counts:?}");
        // Held checkouts make a member busier: the others are picked.
        let held: Vec<Checkout> = (0..10).map(|_| pool.pick(&[]).unwrap()).collect();
        let busy = held
            .iter()
            .map(|l| l.member.in_flight.load(Ordering::Acquire))
            .max()
            .unwrap();
        // Power of two choices over distinct members: a member is only picked at load k when
        // another has at least k, so 10 checkouts over 3 members put at most 5 on one.
        assert!(busy <= 5, "load is spread: {busy}");
    }

    #[tokio::test]
    async fn retries_skip_tried_and_ejected_members() {
        let pool = pool(3);
        let first = pool.pick(&[]).unwrap();
        pool.eject(&first.member, Duration::from_secs(60));
        for _ in 0..50 {
            assert_ne!(
                pool.pick(&[]).unwrap().member.uri,
                first.member.uri,
                "ejected members are skipped"
            );
        }
        let tried: Vec<String> = pool.uris().into_iter().filter(|u| *u != first.member.uri).collect();
        // Everything else tried or ejected: the ejected one is still used rather than nothing.
        assert_eq!(pool.pick(&tried).unwrap().member.uri, first.member.uri);
    }

    #[tokio::test]
    async fn set_keeps_staying_members_and_reports_changes() {
        let pool = pool(2);
        let kept = Arc::clone(&pool.pick(&[]).unwrap().member);
        let uris = pool.uris();
        let new = "http://127.0.0.1:49999".to_owned();
        let next = vec![
            (kept.uri.clone(), Endpoint::from_shared(kept.uri.clone()).unwrap()),
            (new.clone(), Endpoint::from_shared(new.clone()).unwrap()),
        ];
        let (added, removed) = pool.set(next.clone(), false);
        assert_eq!(added, vec![new]);
        assert_eq!(removed.len(), 1);
        assert!(uris.contains(&removed[0]) && removed[0] != kept.uri);
        assert!(
            Arc::ptr_eq(&pool.read()[&kept.uri], &kept),
            "the staying member keeps its channel"
        );

        // Renewed (the transport changed): the same endpoints, every one a new member, and a
        // checkout taken before keeps the old one to its end.
        let checkout = pool.pick(&[]).unwrap();
        let (added, removed) = pool.set(next, true);
        assert!(added.is_empty() && removed.is_empty(), "{added:?} {removed:?}");
        assert_eq!(pool.uris().len(), 2);
        assert!(
            !Arc::ptr_eq(&pool.read()[&checkout.member.uri], &checkout.member),
            "a new channel"
        );
        assert_eq!(checkout.member.in_flight.load(Ordering::Acquire), 1);
    }
}
