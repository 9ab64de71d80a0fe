//! `push_devices`, behind one trait. The SQL is written once (`$N` parameters work in both SQLite
//! and PostgreSQL) and instantiated for each backend; only how a write transaction takes its lock
//! differs.

use std::future::Future;

use orca_push_storage::Pool;
use sqlx::Row as _;

use crate::device::{
    ApnsEnvironment, DeviceFilter, LIST_LIMIT, MAX_DEVICES_PER_HOST, Platform, Registration,
};
use crate::error::RegistryError;

mod any;
mod backends;

pub use any::AnyRegistryStore;
pub use backends::{PgRegistryStore, SqliteRegistryStore};

/// Migrations a newer build applied are left alone (`ignore_missing`): the previous build keeps
/// running on a migrated database until traffic moves, and is what a rollback starts again.
static SQLITE_MIGRATIONS: sqlx::migrate::Migrator = sqlx::migrate::Migrator {
    ignore_missing: true,
    ..sqlx::migrate!("../../migrations/registry/sqlite")
};
static POSTGRES_MIGRATIONS: sqlx::migrate::Migrator = sqlx::migrate::Migrator {
    ignore_missing: true,
    ..sqlx::migrate!("../../migrations/registry/postgres")
};

pub async fn migrate(pool: &Pool) -> Result<(), sqlx::migrate::MigrateError> {
    match pool {
        Pool::Sqlite(p) => SQLITE_MIGRATIONS.run(p).await,
        Pool::Postgres(p) => POSTGRES_MIGRATIONS.run(p).await,
    }
}

/// A registration as the host sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceRow {
    pub registration_id: String,
    pub device_id: String,
    pub platform: Platform,
    pub dead: bool,
    pub filter: Option<DeviceFilter>,
}

/// A registration as a delivery needs it. Its `Debug` leaves the token out.
#[derive(Clone, PartialEq, Eq)]
pub struct DeliveryRow {
    pub registration_id: String,
    pub host_fingerprint: String,
    pub platform: Platform,
    pub token: String,
    pub apns_environment: Option<ApnsEnvironment>,
    pub dead: bool,
}

impl std::fmt::Debug for DeliveryRow {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeliveryRow")
            .field("registration_id", &self.registration_id)
            .field("platform", &self.platform)
            .field("token_bytes", &self.token.len())
            .field("apns_environment", &self.apns_environment)
            .field("dead", &self.dead)
            .finish_non_exhaustive()
    }
}

/// What send needs to know of one id the host owns.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResolvedRow {
    pub registration_id: String,
    pub platform: Platform,
    pub dead: bool,
}

pub trait RegistryStore: Send + Sync + 'static {
    /// Upserts by (host, device id) under the host's lock; `new_id` is used only for a new row.
    fn register(
        &self,
        registration: &Registration,
        new_id: &str,
        now_ms: i64,
    ) -> impl Future<Output = Result<String, RegistryError>> + Send;
    fn list(
        &self,
        host: &str,
    ) -> impl Future<Output = Result<Vec<DeviceRow>, RegistryError>> + Send;
    fn delete(
        &self,
        host: &str,
        registration_id: &str,
    ) -> impl Future<Output = Result<bool, RegistryError>> + Send;
    fn resolve(
        &self,
        host: &str,
        ids: &[String],
    ) -> impl Future<Output = Result<Vec<ResolvedRow>, RegistryError>> + Send;
    fn for_delivery(
        &self,
        ids: &[String],
    ) -> impl Future<Output = Result<Vec<DeliveryRow>, RegistryError>> + Send;
    fn mark_dead(
        &self,
        registration_id: &str,
        token: &str,
        platform: Platform,
        apns_environment: Option<ApnsEnvironment>,
        now_ms: i64,
    ) -> impl Future<Output = Result<bool, RegistryError>> + Send;
    fn hosts_with_devices(
        &self,
        hosts: &[String],
    ) -> impl Future<Output = Result<Vec<String>, RegistryError>> + Send;
}

