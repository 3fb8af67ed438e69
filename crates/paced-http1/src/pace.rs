//! How a body's reader reads: on every chunk, or only on its ticks (shared with the connection).

use std::sync::atomic::Ordering::Relaxed;

/// Whether a completion's reader reads it only on its stream interval's ticks (shared between
/// the reader and the connection). While it does, the connection's socket need not wake anyone
/// for each chunk that arrives: the reader takes them all at the next tick; and once a tick's
/// read found the socket drained, it is not read again before the next tick.
#[derive(Debug, Clone, Default)]
pub struct ReadPace(std::sync::Arc<PaceState>);

#[derive(Debug, Default)]
struct PaceState {
    ticking: std::sync::atomic::AtomicBool,
    /// Ticks the reader has woken on.
    ticks: std::sync::atomic::AtomicU64,
    /// `ticks` + 1 when the socket was last found drained (0: never).
    drained: std::sync::atomic::AtomicU64,
}

impl ReadPace {
    /// The reader now reads only on its ticks (`true`), or waits for the next chunk (`false`).
    pub fn set_ticking(&self, ticking: bool) {
        self.0.ticking.store(ticking, Relaxed);
    }

    /// Whether the reader reads only on its ticks.
    pub fn ticking(&self) -> bool {
        self.0.ticking.load(Relaxed)
    }

    /// The reader woke on a tick: the socket is worth reading again.
    pub fn ticked(&self) {
        self.0.ticks.fetch_add(1, Relaxed);
    }

    /// Ticks the reader has woken on.
    pub fn ticks(&self) -> u64 {
        self.0.ticks.load(Relaxed)
    }

    /// The connection read everything the socket held (a short read, or none).
    pub fn drained(&self) {
        self.0.drained.store(self.0.ticks.load(Relaxed) + 1, Relaxed);
    }

    /// Whether the socket was found drained since the reader's last tick: what arrives after
    /// waits for the next one.
    pub fn drained_this_tick(&self) -> bool {
        self.ticking() && self.0.drained.load(Relaxed) == self.0.ticks.load(Relaxed) + 1
    }
}

/// A hint between reader and connection, not part of what is asked: any two are equal.
impl PartialEq for ReadPace {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}
