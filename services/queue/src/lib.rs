//! The queue service: per-host quota, durable events, coalescing windows shared by every replica,
//! and delivery batches claimed under expiring leases. It owns `push_events`,
//! `push_event_recipients`, `push_delivery_batches` and `push_dismissed_events`.
//!
//! Every accepted event is committed before `queued` is answered. It must never log a title, body,
//! token, or more than 4 characters of a host fingerprint.

pub mod admission;
mod error;
pub mod group_commit;
mod grpc;
pub mod handoff;
pub mod model;
mod queue;
pub mod store;
pub mod wake;

use std::sync::Arc;
use std::time::Duration;

use orca_push_proto::queue::v1::queue_service_server::QueueServiceServer;
use orca_push_storage::{Clock, DatabaseConfig, Pool, ServiceStorage};
use tokio_util::sync::CancellationToken;
use tonic_health::ServingStatus;

pub use error::QueueError;
pub use grpc::MAX_ENQUEUE_MANY;
pub use grpc::QueueGrpc;
pub use queue::DeliveryQueue;
pub use store::{AnyQueueStore, QueueStore};
pub use wake::Wake;

/// The name the queue reports its health under.
pub const HEALTH_NAME: &str = "orca.push.queue.v1.QueueService";

/// The audience internal tokens for this service name.
pub const AUDIENCE: &str = "queue";

pub const STORAGE: ServiceStorage = ServiceStorage {
    sqlite_file: "queue.sqlite",
    postgres_schema: "push_queue",
    create_schema_sql: "CREATE SCHEMA IF NOT EXISTS push_queue",
    max_connections: 24,
    sqlite_durability: None,
    // Its group commit answers admissions and reports after a sync of its own.
    sqlite_syncs_wal: true,
};

const CLEANUP_EVERY: Duration = Duration::from_secs(60);
/// How often the depth gauges are refreshed.
const DEPTH_EVERY: Duration = Duration::from_secs(5);

pub async fn open_and_migrate(
    database: &DatabaseConfig,
) -> Result<Pool, orca_push_storage::OpenError> {
    let pool = orca_push_storage::open(database, &STORAGE).await?;
    store::migrate(&pool).await?;
    Ok(pool)
}

/// Why this process cannot serve a SQLite queue.
#[derive(Debug, thiserror::Error)]
pub enum SqliteQueueLock {
    #[error(
        "another process serves the SQLite queue {path} (it holds {path}.lock); one process owns \
         a SQLite queue, whose writer counts the hosts' quota in its memory"
    )]
    Taken { path: String },
    #[error("cannot lock the SQLite queue {path} ({path}.lock)")]
    Failed {
        path: String,
        #[source]
        source: std::io::Error,
    },
}

/// Makes this process the one that serves a SQLite queue, until it exits: an exclusive lock on
/// `<file>.lock` beside it (`flock`, let go by the kernel when the process ends, however it ends),
/// taken before anything in the folder is opened or migrated. Its writer counts the hosts' quota
/// in memory (`store::quota`): a second process admitting to the same file would count only its
/// own admissions, and each host could spend its quota once per process. A second `serve` is
/// refused at start instead. Nothing to do on PostgreSQL, whose replicas count in SQL;
/// `orca-push migrate` does not take the lock.
pub fn own_sqlite_queue(database: &DatabaseConfig) -> Result<(), SqliteQueueLock> {
    static OWNED: std::sync::Mutex<Vec<std::fs::File>> = std::sync::Mutex::new(Vec::new());
    let DatabaseConfig::Sqlite { data_dir, .. } = database else {
        return Ok(());
    };
    let path = data_dir.join(STORAGE.sqlite_file);
    let failed = |source| SqliteQueueLock::Failed {
        path: path.display().to_string(),
        source,
    };
    orca_push_storage::data_dir(data_dir).map_err(failed)?;
    let mut lock_path = path.clone().into_os_string();
    lock_path.push(".lock");
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&lock_path)
        .map_err(failed)?;
    file.try_lock().map_err(|e| match e {
        std::fs::TryLockError::WouldBlock => SqliteQueueLock::Taken {
            path: path.display().to_string(),
        },
        std::fs::TryLockError::Error(e) => failed(e),
    })?;
    OWNED
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
        .push(file);
    Ok(())
}

/// Builds the queue over `pool`, and on PostgreSQL starts listening for other replicas' new work.
pub fn delivery_queue(
    pool: Pool,
    clock: Arc<dyn Clock>,
    coalesce_ms: u64,
    shutdown: &CancellationToken,
) -> Arc<DeliveryQueue<AnyQueueStore>> {
    let wake = Arc::new(Wake::new());
    let store = AnyQueueStore::new(pool);
    if let AnyQueueStore::Postgres(pg) = &store {
        tokio::spawn(listen_for_replicas(
            pg.pool().clone(),
            pg.origin().to_owned(),
            wake.clone(),
            clock.clone(),
            shutdown.clone(),
        ));
    }
    Arc::new(DeliveryQueue::new(store, clock, coalesce_ms, wake))
}

