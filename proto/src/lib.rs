//! Wire types of every orca-push service: the generated prost messages and tonic clients and servers,
//! one module per proto package. Services use these types at their gRPC edge only.

pub mod convert;

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

/// Every method path of our own services, as their servers route them. Checked against the .proto
/// files by a test, so a new rpc cannot be forgotten here.
pub const SERVICE_METHODS: &[&str] = &[
    "/orca.push.auth.v1.AuthService/IssueChallenge",
    "/orca.push.auth.v1.AuthService/CreateSession",
    "/orca.push.auth.v1.AuthService/GetSessionKey",
    "/orca.push.auth.v1.AuthService/Authenticate",
    "/orca.push.auth.v1.AuthService/WatchSessions",
    "/orca.push.registry.v1.RegistryService/RegisterDevice",
    "/orca.push.registry.v1.RegistryService/ListDevices",
    "/orca.push.registry.v1.RegistryService/DeleteDevice",
    "/orca.push.registry.v1.RegistryService/ResolveRegistrations",
    "/orca.push.registry.v1.RegistryService/GetDevicesForDelivery",
    "/orca.push.registry.v1.RegistryService/MarkDead",
    "/orca.push.registry.v1.RegistryService/HostsWithDevices",
    "/orca.push.registry.v1.RegistryService/WatchDevices",
    "/orca.push.queue.v1.QueueService/Enqueue",
    "/orca.push.queue.v1.QueueService/EnqueueMany",
    "/orca.push.queue.v1.QueueService/Claim",
    "/orca.push.queue.v1.QueueService/RenewLease",
    "/orca.push.queue.v1.QueueService/Complete",
    "/orca.push.queue.v1.QueueService/CompleteMany",
    "/orca.push.queue.v1.QueueService/Retry",
    "/orca.push.queue.v1.QueueService/GetEventOutcomes",
    "/orca.push.queue.v1.QueueService/GetQueueDepth",
    "/orca.push.queue.v1.QueueService/HoldProvider",
];

/// The standard services servers add: gRPC health and server reflection (v1 on every server; the
/// v1alpha that older grpcurl speaks on the all-in-one listener).
pub const STANDARD_METHODS: &[&str] = &[
    "/grpc.health.v1.Health/Check",
    "/grpc.health.v1.Health/Watch",
    "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
    "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
];

/// Whether `path` is a method some orca-push server routes: metric labels name only these.
pub fn is_known_method(path: &str) -> bool {
    SERVICE_METHODS.contains(&path) || STANDARD_METHODS.contains(&path)
}

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

/// Server reflection v1alpha (what grpcurl before 1.8.8 asks), for the all-in-one listener.
pub fn reflection_service_v1alpha() -> Result<
    tonic_reflection::server::v1alpha::ServerReflectionServer<
        impl tonic_reflection::server::v1alpha::ServerReflection,
    >,
    tonic_reflection::server::Error,
