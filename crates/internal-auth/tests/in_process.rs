//! A service called in process runs behind the same caller check as over the network: a client
//! made by `channel_to` for a local server gets through with its in-process identity, and a call
//! that carries neither that identity nor a token is refused.

use orca_push_internal_auth::{InternalKey, LocalServer, Target, Transport, channel_to};
use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
use tonic_reflection::pb::v1::{ServerReflectionRequest, server_reflection_response};

fn local_server(key: &InternalKey) -> LocalServer {
    let (_health, health) = tonic_health::server::health_reporter();
    LocalServer::new(
        key.clone(),
        "queue",
        orca_push_internal_auth::service_routes(health),
    )
}

/// Lists services over reflection (a method behind the caller check).
async fn list_services<T>(
    client: &mut ServerReflectionClient<T>,
) -> Result<Vec<String>, tonic::Status>
where
    T: tonic::client::GrpcService<tonic::body::Body>,
    T::Error: Into<tonic::codegen::StdError>,
    T::ResponseBody: tonic::codegen::Body<Data = tonic::codegen::Bytes> + Send + 'static,
    <T::ResponseBody as tonic::codegen::Body>::Error: Into<tonic::codegen::StdError> + Send,
{
    let request = ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::ListServices(String::new())),
    };
    let mut answers = client
        .server_reflection_info(tokio_stream::iter([request]))
        .await?
        .into_inner();
    let answer = answers.message().await?.expect("one answer");
    match answer.message_response {
        Some(server_reflection_response::MessageResponse::ListServicesResponse(list)) => {
            Ok(list.service.into_iter().map(|s| s.name).collect())
        }
        other => panic!("unexpected reflection answer {other:?}"),
    }
}

#[tokio::test]
async fn an_in_process_caller_is_let_in_and_an_anonymous_call_is_refused() {
    let key = InternalKey::generate();
    let server = local_server(&key);

    let channel = channel_to(&Target::Local(server.clone()), &key, "facade", "queue").unwrap();
    let services = list_services(&mut ServerReflectionClient::new(channel))
        .await
        .expect("an in-process caller is let in");
    assert!(
        services.iter().any(|s| s == "grpc.health.v1.Health"),
        "{services:?}"
    );

    // The same server, called with neither a token nor the in-process identity.
    let anonymous = Transport::Local(server);
    let refused = list_services(&mut ServerReflectionClient::new(anonymous))
        .await
        .unwrap_err();
    assert_eq!(refused.code(), tonic::Code::Unauthenticated);
}

#[tokio::test]
async fn a_network_caller_with_another_keys_token_is_refused_in_process_too() {
    // A token is still checked when one is presented to a local server without the identity.
    let key = InternalKey::generate();
    let server = local_server(&key);
    let other = InternalKey::generate();
    let token = orca_push_internal_auth::mint(
        &other,
        "support",
        "queue",
        orca_push_internal_auth::Scope::Full,
        std::time::Duration::from_secs(60),
    );
    let mut client = ServerReflectionClient::with_interceptor(
        Transport::Local(server),
        move |mut request: tonic::Request<()>| {
            request
                .metadata_mut()
                .insert("authorization", format!("Bearer {token}").parse().unwrap());
            Ok(request)
        },
    );
    let refused = list_services(&mut client).await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::Unauthenticated);
}
