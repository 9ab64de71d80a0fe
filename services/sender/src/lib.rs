//! The sender service: four delivery lanes per instance that claim due batches from the queue
//! under renewed leases, re-read each device from the registry (or its copy kept while the
//! registry's device watch vouches for it), and deliver through APNs (HTTP/2,
//! ES256 provider tokens) and FCM HTTP v1 (OAuth). It owns no tables.
//!
//! It must never log a push token, a title, a body, or more than 4 characters of a fingerprint.

pub mod apns;
pub mod breaker;
pub mod fcm;
pub mod lane;
pub mod payload;
pub mod providers;
pub mod report;
pub mod tls;
pub mod verdict;

use std::sync::Arc;
use std::time::Duration;

use orca_push_internal_auth::Target;
use orca_push_storage::Clock;
use tokio_util::sync::CancellationToken;

pub use lane::{QueueClient, RegistryClient, Sender};
pub use providers::{ApnsCredentials, ProviderConfig, Providers};

/// The audience internal tokens for this service name.
pub const AUDIENCE: &str = "sender";

/// The sender reports its health as the server as a whole.
pub const HEALTH_NAME: &str = "";

/// What one sender instance is told at start.
#[derive(Debug, Clone)]
pub struct SenderSettings {
    /// Its name in leases and logs (host and pid).
    pub instance: String,
    /// A lane's lease on a batch (`ORCA_PUSH_LEASE_MS`).
    pub lease_ms: u32,
    /// The retry backoff (`ORCA_PUSH_RETRY_BASE_MS`).
    pub backoff: verdict::Backoff,
}

/// How long in-flight deliveries may run after SIGTERM: the platform's grace, less a margin.
pub const DRAIN_GRACE: Duration = Duration::from_secs(8);

/// Runs the sender: its gRPC health server on `listener`, and the lanes. `drain` stops taking work;
/// in-flight deliveries then get `DRAIN_GRACE`; when the lanes are done the sender cancels
/// `shutdown`, which stops its server (and, all in one, the rest of the process).
#[allow(clippy::too_many_arguments)]
pub async fn serve(
    listener: tokio::net::TcpListener,
    providers: Providers,
    queue: Target,
    registry: Target,
    clock: Arc<dyn Clock>,
    settings: SenderSettings,
    key: orca_push_internal_auth::InternalKey,
    drain: CancellationToken,
    shutdown: CancellationToken,
) -> Result<(), tonic::transport::Error> {
    let (routes, lanes) = start(
        providers,
        &queue,
        &registry,
        clock,
        settings,
        &key,
        drain,
        shutdown.clone(),
    )?;
    let result =
        orca_push_internal_auth::serve_routes(listener, key, AUDIENCE, routes, shutdown).await;
    let _ = lanes.await;
    result
}

/// Starts the lanes (as [`serve`] does) and returns the sender's routes (health, reflection) with
/// the task that ends once the lanes have drained and `shutdown` is cancelled.
#[allow(clippy::too_many_arguments)]
pub fn start(
    providers: Providers,
    queue: &Target,
    registry: &Target,
    clock: Arc<dyn Clock>,
    settings: SenderSettings,
    key: &orca_push_internal_auth::InternalKey,
    drain: CancellationToken,
    shutdown: CancellationToken,
) -> Result<(tonic::service::Routes, tokio::task::JoinHandle<()>), tonic::transport::Error> {
    let registry_client = RegistryClient::new(orca_push_internal_auth::channel_to(
        registry, key, "sender", "registry",
    )?);
    // Across a socket, lanes keep the phones they looked up (`Sender::look_up`).
    let devices = matches!(registry, Target::Url(_)).then(lane::kept_devices);
    let sender = Arc::new(Sender {
        queue: QueueClient::new(orca_push_internal_auth::channel_to(
            queue, key, "sender", "queue",
        )?),
        registry: registry_client.clone(),
        devices: devices.clone(),
        providers,
        clock,
        counters: Default::default(),
        instance: settings.instance,
        lease_ms: settings.lease_ms,
        backoff: settings.backoff,
        breakers: Arc::default(),
    });
    Providers::register_metrics();
    let hard_stop = CancellationToken::new();
    {
        let drain = drain.clone();
        let hard_stop = hard_stop.clone();
        tokio::spawn(async move {
            drain.cancelled().await;
            tokio::time::sleep(DRAIN_GRACE).await;
            hard_stop.cancel();
        });
    }
    // The watch is followed until the lanes have drained (their look-ups use it until then), or
    // their task has ended some other way.
    let watching = CancellationToken::new();
    if let Some(devices) = devices {
        tokio::spawn(devices.follow(registry_client, watching.clone()));
    }
    let lanes = tokio::spawn(async move {
        let _watching = watching.drop_guard();
        sender.run(drain, hard_stop).await;
        // Drained: the services this process shares (all in one) may stop now.
        shutdown.cancel();
    });
    let (_health, health_service) = tonic_health::server::health_reporter();
    Ok((
        orca_push_internal_auth::service_routes(health_service),
        lanes,
    ))
}