/// Runs the queue gRPC server (with health checking) on `listener` until `shutdown` fires.
pub async fn serve(
    listener: tokio::net::TcpListener,
    pool: Pool,
    clock: Arc<dyn Clock>,
    coalesce_ms: u64,
    key: orca_push_internal_auth::InternalKey,
    shutdown: CancellationToken,
) -> Result<(), tonic::transport::Error> {
    let routes = routes(pool, clock, coalesce_ms, shutdown.clone()).await;
    orca_push_internal_auth::serve_routes(listener, key, AUDIENCE, routes, shutdown).await
}

/// The queue's routes (health, reflection, QueueService), with its depth gauge, cleanup and
/// database health running until `shutdown`: served on a listener by [`serve`], or in process.
pub async fn routes(
    pool: Pool,
    clock: Arc<dyn Clock>,
    coalesce_ms: u64,
    shutdown: CancellationToken,
) -> tonic::service::Routes {
    if let Pool::Postgres(pg) = &pool {
        tokio::spawn(orca_push_storage::clock_offset::watch_until(
            "queue",
            pg.clone(),
            clock.clone(),
            shutdown.clone(),
        ));
    }
    let queue = delivery_queue(pool.clone(), clock, coalesce_ms, &shutdown);
    tokio::spawn(orca_push_storage::pool_gauges::record_until(
        "queue",
        queue.store().pools(),
        shutdown.clone(),
    ));
    metrics::counter!("orca_push_lease_expiries_total").increment(0);
    for kind in ["alert", "dismiss"] {
        metrics::counter!("orca_push_quota_refusals_total", "kind" => kind).increment(0);
    }
    {
        let queue = queue.clone();
        let shutdown = shutdown.clone();
        tokio::spawn(async move {
            let mut ticker = tokio::time::interval(DEPTH_EVERY);
            loop {
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    _ = ticker.tick() => queue.record_depth().await,
                }
            }
        });
    }
    let (health, health_service) = tonic_health::server::health_reporter();
    health
        .set_service_status(HEALTH_NAME, ServingStatus::Serving)
        .await;
    {
        let queue = queue.clone();
        let unsynced = queue.clone();
        tokio::spawn(orca_push_storage::health::follow_database_unless(
            pool,
            health,
            HEALTH_NAME,
            CLEANUP_EVERY,
            move || {
                let queue = queue.clone();
                async move {
                    match queue.cleanup().await {
                        Ok(c) => {
                            metrics::gauge!("orca_push_queue_retention_overdue_seconds")
                                .set(c.past_retention_ms as f64 / 1000.0);
                            tracing::debug!(
                                expired = c.expired_batches,
                                cleared = c.cleared_payloads,
                                deleted_events = c.deleted_events,
                                deleted_batches = c.deleted_batches,
                                deleted_fences = c.deleted_fences,
                                deleted_quota_rows = c.deleted_quota_rows,
                                past_retention_ms = c.past_retention_ms,
                                "queue cleanup"
                            )
                        }
                        Err(error) => tracing::warn!(%error, "queue cleanup failed"),
                    }
                }
            },
            move || unsynced.broken(),
            shutdown.clone(),
        ));
    }
    orca_push_internal_auth::service_routes(health_service)
        .add_service(QueueServiceServer::new(QueueGrpc::new(queue, shutdown)))
}

/// How long the queue's notification listener may hear nothing (not even its own commits' echo)
/// before it listens on a new connection.
const LISTEN_SILENCE: Duration = Duration::from_secs(60);

/// Another replica committed work that may be due: wake this replica's waiting claims that the
/// work is news to (see `Wake::work_due`). What this replica signed (`origin`) it woke its own
/// lanes for when it committed (`wake::payload_from`).
async fn listen_for_replicas(
    pool: sqlx::PgPool,
    origin: String,
    wake: Arc<Wake>,
    clock: Arc<dyn Clock>,
    shutdown: CancellationToken,
) {
    loop {
        let listener = async {
            let mut listener = sqlx::postgres::PgListener::connect_with(&pool).await?;
            listener.listen(store::WAKE_CHANNEL).await?;
            // What was committed before this listener was in place (at start, or while it
            // reconnected) was told to no one here: the claims look again.
            wake.any();
            loop {
                // Nothing heard for a while (a quiet deployment, or a connection the network
                // dropped without a word, which nothing else would find out): listen on a new
                // connection, the claims looking again meanwhile.
                let Some(heard) =
                    orca_push_storage::notify_relay::next_within(&mut listener, LISTEN_SILENCE)
                        .await
                else {
                    tracing::debug!(
                        "nothing heard on the queue's notification connection; listening on a new one"
                    );
                    return Ok(());
                };
                match heard? {
                    Some(notification) => {
                        let now = i64::try_from(clock.now_ms()).unwrap_or(i64::MAX);
                        wake.notified(notification.payload(), &origin, now);
                    }
                    // The connection was lost and made again, listening (sqlx's eager
                    // reconnect): what was told meanwhile is lost, so the claims look again.
                    // `recv` reconnected without saying so, and other replicas tell a time
                    // only once (`wake::Told`).
                    None => wake.any(),
                }
            }
        };
        tokio::select! {
            _ = shutdown.cancelled() => return,
            result = listener => {
                if let Err::<(), sqlx::Error>(error) = result {
                    tracing::warn!(%error, "queue notification listener failed; reconnecting");
                }
                // Whatever was missed while disconnected is found by the next claim.
                wake.any();
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        }
    }
}
