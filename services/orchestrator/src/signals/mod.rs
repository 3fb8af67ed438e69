//! The signal topic: where exit-tool calls (signals) are published and read back.
//!
//! Backends implement [`SignalTopic`]; [`memory::MemoryTopic`] is the default (an in-process,
//! bounded broadcast). Publishing never waits for subscribers.

pub mod memory;

use futures::stream::BoxStream;

use crate::run::Signal;

/// Which signals a subscriber wants; empty fields match everything.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SignalFilter {
    /// Only this run's signals.
    pub run_id: Option<String>,
    /// Only these exit tools.
    pub tool_names: Vec<String>,
}

impl SignalFilter {
    /// Whether `signal` passes the filter.
    pub fn matches(&self, signal: &Signal) -> bool {
        self.run_id.as_ref().is_none_or(|id| *id == signal.run_id)
            && (self.tool_names.is_empty() || self.tool_names.contains(&signal.tool_name))
    }
}

/// One item of a subscription.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SignalItem {
    /// A signal.
    Signal(Signal),
    /// The subscriber fell behind and this many signals were skipped.
    Missed(u64),
}

/// A topic signals are published to and subscribed from.
pub trait SignalTopic: Send + Sync + 'static {
    /// Publishes a signal; never blocks the run.
    fn publish(&self, signal: &Signal);
    /// Signals published from now on that pass `filter`.
    fn subscribe(&self, filter: SignalFilter) -> BoxStream<'static, SignalItem>;
}
