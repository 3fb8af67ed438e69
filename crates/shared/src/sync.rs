//! Locks that survive a panic elsewhere, and the wall clock as Unix milliseconds (which a
//! simulation may replace with its virtual one, [`set_clock`]; the services never do).
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

/// The clock a simulation put in place of the system's, if any.
static CLOCK: std::sync::OnceLock<fn() -> Option<u64>> = std::sync::OnceLock::new();

/// Makes [`unix_ms`] ask `clock` first (its `None`: the system clock), for the rest of the
/// process; a second call changes nothing. A simulation on a virtual clock sets it, so that the
/// Unix times the services compare (a thread's holder since when, an approval's expiry) move
/// with that clock; the services never set it.
pub fn set_clock(clock: fn() -> Option<u64>) {
    let _ = CLOCK.set(clock);
}

/// Now, in milliseconds since the Unix epoch (0 for a clock set before 1970).
pub fn unix_ms() -> u64 {
    if let Some(now) = CLOCK.get().and_then(|clock| clock()) {
        return now;
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
}
