//! Threads in this process ([`MemoryThreads`]): at most `--max-threads` kept (a new one pushes
//! out the least recently changed thread no run holds), each expiring `--thread-max-age` after
//! its last change.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use futures::future::BoxFuture;

use crate::domain::ports::{StoreError, ThreadStore};
use crate::domain::thread::Thread;

/// See the module docs.
pub struct MemoryThreads {
    kept: Mutex<Kept>,
    max_threads: usize,
    max_age: Duration,
}

#[derive(Default)]
struct Kept {
    threads: HashMap<String, (Thread, u64)>,
    revisions: u64,
}

impl MemoryThreads {
    /// At most `max_threads` threads, each kept `max_age` after its last change.
    pub fn new(max_threads: usize, max_age: Duration) -> Self {
        Self {
            kept: Mutex::default(),
            max_threads,
            max_age,
        }
    }

    fn expired(&self, thread: &Thread, now: u64) -> bool {
        let age = u64::try_from(self.max_age.as_millis()).unwrap_or(u64::MAX);
        thread.live.is_none() && thread.updated_at_unix_ms.saturating_add(age) <= now
    }

    /// Room for one more thread: the expired ones go, then the least recently changed one no run
    /// holds; `false` when every thread is held.
    fn make_room(&self, kept: &mut Kept, now: u64) -> bool {
        kept.threads.retain(|_, (t, _)| !self.expired(t, now));
        if kept.threads.len() < self.max_threads {
            return true;
        }
        let oldest = kept
            .threads
            .iter()
            .filter(|(_, (t, _))| t.live.is_none() && t.queue.is_empty())
            .min_by_key(|(_, (t, _))| t.updated_at_unix_ms)
            .map(|(id, _)| id.clone());
        match oldest {
            Some(id) => {
                kept.threads.remove(&id);
                true
            }
            None => false,
        }
    }
}

impl ThreadStore for MemoryThreads {
    fn read(&self, thread_id: &str) -> BoxFuture<'static, Result<Option<(Thread, u64)>, StoreError>> {
        let now = shared::sync::unix_ms();
        let mut kept = shared::sync::lock(&self.kept);
        let found = match kept.threads.get(thread_id) {
            Some((thread, _)) if self.expired(thread, now) => {
                kept.threads.remove(thread_id);
                None
            }
            found => found.cloned(),
        };
        Box::pin(std::future::ready(Ok(found)))
    }

    fn write(&self, thread: Thread, revision: u64) -> BoxFuture<'static, Result<bool, StoreError>> {
        let now = shared::sync::unix_ms();
        let mut kept = shared::sync::lock(&self.kept);
        let current = kept.threads.get(&thread.thread_id).map_or(0, |(_, r)| *r);
        let answer = if current != revision {
            Ok(false)
        } else if revision == 0 && !self.make_room(&mut kept, now) {
            Err(StoreError::Unavailable {
                operation: "thread create",
                key: thread.thread_id.clone(),
                reason: format!(
                    "this replica keeps {} threads (--max-threads) and runs hold every one",
                    self.max_threads
                ),
            })
        } else {
            kept.revisions += 1;
            let revision = kept.revisions;
            kept.threads.insert(thread.thread_id.clone(), (thread, revision));
            Ok(true)
        };
        Box::pin(std::future::ready(answer))
    }

    fn delete(&self, thread_id: &str, revision: u64) -> BoxFuture<'static, Result<bool, StoreError>> {
        let mut kept = shared::sync::lock(&self.kept);
        let answer = match kept.threads.get(thread_id) {
            Some((_, r)) if *r == revision => {
                kept.threads.remove(thread_id);
                true
            }
            Some(_) => false,
            None => revision == 0,
        };
        Box::pin(std::future::ready(Ok(answer)))
    }
}

#[cfg(test)]
mod tests {
    use futures::FutureExt;

    use super::*;

    fn thread(id: &str, at: u64) -> Thread {
        Thread::new(id, "alice", at)
    }

    fn write(store: &MemoryThreads, t: Thread, revision: u64) -> Result<bool, StoreError> {
        store.write(t, revision).now_or_never().unwrap_or(Ok(false))
    }

    fn revision(store: &MemoryThreads, id: &str) -> u64 {
        match store.read(id).now_or_never() {
            Some(Ok(Some((_, r)))) => r,
            _ => 0,
        }
    }

    #[test]
    fn a_write_over_a_stale_revision_is_refused() {
        let store = MemoryThreads::new(4, Duration::from_secs(60));
        let now = shared::sync::unix_ms();
        assert_eq!(write(&store, thread("t", now), 0), Ok(true));
        assert_eq!(write(&store, thread("t", now), 0), Ok(false), "created already");
        let r = revision(&store, "t");
        assert_eq!(write(&store, thread("t", now), r), Ok(true));
        assert_eq!(write(&store, thread("t", now), r), Ok(false), "stale");
    }

    /// `--max-threads` on both sides: at the bound a new thread pushes out the least recently
    /// changed one no run holds; when runs hold them all, it is refused.
    #[test]
    fn the_count_is_bounded_and_held_threads_are_never_pushed_out() {
        let store = MemoryThreads::new(2, Duration::from_secs(3600));
        let now = shared::sync::unix_ms();
        assert_eq!(write(&store, thread("a", now - 10), 0), Ok(true));
        assert_eq!(write(&store, thread("b", now), 0), Ok(true));
        assert_eq!(write(&store, thread("c", now), 0), Ok(true));
        assert_eq!((revision(&store, "a"), revision(&store, "c") > 0), (0, true), "a went");
        for id in ["b", "c"] {
            let mut held = thread(id, now);
            held.live = Some("run".into());
            let r = revision(&store, id);
            assert_eq!(write(&store, held, r), Ok(true));
        }
        assert!(write(&store, thread("d", now), 0).is_err());
    }

    #[test]
    fn a_thread_unchanged_for_its_age_expires_unless_held() {
        let store = MemoryThreads::new(4, Duration::from_secs(60));
        let old = shared::sync::unix_ms() - 61_000;
        assert_eq!(write(&store, thread("old", old), 0), Ok(true));
        assert_eq!(revision(&store, "old"), 0, "expired");
        let mut held = thread("held", old);
        held.live = Some("run".into());
        assert_eq!(write(&store, held, 0), Ok(true));
        assert!(revision(&store, "held") > 0);
    }
}
