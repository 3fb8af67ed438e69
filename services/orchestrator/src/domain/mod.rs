//! The domain: the values a run is made of and the ports it talks through. A leaf: it depends on
//! nothing else in the crate, and everything else (the loop, the adapters, the gRPC mapping, the
//! configuration) depends on it.
//!
//! * [`chat`]: the conversation with the model (messages, tool calls, tool definitions, usage);
//! * [`model`]: the model port ([`model::ChatModel`]): a turn's request, the events its stream
//!   says, and why it failed;
//! * [`assembly`]: those events' tool-call fragments → whole tool calls, whatever the server's
//!   quirks;
//! * [`params`]: the model parameters of a run and their rules;
//! * [`ids`]: the one rule of every id a caller names (runs, threads, affinity keys);
//! * [`spec`]: what a run is asked to do ([`spec::RunSpec`], its limits, deadline and output bounds);
//! * [`result`]: what it produced ([`result::RunResult`], tool-call records, signals);
//! * [`event`]: the events of its stream;
//! * [`agent`]: the named agent a run took its definition from, and what a request may override;
//! * [`approval`]: calls that wait for a person's decision, and the decisions;
//! * [`input`]: questions a call asks a person before it can finish, and the answers;
//! * [`task`]: a call its tool's server runs as a task, and how often it is polled;
//! * [`cancel`]: how a run is asked to stop (at once, or after its turn);
//! * [`steering`]: a user message sent to a live run, and why a run refuses one;
//! * [`thread`]: conversations that continue across runs, their limits and busy policies;
//! * [`listing`]: finding runs (`ListRuns`): queries, rows, pages and their cursors, labels;
//! * [`usage`]: what each principal spends, per hour window, and its budget;
//! * [`share`]: fair shares of the run slots among the principals whose runs wait;
//! * [`rendezvous`]: which of several endpoints (or replicas) a key goes to first, stable as
//!   they come and go;
//! * [`visibility`]: who sees a run or a thread;
//! * [`webhook`]: where callers are told of their runs, and the rules of a delivery (payload,
//!   signature, backoff);
//! * [`ownership`]: a replica's lease on a durable run, measured on its own clock, and its stop;
//! * [`ports`]: the traits the loop needs ([`ports::ToolExecutor`], [`ports::ResultStore`],
//!   [`ports::SignalTopic`]) with their typed errors.

pub mod agent;
pub mod approval;
pub mod assembly;
pub mod cancel;
pub mod chat;
pub mod event;
pub mod ids;
pub mod input;
pub mod listing;
pub mod model;
pub mod ownership;
pub mod params;
pub mod ports;
pub mod rendezvous;
pub mod result;
pub mod share;
pub mod spec;
pub mod steering;
pub mod task;
pub mod thread;
pub mod usage;
pub mod visibility;
pub mod webhook;

pub use cancel::CancelMode;
pub use event::{Event, EventBatch, NumberedEvent};
pub use ownership::{Holding, LeaseTerms, Liveness, Ownership, Stop};
pub use result::{Delivery, FailureReason, RunResult, RunStatus, Signal, ToolCallError, ToolCallRecord};
pub use spec::{Deadline, HARD_MAX_TURNS, Limits, LoopDetection, OutputBounds, ParsePolicy, RunSpec};