/// The PostgreSQL channel on which every replica's device writes name their host (and relays send
/// heartbeats, with an empty payload): see `resolve_cache`.
pub const DEVICES_CHANNEL: &str = "orca_push_devices";

/// A `DeliveryRow`'s columns (`delivery_row`), before the condition.
macro_rules! delivery_columns {
    () => {
        "SELECT registration_id, host_fingerprint, platform, token, apns_environment, dead_at \
         FROM push_devices WHERE "
    };
}
const HOST_REGISTRATIONS_SQL: &str = concat!(delivery_columns!(), "host_fingerprint = $1");

fn platform_of(value: &str) -> Result<Platform, sqlx::Error> {
    Platform::parse(value)
        .ok_or_else(|| sqlx::Error::Decode(format!("unknown platform {value:?}").into()))
}

fn environment_of(value: Option<String>) -> Result<Option<ApnsEnvironment>, sqlx::Error> {
    value
        .map(|v| {
            ApnsEnvironment::parse(&v).ok_or_else(|| {
                sqlx::Error::Decode(format!("unknown apns environment {v:?}").into())
            })
        })
        .transpose()
}

/// SQL shared by both backends; each expands it over its own pool and row types.
macro_rules! registry_store {
    ($store:ident, $row:ty) => {
        impl $store {
            /// Every registration of `host` (at most 64, by the device cap), as a delivery needs
            /// it: one static statement, whatever ids a send names.
            async fn host_registrations(&self, host: &str) -> Result<Vec<DeliveryRow>, RegistryError> {
                use tracing::Instrument as _;
                let rows = sqlx::query(HOST_REGISTRATIONS_SQL)
                    .bind(host)
                    .fetch_all(self.reader())
                    .instrument(orca_push_storage::db_span(Self::DB_SYSTEM, "resolve"))
                    .await?;
                rows.iter()
                    .map(Self::delivery_row)
                    .collect::<Result<_, sqlx::Error>>()
                    .map_err(Into::into)
            }

            /// A row of `delivery_columns!`.
            fn delivery_row(row: &$row) -> Result<DeliveryRow, sqlx::Error> {
                Ok(DeliveryRow {
                    registration_id: row.try_get("registration_id")?,
                    host_fingerprint: row.try_get("host_fingerprint")?,
                    platform: platform_of(row.try_get("platform")?)?,
                    token: row.try_get("token")?,
                    apns_environment: environment_of(row.try_get("apns_environment")?)?,
                    dead: row.try_get::<Option<i64>, _>("dead_at")?.is_some(),
                })
            }

            /// The rows of `ids` from the database, keyed by id (unknown ids absent).
            async fn read_deliveries(
                &self,
                ids: &[&String],
            ) -> Result<std::collections::HashMap<String, DeliveryRow>, RegistryError> {
                use tracing::Instrument as _;
                let mut query = sqlx::QueryBuilder::new(delivery_columns!());
                query.push("registration_id IN (");
                let mut list = query.separated(", ");
                for id in ids {
                    list.push_bind(*id);
                }
                query.push(")");
                let rows = query
                    .build()
                    .fetch_all(self.reader())
                    .instrument(orca_push_storage::db_span(Self::DB_SYSTEM, "for_delivery"))
                    .await?;
                let mut found = std::collections::HashMap::with_capacity(rows.len());
                for row in &rows {
                    let row = Self::delivery_row(row)?;
                    found.insert(row.registration_id.clone(), row);
                }
                Ok(found)
            }

            fn changed(&self, host: &str) {
                if let Some(cache) = self.resolve_cache() {
                    cache.invalidate(host);
                }
            }
        }

        impl RegistryStore for $store {
            async fn register(
                &self,
                r: &Registration,
                new_id: &str,
                now_ms: i64,
            ) -> Result<String, RegistryError> {
                let mut tx = self.begin_host_write(&r.host_fingerprint).await?;
                let environment = r.apns_environment.map(ApnsEnvironment::as_str);
                let filter = r.filter.as_ref().map(DeviceFilter::to_json);
                let existing: Option<String> = sqlx::query_scalar(
                    "SELECT registration_id FROM push_devices WHERE host_fingerprint = $1 AND device_id = $2",
                )
                .bind(&r.host_fingerprint)
                .bind(&r.device_id)
                .fetch_optional(&mut *tx)
                .await?;
                // Updated only if the row is still there: on PostgreSQL a delete of it (which
                // takes no host lock) may commit between the read and the update, and answering
                // its id would hand the host a registration that no longer exists.
                let updated = match existing {
                    Some(id) => {
                        // A new token (or platform or environment) revives a dead registration; the
                        // same token stays dead, since the provider already refused it.
                        let updated = sqlx::query(
                            "UPDATE push_devices SET \
                             dead_at = CASE WHEN token = $2 AND platform = $3 \
                               AND COALESCE(apns_environment, '') = COALESCE($4, '') THEN dead_at ELSE NULL END, \
                             platform = $3, token = $2, apns_environment = $4, filter_json = $5, updated_at = $6 \
                             WHERE registration_id = $1",
                        )
                        .bind(&id)
                        .bind(&r.token)
                        .bind(r.platform.as_str())
                        .bind(environment)
                        .bind(&filter)
                        .bind(now_ms)
                        .execute(&mut *tx)
                        .await?;
                        (updated.rows_affected() == 1).then_some(id)
                    }
                    None => None,
                };
                let id = match updated {
                    Some(id) => id,
                    None => {
                        let count: i64 = sqlx::query_scalar(
                            "SELECT COUNT(*) FROM push_devices WHERE host_fingerprint = $1",
                        )
                        .bind(&r.host_fingerprint)
                        .fetch_one(&mut *tx)
                        .await?;
                        if count >= MAX_DEVICES_PER_HOST {
                            return Err(RegistryError::TooManyDevices);
                        }
                        sqlx::query(
                            "INSERT INTO push_devices (registration_id, host_fingerprint, device_id, platform, \
                             token, apns_environment, filter_json, dead_at, created_at, updated_at) \
                             VALUES ($1, $2, $3, $4, $5, $6, $7, NULL, $8, $8)",
                        )
                        .bind(new_id)
                        .bind(&r.host_fingerprint)
                        .bind(&r.device_id)
                        .bind(r.platform.as_str())
                        .bind(&r.token)
                        .bind(environment)
                        .bind(&filter)
                        .bind(now_ms)
                        .execute(&mut *tx)
                        .await?;
                        new_id.to_owned()
                    }
                };
                if let Some(announce) = Self::ANNOUNCE_SQL {
                    sqlx::query(announce)
                        .bind(DEVICES_CHANNEL)
                        .bind(&r.host_fingerprint)
                        .execute(&mut *tx)
                        .await?;
                }
                tx.commit().await?;
                self.changed(&r.host_fingerprint);
                Ok(id)
            }

            async fn list(&self, host: &str) -> Result<Vec<DeviceRow>, RegistryError> {
                let rows = sqlx::query(
                    "SELECT registration_id, device_id, platform, dead_at, filter_json FROM push_devices \
                     WHERE host_fingerprint = $1 ORDER BY created_at, registration_id LIMIT $2",
                )
                .bind(host)
                .bind(LIST_LIMIT)
                .fetch_all(self.reader())
                .await?;
                rows.iter()
                    .map(|row| {
                        Ok(DeviceRow {
                            registration_id: row.try_get("registration_id")?,
                            device_id: row.try_get("device_id")?,
                            platform: platform_of(row.try_get("platform")?)?,
                            dead: row.try_get::<Option<i64>, _>("dead_at")?.is_some(),
                            filter: row
                                .try_get::<Option<String>, _>("filter_json")?
                                .and_then(|json| DeviceFilter::from_json(&json)),
                        })
                    })
                    .collect::<Result<_, sqlx::Error>>()
                    .map_err(Into::into)
            }

            async fn delete(&self, host: &str, registration_id: &str) -> Result<bool, RegistryError> {
                let deleted: Option<String> = sqlx::query_scalar(Self::DELETE_SQL)
                    .bind(registration_id)
                    .bind(host)
                    .bind(DEVICES_CHANNEL)
                    .fetch_optional(&self.pool)
                    .await?;
                self.changed(host);
                Ok(deleted.is_some())
            }

            async fn resolve(&self, host: &str, ids: &[String]) -> Result<Vec<ResolvedRow>, RegistryError> {
                let owned = match self.resolve_cache() {
                    Some(cache) => cache.host(host, || self.host_registrations(host)).await?,
                    None => self.host_registrations(host).await?.into(),
                };
                // In the order asked; ids the host does not own are left out.
                Ok(ids
                    .iter()
                    .filter_map(|id| {
                        owned
                            .iter()
                            .find(|row| row.registration_id == *id)
                            .map(|row| ResolvedRow {
                                registration_id: row.registration_id.clone(),
                                platform: row.platform,
                                dead: row.dead,
                            })
                    })
                    .collect())
            }

            async fn for_delivery(&self, ids: &[String]) -> Result<Vec<DeliveryRow>, RegistryError> {
                if ids.is_empty() {
                    return Ok(Vec::new());
                }
                // The phones of hosts a send resolved are kept (`resolve_cache`); the rest in one
                // read (ids are capped at MAX_IDS_PER_CALL).
                let (mut rows, missing) = match self.resolve_cache() {
                    Some(cache) => cache.deliveries(ids),
                    None => (vec![None; ids.len()], (0..ids.len()).collect()),
                };
                if !missing.is_empty() {
                    let asked: Vec<&String> = missing.iter().map(|&i| &ids[i]).collect();
                    let mut found = self.read_deliveries(&asked).await?;
                    for i in missing {
                        rows[i] = found.remove(&ids[i]);
                    }
                }
                // In the order asked, once each; unknown ids are left out.
                let mut seen = std::collections::HashSet::with_capacity(ids.len());
                Ok(ids
                    .iter()
                    .zip(rows)
                    .filter_map(|(id, row)| if seen.insert(id.as_str()) { row } else { None })
                    .collect())
            }

            async fn mark_dead(
                &self,
                registration_id: &str,
                token: &str,
                platform: Platform,
                apns_environment: Option<ApnsEnvironment>,
                now_ms: i64,
            ) -> Result<bool, RegistryError> {
                let marked: Option<String> = sqlx::query_scalar(Self::MARK_DEAD_SQL)
                .bind(registration_id)
                .bind(token)
                .bind(platform.as_str())
                .bind(apns_environment.map(ApnsEnvironment::as_str))
                .bind(now_ms)
                .bind(DEVICES_CHANNEL)
                .fetch_optional(&self.pool)
                .await?;
                if let Some(host) = &marked {
                    self.changed(host);
                }
                Ok(marked.is_some())
            }

            async fn hosts_with_devices(&self, hosts: &[String]) -> Result<Vec<String>, RegistryError> {
                let mut out = Vec::new();
                for host in hosts {
                    let has: Option<i64> = sqlx::query_scalar(
                        "SELECT CAST(1 AS BIGINT) FROM push_devices WHERE host_fingerprint = $1 LIMIT 1",
                    )
                    .bind(host)
                    .fetch_optional(self.reader())
                    .await?;
                    if has.is_some() {
                        out.push(host.clone());
                    }
                }
                Ok(out)
            }
        }
    };
}

registry_store!(SqliteRegistryStore, sqlx::sqlite::SqliteRow);
registry_store!(PgRegistryStore, sqlx::postgres::PgRow);
