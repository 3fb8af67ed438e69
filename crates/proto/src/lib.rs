//! The gRPC contracts of the orchestrator and the tool-runner, generated from `proto/` by
//! `tonic-prost-build` (see `build.rs`): messages, clients, servers, and the file descriptor set
//! that reflection serves. A service that calls `Orchestrate` depends on this crate alone.

#![allow(missing_docs, clippy::all, clippy::unwrap_used, clippy::expect_used)]

pub mod codec;

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
