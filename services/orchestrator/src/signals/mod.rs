//! The signal topic: where exit-tool calls (signals) are published and read back.
//!
//! Backends implement [`SignalTopic`]; [`memory::MemoryTopic`] is the default (an in-process,
//! bounded broadcast), [`nats::NatsTopic`] publishes to NATS JetStream. Publishing never waits:
//! the topic reports the outcome later through the publisher's callback.

pub mod memory;
pub mod nats;

use futures::future::BoxFuture;
use futures::stream::BoxStream;

use crate::run::{Delivery, Signal};

/// Told once whether a published signal was delivered.
pub type OnDelivery = Box<dyn FnOnce(Delivery) + Send>;

/// Which signals a subscriber wants; empty fields match everything.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SignalFilter {
    /// Only this run's signals.
    pub run_id: Option<String>,
    /// Only these exit tools.
    pub tool_names: Vec<String>,
    /// Only the runs of this caller (set when the server authenticates callers).
    pub principal: Option<String>,
}

impl SignalFilter {
    /// Whether `signal` passes the filter.
    pub fn matches(&self, signal: &Signal) -> bool {
        self.run_id.as_ref().is_none_or(|id| *id == signal.run_id)
            && self.principal.as_ref().is_none_or(|p| *p == signal.principal)
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
    /// Publishes a signal and returns at once; `on_delivery` is called once with the outcome.
    fn publish(&self, signal: &Signal, on_delivery: OnDelivery);
    /// Signals published from the moment the returned future resolves that pass `filter`.
    fn subscribe(&self, filter: SignalFilter) -> BoxFuture<'static, BoxStream<'static, SignalItem>>;
}
