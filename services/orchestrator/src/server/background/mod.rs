//! The tasks a replica runs beside the requests it answers, each over the shared [`Core`]:
//!
//! * `takeover.rs`: takes over orphaned durable runs (a lease lapsed, a replica handed its runs
//!   over), at once when a hand-over is announced and on a timer otherwise;
//! * `unpark.rs`: goes on with parked runs whose calls were decided, on any replica;
//! * `remote_asks.rs`: answers cancels and messages asked on other replicas for runs live here.
//!
//! [`Core`]: super::Core

pub(super) mod remote_asks;
pub(super) mod takeover;
pub(super) mod unpark;
