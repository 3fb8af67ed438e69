//! The NATS JetStream backend: every port the store offers, shared by the orchestrator replicas and
//! kept across restarts, so runs are durable with it.
//!
//! * [`results`]: the [`ResultStore`](crate::domain::ports::ResultStore) — one key-value record
//!   per run: its result, owner and lease ([`KvStore`]);
//! * [`journal`]: the [`RunJournal`](crate::domain::ports::RunJournal) on the same [`KvStore`] —
//!   claims, checkpoints, takeover, hand-over, cancels asked of other replicas;
//! * [`checkpoints`]: the checkpoint objects the journal names (an object-store bucket);
//! * `segments`: the transcript segments checkpoints name instead of holding (a stream per
//!   shard, a subject per run);
//! * `kv`: what the key-value adapters share (subject tokens, conditional writes);
//! * `incarnation`: this process's incarnation — the one lease record that holds all its runs —
//!   and the keeper that renews it;
//! * `owners`: the indexes that find orphans (runs by incarnation, parked runs by wake minute),
//!   read by `finder`, one look for orphans;
//! * `fence`: a run's fence (the newest epoch it was claimed in, which the tool-runners read),
//!   raised by a takeover before it acts;
//! * [`index`]: the [`RunIndex`](crate::domain::ports::RunIndex) — a JetStream stream with an
//!   entry per claimed run, walked newest first by principal and thread ([`NatsIndex`]);
//! * [`log`]: the [`EventLog`](crate::domain::ports::EventLog) — a JetStream stream ([`NatsLog`]);
//! * [`approvals`]: the [`ApprovalStore`](crate::domain::ports::ApprovalStore) — a key-value bucket
//!   ([`NatsApprovals`]), decided and resumed on any replica;
//! * [`quotas`]: the [`Quotas`](crate::domain::ports::Quotas) — each principal's run slots
//!   across the fleet, a key-value bucket ([`NatsQuotas`]);
//! * [`usage`]: the [`UsageBook`](crate::domain::ports::UsageBook) — each principal's spend per
//!   hour, a key-value bucket ([`NatsUsage`]);
//! * [`threads`]: the [`ThreadStore`](crate::domain::ports::ThreadStore) — a key-value bucket
//!   ([`NatsThreads`]), one record per thread, compare-and-set;
//! * [`inspect`]: what the store keeps, read from outside the adapters (the simulation's checks);
//! * [`sign_outs`]: the [`SignOuts`](crate::domain::ports::SignOuts) — console sessions people
//!   ended, a key-value bucket ([`NatsSignOuts`]);
//! * [`webhooks`]: the webhooks' registrations and outbox, two key-value buckets.

pub mod approvals;
pub(crate) mod checkpoints;
mod fence;
mod finder;
mod incarnation;
pub mod index;
pub mod inspect;
pub mod journal;
pub(crate) mod kv;
pub mod log;
mod owners;
pub mod quotas;
pub mod results;
mod segments;
pub mod sign_outs;
pub mod threads;
pub mod usage;
pub mod webhooks;

pub use approvals::NatsApprovals;
pub use index::NatsIndex;
pub use log::{NatsLog, NatsLogOptions};
pub use quotas::NatsQuotas;
pub use results::{KvStore, Shape};
pub use sign_outs::NatsSignOuts;
pub use threads::NatsThreads;
pub use usage::NatsUsage;
