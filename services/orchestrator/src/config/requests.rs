//! How much one `Orchestrate` request may carry besides its byte size.

use clap::Args;
use shared::config::{Bound, Bounded, bound};

use super::{KIB, MIB};

/// How much one `Orchestrate` request may carry besides its byte size (`--max-request-bytes`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Args)]
pub struct RequestBounds {
    /// Messages in one request (1..=100000).
    #[arg(long, env = "ORCHESTRATOR_MAX_MESSAGES", default_value_t = 1000)]
    pub max_messages: usize,
    /// Exit tools one request may define (0..=1024).
    #[arg(long, env = "ORCHESTRATOR_MAX_REQUEST_EXIT_TOOLS", default_value_t = 64)]
    pub max_request_exit_tools: usize,
    /// Metadata entries in one request; they travel with every tool call and signal (0..=1024).
    #[arg(long, env = "ORCHESTRATOR_MAX_METADATA_ENTRIES", default_value_t = 64)]
    pub max_metadata_entries: usize,
    /// Bytes of metadata keys and values in one request (0..=1 MiB).
    #[arg(long, env = "ORCHESTRATOR_MAX_METADATA_BYTES", default_value_t = 16 * KIB)]
    pub max_metadata_bytes: usize,
    /// Labels of one run (what ListRuns finds it by); each is kept in the run's index entry and
    /// record (0..=64).
    #[arg(long, env = "ORCHESTRATOR_MAX_LABELS", default_value_t = 16)]
    pub max_labels: usize,
    /// Bytes of one label's value (1..=1024).
    #[arg(long, env = "ORCHESTRATOR_MAX_LABEL_BYTES", default_value_t = 256)]
    pub max_label_bytes: usize,
}

impl Bounded for RequestBounds {
    fn bounds(&self) -> Vec<Bound> {
        vec![
            bound("max_messages", self.max_messages, 1usize, 100_000usize),
            bound("max_request_exit_tools", self.max_request_exit_tools, 0usize, 1024usize),
            bound("max_metadata_entries", self.max_metadata_entries, 0usize, 1024usize),
            bound("max_metadata_bytes", self.max_metadata_bytes, 0usize, MIB),
            bound("max_labels", self.max_labels, 0usize, 64usize),
            bound("max_label_bytes", self.max_label_bytes, 1usize, 1024usize),
        ]
    }
}
