//! The in-memory backend, the default: every port the store offers, kept in this process, bounded
//! by count and age, lost on restart, local to one replica (so runs are not durable with it).
//!
//! * [`results`]: the [`ResultStore`](crate::domain::ports::ResultStore) ([`MemoryStore`]);
//! * [`log`]: the [`EventLog`](crate::domain::ports::EventLog) ([`MemoryLog`]);
//! * [`approvals`]: the [`ApprovalStore`](crate::domain::ports::ApprovalStore) ([`MemoryApprovals`]);
//! * [`threads`]: the [`ThreadStore`](crate::domain::ports::ThreadStore) ([`MemoryThreads`]);
//! * [`usage`]: the [`UsageBook`](crate::domain::ports::UsageBook) ([`MemoryUsage`]);
//! * [`sign_outs`]: the [`SignOuts`](crate::domain::ports::SignOuts) ([`MemorySignOuts`]);
//! * [`bucket`]: a key-value bucket with the JetStream seam's semantics ([`MemoryBucket`]), where
//!   the webhooks keep their registrations and deliveries without NATS.

pub mod approvals;
pub mod bucket;
pub mod log;
pub mod results;
pub mod sign_outs;
pub mod threads;
pub mod usage;

pub use approvals::MemoryApprovals;
pub use bucket::MemoryBucket;
pub use log::MemoryLog;
pub use results::MemoryStore;
pub use sign_outs::MemorySignOuts;
pub use threads::MemoryThreads;
pub use usage::MemoryUsage;
