//! The auth service's tables, behind one trait with a SQLite and a PostgreSQL implementation.

mod postgres;
mod sqlite;

use std::future::Future;

pub use postgres::PgAuthStore;
pub use sqlite::SqliteAuthStore;

use orca_push_storage::Pool;

static SQLITE_MIGRATIONS: sqlx::migrate::Migrator = sqlx::migrate!("../../migrations/auth/sqlite");
static POSTGRES_MIGRATIONS: sqlx::migrate::Migrator =
    sqlx::migrate!("../../migrations/auth/postgres");

/// Applies the auth migrations for the pool's backend.
pub async fn migrate(pool: &Pool) -> Result<(), sqlx::migrate::MigrateError> {
    match pool {
        Pool::Sqlite(p) => SQLITE_MIGRATIONS.run(p).await,
        Pool::Postgres(p) => POSTGRES_MIGRATIONS.run(p).await,
    }
}

pub struct NewChallenge<'a> {
    pub challenge_id: &'a str,
    pub host_fingerprint: &'a str,
    pub host_public_key: &'a [u8],
    pub secret_hash: &'a str,
    pub transcript: &'a [u8],
    pub issued_at_ms: u64,
    pub expires_at_ms: u64,
}

#[derive(Debug, Clone)]
pub struct ChallengeRow {
    pub host_fingerprint: String,
    pub host_public_key: Vec<u8>,
    pub secret_hash: String,
    pub expires_at_ms: u64,
    pub consumed_at_ms: Option<u64>,
}

pub struct NewSession<'a> {
    pub challenge_id: &'a str,
    pub host_fingerprint: &'a str,
    pub host_public_key: &'a [u8],
    pub token_hash: &'a str,
    pub now_ms: u64,
    pub expires_at_ms: u64,
}

#[derive(Debug, Clone)]
pub struct SessionRow {
    pub host_fingerprint: String,
    pub expires_at_ms: u64,
    /// None when the host row is gone (pruned); the session still stands until it expires.
    pub last_seen_at_ms: Option<u64>,
}

#[derive(Debug, Clone, Copy, Default)]
pub struct Pruned {
    pub challenges: u64,
    pub sessions: u64,
}

/// Storage of challenges, hosts and sessions.
pub trait AuthStore: Send + Sync + 'static {
    fn insert_challenge(
        &self,
        challenge: &NewChallenge<'_>,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send;

    fn find_challenge(
        &self,
        challenge_id: &str,
    ) -> impl Future<Output = Result<Option<ChallengeRow>, sqlx::Error>> + Send;

    /// In one transaction: consume the challenge if it is unconsumed and unexpired at `now_ms`, upsert
    /// the host, and replace the host's session. False when the challenge was no longer redeemable.
    fn redeem_challenge(
        &self,
        session: &NewSession<'_>,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send;

    fn find_session(
        &self,
        token_hash: &str,
    ) -> impl Future<Output = Result<Option<SessionRow>, sqlx::Error>> + Send;

    /// The host's last contact, if the host row exists.
    fn host_last_seen(
        &self,
        host_fingerprint: &str,
    ) -> impl Future<Output = Result<Option<u64>, sqlx::Error>> + Send;

    /// Sets `last_seen_at = now_ms` if it is at or before `stale_before_ms`.
    fn touch_host(
        &self,
        host_fingerprint: &str,
        now_ms: u64,
        stale_before_ms: u64,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send;

    /// Hosts whose last contact is at or before `before_ms`, at most `limit`.
    fn stale_hosts(
        &self,
        before_ms: u64,
        limit: i64,
    ) -> impl Future<Output = Result<Vec<String>, sqlx::Error>> + Send;

    /// Deletes these hosts if their last contact is still at or before `before_ms` (a host seen
    /// since the registry was asked is kept).
    fn delete_stale_hosts(
        &self,
        hosts: &[String],
        before_ms: u64,
    ) -> impl Future<Output = Result<u64, sqlx::Error>> + Send;

    /// Deletes challenges that expired before `challenges_before_ms` and sessions that expired
    /// before `sessions_before_ms`.
    fn prune(
        &self,
        challenges_before_ms: u64,
        sessions_before_ms: u64,
    ) -> impl Future<Output = Result<Pruned, sqlx::Error>> + Send;
}

/// Either backend, chosen at start-up from the configured database.
#[derive(Debug, Clone)]
pub enum AnyAuthStore {
    Sqlite(SqliteAuthStore),
    Postgres(PgAuthStore),
}

impl AnyAuthStore {
    pub fn new(pool: Pool) -> Self {
        match pool {
            Pool::Sqlite(p) => Self::Sqlite(SqliteAuthStore::new(p)),
            Pool::Postgres(p) => Self::Postgres(PgAuthStore::new(p)),
        }
    }
}

macro_rules! delegate {
    ($self:ident, $store:ident => $call:expr) => {
        match $self {
            AnyAuthStore::Sqlite($store) => $call.await,
            AnyAuthStore::Postgres($store) => $call.await,
        }
    };
}

impl AuthStore for AnyAuthStore {
    async fn insert_challenge(&self, c: &NewChallenge<'_>) -> Result<(), sqlx::Error> {
        delegate!(self, s => s.insert_challenge(c))
    }
    async fn find_challenge(&self, id: &str) -> Result<Option<ChallengeRow>, sqlx::Error> {
        delegate!(self, s => s.find_challenge(id))
    }
    async fn redeem_challenge(&self, session: &NewSession<'_>) -> Result<bool, sqlx::Error> {
        delegate!(self, s => s.redeem_challenge(session))
    }
    async fn find_session(&self, token_hash: &str) -> Result<Option<SessionRow>, sqlx::Error> {
        delegate!(self, s => s.find_session(token_hash))
    }
    async fn host_last_seen(&self, fp: &str) -> Result<Option<u64>, sqlx::Error> {
        delegate!(self, s => s.host_last_seen(fp))
    }
    async fn touch_host(
        &self,
        fp: &str,
        now_ms: u64,
        stale_before_ms: u64,
    ) -> Result<(), sqlx::Error> {
        delegate!(self, s => s.touch_host(fp, now_ms, stale_before_ms))
    }
    async fn stale_hosts(&self, before_ms: u64, limit: i64) -> Result<Vec<String>, sqlx::Error> {
        delegate!(self, s => s.stale_hosts(before_ms, limit))
    }
    async fn delete_stale_hosts(
        &self,
        hosts: &[String],
        before_ms: u64,
    ) -> Result<u64, sqlx::Error> {
        delegate!(self, s => s.delete_stale_hosts(hosts, before_ms))
    }
    async fn prune(
        &self,
        challenges_before_ms: u64,
        sessions_before_ms: u64,
    ) -> Result<Pruned, sqlx::Error> {
        delegate!(self, s => s.prune(challenges_before_ms, sessions_before_ms))
    }
}

/// Times are stored as signed 64-bit milliseconds in both backends.
pub(crate) fn db_time(ms: u64) -> i64 {
    i64::try_from(ms).unwrap_or(i64::MAX)
}

pub(crate) fn from_db_time(ms: i64) -> u64 {
    u64::try_from(ms).unwrap_or(0)
}
