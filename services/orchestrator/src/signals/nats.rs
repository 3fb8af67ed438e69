//! The NATS JetStream signal topic. Each signal is published as JSON (the `Signal` message's
//! fields) to `<prefix>.<tool_name>` with headers `Orchestrator-Run-Id`, `Orchestrator-Call-Id`,
//! `traceparent` (when the run is traced) and `Nats-Msg-Id` = `<run_id>.<call_id>`, so JetStream
//! drops duplicates of a retried publish within the stream's duplicate window. The stream (one
//! per prefix) is created or bound at start.
//!
//! Publishing never blocks the run: a background task awaits the JetStream acknowledgement,
//! retries with exponential backoff, and reports the outcome; a signal that could not be
//! delivered within the retries is marked undelivered in the run's result and counted in
//! `orchestrator_signals_failed_total`. Each attempt goes out only while the publishing replica
//! still acts for the run (or the run ended there): a replaced owner's retries stop. `subscribe`
//! reads the stream (an ordered consumer), so it sees the signals of every replica, each once.

use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use futures::stream::BoxStream;
use futures::{FutureExt, StreamExt};
use serde::{Deserialize, Serialize};
use shared::jetstream::{Deliver, JetStream, Publish, Read, Stream, StreamConfig};

use super::TopicError;
use crate::domain::ports::{OnDelivery, SignalFilter, SignalItem, SignalTopic};
use crate::domain::{Delivery, Ownership, Signal};

/// A signal as published: the `orchestrator.v1.Signal` fields, as JSON.
#[derive(Debug, Serialize, Deserialize)]
struct SignalJson {
    run_id: String,
    call_id: String,
    tool_name: String,
    arguments_json: String,
    arguments_valid: bool,
    turn: u32,
    emitted_at_unix_ms: u64,
    metadata: std::collections::BTreeMap<String, String>,
    #[serde(default)]
    principal: String,
}

impl From<&Signal> for SignalJson {
    fn from(s: &Signal) -> Self {
        Self {
            run_id: s.run_id.clone(),
            call_id: s.call_id.clone(),
            tool_name: s.tool_name.clone(),
            arguments_json: s.arguments_json.clone(),
            arguments_valid: s.arguments_valid,
            turn: s.turn,
            emitted_at_unix_ms: s.emitted_at_unix_ms,
            metadata: s.metadata.clone(),
            principal: s.principal.clone(),
        }
    }
}

impl From<SignalJson> for Signal {
    fn from(s: SignalJson) -> Self {
        Self {
            run_id: s.run_id,
            call_id: s.call_id,
            tool_name: s.tool_name,
            arguments_json: s.arguments_json,
            arguments_valid: s.arguments_valid,
            turn: s.turn,
            emitted_at_unix_ms: s.emitted_at_unix_ms,
            metadata: s.metadata,
            delivery: Delivery::Delivered,
            principal: s.principal,
        }
    }
}

/// Where signals go in JetStream and how hard publishing tries (the values of the
/// `--signal-*` settings).
#[derive(Debug, Clone)]
pub struct TopicOptions {
    /// Signals go to `<subject_prefix>.<tool_name>`.
    pub subject_prefix: String,
    /// The stream holding `<subject_prefix>.>`, created when missing.
    pub stream: String,
    /// How long the stream keeps signals.
    pub stream_max_age: Duration,
    /// Most bytes the stream keeps; -1 for no limit.
    pub stream_max_bytes: i64,
    /// A full stream drops its oldest signals (else it refuses new ones).
    pub discard_old: bool,
    /// Publish attempts after the first, before a signal is marked undelivered.
    pub publish_retries: u32,
    /// First delay between publish attempts, doubled each time.
    pub publish_backoff: Duration,
    /// How long one publish waits for JetStream's acknowledgement.
    pub ack_timeout: Duration,
    /// Copies JetStream keeps of the stream (`--nats-replicas`).
    pub replicas: usize,
}

/// See the module docs.
pub struct NatsTopic {
    stream: Arc<dyn Stream>,
    settings: TopicOptions,
}

