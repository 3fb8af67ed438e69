//! Where runs are kept: the adapters of the store's ports, one folder per backend — [`memory`] (the
//! default, bounded by count and age) and [`nats`] (NATS JetStream, which several orchestrator
//! replicas share and which survives restarts). Each backend has a file per port: `results.rs`
//! ([`ResultStore`], for `GetRun`), `log.rs` ([`EventLog`], for `AttachRun`), `approvals.rs`
//! ([`ApprovalStore`]), and for NATS `journal.rs` (`RunJournal`: durable runs) with `checkpoints.rs`.
//! A new backend is a new folder implementing the same ports; what both share is here
//! (the log follower; the `unavailable` error; the rules of a decision are the domain's,
//! `domain::approval::record_decisions`).
//!
//! A run writes its state at every turn boundary (live runs answer `RUN_STATUS_RUNNING` with
//! their output so far) and its final result before its stream's `run_finished`, through its
//! persister (`run::persist`).
//!
//! Each run's events are kept beside its result for `AttachRun` (the [`EventLog`] port): in memory
//! with the in-memory store ([`memory::MemoryLog`]), in a JetStream stream with the NATS store
//! ([`nats::NatsLog`]), bounded per run and kept as long as results are.
//!
//! Runs waiting for approvals are parked in an [`ApprovalStore`]: in this process with the
//! in-memory store ([`memory::MemoryApprovals`]), in NATS with the NATS store
//! ([`nats::NatsApprovals`], decided and resumed on any replica).
//!
//! [`ApprovalStore`]: crate::domain::ports::ApprovalStore
//! [`ResultStore`]: crate::domain::ports::ResultStore
//! [`EventLog`]: crate::domain::ports::EventLog

pub mod memory;
pub mod nats;

use std::time::Duration;

use futures::StreamExt;

use crate::domain::NumberedEvent;
use crate::domain::ports::{EventFeed, LogError};

/// A store operation NATS did not do (`operation` on `key`, and why): what every NATS adapter
/// answers for a request that failed or got no answer.
pub(crate) fn unavailable(
    operation: &'static str,
    key: &str,
    reason: impl ToString,
) -> crate::domain::ports::StoreError {
    crate::domain::ports::StoreError::Unavailable {
        operation,
        key: key.to_owned(),
        reason: reason.to_string(),
    }
}

/// Reads one run's log an event at a time, for one caller (the followers of both logs).
trait Follower: Send + Sized + 'static {
    /// The next event, an error that ends the feed, or `None` after `run_finished`.
    fn next(&mut self) -> impl Future<Output = Option<Result<NumberedEvent, LogError>>> + Send;

    /// The follower as the port's feed.
    fn into_feed(self) -> EventFeed {
        futures::stream::unfold(self, |mut this| async move {
            let item = this.next().await?;
            Some((item, this))
        })
        .boxed()
    }
}

/// How much of the runs' events a log keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LogBounds {
    /// Bytes of one run's events; past them its oldest events are dropped, so a re-attach from
    /// a recent seq still works while a replay from the start is refused.
    pub per_run_bytes: usize,
    /// Bytes of all runs' logs together (memory only): the oldest finished logs go first.
    pub total_bytes: usize,
    /// Finished runs' logs kept (memory only; like results).
    pub keep: usize,
    /// How long a finished run's log is kept (like its result).
    pub keep_for: Duration,
}
