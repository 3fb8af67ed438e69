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

use std::time::Duration;

use async_nats::jetstream;
use futures::future::BoxFuture;
use futures::stream::BoxStream;
use futures::{FutureExt, StreamExt};
use serde::{Deserialize, Serialize};

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
    /// What a full stream gives up.
    pub stream_discard: jetstream::stream::DiscardPolicy,
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
    js: jetstream::Context,
    settings: TopicOptions,
}

impl NatsTopic {
    /// Binds (or creates) the stream for the prefix.
    pub async fn open(client: async_nats::Client, settings: TopicOptions) -> Result<Self, TopicError> {
        let js = jetstream::context::ContextBuilder::new()
            .timeout(settings.ack_timeout)
            .build(client.clone());
        let config = jetstream::stream::Config {
            name: settings.stream.clone(),
            subjects: vec![format!("{}.>", settings.subject_prefix)],
            max_age: settings.stream_max_age,
            max_bytes: settings.stream_max_bytes,
            discard: settings.stream_discard,
            duplicate_window: Duration::from_secs(120),
            storage: jetstream::stream::StorageType::File,
            num_replicas: settings.replicas,
            ..Default::default()
        };
        crate::nats::ensure_stream(&js, config)
            .await
            .map_err(|reason| TopicError::Stream {
                stream: settings.stream.clone(),
                reason,
            })?;
        Ok(Self { js, settings })
    }

    /// The JetStream context (for tests and tools).
    pub fn jetstream(&self) -> &jetstream::Context {
        &self.js
    }
}

/// The signals stored in `stream` under `<prefix>.>` from now on, each once, in order.
async fn ordered_messages(
    js: &jetstream::Context,
    stream: &str,
    prefix: &str,
) -> Result<jetstream::consumer::pull::Ordered, String> {
    let stream = js.get_stream(stream).await.map_err(|e| e.to_string())?;
    let consumer = stream
        .create_consumer(jetstream::consumer::pull::OrderedConfig {
            filter_subject: format!("{prefix}.>"),
            deliver_policy: jetstream::consumer::DeliverPolicy::New,
            ..Default::default()
        })
        .await
        .map_err(|e| e.to_string())?;
    consumer.messages().await.map_err(|e| e.to_string())
}

impl SignalTopic for NatsTopic {
    fn publish(&self, signal: &Signal, owner: Option<Ownership>, on_delivery: OnDelivery) {
        let subject = format!("{}.{}", self.settings.subject_prefix, signal.tool_name);
        let mut headers = async_nats::HeaderMap::new();
        headers.insert(
            async_nats::header::NATS_MESSAGE_ID,
            format!("{}.{}", signal.run_id, signal.call_id).as_str(),
        );
        headers.insert("Orchestrator-Run-Id", signal.run_id.as_str());
        headers.insert("Orchestrator-Call-Id", signal.call_id.as_str());
        if let Some(traceparent) = shared::telemetry::current_traceparent() {
            headers.insert("traceparent", traceparent.as_str());
        }
        let payload: bytes::Bytes = match serde_json::to_vec(&SignalJson::from(signal)) {
            Ok(json) => json.into(),
            Err(e) => {
                tracing::error!("cannot encode a signal: {e}");
                on_delivery(Delivery::Undelivered);
                return;
            }
        };
        let (js, settings) = (self.js.clone(), self.settings.clone());
        let (run_id, call_id) = (signal.run_id.clone(), signal.call_id.clone());
        tokio::spawn(async move {
            for attempt in 0..=settings.publish_retries {
                if attempt > 0 {
                    tokio::time::sleep(settings.publish_backoff.saturating_mul(1 << (attempt - 1).min(16))).await;
                }
                if owner.as_ref().is_some_and(|o| !o.may_log()) {
                    tracing::info!(run_id = %run_id, call_id = %call_id, attempt, "signal not published: this replica no longer acts for the run");
                    return;
                }
                let error = match js
                    .publish_with_headers(subject.clone(), headers.clone(), payload.clone())
                    .await
                {
                    Ok(ack) => match tokio::time::timeout(settings.ack_timeout, ack).await {
                        Ok(Ok(_)) => {
                            on_delivery(Delivery::Delivered);
                            return;
                        }
                        Ok(Err(e)) => e.to_string(),
                        Err(_) => "no acknowledgement in time".to_owned(),
                    },
                    Err(e) => e.to_string(),
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
        let (js, stream, prefix) = (
            self.js.clone(),
            self.settings.stream.clone(),
            self.settings.subject_prefix.clone(),
        );
        async move {
            let messages = match ordered_messages(&js, &stream, &prefix).await {
                Ok(messages) => messages,
                Err(e) => {
                    tracing::warn!("cannot subscribe to the signals of stream {stream}: {e}");
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
