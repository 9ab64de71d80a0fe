//! Either backend behind one type, chosen at start-up from the pool.

use orca_push_storage::Pool;

use super::{
    AuthStore, ChallengeRow, NewChallenge, NewSession, PgAuthStore, Pruned, SessionRow,
    SqliteAuthStore,
};

/// Either backend, chosen at start-up from the configured database.
#[derive(Debug, Clone)]
pub enum AnyAuthStore {
    Sqlite(SqliteAuthStore),
    Postgres(PgAuthStore),
}

impl AnyAuthStore {
    pub fn new(pool: Pool) -> Self {
        match pool {
            Pool::Sqlite(p) => Self::Sqlite(SqliteAuthStore::grouped(p)),
            Pool::Postgres(p) => Self::Postgres(PgAuthStore::grouped(p)),
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
            AnyAuthStore::Sqlite($s) => $target.$method($($arg),*)
                .instrument(orca_push_storage::db_span("sqlite", stringify!($method)))
                .await,
            AnyAuthStore::Postgres($s) => $target.$method($($arg),*)
                .instrument(orca_push_storage::db_span("postgresql", stringify!($method)))
                .await,
        }
    }};
}

impl AuthStore for AnyAuthStore {
    async fn session_key(
        &self,
        candidate: &[u8],
        legacy_until_ms: u64,
        now_ms: u64,
    ) -> Result<(Vec<u8>, u64), sqlx::Error> {
        delegate!(self, s => s.session_key(candidate, legacy_until_ms, now_ms))
    }
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
    async fn stale_hosts(
        &self,
        before_ms: u64,
        after: &str,
        limit: i64,
    ) -> Result<Vec<String>, sqlx::Error> {
        delegate!(self, s => s.stale_hosts(before_ms, after, limit))
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
