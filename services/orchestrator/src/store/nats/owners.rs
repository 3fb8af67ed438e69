//! The indexes that find orphans without reading every run: in the run store's bucket, an entry
//! per held run under the incarnation holding it (`owner.<incarnation>.<run>`), and an entry per
//! parked run under the minute it wakes (`wake.<minute>.<run>`). A lapsed incarnation's runs are
//! listed by its prefix, the parked runs due by their minutes' prefixes: the cost of a look is
//! the runs that moved, not the runs that exist.
//!
//! An entry is written before the record it points at (a held run is always found). An owner
//! entry holds the epoch its claim writes: one left behind (a run that ended, moved, or whose
//! claim lost) is removed by whoever reads it and finds the record names another incarnation in
//! that epoch or a later one — never while the claim may still land (its record is older).

use std::collections::HashSet;
use std::sync::Mutex;

use shared::jetstream::Bucket;

use crate::domain::ports::StoreError;
use crate::store::unavailable;
use shared::fence::escaped_key;

/// What one replica remembers between its looks.
#[derive(Default)]
pub(super) struct Finder {
    pub(super) state: Mutex<Looked>,
}

#[derive(Default)]
pub(super) struct Looked {
    /// The wake minute the next look lists from (`None`: every entry, at the first look).
    pub(super) wake_from: Option<u64>,
    /// Orphans another live incarnation ranks first, left to it for one look.
    pub(super) deferred: HashSet<String>,
    /// Where the scan for records from before incarnations is.
    pub(super) legacy: LegacyScan,
}

/// The scan for records from before incarnations: it reads every run, so it runs beside the
/// looks (a look's budget is one store timeout, and the scan's cost grows with the runs).
#[derive(Default)]
pub(super) enum LegacyScan {
    /// To start at the next look.
    #[default]
    Due,
    /// Under way.
    Running,
    /// Finished: the orphans it found (for the next look), and whether such records were still
    /// held (scanned again then).
    Found(Vec<String>, bool),
    /// No record from before incarnations is held: never again.
    Done,
}

/// A minute of wake times, in ms.
pub(super) const MINUTE_MS: u64 = 60_000;

/// The token of a run's record key in an index entry (its escaped id).
fn run_token(key: &str) -> &str {
    key.strip_prefix("run.").unwrap_or(key)
}

/// The entry of the run under `key` in the index of `incarnation`.
pub(super) fn owner_key(incarnation: &str, key: &str) -> String {
    format!("{}.{}", escaped_key("owner.", incarnation), run_token(key))
}

/// Every entry of `incarnation`'s runs.
pub(super) fn owner_filter(incarnation: &str) -> String {
    format!("{}.>", escaped_key("owner.", incarnation))
}

/// The entry of the parked run under `key`, due at `wake_at_unix_ms`.
pub(super) fn wake_key(wake_at_unix_ms: u64, key: &str) -> String {
    format!("wake.{}.{}", wake_at_unix_ms / MINUTE_MS, run_token(key))
}

/// Every entry of the runs due in `minute`.
pub(super) fn wake_filter(minute: u64) -> String {
    format!("wake.{minute}.>")
}

/// The record key an index entry points at.
pub(super) fn record_key_of(entry: &str) -> Option<String> {
    let (_, token) = entry.rsplit_once('.')?;
    Some(format!("run.{token}"))
}

/// Writes the index entry `entry`.
pub(super) async fn enter(kv: &dyn Bucket, entry: &str) -> Result<(), StoreError> {
    tracing::trace!(entry, "enter");
    kv.put(entry, bytes::Bytes::new())
        .await
        .map(|_| ())
        .map_err(|e| unavailable("KV put", entry, e))
}

/// Enters the run under `key` in the index of `incarnation`, for its claim in `epoch`.
pub(super) async fn enter_owner(kv: &dyn Bucket, incarnation: &str, key: &str, epoch: u64) -> Result<(), StoreError> {
    let entry = owner_key(incarnation, key);
    tracing::trace!(entry, epoch, "enter owner");
    kv.put(&entry, epoch.to_string().into())
        .await
        .map(|_| ())
        .map_err(|e| unavailable("KV put", &entry, e))
}

/// The epoch an owner entry's claim writes (0 when it holds none).
pub(super) fn entry_epoch(value: &[u8]) -> u64 {
    std::str::from_utf8(value)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// Removes the index entry `entry` (a failure leaves it to whoever reads it next).
pub(super) async fn leave(kv: &dyn Bucket, entry: &str) {
    tracing::trace!(entry, "leave");
    if let Err(e) = kv.delete(entry, None).await {
        tracing::debug!(entry = %entry, "removing an index entry failed (it is removed when next read): {e}");
    }
}

/// Removes the index entry `entry` if it still stands at `revision` (one written again since
/// stays; a failure leaves it to whoever reads it next).
pub(super) async fn leave_at(kv: &dyn Bucket, entry: &str, revision: u64) {
    tracing::trace!(entry, revision, "leave");
    if let Err(e) = kv.delete(entry, Some(revision)).await {
        tracing::debug!(entry = %entry, "removing an index entry failed (it is removed when next read): {e}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_entry_names_its_run_and_falls_under_its_prefix() {
        let entry = owner_key("orch-0~18f.2", "run.a=2eb");
        assert_eq!(entry, "owner.orch-0=7e18f=2e2.a=2eb");
        assert!(entry.starts_with(owner_filter("orch-0~18f.2").trim_end_matches('>')));
        assert_eq!(record_key_of(&entry).as_deref(), Some("run.a=2eb"));
        let wake = wake_key(3 * MINUTE_MS + 5, "run.x");
        assert_eq!(wake, "wake.3.x");
        assert!(wake.starts_with(wake_filter(3).trim_end_matches('>')));
        assert_eq!(record_key_of(&wake).as_deref(), Some("run.x"));
    }
}
