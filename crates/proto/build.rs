//! Generates the gRPC code for both contracts in `proto/` and a file descriptor set for reflection.
//! `protoc` comes from `protoc-bin-vendored`, so building needs nothing but the Rust toolchain.

use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto_root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../proto");
    let protos = [
        proto_root.join("orchestrator/v1/orchestrator.proto"),
        proto_root.join("toolrunner/v1/tool_runner.proto"),
        // A2A 1.0's contract, vendored: the orchestrator serves it (`--a2a-listen`).
        proto_root.join("lf/a2a/v1/a2a.proto"),
    ];
    let out_dir = PathBuf::from(std::env::var("OUT_DIR")?);

    let mut config = tonic_prost_build::Config::new();
    config.protoc_executable(protoc_bin_vendored::protoc_bin_path()?);
    // Encoded in key order, so one run's result encodes the same bytes every time (a client
    // comparing what two attaches printed sees the same lines).
    config.btree_map([".orchestrator.v1.RunResult.request_digests"]);

    tonic_prost_build::configure()
        .codec_path("crate::codec::LeanCodec")
        .file_descriptor_set_path(out_dir.join("descriptor.bin"))
        .compile_with_config(config, &protos, std::slice::from_ref(&proto_root))?;

    for proto in &protos {
        println!("cargo:rerun-if-changed={}", proto.display());
    }
    Ok(())
}
