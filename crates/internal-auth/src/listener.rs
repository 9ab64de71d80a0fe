//! One gRPC listener for every service of an all-in-one process (`ORCA_PUSH_GRPC_ADDR` with
//! `orca-push serve`), for internal teams and SREs: each call goes to its service's in-process
//! server, behind that service's own caller check, so a token works here exactly as it does
//! against the split service. gRPC health is open; server reflection (v1, and the v1alpha older
//! grpcurl asks for) takes a token of any of the services.

use std::convert::Infallible;
use std::sync::Arc;
use std::task::{Context, Poll};

use crate::{InternalKey, LocalServer, RequireToken, incoming};

/// Serves `services` (each an audience with its in-process server) on `listener` until
/// `shutdown`, with health for each service name in `health_names` and reflection.
pub async fn serve_services(
    listener: tokio::net::TcpListener,
    key: InternalKey,
    services: Vec<(&'static str, LocalServer)>,
    health_names: &[&'static str],
    shutdown: tokio_util::sync::CancellationToken,
) -> Result<(), tonic::transport::Error> {
    let (reporter, health) = tonic_health::server::health_reporter();
    for name in health_names {
        reporter
            .set_service_status(*name, tonic_health::ServingStatus::Serving)
            .await;
    }
    let mut routes = tonic::service::Routes::new(health);
    match orca_push_proto::reflection_service() {
        Ok(reflection) => routes = routes.add_service(reflection),
        Err(error) => tracing::error!(%error, "gRPC reflection v1 unavailable"),
    }
    match orca_push_proto::reflection_service_v1alpha() {
        Ok(reflection) => routes = routes.add_service(reflection),
        Err(error) => tracing::error!(%error, "gRPC reflection v1alpha unavailable"),
    }
    let audiences: Vec<&'static str> = services.iter().map(|(audience, _)| *audience).collect();
    let common = LocalServer::checked_by(RequireToken::any_of(key, &audiences), routes);
    let dispatch = ByService {
        services: services
            .into_iter()
            .map(|(audience, server)| (format!("/orca.push.{audience}.v1."), server))
            .collect::<Vec<_>>()
            .into(),
        common,
    };
    let router = axum::Router::new().fallback_service(dispatch);
    tonic::transport::Server::builder()
        .http2_keepalive_interval(Some(crate::server::HTTP2_KEEPALIVE))
        .add_routes(tonic::service::Routes::from(router))
        .serve_with_incoming_shutdown(incoming(listener), shutdown.cancelled_owned())
        .await
}

/// Sends each call to the server of the service its path names; health, reflection and unknown
/// paths (answered UNIMPLEMENTED) to the common one.
#[derive(Clone)]
struct ByService {
    services: Arc<[(String, LocalServer)]>,
    common: LocalServer,
}

impl tower::Service<http::Request<axum::body::Body>> for ByService {
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = std::pin::Pin<
        Box<dyn Future<Output = Result<Self::Response, Infallible>> + Send + 'static>,
    >;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        // Each call clones its server and waits for it to be ready (`oneshot`).
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<axum::body::Body>) -> Self::Future {
        let path = request.uri().path();
        let server = self
            .services
            .iter()
            .find(|(prefix, _)| path.starts_with(prefix.as_str()))
            .map_or(&self.common, |(_, server)| server);
        let call = server.serve(request.map(tonic::body::Body::new));
        Box::pin(async move { Ok(call.await) })
    }
}
