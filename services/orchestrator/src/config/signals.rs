//! The signal topic: its backend, buffer, and JetStream stream.

use std::time::Duration;

use clap::Args;
use shared::config::{Bound, Bounded, bound, parse_duration};

use super::{Backend, DAY, ms, secs};

/// What a full signal stream gives up (see `--signal-stream-discard`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum StreamDiscard {
    /// Refuse new signals.
    New,
    /// Drop the oldest signals.
    Old,
}

/// The signal topic.
#[derive(Debug, Clone, Args)]
#[command(next_help_heading = "Signal topic")]
pub struct SignalSettings {
    /// Signal topic: memory, or nats://host:4222 (JetStream).
    #[arg(long = "signal-topic", env = "ORCHESTRATOR_SIGNAL_TOPIC", default_value = "memory")]
    pub topic: Backend,
    /// Signals buffered per SubscribeSignals subscriber (cap 1000000).
    #[arg(long = "signal-buffer", env = "ORCHESTRATOR_SIGNAL_BUFFER", default_value_t = 1024)]
    pub buffer: usize,
    /// NATS subject prefix: signals go to <prefix>.<tool_name>.
    #[arg(
        long = "signal-subject-prefix",
        env = "ORCHESTRATOR_SIGNAL_SUBJECT_PREFIX",
        default_value = "signals"
    )]
    pub subject_prefix: String,
    /// JetStream stream holding <prefix>.> (created when missing).
    #[arg(
        long = "signal-stream",
        env = "ORCHESTRATOR_SIGNAL_STREAM",
        default_value = "SIGNALS"
    )]
    pub stream: String,
    /// How long the stream keeps signals (cap 365d).
    #[arg(long = "signal-stream-max-age", env = "ORCHESTRATOR_SIGNAL_STREAM_MAX_AGE", default_value = "7d", value_parser = parse_duration)]
    pub stream_max_age: Duration,
    /// Most bytes the stream keeps; -1 for no limit.
    #[arg(long = "signal-stream-max-bytes", env = "ORCHESTRATOR_SIGNAL_STREAM_MAX_BYTES", default_value_t = 1 << 30, allow_negative_numbers = true)]
    pub stream_max_bytes: i64,
    /// What the stream does when full: `new` refuses new signals (they are marked undelivered in
    /// the run's result and counted, so nothing is lost unseen); `old` drops the oldest signals
    /// silently, consumed or not.
    #[arg(
        long = "signal-stream-discard",
        env = "ORCHESTRATOR_SIGNAL_STREAM_DISCARD",
        default_value = "new",
        value_enum
    )]
    pub stream_discard: StreamDiscard,
    /// Publish attempts after the first, before a signal is marked undelivered (cap 30).
    #[arg(
        long = "signal-publish-retries",
        env = "ORCHESTRATOR_SIGNAL_PUBLISH_RETRIES",
        default_value_t = 6
    )]
    pub publish_retries: u32,
    /// First delay between publish attempts, doubled each time (cap 1m).
    #[arg(long = "signal-publish-backoff", env = "ORCHESTRATOR_SIGNAL_PUBLISH_BACKOFF", default_value = "250ms", value_parser = parse_duration)]
    pub publish_backoff: Duration,
    /// How long one publish waits for JetStream's acknowledgement (cap 1m).
    #[arg(long = "signal-ack-timeout", env = "ORCHESTRATOR_SIGNAL_ACK_TIMEOUT", default_value = "5s", value_parser = parse_duration)]
    pub ack_timeout: Duration,
}

impl Bounded for SignalSettings {
    fn bounds(&self) -> Vec<Bound> {
        vec![
            bound("buffer", self.buffer, 1usize, 1_000_000usize),
            bound("stream_max_age", self.stream_max_age, secs(1), DAY * 365),
            bound("stream_max_bytes", self.stream_max_bytes, -1i64, i64::MAX),
            bound("publish_retries", self.publish_retries, 0u32, 30u32),
            bound("publish_backoff", self.publish_backoff, Duration::ZERO, secs(60)),
            bound("ack_timeout", self.ack_timeout, ms(10), secs(60)),
        ]
    }
}

impl From<&SignalSettings> for crate::signals::nats::TopicOptions {
    fn from(s: &SignalSettings) -> Self {
        Self {
            subject_prefix: s.subject_prefix.clone(),
            stream: s.stream.clone(),
            stream_max_age: s.stream_max_age,
            stream_max_bytes: s.stream_max_bytes,
            discard_old: match s.stream_discard {
                StreamDiscard::New => false,
                StreamDiscard::Old => true,
            },
            publish_retries: s.publish_retries,
            publish_backoff: s.publish_backoff,
            ack_timeout: s.ack_timeout,
            replicas: 1,
        }
    }
}
