//! What one party may hold of the console: sign-ins per address per minute
//! (`--console-sign-ins-per-minute`), and live run pages per session
//! (`--console-max-streams-per-session`) within the replica's (`--console-max-streams`).

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};

use shared::sync::lock;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// The most addresses whose sign-ins are counted at once; past it the oldest minute's counts
/// are forgotten first (memory stays bounded whoever signs in).
const MAX_ADDRESSES: usize = 10_000;

/// Sign-ins per address in the current minute.
pub(super) struct SignIns {
    per_minute: u32,
    /// By address: the minute (Unix minutes) and its sign-ins.
    counts: Mutex<HashMap<IpAddr, (u64, u32)>>,
}

impl SignIns {
    pub(super) fn new(per_minute: u32) -> Self {
        Self {
            per_minute,
            counts: Mutex::default(),
        }
    }

    /// Counts a sign-in from `address`; `false` when it has tried `per_minute` times this minute.
    pub(super) fn admit(&self, address: IpAddr) -> bool {
        let minute = shared::sync::unix_ms() / 60_000;
        let mut counts = lock(&self.counts);
        if counts.len() >= MAX_ADDRESSES && !counts.contains_key(&address) {
            counts.retain(|_, (at, _)| *at == minute);
            if counts.len() >= MAX_ADDRESSES {
                counts.clear();
            }
        }
        let entry = counts.entry(address).or_insert((minute, 0));
        if entry.0 != minute {
            *entry = (minute, 0);
        }
        entry.1 += 1;
        entry.1 <= self.per_minute
    }
}

/// Live run pages followed: the replica's slots, and each session's share of them.
pub(super) struct Streams {
    all: Arc<Semaphore>,
    per_session: usize,
    /// Pages each session follows now, by session id.
    by_session: Arc<Mutex<HashMap<String, usize>>>,
}

/// A live run page's hold on its slots, given back when dropped.
pub(super) struct StreamSlot {
    _all: OwnedSemaphorePermit,
    session: String,
    by_session: Arc<Mutex<HashMap<String, usize>>>,
}

impl Drop for StreamSlot {
    fn drop(&mut self) {
        let mut by_session = lock(&self.by_session);
        if let Some(count) = by_session.get_mut(&self.session) {
            *count -= 1;
            if *count == 0 {
                by_session.remove(&self.session);
            }
        }
    }
}

/// Why a page gets no slot.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum NoSlot {
    /// The replica follows `--console-max-streams` pages.
    Replica,
    /// The session follows `--console-max-streams-per-session` pages.
    Session,
}

impl Streams {
    pub(super) fn new(all: usize, per_session: usize) -> Self {
        Self {
            all: Arc::new(Semaphore::new(all)),
            per_session,
            by_session: Arc::default(),
        }
    }

    /// A slot for a page of session `session`.
    pub(super) fn take(&self, session: &str) -> Result<StreamSlot, NoSlot> {
        let mut by_session = lock(&self.by_session);
        let count = by_session.get(session).copied().unwrap_or(0);
        if count >= self.per_session {
            return Err(NoSlot::Session);
        }
        let permit = Arc::clone(&self.all).try_acquire_owned().map_err(|_| NoSlot::Replica)?;
        by_session.insert(session.to_owned(), count + 1);
        Ok(StreamSlot {
            _all: permit,
            session: session.to_owned(),
            by_session: Arc::clone(&self.by_session),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_address_signs_in_up_to_its_limit_a_minute() {
        let sign_ins = SignIns::new(3);
        let (one, two): (IpAddr, IpAddr) = ("10.0.0.1".parse().unwrap(), "10.0.0.2".parse().unwrap());
        assert_eq!(
            (0..4).map(|_| sign_ins.admit(one)).collect::<Vec<_>>(),
            [true, true, true, false]
        );
        assert!(sign_ins.admit(two), "another address has its own");
    }

    #[test]
    fn a_session_holds_its_share_of_the_slots_and_gives_them_back() {
        let streams = Streams::new(3, 2);
        let (a1, a2) = (streams.take("a").unwrap(), streams.take("a").unwrap());
        assert_eq!(streams.take("a").err(), Some(NoSlot::Session));
        let b1 = streams.take("b").unwrap();
        assert_eq!(streams.take("c").err(), Some(NoSlot::Replica));
        drop(a1);
        assert!(streams.take("a").is_ok(), "a page closed gives its slot back");
        drop((a2, b1));
    }
}
