//! The orchestrator: serves `Orchestrate` and runs LLM tool loops for other services.
//!
//! * [`run`] (module): the tool loop and its parts — nothing there knows about gRPC or HTTP;
//! * [`llm`]: the streaming client for OpenAI-compatible servers;
//! * [`tool_runners`]: the gRPC client of the tool-runners (balancing, catalog, execution);
//! * [`signals`]: the signal topic (exit-tool calls);
//! * [`store`]: where run results are kept;
//! * [`config`]: the settings, in sections; [`server`]: `serve(listener, config, shutdown)`;
//! * [`secrets`]: keeping credentials out of logs, spans, metrics and errors;
//! * [`cli`] / [`client`]: the command line and the `call` client.
//!
//! Inside, not API: the runs registry (`runs`), the gRPC adapter (`service`, `convert`), the
//! resumption of runs parked for approvals (`approvals`) and of runs taken over (`takeover`),
//! and span and metric names (`telemetry`). docs/architecture.md explains how they fit.

// Two unsafe places in the whole crate, allowed where they are (`llm::direct::socket`): setting
// SO_RCVLOWAT on the LLM connection's socket, which no safe socket crate offers, and reading it
// into a buffer without zeroing the buffer first, as the runtime's own read does.
#![deny(unsafe_code)]

pub(crate) mod approvals;
pub(crate) mod cancels;
pub mod cli;
pub mod client;
pub mod config;
pub(crate) mod convert;
pub mod domain;
mod error;
pub mod llm;
pub(crate) mod nats;
pub mod run;
pub(crate) mod runs;
pub mod secrets;
pub mod server;
pub(crate) mod service;
pub mod signals;
pub mod store;
pub(crate) mod takeover;
pub(crate) mod telemetry;
pub mod tool_runners;

/// The log filter when `RUST_LOG` is not set. The spans (`invoke_agent`, `chat`, `execute_tool`)
/// are at `info`, so they exist for every run as shipped.
pub const DEFAULT_LOG_FILTER: &str = "info";

pub use config::Config;
pub use error::Error;
pub use server::serve;
