//! The runtime pieces the orchestrator and the tool-runner share: settings and their bounds,
//! telemetry and metrics, the process lifecycle (runtime, stop signals, drain, exit codes), gRPC
//! reflection. Nothing service-specific lives here; the contracts are the `proto` crate.

#![forbid(unsafe_code)]

pub mod auth;
pub mod config;
pub mod config_file;
pub mod dns;
pub mod egress;
pub mod fence;
pub mod grpc;
pub mod jetstream;
pub mod metrics;
pub mod nats;
pub mod runtime;
pub mod secrets;
pub mod serving;
pub mod shutdown;
pub mod sync;
pub mod tasks;
pub mod telemetry;
pub mod text;
pub mod tls;
pub mod tools;
