//! Either backend behind one type, chosen at start-up from the pool.

use orca_push_storage::Pool;

use super::{
    DeliveryRow, DeviceRow, PgRegistryStore, RegistryStore, ResolvedRow, SqliteRegistryStore,
};
use crate::device::{ApnsEnvironment, Platform, Registration};
use crate::error::RegistryError;
use crate::resolve_cache::ResolveCache;

/// Either backend, chosen at start-up.
#[derive(Debug, Clone)]
pub enum AnyRegistryStore {
    Sqlite(SqliteRegistryStore),
    Postgres(PgRegistryStore),
}

impl AnyRegistryStore {
    pub fn new(pool: Pool) -> Self {
        match pool {
            Pool::Sqlite(p) => Self::Sqlite(SqliteRegistryStore::new(p)),
            Pool::Postgres(p) => Self::Postgres(PgRegistryStore::new(p)),
        }
    }

    /// The cache of what hosts resolve to, and its news for `WatchDevices`.
    pub fn resolves(&self) -> std::sync::Arc<ResolveCache> {
        match self {
            Self::Sqlite(s) => s.resolves.clone(),
            Self::Postgres(s) => s.resolves.clone(),
        }
    }

    /// Hosts whose registrations are kept in memory (see `resolve_cache`).
    pub fn cached_hosts(&self) -> usize {
        match self {
            Self::Sqlite(s) => s.resolves.len(),
            Self::Postgres(s) => s.resolves.len(),
        }
    }

    /// The connection pools behind this store, for the pool gauges.
    pub fn pools(&self) -> orca_push_storage::StorePools {
        match self {
            Self::Sqlite(s) => orca_push_storage::StorePools::sqlite(&s.pool, &s.readers),
            Self::Postgres(s) => orca_push_storage::StorePools::postgres(&s.pool),
        }
    }
}

macro_rules! delegate {
    ($self:ident, $s:ident => $target:ident . $method:ident ( $($arg:expr),* )) => {{
        use tracing::Instrument as _;
        match $self {
            AnyRegistryStore::Sqlite($s) => $target.$method($($arg),*)
                .instrument(orca_push_storage::db_span("sqlite", stringify!($method)))
                .await,
            AnyRegistryStore::Postgres($s) => $target.$method($($arg),*)
                .instrument(orca_push_storage::db_span("postgresql", stringify!($method)))
                .await,
        }
    }};
}

impl RegistryStore for AnyRegistryStore {
    async fn register(
        &self,
        r: &Registration,
        new_id: &str,
        now_ms: i64,
    ) -> Result<String, RegistryError> {
        delegate!(self, s => s.register(r, new_id, now_ms))
    }
    async fn list(&self, host: &str) -> Result<Vec<DeviceRow>, RegistryError> {
        delegate!(self, s => s.list(host))
    }
    async fn delete(&self, host: &str, id: &str) -> Result<bool, RegistryError> {
        delegate!(self, s => s.delete(host, id))
    }
    /// Mostly answered by the resolve cache: only a read of the database gets a `db` span (one
    /// per send otherwise, for no statement).
    async fn resolve(&self, host: &str, ids: &[String]) -> Result<Vec<ResolvedRow>, RegistryError> {
        match self {
            AnyRegistryStore::Sqlite(s) => s.resolve(host, ids).await,
            AnyRegistryStore::Postgres(s) => s.resolve(host, ids).await,
        }
    }
    /// As `resolve`: only a read of the database gets a `db` span, named `for_delivery` as before.
    async fn for_delivery(&self, ids: &[String]) -> Result<Vec<DeliveryRow>, RegistryError> {
        match self {
            AnyRegistryStore::Sqlite(s) => s.for_delivery(ids).await,
            AnyRegistryStore::Postgres(s) => s.for_delivery(ids).await,
        }
    }
    async fn mark_dead(
        &self,
        id: &str,
        token: &str,
        platform: Platform,
        env: Option<ApnsEnvironment>,
        now_ms: i64,
    ) -> Result<bool, RegistryError> {
        delegate!(self, s => s.mark_dead(id, token, platform, env, now_ms))
    }
    async fn hosts_with_devices(&self, hosts: &[String]) -> Result<Vec<String>, RegistryError> {
        delegate!(self, s => s.hosts_with_devices(hosts))
    }
}
