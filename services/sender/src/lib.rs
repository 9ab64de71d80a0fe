//! The sender service: delivery lanes to APNs and FCM.
//!
//! For now it runs as a real tonic server answering gRPC health checks only; its API arrives with
//! the issue that needs it.

use tokio_util::sync::CancellationToken;

/// The name this service reports its health under ("" is the server as a whole).
pub const HEALTH_NAME: &str = "";

/// Runs the sender gRPC server on `listener` until `shutdown` fires.
pub async fn serve(
    listener: tokio::net::TcpListener,
    shutdown: CancellationToken,
) -> Result<(), tonic::transport::Error> {
    let (_health, health_service) = tonic_health::server::health_reporter();
    tonic::transport::Server::builder()
        .layer(orca_push_telemetry::GrpcServerLayer::new())
        .add_service(health_service)
        .serve_with_incoming_shutdown(
            tokio_stream::wrappers::TcpListenerStream::new(listener),
            shutdown.cancelled_owned(),
        )
        .await
}
