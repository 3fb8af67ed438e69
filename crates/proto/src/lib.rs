//! The gRPC contracts of the orchestrator and the tool-runner (and A2A 1.0's, vendored), generated from `proto/` by
//! `tonic-prost-build` (see `build.rs`): messages, clients, servers, and the file descriptor set
//! that reflection serves. A service that calls `Orchestrate` depends on this crate alone.

#![allow(missing_docs, clippy::all, clippy::unwrap_used, clippy::expect_used)]

pub mod codec;

/// The response header of an `Orchestrate` call that replays a run which had ended under its id
/// (the call's retry): `log` (its events as logged, from seq 1) or `result` (its log no longer
/// holds it whole: its result as one delta each, then `run_finished`). Absent on a run started by
/// the call.
pub const REPLAY_HEADER: &str = "orchestrator-replay";

/// Encoded `FileDescriptorSet` of every contract, served by gRPC reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/descriptor.bin"));

/// `orchestrator.v1`: the Orchestrate contract.
pub mod orchestrator {
    /// Version 1 of the contract.
    pub mod v1 {
        tonic::include_proto!("orchestrator.v1");
    }
}

/// `toolrunner.v1`: the tool-runner contract.
pub mod toolrunner {
    /// Version 1 of the contract.
    pub mod v1 {
        tonic::include_proto!("toolrunner.v1");
    }
}

/// `lf.a2a.v1`: A2A 1.0, the agent-to-agent protocol the orchestrator serves on `--a2a-listen`
/// (its contract vendored as published, in `proto/lf/a2a/v1`).
pub mod lf {
    /// The A2A project's package.
    pub mod a2a {
        /// Version 1 of A2A.
        pub mod v1 {
            tonic::include_proto!("lf.a2a.v1");
        }
    }
}