> {
    tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1alpha()
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

/// A failed call's status as one call within a batch answers it (`RefusedCall` of
/// `EnqueueMany`), keeping its contract error code.
pub fn refused_call(status: &tonic::Status) -> queue::v1::RefusedCall {
    queue::v1::RefusedCall {
        code: status.code() as i32,
        message: status.message().to_owned(),
        error_code: error_code(status).map(str::to_owned),
    }
}

/// The status a `RefusedCall` stands for, as if its call had failed alone.
pub fn refused_status(refused: queue::v1::RefusedCall) -> tonic::Status {
    let mut status = tonic::Status::new(tonic::Code::from_i32(refused.code), refused.message);
    if let Some(value) = refused
        .error_code
        .and_then(|code| tonic::metadata::MetadataValue::try_from(code).ok())
    {
        status.metadata_mut().insert(ERROR_CODE_METADATA, value);
    }
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
        // The key that tags session tokens: for the facade only.
        ("/orca.push.auth.v1.AuthService/GetSessionKey", Write),
        // Which hosts log in, as they do: for the facade's session cache only.
        ("/orca.push.auth.v1.AuthService/WatchSessions", Write),
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
        // Which hosts change their phones, as they do: for the facade's resolve cache only.
        ("/orca.push.registry.v1.RegistryService/WatchDevices", Write),
        // Queue: admission and the sender's lease protocol write; the support look-ups read.
        ("/orca.push.queue.v1.QueueService/Enqueue", Write),
        ("/orca.push.queue.v1.QueueService/EnqueueMany", Write),
        ("/orca.push.queue.v1.QueueService/Claim", Write),
        ("/orca.push.queue.v1.QueueService/RenewLease", Write),
        ("/orca.push.queue.v1.QueueService/Complete", Write),
        ("/orca.push.queue.v1.QueueService/CompleteMany", Write),
        ("/orca.push.queue.v1.QueueService/Retry", Write),
        ("/orca.push.queue.v1.QueueService/HoldProvider", Write),
        ("/orca.push.queue.v1.QueueService/GetEventOutcomes", Read),
        ("/orca.push.queue.v1.QueueService/GetQueueDepth", Read),
        // Server reflection lists the API (what grpcurl needs to call anything).
        (
            "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
            Read,
        ),
        (
            "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
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

#[cfg(test)]
mod tests {
    use super::*;

    /// `/package.Service/Method` for every rpc the .proto files declare.
    fn declared_in_protos() -> Vec<String> {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
        let mut paths = Vec::new();
        for file in [
            "orca/push/auth/v1/auth.proto",
            "orca/push/registry/v1/registry.proto",
            "orca/push/queue/v1/queue.proto",
        ] {
            let text = std::fs::read_to_string(root.join(file)).expect("read proto");
            let word_after = |line: &str, keyword: &str| {
                line.trim().strip_prefix(keyword).map(|rest| {
                    rest.trim()
                        .split(|c: char| !(c.is_alphanumeric() || c == '_' || c == '.'))
                        .next()
                        .unwrap_or("")
                        .to_owned()
                })
            };
            let package = text
                .lines()
                .find_map(|l| word_after(l, "package "))
                .expect("package");
            let mut service = String::new();
            for line in text.lines() {
                if let Some(name) = word_after(line, "service ") {
                    service = name;
                } else if let Some(method) = word_after(line, "rpc ") {
                    paths.push(format!("/{package}.{service}/{method}"));
                }
            }
        }
        paths
    }

    #[test]
    fn the_method_table_is_exactly_what_the_protos_declare() {
        let mut declared = declared_in_protos();
        let mut table: Vec<String> = SERVICE_METHODS.iter().map(|m| m.to_string()).collect();
        declared.sort();
        table.sort();
        assert_eq!(table, declared);
    }

    #[test]
    fn every_routed_method_is_known_and_nothing_else() {
        for path in [
            "/orca.push.auth.v1.AuthService/Authenticate",
            "/orca.push.registry.v1.RegistryService/RegisterDevice",
            "/orca.push.queue.v1.QueueService/CompleteMany",
            "/grpc.health.v1.Health/Check",
        ] {
            assert!(is_known_method(path), "{path}");
        }
        for path in [
            "/orca.push.auth.v1.AuthService/Nope",
            "/orca.push.auth.v1.AuthService",
            "orca.push.auth.v1.AuthService/Authenticate",
            "/x/y",
            "",
        ] {
            assert!(!is_known_method(path), "{path}");
        }
    }

    /// The hand-written standard paths are the ones the health and reflection servers route.
    #[test]
    fn the_standard_paths_match_their_servers() {
        use tonic::server::NamedService as _;
        type Health =
            tonic_health::pb::health_server::HealthServer<tonic_health::server::HealthService>;
        assert!(STANDARD_METHODS[0].starts_with(&format!("/{}/", Health::NAME)));
        assert!(STANDARD_METHODS[1].starts_with(&format!("/{}/", Health::NAME)));
        type Reflection = tonic_reflection::server::v1::ServerReflectionServer<
            tonic_reflection::server::v1::ReflectionService,
        >;
        assert!(STANDARD_METHODS[2].starts_with(&format!("/{}/", Reflection::NAME)));
        type ReflectionAlpha = tonic_reflection::server::v1alpha::ServerReflectionServer<
            tonic_reflection::server::v1alpha::ReflectionService,
        >;
        assert!(STANDARD_METHODS[3].starts_with(&format!("/{}/", ReflectionAlpha::NAME)));
    }
}
