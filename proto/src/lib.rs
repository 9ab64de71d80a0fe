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
///
/// A service's own refusals always carry it. UNAUTHENTICATED or PERMISSION_DENIED without it is the
/// internal token refused (see `orca-push-internal-auth`): a fault between services, never the
/// host's.
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

/// Which internal methods only read, for internal tokens of read-only scope (internal teams,
/// support, SREs). One table for every service, next to the protos it classifies; a method not in
/// it (a new rpc, or a path nobody declared) counts as a write.
pub mod access {
    /// What a method does, as far as internal tokens are concerned.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum Access {
        /// Reads state without changing it, and reveals no secret (no push token, no session).
        Read,
        /// Changes state, or reveals what a read-only caller must not see.
        Write,
    }

    use Access::{Read, Write};

    /// Every method of every service, by gRPC path. Health is not here: it is open to everyone.
    pub const METHODS: &[(&str, Access)] = &[
        // Auth: every method writes (challenges, sessions, last contact) or resolves a host's
        // bearer, which is a credential check, not a look-up.
        ("/orca.push.auth.v1.AuthService/IssueChallenge", Write),
        ("/orca.push.auth.v1.AuthService/CreateSession", Write),
        ("/orca.push.auth.v1.AuthService/Authenticate", Write),
        // Registry: look-ups that show platform and state, never a push token, are reads.
        (
            "/orca.push.registry.v1.RegistryService/RegisterDevice",
            Write,
        ),
        ("/orca.push.registry.v1.RegistryService/ListDevices", Read),
        ("/orca.push.registry.v1.RegistryService/DeleteDevice", Write),
        (
            "/orca.push.registry.v1.RegistryService/ResolveRegistrations",
            Read,
        ),
        // Answers every phone's native push token: for the sender only.
        (
            "/orca.push.registry.v1.RegistryService/GetDevicesForDelivery",
            Write,
        ),
        ("/orca.push.registry.v1.RegistryService/MarkDead", Write),
        (
            "/orca.push.registry.v1.RegistryService/HostsWithDevices",
            Read,
        ),
        // Queue: admission and the sender's lease protocol write; the support look-ups read.
        ("/orca.push.queue.v1.QueueService/Enqueue", Write),
        ("/orca.push.queue.v1.QueueService/Claim", Write),
        ("/orca.push.queue.v1.QueueService/RenewLease", Write),
        ("/orca.push.queue.v1.QueueService/Complete", Write),
        ("/orca.push.queue.v1.QueueService/CompleteMany", Write),
        ("/orca.push.queue.v1.QueueService/Retry", Write),
        ("/orca.push.queue.v1.QueueService/GetEventOutcomes", Read),
        ("/orca.push.queue.v1.QueueService/GetQueueDepth", Read),
        // Server reflection lists the API (what grpcurl needs to call anything).
        (
            "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
            Read,
        ),
    ];

    /// Every method path the protos declare (generated from them at build time).
    pub const DECLARED: &[&str] = include!(concat!(env!("OUT_DIR"), "/declared_methods.rs"));

    /// What the method at `path` (`/package.Service/Method`) does; unknown paths are writes.
    pub fn of(path: &str) -> Access {
        METHODS
            .iter()
            .find(|(method, _)| *method == path)
            .map_or(Write, |(_, access)| *access)
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn every_declared_method_is_classified_once() {
            for method in DECLARED {
                let entries = METHODS.iter().filter(|(m, _)| m == method).count();
                assert_eq!(entries, 1, "{method}: classify it in access::METHODS");
            }
            for (method, _) in METHODS {
                assert!(
                    DECLARED.contains(method) || method.starts_with("/grpc.reflection."),
                    "{method} is not declared by any proto"
                );
            }
        }

        #[test]
        fn unknown_methods_and_push_tokens_are_writes() {
            assert_eq!(of("/orca.push.queue.v1.QueueService/GetQueueDepth"), Read);
            assert_eq!(
                of("/orca.push.registry.v1.RegistryService/ListDevices"),
                Read
            );
            assert_eq!(
                of("/orca.push.registry.v1.RegistryService/GetDevicesForDelivery"),
                Write
            );
            assert_eq!(of("/orca.push.queue.v1.QueueService/Enqueue"), Write);
            assert_eq!(of("/orca.push.queue.v1.QueueService/Purge"), Write);
            assert_eq!(of("/orca.push.queue.v1.QueueService/GetQueueDepth/"), Write);
            assert_eq!(of(""), Write);
        }
    }
}
