//! A sender's lanes against a real queue (SQLite) and a registry whose device look-ups never
//! answer: what the lanes do while a claim's look-up is on its way.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use orca_push_proto::queue::v1 as queue_pb;
use orca_push_proto::registry::v1 as registry_pb;
use orca_push_storage::SystemClock;
use orca_push_storage::testing::{Backend, fresh};
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

/// A registry whose device look-ups hang, counting them; it has nothing else.
struct HangingRegistry {
    look_ups: Arc<AtomicUsize>,
}

fn nothing<T>() -> Result<Response<T>, Status> {
    Err(Status::unimplemented("a registry of look-ups only"))
}

#[tonic::async_trait]
impl registry_pb::registry_service_server::RegistryService for HangingRegistry {
    async fn register_device(
        &self,
        _: Request<registry_pb::RegisterDeviceRequest>,
    ) -> Result<Response<registry_pb::RegisterDeviceResponse>, Status> {
        nothing()
    }
    async fn list_devices(
        &self,
        _: Request<registry_pb::ListDevicesRequest>,
    ) -> Result<Response<registry_pb::ListDevicesResponse>, Status> {
        nothing()
    }
    async fn delete_device(
        &self,
        _: Request<registry_pb::DeleteDeviceRequest>,
    ) -> Result<Response<registry_pb::DeleteDeviceResponse>, Status> {
        nothing()
    }
    async fn resolve_registrations(
        &self,
        _: Request<registry_pb::ResolveRegistrationsRequest>,
    ) -> Result<Response<registry_pb::ResolveRegistrationsResponse>, Status> {
        nothing()
    }
    async fn get_devices_for_delivery(
        &self,
        _: Request<registry_pb::GetDevicesForDeliveryRequest>,
    ) -> Result<Response<registry_pb::GetDevicesForDeliveryResponse>, Status> {
        self.look_ups.fetch_add(1, Ordering::SeqCst);
        std::future::pending().await
    }
    async fn mark_dead(
        &self,
        _: Request<registry_pb::MarkDeadRequest>,
    ) -> Result<Response<registry_pb::MarkDeadResponse>, Status> {
        nothing()
    }
    async fn hosts_with_devices(
        &self,
        _: Request<registry_pb::HostsWithDevicesRequest>,
    ) -> Result<Response<registry_pb::HostsWithDevicesResponse>, Status> {
        nothing()
    }
}

fn alert(seq: u64) -> queue_pb::EnqueueRequest {
    queue_pb::EnqueueRequest {
        host_fingerprint: "hostAAAAAAAAAAAA".into(),
        notification: Some(queue_pb::Notification {
            notification_id: Some(format!("n-{seq}")),
            notification_seq: seq,
            notification_epoch: "epoch".into(),
            source: "agent-task-complete".into(),
            agent_state: Some("finished".into()),
            title: "Done".into(),
            body: "All good".into(),
            worktree_id: None,
            kind: queue_pb::Kind::Alert as i32,
            expires_at_ms: None,
        }),
        recipients: vec![queue_pb::Recipient {
            registration_id: format!("phone-{seq}"),
            silent: false,
            provider: queue_pb::Provider::Apns as i32,
        }],
    }
}

/// A lane that has claimed work looks its devices up and makes its attempts beside its next
/// claim, not before it: a lane waiting in a claim is one an admission hands new work to without a
/// claim transaction. So while every look-up hangs, new sends still reach the lanes (each a new
/// look-up), where before a lane waited for its look-up and at most one hung per lane.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lanes_claim_again_while_their_look_ups_are_on_the_way() {
    let (config, _guard) = fresh(Backend::Sqlite).await;
    let pool = orca_push_queue::open_and_migrate(&config).await.unwrap();
    let key = orca_push_internal_auth::InternalKey::generate();
    let shutdown = CancellationToken::new();

    let queue_listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let queue_url = format!("http://{}", queue_listener.local_addr().unwrap());
    tokio::spawn(orca_push_queue::serve(
        queue_listener,
        pool,
        Arc::new(SystemClock),
        0,
        key.clone(),
        shutdown.clone(),
    ));
    let look_ups = Arc::new(AtomicUsize::new(0));
    let registry_listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let registry_url = format!("http://{}", registry_listener.local_addr().unwrap());
    let registry =
        registry_pb::registry_service_server::RegistryServiceServer::new(HangingRegistry {
            look_ups: look_ups.clone(),
        });
    tokio::spawn(orca_push_internal_auth::serve_routes(
        registry_listener,
        key.clone(),
        "registry",
        tonic::service::Routes::new(registry),
        shutdown.clone(),
    ));

    let providers = orca_push_sender::Providers::new(&orca_push_sender::ProviderConfig::new(
        orca_push_sender::fcm::TokenSource::Metadata {
            host: "127.0.0.1:9".into(),
        },
    ))
    .await
    .unwrap();
    let drain = CancellationToken::new();
    let (_routes, _lanes) = orca_push_sender::start(
        providers,
        &orca_push_internal_auth::Target::Url(queue_url.clone()),
        &orca_push_internal_auth::Target::Url(registry_url),
        Arc::new(SystemClock),
        orca_push_sender::SenderSettings {
            instance: "test".into(),
            lease_ms: 30_000,
            backoff: Default::default(),
        },
        &key,
        drain.clone(),
        shutdown.clone(),
    )
    .unwrap();

    let mut queue = queue_pb::queue_service_client::QueueServiceClient::new(
        orca_push_internal_auth::channel(&queue_url, &key, "test", "queue").unwrap(),
    );
    let lanes = orca_push_sender::lane::LANES;
    let sends = lanes + 2;
    for seq in 1..=sends as u64 {
        queue.enqueue(alert(seq)).await.unwrap();
        // Each send on its own: the next goes once a lane has its look-up on the way (10 s at
        // most: before, the fifth never came, so the test failed after 20 s).
        let want = usize::try_from(seq).unwrap();
        for _ in 0..1_000 {
            if look_ups.load(Ordering::SeqCst) >= want {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
    assert_eq!(
        look_ups.load(Ordering::SeqCst),
        sends,
        "{lanes} lanes, every look-up hanging: each send still reached a lane"
    );
    drain.cancel();
    shutdown.cancel();
}
