//! The in-memory signal topic: a bounded broadcast. A subscriber that falls more than `capacity`
//! signals behind is told how many it missed; publishers never wait.

use std::sync::Arc;

use futures::future::BoxFuture;
use futures::stream::BoxStream;
use futures::{FutureExt, StreamExt};
use tokio::sync::broadcast;
use tokio_stream::wrappers::BroadcastStream;
use tokio_stream::wrappers::errors::BroadcastStreamRecvError;

use crate::domain::ports::{OnDelivery, SignalFilter, SignalItem, SignalTopic};
use crate::domain::{Delivery, Ownership, Signal};

/// See the module docs.
pub struct MemoryTopic {
    tx: broadcast::Sender<Arc<Signal>>,
}

impl MemoryTopic {
    /// A topic buffering up to `capacity` signals per subscriber.
    pub fn new(capacity: usize) -> Self {
        let (tx, _) = broadcast::channel(capacity.max(1));
        Self { tx }
    }
}

impl SignalTopic for MemoryTopic {
    fn publish(&self, signal: &Signal, _owner: Option<Ownership>, on_delivery: OnDelivery) {
        // No subscriber is not an error: the signal is in the run's result and events anyway.
        let delivered = Signal {
            delivery: Delivery::Delivered,
            ..signal.clone()
        };
        let _ = self.tx.send(Arc::new(delivered));
        on_delivery(Delivery::Delivered);
    }

    fn subscribe(&self, filter: SignalFilter) -> BoxFuture<'static, BoxStream<'static, SignalItem>> {
        let stream = BroadcastStream::new(self.tx.subscribe())
            .filter_map(move |item| {
                let out = match item {
                    Ok(signal) if filter.matches(&signal) => Some(SignalItem::Signal((*signal).clone())),
                    Ok(_) => None,
                    Err(BroadcastStreamRecvError::Lagged(n)) => Some(SignalItem::Missed(n)),
                };
                futures::future::ready(out)
            })
            .boxed();
        futures::future::ready(stream).boxed()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn signal(run: &str, tool: &str) -> Signal {
        Signal {
            run_id: run.into(),
            call_id: "c".into(),
            tool_name: tool.into(),
            arguments_json: "{}".into(),
            arguments_valid: true,
            turn: 1,
            emitted_at_unix_ms: 0,
            metadata: Default::default(),
            delivery: Delivery::Pending,
            principal: String::new(),
        }
    }

    #[tokio::test]
    async fn filters_and_reports_missed_signals() {
        let topic = MemoryTopic::new(2);
        let mut all = topic.subscribe(SignalFilter::default()).await;
        let mut only = topic
            .subscribe(SignalFilter {
                run_id: Some("r2".into()),
                tool_names: vec!["finish".into()],
                principal: None,
            })
            .await;
        for (run, tool) in [("r1", "finish"), ("r2", "escalate"), ("r2", "finish"), ("r3", "finish")] {
            topic.publish(
                &signal(run, tool),
                None,
                Box::new(|d| assert_eq!(d, Delivery::Delivered)),
            );
        }
        // `all` lagged: capacity 2, four published.
        assert_eq!(all.next().await, Some(SignalItem::Missed(2)));
        let delivered = |run: &str, tool: &str| Signal {
            delivery: Delivery::Delivered,
            ..signal(run, tool)
        };
        assert_eq!(all.next().await, Some(SignalItem::Signal(delivered("r2", "finish"))));
        assert_eq!(only.next().await, Some(SignalItem::Missed(2)));
        assert_eq!(only.next().await, Some(SignalItem::Signal(delivered("r2", "finish"))));
    }
}
