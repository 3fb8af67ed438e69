//! The signal topic: where exit-tool calls (signals) are published and read back.
//!
//! Backends implement the [`SignalTopic`] port, a file each (`memory.rs`, `nats.rs`);
//! [`memory::MemoryTopic`] is the default (an in-process, bounded broadcast), [`nats::NatsTopic`]
//! publishes to NATS JetStream. Publishing never waits: the topic reports the outcome later through
//! the publisher's callback.
//!
//! [`SignalTopic`]: crate::domain::ports::SignalTopic

pub mod memory;
pub mod nats;

/// Why a signal topic cannot be opened.
#[derive(Debug, thiserror::Error)]
pub enum TopicError {
    /// JetStream refused to create or bind the stream.
    #[error("cannot create or bind the JetStream stream {stream:?}: {reason}")]
    Stream {
        /// The stream.
        stream: String,
        /// JetStream's answer.
        reason: String,
    },
}
