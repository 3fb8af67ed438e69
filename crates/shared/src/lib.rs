//! What the orchestrator and the tool-runner share: the generated gRPC contracts (`proto`), the
//! file descriptor set for reflection, and small service plumbing (duration parsing with caps,
//! logging setup, the runtime, shutdown signals). Nothing service-specific lives here.

#![forbid(unsafe_code)]

pub mod config;
pub mod grpc;
pub mod metrics;
pub mod proto;
pub mod runtime;
pub mod shutdown;
pub mod telemetry;
pub mod tools;
