//! The tool-runner: a stateless gRPC service that lists and runs tools for the orchestrator.
//!
//! * [`tools`]: the tool sources — [`tools::builtin`] and manifest-declared [`tools::command`] tools;
//! * [`catalog`]: lookup, argument limits, JSON Schema validation and timeouts for every call;
//! * [`service`]: the gRPC adapter (`ListTools`, `RunTool`);
//! * [`admission`]: the concurrency limit and drain refusals, as a tower layer;
//! * [`fence`]: the refusal of a replaced orchestrator replica's call, read from the run store;
//! * [`record`]: a durable call's record in the run store, so that a call sent again runs once;
//! * [`server`]: [`serve`]`(listener, config, shutdown)`, which tests call with a port-0 listener;
//! * [`cli`]: flags (with environment equivalents) and the `list` / `call` client commands;
//! * `config`: the settings and their bounds; `error`: the crate's error and its gRPC codes;
//!   `telemetry`: span attributes and metric names.

#![forbid(unsafe_code)]

pub mod admission;
pub mod catalog;
pub mod cli;
pub mod config;
mod error;
pub mod fence;
pub mod record;
pub mod server;
pub mod service;
pub mod telemetry;
pub mod tools;

pub use config::Config;
pub use error::Error;
pub use server::serve;
