//! Locks that survive a panic elsewhere, and the wall clock as Unix milliseconds (which a
//! simulation or a test on a paused clock may have follow tokio's, [`UnixClockOnTokio`]; the
//! services never do).
//!
//! Every lock in both services guards a value a panicking holder cannot leave harmful (a table
//! swapped whole, a result written field by field), so a poisoned lock is used as it is rather than
//! spreading the panic to every later caller.

use std::sync::{Mutex, MutexGuard, PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::{SystemTime, UNIX_EPOCH};

/// Locks `mutex`, poisoned or not.
pub fn lock<T: ?Sized>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Reads `lock`, poisoned or not.
pub fn read<T: ?Sized>(lock: &RwLock<T>) -> RwLockReadGuard<'_, T> {
    lock.read().unwrap_or_else(PoisonError::into_inner)
}

/// Writes `lock`, poisoned or not.
pub fn write<T: ?Sized>(lock: &RwLock<T>) -> RwLockWriteGuard<'_, T> {
    lock.write().unwrap_or_else(PoisonError::into_inner)
}

thread_local! {
    /// Tokio's clock read as Unix time on this thread: the Unix time (ms) at one of its instants.
    static ON_TOKIO_CLOCK: std::cell::Cell<Option<(u64, tokio::time::Instant)>> =
        const { std::cell::Cell::new(None) };
}

/// While it lives, [`unix_ms`] on this thread reads tokio's clock (from `start_ms` at the moment
/// it was made) instead of the system's: on a paused clock (a simulation, a test of a wait that
/// time ends) the Unix times the services compare (an approval's expiry, a thread's holder since
/// when, a parked run's wake) move with the clock that jumps. The services never make one.
#[must_use = "the clock is tokio's only while this lives"]
pub struct UnixClockOnTokio(());

impl UnixClockOnTokio {
    /// Makes [`unix_ms`] on this thread read `start_ms` now and move with tokio's clock.
    pub fn starting_at(start_ms: u64) -> Self {
        ON_TOKIO_CLOCK.with(|anchor| anchor.set(Some((start_ms, tokio::time::Instant::now()))));
        Self(())
    }
}

impl Drop for UnixClockOnTokio {
    fn drop(&mut self) {
        ON_TOKIO_CLOCK.with(|anchor| anchor.set(None));
    }
}

/// Now, in milliseconds since the Unix epoch (0 for a clock set before 1970): tokio's clock
/// while a [`UnixClockOnTokio`] lives on this thread, the system's otherwise.
pub fn unix_ms() -> u64 {
    if let Some((start, at)) = ON_TOKIO_CLOCK.with(std::cell::Cell::get) {
        return start.saturating_add(u64::try_from(at.elapsed().as_millis()).unwrap_or(u64::MAX));
    }
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_poisoned_lock_is_still_usable() {
        let mutex = std::sync::Arc::new(Mutex::new(1));
        let held = std::sync::Arc::clone(&mutex);
        let _ = std::thread::spawn(move || {
            let _guard = held.lock();
            panic!("poisons the lock");
        })
        .join();
        assert!(mutex.is_poisoned());
        *lock(&mutex) += 1;
        assert_eq!(*lock(&mutex), 2);
        let table = RwLock::new(vec![1]);
        write(&table).push(2);
        assert_eq!(*read(&table), [1, 2]);
    }

    #[test]
    fn unix_ms_is_after_2020() {
        assert!(unix_ms() > 1_577_836_800_000);
    }

    #[tokio::test(start_paused = true)]
    async fn unix_time_follows_a_paused_clock_while_asked_and_the_system_after() {
        let clock = UnixClockOnTokio::starting_at(1_000);
        assert_eq!(unix_ms(), 1_000);
        tokio::time::advance(std::time::Duration::from_secs(90)).await;
        assert_eq!(unix_ms(), 91_000, "the jump of the paused clock is Unix time too");
        drop(clock);
        assert!(unix_ms() > 1_577_836_800_000, "the system's clock again");
    }
}
