//! The orchestrator: serves `Orchestrate` and runs LLM tool loops for other services.
//!
//! * [`run`] (module): the tool loop and its parts — nothing there knows about gRPC or HTTP;
//! * [`llm`]: the streaming client for OpenAI-compatible servers;
//! * [`tool_runners`]: the gRPC client of the tool-runners (balancing, catalog, execution);
//! * [`signals`]: the signal topic (exit-tool calls);
//! * [`runs`]: run slots, live runs, kept results;
//! * [`service`] / [`convert`]: the gRPC adapter; [`server`]: `run(listener, config, shutdown)`;
//! * [`cli`] / [`client`] / [`demo`]: flags, the `call` client and the one-command demo.

#![forbid(unsafe_code)]

pub mod cli;
pub mod client;
pub mod config;
pub mod convert;
pub mod demo;
mod error;
pub mod llm;
pub mod pool;
pub mod run;
pub mod runs;
pub mod server;
pub mod service;
pub mod signals;
pub mod store;
pub mod telemetry;
pub mod tool_runners;

pub use config::Config;
pub use error::Error;
pub use server::run;
