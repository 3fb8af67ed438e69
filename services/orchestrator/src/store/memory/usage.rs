//! Each principal's spend per hour window, in this process ([`UsageBook`]): bounded by age
//! (`--usage-keep-for`) and by count (the oldest windows go first).

use std::collections::BTreeMap;
use std::sync::Mutex;

use futures::future::BoxFuture;

use crate::domain::ports::{StoreError, UsageBook};
use crate::domain::usage::{Add, Tally, WINDOW_MS};

/// Windows kept at most, all principals together.
const MAX_WINDOWS: usize = 100_000;

/// See the module docs.
pub struct MemoryUsage {
    windows: Mutex<BTreeMap<(u64, String), Tally>>,
    /// Windows older than this many before the newest are dropped.
    keep: u64,
}

impl MemoryUsage {
    /// Keeps `keep_for` of windows.
    pub fn new(keep_for: std::time::Duration) -> Self {
        Self {
            windows: Mutex::default(),
            keep: u64::try_from(keep_for.as_millis()).unwrap_or(u64::MAX) / WINDOW_MS + 1,
        }
    }
}

impl UsageBook for MemoryUsage {
    fn add(&self, principal: &str, window: u64, add: Add) -> BoxFuture<'static, Result<Tally, StoreError>> {
        // An add here is never made twice (no answer is lost in a process, and no other replica
        // takes a run over): the window keeps its total only.
        let mut windows = shared::sync::lock(&self.windows);
        let total = windows.entry((window, principal.to_owned())).or_default();
        total.add(&add.change);
        let total = *total;
        let oldest = window.saturating_sub(self.keep.saturating_mul(WINDOW_MS));
        while windows
            .first_key_value()
            .is_some_and(|((start, _), _)| *start < oldest || windows.len() > MAX_WINDOWS)
        {
            windows.pop_first();
        }
        Box::pin(std::future::ready(Ok(total)))
    }

    fn read(&self, principal: &str, from: u64, to: u64) -> BoxFuture<'static, Result<Vec<(u64, Tally)>, StoreError>> {
        let windows = shared::sync::lock(&self.windows);
        let found = windows
            .range((from, String::new())..(to.saturating_add(1), String::new()))
            .filter(|((_, p), _)| p == principal)
            .map(|((start, _), spend)| (*start, *spend))
            .collect();
        Box::pin(std::future::ready(Ok(found)))
    }
}