impl NatsTopic {
    /// Binds (or creates) the stream for the prefix (`js` waits `settings.ack_timeout` for each
    /// answer).
    pub async fn open(js: &dyn JetStream, settings: TopicOptions) -> Result<Self, TopicError> {
        let config = StreamConfig {
            name: settings.stream.clone(),
            description: "orchestrator signals (exit tool calls)".to_owned(),
            subjects: vec![format!("{}.>", settings.subject_prefix)],
            max_age: settings.stream_max_age,
            max_bytes: u64::try_from(settings.stream_max_bytes).unwrap_or(0),
            discard_old: settings.discard_old,
            duplicate_window: Duration::from_secs(120),
            replicas: settings.replicas,
        };
        let stream = js.stream(config).await.map_err(|e| TopicError::Stream {
            stream: settings.stream.clone(),
            reason: e.to_string(),
        })?;
        Ok(Self { stream, settings })
    }
}

impl SignalTopic for NatsTopic {
    fn publish(&self, signal: &Signal, owner: Option<Ownership>, on_delivery: OnDelivery) {
        let subject = format!("{}.{}", self.settings.subject_prefix, signal.tool_name);
        let mut headers = vec![
            ("Orchestrator-Run-Id".to_owned(), signal.run_id.clone()),
            ("Orchestrator-Call-Id".to_owned(), signal.call_id.clone()),
        ];
        if let Some(traceparent) = shared::telemetry::current_traceparent() {
            headers.push(("traceparent".to_owned(), traceparent));
        }
        let id = format!("{}.{}", signal.run_id, signal.call_id);
        let payload: bytes::Bytes = match serde_json::to_vec(&SignalJson::from(signal)) {
            Ok(json) => json.into(),
            Err(e) => {
                tracing::error!("cannot encode a signal: {e}");
                on_delivery(Delivery::Undelivered);
                return;
            }
        };
        let (stream, settings) = (Arc::clone(&self.stream), self.settings.clone());
        let (run_id, call_id) = (signal.run_id.clone(), signal.call_id.clone());
        shared::tasks::spawn(async move {
            for attempt in 0..=settings.publish_retries {
                if attempt > 0 {
                    tokio::time::sleep(settings.publish_backoff.saturating_mul(1 << (attempt - 1).min(16))).await;
                }
                if owner.as_ref().is_some_and(|o| !o.may_log()) {
                    tracing::info!(run_id = %run_id, call_id = %call_id, attempt, "signal not published: this replica no longer acts for the run");
                    return;
                }
                let message = Publish {
                    subject: subject.clone(),
                    payload: payload.clone(),
                    id: Some(id.clone()),
                    after: None,
                    headers: headers.clone(),
                };
                let error = match tokio::time::timeout(settings.ack_timeout, stream.publish(message)).await {
                    Ok(Ok(_)) => {
                        on_delivery(Delivery::Delivered);
                        return;
                    }
                    Ok(Err(e)) => e.to_string(),
                    Err(_) => "no acknowledgement in time".to_owned(),
                };
                tracing::warn!(run_id = %run_id, call_id = %call_id, attempt, "publishing a signal to {subject} failed: {error}");
            }
            metrics::counter!(crate::telemetry::metric::SIGNALS_FAILED).increment(1);
            tracing::error!(run_id = %run_id, call_id = %call_id, "signal undelivered after {} attempts", settings.publish_retries + 1);
            on_delivery(Delivery::Undelivered);
        });
    }

    /// Read from the stream (an ordered consumer from the moment it is created), not from the
    /// subject: a publish retried after its acknowledgement was lost reaches the subject twice,
    /// but the stream keeps it once (its `Nats-Msg-Id`), so each signal is seen once.
    fn subscribe(&self, filter: SignalFilter) -> BoxFuture<'static, BoxStream<'static, SignalItem>> {
        let (stream, name, prefix) = (
            Arc::clone(&self.stream),
            self.settings.stream.clone(),
            self.settings.subject_prefix.clone(),
        );
        async move {
            let read = Read {
                filter: format!("{prefix}.>"),
                deliver: Deliver::New,
                headers_only: false,
                expires: None,
            };
            let messages = match stream.read(read).await {
                Ok(reading) => reading.messages,
                Err(e) => {
                    tracing::warn!("cannot subscribe to the signals of stream {name}: {e}");
                    return futures::stream::empty().boxed();
                }
            };
            messages
                .filter_map(move |message| {
                    let signal = match message {
                        Ok(message) => serde_json::from_slice::<SignalJson>(&message.payload)
                            .ok()
                            .map(Signal::from),
                        Err(e) => {
                            tracing::debug!("a signal subscription's consumer: {e}");
                            None
                        }
                    };
                    futures::future::ready(signal.filter(|s| filter.matches(s)).map(SignalItem::Signal))
                })
                .boxed()
        }
        .boxed()
    }
}
