//! What the orchestrator and the tool-runner share, in two kinds:
//!
//! * the platform both run on: settings and their bounds (`config`, `config_file`), telemetry and
//!   metrics, the process lifecycle (`runtime`, `shutdown`, `tasks`), serving (`serving`, `tls`,
//!   `grpc`), outgoing connections (`dns`, `egress`, `nats`, `jetstream`), and small helpers
//!   (`sync`, `text`, `secrets`);
//! * the rules of the protocol between them, which both must enforce alike, so they have one
//!   home: who is calling and what a principal may do (`auth`), the run fence a replaced owner's
//!   calls are refused by (`fence`), and valid tool names and argument schemas (`tools`).
//!
//! Nothing here belongs to one service alone; the contracts' messages are the `proto` crate.

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
