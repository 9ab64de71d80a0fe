//! The two backends' stores: their pools, resolve caches and how each takes a host's write lock.

use crate::resolve_cache::ResolveCache;

/// SQLite: one writer at a time; `BEGIN IMMEDIATE` takes the write lock before the first read, so a
/// read-then-write transaction cannot fail to upgrade.
#[derive(Debug, Clone)]
pub struct SqliteRegistryStore {
    pub(super) pool: sqlx::SqlitePool,
    pub(super) readers: sqlx::SqlitePool,
    /// This process alone writes the file, so what a host resolves to can be kept exactly.
    pub(super) resolves: std::sync::Arc<ResolveCache>,
}

impl SqliteRegistryStore {
    /// `db.system` of its spans.
    pub(super) const DB_SYSTEM: &'static str = "sqlite";
    /// This process alone writes the file: nothing to announce (`$3` is unused).
    pub(super) const DELETE_SQL: &'static str = "DELETE FROM push_devices \
         WHERE registration_id = $1 AND host_fingerprint = $2 AND $3 = $3 RETURNING host_fingerprint";
    pub(super) const MARK_DEAD_SQL: &'static str = concat!(
        "UPDATE push_devices SET dead_at = $5 ",
        "WHERE registration_id = $1 AND token = $2 AND platform = $3 ",
        "AND COALESCE(apns_environment, '') = COALESCE($4, '') AND dead_at IS NULL ",
        "AND $6 = $6 RETURNING host_fingerprint"
    );
    pub(super) const ANNOUNCE_SQL: Option<&'static str> = None;

    pub fn new(pool: sqlx::SqlitePool) -> Self {
        let readers = orca_push_storage::ReadPool::readers(&pool);
        Self {
            pool,
            readers,
            resolves: Default::default(),
        }
    }

    pub(super) fn resolve_cache(&self) -> Option<&ResolveCache> {
        Some(&self.resolves)
    }

    /// Where reads outside a transaction go.
    pub(super) fn reader(&self) -> &sqlx::SqlitePool {
        &self.readers
    }

    pub(super) async fn begin_host_write(
        &self,
        _host: &str,
    ) -> Result<sqlx::Transaction<'static, sqlx::Sqlite>, sqlx::Error> {
        self.pool.begin_with("BEGIN IMMEDIATE").await
    }
}

/// PostgreSQL (READ COMMITTED): a transaction-scoped advisory lock per host serialises the
/// count-then-insert of the device cap across every replica.
#[derive(Debug, Clone)]
pub struct PgRegistryStore {
    pub(super) pool: sqlx::PgPool,
    pub(super) readers: sqlx::PgPool,
    /// Served only while `relay` vouches for it (see `resolve_cache`).
    pub(super) resolves: std::sync::Arc<ResolveCache>,
}

impl PgRegistryStore {
    /// `db.system` of its spans.
    pub(super) const DB_SYSTEM: &'static str = "postgresql";
    /// Each write names its host on `DEVICES_CHANNEL` ($3 / $6), delivered to every replica's
    /// relay if it commits.
    pub(super) const DELETE_SQL: &'static str = "WITH d AS (DELETE FROM push_devices \
         WHERE registration_id = $1 AND host_fingerprint = $2 RETURNING host_fingerprint) \
         SELECT d.host_fingerprint FROM d, LATERAL (SELECT pg_notify($3, d.host_fingerprint)) AS n";
    pub(super) const MARK_DEAD_SQL: &'static str = concat!(
        "WITH m AS (UPDATE push_devices SET dead_at = $5 ",
        "WHERE registration_id = $1 AND token = $2 AND platform = $3 ",
        "AND COALESCE(apns_environment, '') = COALESCE($4, '') AND dead_at IS NULL ",
        "RETURNING host_fingerprint) ",
        "SELECT m.host_fingerprint FROM m, LATERAL (SELECT pg_notify($6, m.host_fingerprint)) AS n"
    );
    pub(super) const ANNOUNCE_SQL: Option<&'static str> = Some("SELECT pg_notify($1, $2)");

    pub fn new(pool: sqlx::PgPool) -> Self {
        let readers = orca_push_storage::ReadPool::readers(&pool);
        Self {
            pool,
            readers,
            resolves: std::sync::Arc::new(ResolveCache::relayed()),
        }
    }

    /// Replicas share the table: entries are served while the relay of their writes is heard.
    pub(super) fn resolve_cache(&self) -> Option<&ResolveCache> {
        Some(&self.resolves)
    }

    /// Relays every replica's device writes into this replica's cache, until `shutdown`.
    pub async fn relay(self, shutdown: tokio_util::sync::CancellationToken) {
        crate::relay::relay(self.pool.clone(), self.resolves.clone(), shutdown).await;
    }

    /// Where reads outside a transaction go.
    pub(super) fn reader(&self) -> &sqlx::PgPool {
        &self.readers
    }

    pub(super) async fn begin_host_write(
        &self,
        host: &str,
    ) -> Result<sqlx::Transaction<'static, sqlx::Postgres>, sqlx::Error> {
        let mut tx = self.pool.begin().await?;
        sqlx::query("SELECT pg_advisory_xact_lock(hashtextextended('push_devices:' || $1, 0))")
            .bind(host)
            .execute(&mut *tx)
            .await?;
        Ok(tx)
    }
}
