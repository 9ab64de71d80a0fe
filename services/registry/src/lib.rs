//! The registry service: device registrations. It owns `push_devices` and nothing else.
//!
//! Only the owning host may see or delete a registration; another host's id answers exactly like an
//! unknown one. It must never log a push token or more than 4 characters of a host fingerprint.

pub mod device;
mod error;
mod grpc;
mod registry;
mod relay;
pub mod resolve_cache;
pub mod store;
pub mod watched;

use std::sync::Arc;
use std::time::Duration;

use orca_push_proto::registry::v1::registry_service_server::RegistryServiceServer;
use orca_push_storage::{Clock, DatabaseConfig, Pool, ServiceStorage};
use tokio_util::sync::CancellationToken;
use tonic_health::ServingStatus;

pub use error::RegistryError;
pub use grpc::{RegistryGrpc, registration_from_wire};
pub use registry::DeviceRegistry;
pub use store::{AnyRegistryStore, RegistryStore};

/// The name the registry reports its health under.
pub const HEALTH_NAME: &str = "orca.push.registry.v1.RegistryService";

/// The audience internal tokens for this service name.
pub const AUDIENCE: &str = "registry";

pub const STORAGE: ServiceStorage = ServiceStorage {
    sqlite_file: "registry.sqlite",
    postgres_schema: "push_registry",
    create_schema_sql: "CREATE SCHEMA IF NOT EXISTS push_registry",
    max_connections: 16,
    sqlite_durability: None,
    sqlite_syncs_wal: false,
};

pub async fn open_and_migrate(
    database: &DatabaseConfig,
) -> Result<Pool, orca_push_storage::OpenError> {
    let pool = orca_push_storage::open(database, &STORAGE).await?;
    store::migrate(&pool).await?;
    Ok(pool)
}

/// Runs the registry gRPC server (with health checking) on `listener` until `shutdown` fires.
pub async fn serve(
    listener: tokio::net::TcpListener,
    pool: Pool,
    clock: Arc<dyn Clock>,
    key: orca_push_internal_auth::InternalKey,
    shutdown: CancellationToken,
) -> Result<(), tonic::transport::Error> {
    let routes = routes(pool, clock, shutdown.clone()).await;
    orca_push_internal_auth::serve_routes(listener, key, AUDIENCE, routes, shutdown).await
}

/// The registry's routes (health, reflection, RegistryService), with its database health followed
/// until `shutdown`: served on a listener by [`serve`], or in process.
pub async fn routes(
    pool: Pool,
    clock: Arc<dyn Clock>,
    shutdown: CancellationToken,
) -> tonic::service::Routes {
    let store = AnyRegistryStore::new(pool.clone());
    tokio::spawn(orca_push_storage::pool_gauges::record_until(
        "registry",
        store.pools(),
        shutdown.clone(),
    ));
    let resolves = store.resolves();
    match &store {
        AnyRegistryStore::Postgres(store) => {
            tokio::spawn(store.clone().relay(shutdown.clone()));
        }
        AnyRegistryStore::Sqlite(_) => {
            tokio::spawn(relay::exact_heartbeat(resolves.clone(), shutdown.clone()));
        }
    }
    let registry = Arc::new(DeviceRegistry::new(store, clock));
    let (health, health_service) = tonic_health::server::health_reporter();
    health
        .set_service_status(HEALTH_NAME, ServingStatus::Serving)
        .await;
    tokio::spawn(orca_push_storage::health::follow_database(
        pool,
        health,
        HEALTH_NAME,
        Duration::MAX,
        orca_push_storage::health::nothing,
        shutdown.clone(),
    ));
    orca_push_internal_auth::service_routes(health_service).add_service(RegistryServiceServer::new(
        RegistryGrpc::new(registry, resolves, shutdown),
    ))
}
