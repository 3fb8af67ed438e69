//! Code generated from `proto/` by `tonic-prost-build` (see `build.rs`).

#![allow(missing_docs, clippy::all, clippy::unwrap_used, clippy::expect_used)]

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
