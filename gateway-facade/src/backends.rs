//! The gRPC clients the facade calls, one per service, each on a traced channel.

use std::sync::Arc;
use std::time::Duration;

use orca_push_internal_auth::{InternalChannel, InternalKey, Target};
use orca_push_proto::auth::v1::auth_service_client::AuthServiceClient;
use orca_push_proto::queue::v1 as queue_pb;
use orca_push_proto::queue::v1::queue_service_client::QueueServiceClient;
use orca_push_proto::registry::v1::registry_service_client::RegistryServiceClient;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

use crate::enqueues::Enqueues;
use crate::resolves::ResolvedHosts;

/// One service as the facade sees it: its client channel and the name its health is reported under.
#[derive(Clone)]
pub struct ServiceEndpoint {
    pub name: &'static str,
    /// The gRPC health service name to check ("" for the server as a whole).
    pub health_name: &'static str,
    pub channel: InternalChannel,
}

impl ServiceEndpoint {
    /// A channel to `target` (lazily connecting for a URL, so services may start in any order).
    /// Calls carry the facade's identity for `name`.
    pub fn connect(
        name: &'static str,
        health_name: &'static str,
        target: &Target,
        key: &InternalKey,
    ) -> Result<Self, tonic::transport::Error> {
        Ok(Self {
            name,
            health_name,
            channel: orca_push_internal_auth::channel_to(target, key, "facade", name)?,
        })
    }

    /// True when the service answers its health check with SERVING.
    pub async fn is_serving(&self) -> bool {
        let mut client = HealthClient::new(self.channel.clone());
        let request = tonic::Request::new(HealthCheckRequest {
            service: self.health_name.to_owned(),
        });
        match tokio::time::timeout(Duration::from_secs(2), client.check(request)).await {
            Ok(Ok(response)) => response.into_inner().status == ServingStatus::Serving as i32,
            Ok(Err(status)) => {
                tracing::warn!(service = self.name, code = ?status.code(), "health check failed");
                false
            }
            Err(_) => {
                tracing::warn!(service = self.name, "health check timed out");
                false
            }
        }
    }
}

/// The facade's view of the four services.
#[derive(Clone)]
pub struct Backends {
    pub auth: AuthServiceClient<InternalChannel>,
    pub registry: RegistryServiceClient<InternalChannel>,
    pub queue: QueueServiceClient<InternalChannel>,
    /// Sends to a queue across a socket, several to a call (`crate::enqueues`); `None` when the
    /// queue is in this process, where a call costs no socket.
    pub enqueues: Option<Enqueues>,
    /// Every service `/ready` checks.
    pub endpoints: Vec<ServiceEndpoint>,
    /// What sends resolved (`crate::resolves`).
    pub resolves: Arc<ResolvedHosts>,
}

/// Where each service lives: in this process, or at a URL.
#[derive(Clone)]
pub struct BackendTargets {
    pub auth: Target,
    pub registry: Target,
    pub queue: Target,
    pub sender: Target,
}

impl Backends {
    pub fn connect(
        urls: &BackendTargets,
        key: &InternalKey,
    ) -> Result<Self, tonic::transport::Error> {
        let auth = ServiceEndpoint::connect("auth", orca_push_auth::HEALTH_NAME, &urls.auth, key)?;
        let registry = ServiceEndpoint::connect(
            "registry",
            orca_push_registry::HEALTH_NAME,
            &urls.registry,
            key,
        )?;
        let queue =
            ServiceEndpoint::connect("queue", orca_push_queue::HEALTH_NAME, &urls.queue, key)?;
        let sender =
            ServiceEndpoint::connect("sender", orca_push_sender::HEALTH_NAME, &urls.sender, key)?;
        let queue_client = QueueServiceClient::new(queue.channel.clone());
        let enqueues = match &urls.queue {
            Target::Url(_) => Some(Enqueues::spawn(queue_client.clone())),
            Target::Local(_) => None,
        };
        Ok(Self {
            auth: AuthServiceClient::new(auth.channel.clone()),
            registry: RegistryServiceClient::new(registry.channel.clone()),
            queue: queue_client,
            enqueues,
            endpoints: vec![auth, registry, queue, sender],
            resolves: Arc::default(),
        })
    }

    /// What `Enqueue` answers for `request`: batched with other sends when the queue is across
    /// the network, a call of its own in this process.
    pub async fn enqueue(
        &self,
        request: queue_pb::EnqueueRequest,
    ) -> Result<queue_pb::EnqueueResponse, tonic::Status> {
        match &self.enqueues {
            Some(enqueues) => enqueues.enqueue(request).await,
            None => Ok(self.queue.clone().enqueue(request).await?.into_inner()),
        }
    }

    /// A write through this facade may have changed what `host` resolves to.
    pub fn changed(&self, host: &str) {
        self.resolves.changed(host);
    }
}
