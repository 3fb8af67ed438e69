//! gRPC plumbing both services serve the same way.

use tonic_reflection::server::v1::{ServerReflection, ServerReflectionServer};

/// The reflection service (so `grpcurl` works without .proto files), knowing our contracts,
/// gRPC health and reflection itself.
pub fn reflection_service() -> Result<ServerReflectionServer<impl ServerReflection>, tonic_reflection::server::Error> {
    tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(proto::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_reflection::pb::v1::FILE_DESCRIPTOR_SET)
        .build_v1()
}
