//! The orchestrator: serves `Orchestrate` and runs LLM tool loops for other services.
//!
//! By role (docs/architecture.md opens with the map):
//! * [`domain`]: the domain, a leaf — a run's spec, result, events, approvals, ownership, and the
//!   ports the loop and the server talk through;
//! * [`run`] (module): the tool loop — nothing there knows about gRPC or HTTP;
//! * `registry`: the live runs of this replica — slots, admission, attach, cancel, steering;
//! * `agents`: the named agents of the agents file (`--agents`), reloaded when it changes;
//! * [`webhooks`]: where callers are told of their runs, and the durable outbox that tells them;
//! * [`threads`]: threads across runs: the keeper (changes by their rules on the thread store)
//!   and the busy policies;
//! * [`server`]: [`serve`] and a folder per role: the application core (`Core`, the operations
//!   every face calls), the background tasks (takeover, unparking, remote cancels and messages),
//!   the gRPC face (`server::grpc`) and the console's pages;
//! * the adapters of the ports: [`llm`] (the model fleet), [`tool_runners`] (the tool-runners'
//!   gRPC client), [`signals`] (the signal topic), [`store`] (results, event logs, approvals,
//!   threads, the journal of durable runs; a folder per backend);
//! * [`config`]: the settings, in sections; `error`: the crate's error and its gRPC codes;
//!   [`cli`]: the command line and its client commands (`call`, `get`, `cancel`, `runs`,
//!   `approvals`, `decide`, `answer`, `say`, `thread`, `usage`, `agents`); `telemetry`: span and
//!   metric names; `wire`: every mapping between the contract's messages and the domain (the gRPC
//!   answers, the events, what the NATS store keeps, and the contract's JSON for the CLI's
//!   `--json` and the console's pages).
//!   The NATS adapters reach JetStream only through the seam `shared::jetstream`, which the
//!   simulation replaces.

#![forbid(unsafe_code)]

pub(crate) mod agents;
pub mod cli;
pub mod config;
pub mod domain;
mod error;
pub mod llm;
pub(crate) mod registry;
pub mod run;
pub mod server;
pub mod signals;
pub mod store;
pub(crate) mod telemetry;
pub mod threads;
pub mod tool_runners;
pub mod webhooks;
pub(crate) mod wire;

/// The log filter when `RUST_LOG` is not set. The spans (`invoke_agent`, `chat`, `execute_tool`)
/// are at `info`, so they exist for every run as shipped.
pub const DEFAULT_LOG_FILTER: &str = "info";

pub use config::Config;
pub use error::Error;
pub use server::serve;
