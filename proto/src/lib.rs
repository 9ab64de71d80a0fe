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

/// Every method path of our own services, as their servers route them. Checked against the .proto
/// files by a test, so a new rpc cannot be forgotten here.
pub const SERVICE_METHODS: &[&str] = &[
    "/orca.push.auth.v1.AuthService/IssueChallenge",
    "/orca.push.auth.v1.AuthService/CreateSession",
    "/orca.push.auth.v1.AuthService/GetSessionKey",
    "/orca.push.auth.v1.AuthService/Authenticate",
    "/orca.push.registry.v1.RegistryService/RegisterDevice",
    "/orca.push.registry.v1.RegistryService/ListDevices",
    "/orca.push.registry.v1.RegistryService/DeleteDevice",
    "/orca.push.registry.v1.RegistryService/ResolveRegistrations",
    "/orca.push.registry.v1.RegistryService/GetDevicesForDelivery",
    "/orca.push.registry.v1.RegistryService/MarkDead",
    "/orca.push.registry.v1.RegistryService/HostsWithDevices",
    "/orca.push.queue.v1.QueueService/Enqueue",
    "/orca.push.queue.v1.QueueService/Claim",
    "/orca.push.queue.v1.QueueService/RenewLease",
    "/orca.push.queue.v1.QueueService/Complete",
    "/orca.push.queue.v1.QueueService/CompleteMany",
    "/orca.push.queue.v1.QueueService/Retry",
    "/orca.push.queue.v1.QueueService/GetEventOutcomes",
    "/orca.push.queue.v1.QueueService/GetQueueDepth",
    "/orca.push.queue.v1.QueueService/HoldProvider",
];

/// The standard services every server adds: gRPC health and server reflection (v1, the only
/// version `reflection_service` builds).
pub const STANDARD_METHODS: &[&str] = &[
    "/grpc.health.v1.Health/Check",
    "/grpc.health.v1.Health/Watch",
    "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
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
    }
}
