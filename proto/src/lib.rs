//! Wire types of every orca-push service: the generated prost messages and tonic clients and servers,
//! one module per proto package. Services use these types at their gRPC edge only.

pub mod auth {
    pub mod v1 {
        tonic::include_proto!("orca.push.auth.v1");
    }
}

pub mod queue {
    pub mod v1 {
        tonic::include_proto!("orca.push.queue.v1");
    }
}

pub mod registry {
    pub mod v1 {
        tonic::include_proto!("orca.push.registry.v1");
    }
}

/// Every orca-push proto, encoded, for server reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/descriptors.bin"));

/// The reflection service every server exposes: our protos and gRPC health.
pub fn reflection_service() -> Result<
    tonic_reflection::server::v1::ServerReflectionServer<
        impl tonic_reflection::server::v1::ServerReflection,
    >,
    tonic_reflection::server::Error,
> {
    tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1()
}

/// Metadata key carrying the contract's error code (`invalid_proof`, `session_expired`, ...) on a
/// failed call, so the facade can answer the exact public `{"error": ...}` without parsing messages.
pub const ERROR_CODE_METADATA: &str = "x-orca-error";

/// Builds a status whose message and `x-orca-error` metadata are the contract's error code.
pub fn status_with_code(code: tonic::Code, error_code: &'static str) -> tonic::Status {
    let mut status = tonic::Status::new(code, error_code);
    status.metadata_mut().insert(
        ERROR_CODE_METADATA,
        tonic::metadata::MetadataValue::from_static(error_code),
    );
    status
}

/// The contract error code a status carries, if any.
pub fn error_code(status: &tonic::Status) -> Option<&str> {
    status
        .metadata()
        .get(ERROR_CODE_METADATA)
        .and_then(|v| v.to_str().ok())
}
