//! Threads that continue across runs, and messages sent to live runs (steering).

use std::time::Duration;

use clap::Args;
use shared::config::{Bound, Bounded, bound, parse_duration};

use super::{DAY, KIB, MIB, secs};
use crate::domain::thread::ThreadLimits;

/// Threads (`OrchestrateRequest.thread_id`) and messages sent to live runs (`SendMessage`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Args)]
#[command(next_help_heading = "Threads and steering")]
pub struct ThreadSettings {
    /// Messages one run may be sent with SendMessage over its life; more get RESOURCE_EXHAUSTED
    /// (0: runs take none; cap 1000).
    #[arg(long, env = "ORCHESTRATOR_MAX_STEERING_MESSAGES", default_value_t = 16)]
    pub max_steering_messages: u32,
    /// Largest message sent to a run with SendMessage, in bytes of its text; a longer one gets
    /// INVALID_ARGUMENT (cap 1 MiB).
    #[arg(long, env = "ORCHESTRATOR_MAX_STEERING_MESSAGE_BYTES", default_value_t = 32 * KIB)]
    pub max_steering_message_bytes: usize,
    /// Runs a thread keeps; past it the oldest run's turns are dropped (cap 10000).
    #[arg(long, env = "ORCHESTRATOR_THREAD_MAX_RUNS", default_value_t = 100)]
    pub thread_max_runs: usize,
    /// Bytes of messages a thread keeps; past it whole turns are dropped from the oldest (cap
    /// 384 KiB, so a thread fits one NATS message of the default 1 MiB limit).
    #[arg(long, env = "ORCHESTRATOR_THREAD_MAX_BYTES", default_value_t = 256 * KIB)]
    pub thread_max_bytes: usize,
    /// A thread unchanged for this long expires (cap 365d).
    #[arg(long, env = "ORCHESTRATOR_THREAD_MAX_AGE", default_value = "30d", value_parser = parse_duration)]
    pub thread_max_age: Duration,
    /// Runs waiting for one thread at once (on_busy enqueue, interrupt, rollback); more get
    /// RESOURCE_EXHAUSTED (cap 256).
    #[arg(long, env = "ORCHESTRATOR_THREAD_QUEUE", default_value_t = 8)]
    pub thread_queue: usize,
    /// Threads kept by the memory store; a new one pushes out the least recently changed one no
    /// run holds (cap 1000000).
    #[arg(long, env = "ORCHESTRATOR_MAX_THREADS", default_value_t = 10_000)]
    pub max_threads: usize,
}

impl ThreadSettings {
    /// A thread's bounds.
    pub fn thread_limits(&self) -> ThreadLimits {
        ThreadLimits {
            max_runs: self.thread_max_runs,
            max_bytes: self.thread_max_bytes,
            max_queue: self.thread_queue,
        }
    }
}

impl Bounded for ThreadSettings {
    fn bounds(&self) -> Vec<Bound> {
        vec![
            bound("max_steering_messages", self.max_steering_messages, 0u32, 1000u32),
            bound(
                "max_steering_message_bytes",
                self.max_steering_message_bytes,
                1usize,
                MIB,
            ),
            bound("thread_max_runs", self.thread_max_runs, 1usize, 10_000usize),
            bound("thread_max_bytes", self.thread_max_bytes, KIB, 384 * KIB),
            bound("thread_max_age", self.thread_max_age, secs(3600), DAY * 365),
            bound("thread_queue", self.thread_queue, 0usize, 256usize),
            bound("max_threads", self.max_threads, 1usize, 1_000_000usize),
        ]
    }
}
