//! Where run results are kept for `GetRun`: adapters of the [`ResultStore`] port, in memory (the
//! default, bounded by count and age) or in a NATS JetStream key-value bucket ([`nats::KvStore`]),
//! which several orchestrator replicas share and which survives restarts.
//!
//! A run writes its state at every turn boundary (live runs answer `RUN_STATUS_RUNNING` with
//! their output so far) and its final result before its stream's `run_finished`, through its
//! persister (`run::persist`).
//!
//! [`ResultStore`]: crate::domain::ports::ResultStore

pub mod memory;
pub mod nats;
