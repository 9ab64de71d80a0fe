//! The auth service: host challenge, proof and session, and the bearer check behind every other
//! route. It owns `push_hosts`, `push_challenges`, `push_sessions` and `push_session_keys` (the key
//! session tokens are tagged with) and nothing else.
//!
//! It must never store a challenge secret or a session token (only their sha256), never log one, and
//! never log more than the first 4 characters of a host fingerprint.

mod error;
mod group_writer;
mod grpc;
mod host_auth;
mod pg_group;
mod recent_challenges;
pub mod session_token;
pub mod session_watch;
pub mod store;

use std::sync::Arc;
use std::time::Duration;

use orca_push_proto::auth::v1::auth_service_server::AuthServiceServer;
use orca_push_storage::{Clock, DatabaseConfig, Pool, ServiceStorage};
use tokio_util::sync::CancellationToken;
use tonic_health::ServingStatus;

pub use error::AuthError;
pub use grpc::AuthGrpc;
pub use host_auth::{
    Announcer, Authenticated, DeviceDirectory, HOST_IDLE_MS, HostAuth, IssuedChallenge,
    LEGACY_WINDOW_MS, SESSION_TTL_MS, Session, SessionNews, WATCH_BACKLOG, fingerprint_prefix,
};
pub use session_token::{SESSION_TOKEN_LEN, SessionKey, SessionTagging, Tag};
pub use store::{AnyAuthStore, AuthStore, PgAuthStore, SqliteAuthStore};

/// The name the auth service reports its health under.
pub const HEALTH_NAME: &str = "orca.push.auth.v1.AuthService";

/// The audience internal tokens for this service name.
pub const AUDIENCE: &str = "auth";

pub const STORAGE: ServiceStorage = ServiceStorage {
    sqlite_file: "auth.sqlite",
    postgres_schema: "push_auth",
    create_schema_sql: "CREATE SCHEMA IF NOT EXISTS push_auth",
    max_connections: 16,
    // Challenges live 10 s and a session can be minted again by logging in: a power loss
    // that drops the last of them costs a host one login, and no host was promised more. Syncing
    // each handshake's two commits halved handshakes per second (1,261/s with NORMAL, 583/s with
    // FULL, back to back).
    sqlite_durability: Some(orca_push_storage::SqliteDurability::Normal),
    sqlite_syncs_wal: false,
};

/// How often expired challenges and long-dead sessions are pruned.
const PRUNE_EVERY: Duration = Duration::from_secs(60);

/// What the auth service needs to run.
#[derive(Debug, Clone)]
pub struct AuthConfig {
    /// The gateway's public origin, bound into every challenge transcript.
    pub gateway_origin: String,
    pub database: DatabaseConfig,
}

/// The auth service's client of the registry (for host pruning).
pub type RegistryClient =
    orca_push_proto::registry::v1::registry_service_client::RegistryServiceClient<
        orca_push_internal_auth::InternalChannel,
    >;

/// A traced registry client carrying auth's identity (a lazily connecting channel for a URL).
pub fn registry_client(
    registry: &orca_push_internal_auth::Target,
    key: &orca_push_internal_auth::InternalKey,
) -> Result<RegistryClient, tonic::transport::Error> {
    Ok(RegistryClient::new(orca_push_internal_auth::channel_to(
        registry, key, "auth", "registry",
    )?))
}

/// Opens the database and applies this service's migrations.
pub async fn open_and_migrate(
    database: &DatabaseConfig,
) -> Result<Pool, orca_push_storage::OpenError> {
    let pool = orca_push_storage::open(database, &STORAGE).await?;
    store::migrate(&pool).await?;
    Ok(pool)
}

/// Runs the auth gRPC server (with health checking) on `listener` until `shutdown` fires.
pub async fn serve(
    listener: tokio::net::TcpListener,
    pool: Pool,
    gateway_origin: String,
    clock: Arc<dyn Clock>,
    registry: RegistryClient,
    key: orca_push_internal_auth::InternalKey,
    shutdown: CancellationToken,
) -> Result<(), tonic::transport::Error> {
    let routes = routes(pool, gateway_origin, clock, registry, shutdown.clone()).await;
    orca_push_internal_auth::serve_routes(listener, key, AUDIENCE, routes, shutdown).await
}

/// The auth service's routes (health, reflection, AuthService), with its pruning running until
/// `shutdown`: served on a listener by [`serve`], or in process.
pub async fn routes(
    pool: Pool,
    gateway_origin: String,
    clock: Arc<dyn Clock>,
    registry: RegistryClient,
    shutdown: CancellationToken,
) -> tonic::service::Routes {
    let pool_for_health = pool.clone();
    if let Pool::Postgres(pg) = &pool {
        tokio::spawn(orca_push_storage::clock_offset::watch_until(
            "auth",
            pg.clone(),
            clock.clone(),
            shutdown.clone(),
        ));
    }
    let store = AnyAuthStore::new(pool);
    tokio::spawn(orca_push_storage::pool_gauges::record_until(
        "auth",
        store.pools(),
        shutdown.clone(),
    ));
    let auth = HostAuth::new(store.clone(), gateway_origin, clock);
    let auth = Arc::new(match &store {
        // One process owns a SQLite file: it mints every session of it.
        AnyAuthStore::Sqlite(_) => auth.with_session_watch(Announcer::ThisProcess),
        AnyAuthStore::Postgres(_) => auth.with_session_watch(Announcer::TheStore),
    });
    if let Some(news) = auth.session_news() {
        match store {
            AnyAuthStore::Sqlite(_) => {
                tokio::spawn(session_watch::heartbeat(news, shutdown.clone()));
            }
            AnyAuthStore::Postgres(store) => {
                tokio::spawn(session_watch::relay(store, news, shutdown.clone()));
            }
        }
    }
    let (health, health_service) = tonic_health::server::health_reporter();
    health
        .set_service_status(HEALTH_NAME, ServingStatus::Serving)
        .await;
    {
        let auth = auth.clone();
        tokio::spawn(orca_push_storage::health::follow_database(
            pool_for_health,
            health.clone(),
            HEALTH_NAME,
            PRUNE_EVERY,
            move || {
                let (auth, registry) = (auth.clone(), registry.clone());
                async move {
                    if let Err(error) = auth.prune().await {
                        tracing::warn!(%error, "auth prune failed");
                    }
                    if let Err(error) = auth.prune_hosts(&registry).await {
                        tracing::warn!(%error, "host prune failed");
                    }
                }
            },
            shutdown.clone(),
        ));
    }

    orca_push_internal_auth::service_routes(health_service)
        .add_service(AuthServiceServer::new(AuthGrpc::new(auth, shutdown)))
}
