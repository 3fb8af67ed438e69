//! A run: the tool loop and everything it is made of. Nothing here knows about gRPC or HTTP; the
//! loop talks to the model, the tool-runners and the signal topic through traits, so it is
//! unit-tested without a network.
//!
//! * [`tool_loop`]: the loop, one method per rule;
//! * [`live`]: a live run's shared state, cancel handle and event emitter;
//! * [`steering`]: user messages sent to a live run, waiting for its next turn boundary;
//! * [`chunks`]: the long strings and arrays of checkpoints and segments, kept once in the journal;
//! * [`persist`]: the run's writes to the store (claim, lease, checkpoints, final result), with
//!   [`backlog`]: final results the store did not take yet, written again until it does;
//! * [`turn`]: one streamed completion → visible text + tool calls;
//! * [`fallback`]: tool calls written in the text (`<tool_call>` blocks, standalone JSON);
//! * [`hold_back`]: what of a turn's text may be shown now, so streamed text equals final text;
//! * [`loop_detector`]: the repeated-line detector;
//! * [`bios`]: the system message the orchestrator writes at the top of a run's conversation, fixed
//!   for the run.

pub mod backlog;
pub mod bios;
pub mod chunks;
pub mod fallback;
pub mod hold_back;
pub mod live;
pub mod loop_detector;
pub mod persist;
pub mod steering;
pub mod tool_loop;
pub mod turn;

/// The live state of a run, shared with `GetRun`.
pub type SharedState = std::sync::Arc<std::sync::Mutex<crate::domain::RunResult>>;
