//! Compiles the .proto files with protox (pure Rust), so a build needs no system `protoc`.

use std::path::PathBuf;

const PROTOS: &[&str] = &[
    "orca/push/auth/v1/auth.proto",
    "orca/push/registry/v1/registry.proto",
    "orca/push/queue/v1/queue.proto",
];

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let root = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR")?);
    for proto in PROTOS {
        println!("cargo:rerun-if-changed={}", root.join(proto).display());
    }
    let descriptors = protox::compile(PROTOS, [&root])?;
    // Kept for gRPC server reflection, so grpcurl can list and call every service.
    let out = PathBuf::from(std::env::var("OUT_DIR")?);
    std::fs::write(
        out.join("descriptors.bin"),
        prost::Message::encode_to_vec(&descriptors),
    )?;
    // Every method path the protos declare, so a test can insist each one is classified read-only
    // or write in `access::METHODS` (a new rpc must be decided, not defaulted silently).
    let mut methods = String::from("&[\n");
    for file in &descriptors.file {
        for service in &file.service {
            for method in &service.method {
                methods.push_str(&format!(
                    "    \"/{}.{}/{}\",\n",
                    file.package(),
                    service.name(),
                    method.name()
                ));
            }
        }
    }
    methods.push_str("]\n");
    std::fs::write(out.join("declared_methods.rs"), methods)?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .compile_fds(descriptors)?;
    Ok(())
}
