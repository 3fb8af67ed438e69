//! Conversations: messages sent to live runs (steering).

use clap::Args;
use shared::config::{Bound, Bounded, bound};

use super::{KIB, MIB};

/// Messages sent to live runs (`SendMessage`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Args)]
#[command(next_help_heading = "Conversations")]
pub struct ConversationSettings {
    /// Messages one run may be sent with SendMessage over its life; more get RESOURCE_EXHAUSTED
    /// (0: runs take none; cap 1000).
    #[arg(long, env = "ORCHESTRATOR_MAX_STEERING_MESSAGES", default_value_t = 16)]
    pub max_steering_messages: u32,
    /// Largest message sent to a run with SendMessage, in bytes of its text; a longer one gets
    /// INVALID_ARGUMENT (cap 1 MiB).
    #[arg(long, env = "ORCHESTRATOR_MAX_STEERING_MESSAGE_BYTES", default_value_t = 32 * KIB)]
    pub max_steering_message_bytes: usize,
}

impl Bounded for ConversationSettings {
    fn bounds(&self) -> Vec<Bound> {
        vec![
            bound("max_steering_messages", self.max_steering_messages, 0u32, 1000u32),
            bound(
                "max_steering_message_bytes",
                self.max_steering_message_bytes,
                1usize,
                MIB,
            ),
        ]
    }
}
