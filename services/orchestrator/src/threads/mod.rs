//! Threads, every rule of a conversation that goes on across runs outside the domain's own
//! (`domain::thread`: who holds a thread, its queue, its limits, what the model sees):
//!
//! * [`keeper`]: the thread keeper: each change read, applied and written compare-and-set, a
//!   run's messages joining its thread as it ends, `GetThread` and `DeleteThread`;
//! * [`busy`]: the busy policies: a run taking its thread before it is let in, waiting for it,
//!   interrupting or rolling back the run that holds it.

pub(crate) mod busy;
pub mod keeper;

pub(crate) use busy::Holders;
pub(crate) use keeper::Change;
pub use keeper::Keeper;
