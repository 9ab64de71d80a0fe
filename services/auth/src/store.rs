//! The auth service's tables, behind one trait with a SQLite and a PostgreSQL implementation.

use std::future::Future;

use orca_push_storage::Pool;
use sqlx::Row as _;

mod any;

pub use any::AnyAuthStore;

/// Migrations a newer build applied are left alone (`ignore_missing`): the previous build keeps
/// running on a migrated database until traffic moves, and is what a rollback starts again.
static SQLITE_MIGRATIONS: sqlx::migrate::Migrator = sqlx::migrate::Migrator {
    ignore_missing: true,
    ..sqlx::migrate!("../../migrations/auth/sqlite")
};
static POSTGRES_MIGRATIONS: sqlx::migrate::Migrator = sqlx::migrate::Migrator {
    ignore_missing: true,
    ..sqlx::migrate!("../../migrations/auth/postgres")
};

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
pub trait AuthStore: Clone + Send + Sync + 'static {
    /// The one session key: `candidate` is stored if none is yet (with the legacy window ending at
    /// `legacy_until_ms` if any session row exists, else 0), and whichever key won is returned, so
    /// racing replicas agree. Returns the key bytes and the legacy window's end.
    fn session_key(
        &self,
        candidate: &[u8],
        legacy_until_ms: u64,
        now_ms: u64,
    ) -> impl Future<Output = Result<(Vec<u8>, u64), sqlx::Error>> + Send;

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

    /// Hosts whose last contact is at or before `before_ms`, in fingerprint order after `after`,
    /// at most `limit` (keyset pages, so hosts that are kept never hide the rest).
    fn stale_hosts(
        &self,
        before_ms: u64,
        after: &str,
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

/// Times are stored as signed 64-bit milliseconds in both backends.
pub(crate) fn db_time(ms: u64) -> i64 {
    i64::try_from(ms).unwrap_or(i64::MAX)
}

pub(crate) fn from_db_time(ms: i64) -> u64 {
    u64::try_from(ms).unwrap_or(0)
}

/// The SQL of every operation, written once (`$N` parameters bind the same way on SQLite and
/// PostgreSQL) and expanded for each backend.
/// The PostgreSQL channel that announces new sessions (payload: the host's fingerprint) and the
/// replicas' heartbeats (empty payload) to every auth replica, for `WatchSessions`.
pub const SESSIONS_CHANNEL: &str = "orca_push_sessions";
const ANNOUNCE_SQL: &str = "SELECT pg_notify($1, $2)";

macro_rules! auth_store {
    ($store:ident, $pool:ty, $conn:ty, $announce:expr) => {
        #[derive(Debug, Clone)]
        pub struct $store {
            pool: $pool,
            readers: $pool,
            /// The handshakes' writes, committed together (see `group_writer`); `None` writes each
            /// in a transaction of its own.
            writer: Option<std::sync::Arc<crate::group_writer::GroupWriter>>,
        }

        impl $store {
            /// Writes straight to `pool`, one transaction per write.
            pub fn new(pool: $pool) -> Self {
                let readers = orca_push_storage::ReadPool::readers(&pool);
                Self {
                    pool,
                    readers,
                    writer: None,
                }
            }

            /// Inserts a challenge on `conn`.
            pub(crate) async fn insert_challenge_on(
                conn: &mut $conn,
                c: &NewChallenge<'_>,
            ) -> Result<(), sqlx::Error> {
                sqlx::query(INSERT_CHALLENGE_SQL)
                    .bind(c.challenge_id)
                    .bind(c.host_fingerprint)
                    .bind(c.host_public_key)
                    .bind(c.secret_hash)
                    .bind(c.transcript)
                    .bind(db_time(c.issued_at_ms))
                    .bind(db_time(c.expires_at_ms))
                    .execute(&mut *conn)
                    .await?;
                Ok(())
            }

            /// Consumes the challenge and mints the host's one session, inside the caller's
            /// transaction on `conn`. `false` (and nothing written) if the challenge was already
            /// consumed or expired.
            ///
            /// The first statement writes: on SQLite the transaction holds the write lock (BEGIN
            /// IMMEDIATE). On PostgreSQL (READ COMMITTED) the conditional UPDATE row-locks the
            /// challenge, so of two racing proofs exactly one sees it unconsumed; the host upsert
            /// then locks the host row, serialising two sessions minted for one host, and the
            /// session upsert replaces the older one.
            pub(crate) async fn redeem_on(
                conn: &mut $conn,
                s: &NewSession<'_>,
            ) -> Result<bool, sqlx::Error> {
                let now = db_time(s.now_ms);
                let consumed = sqlx::query(CONSUME_CHALLENGE_SQL)
                    .bind(now)
                    .bind(s.challenge_id)
                    .bind(now)
                    .execute(&mut *conn)
                    .await?;
                if consumed.rows_affected() != 1 {
                    return Ok(false);
                }
                sqlx::query(UPSERT_HOST_SQL)
                    .bind(s.host_fingerprint)
                    .bind(s.host_public_key)
                    .bind(now)
                    .bind(now)
                    .execute(&mut *conn)
                    .await?;
                sqlx::query(UPSERT_SESSION_SQL)
                    .bind(s.token_hash)
                    .bind(s.host_fingerprint)
                    .bind(db_time(s.expires_at_ms))
                    .bind(now)
                    .execute(&mut *conn)
                    .await?;
                // Delivered to every replica's watchers once (and only if) this commits.
                let announce: Option<&str> = $announce;
                if let Some(announce) = announce {
                    sqlx::query(announce)
                        .bind(SESSIONS_CHANNEL)
                        .bind(s.host_fingerprint)
                        .execute(&mut *conn)
                        .await?;
                }
                Ok(true)
            }

            /// Where reads outside a transaction go.
            fn reader(&self) -> &$pool {
                &self.readers
            }
        }

        impl AuthStore for $store {
        async fn session_key(
            &self,
            candidate: &[u8],
            legacy_until_ms: u64,
            now_ms: u64,
        ) -> Result<(Vec<u8>, u64), sqlx::Error> {
            // `WHERE true` lets SQLite parse ON CONFLICT after a SELECT. Untagged sessions can only
            // exist if rows predate the key, so a fresh database opens no legacy window.
            sqlx::query(
                "INSERT INTO push_session_keys (id, mac_key, legacy_until, created_at) \
                 SELECT 1, $1, CASE WHEN EXISTS (SELECT 1 FROM push_sessions) THEN $2 ELSE 0 END, $3 \
                 WHERE true ON CONFLICT (id) DO NOTHING",
            )
            .bind(candidate)
            .bind(db_time(legacy_until_ms))
            .bind(db_time(now_ms))
            .execute(&self.pool)
            .await?;
            let row = sqlx::query("SELECT mac_key, legacy_until FROM push_session_keys WHERE id = 1")
                .fetch_one(&self.pool)
                .await?;
            Ok((row.try_get("mac_key")?, from_db_time(row.try_get("legacy_until")?)))
        }

        async fn insert_challenge(&self, c: &NewChallenge<'_>) -> Result<(), sqlx::Error> {
            if let Some(writer) = &self.writer {
                return writer.insert_challenge(c).await;
            }
            let mut conn = self.pool.acquire().await?;
            Self::insert_challenge_on(&mut conn, c).await
        }

        async fn find_challenge(
            &self,
            challenge_id: &str,
        ) -> Result<Option<ChallengeRow>, sqlx::Error> {
            let row = sqlx::query(
                "SELECT host_fingerprint, host_public_key, secret_hash, expires_at, consumed_at \
                 FROM push_challenges WHERE challenge_id = $1",
            )
            .bind(challenge_id)
            .fetch_optional(self.reader())
            .await?;
            row.map(|r| {
                Ok(ChallengeRow {
                    host_fingerprint: r.try_get("host_fingerprint")?,
                    host_public_key: r.try_get("host_public_key")?,
                    secret_hash: r.try_get("secret_hash")?,
                    expires_at_ms: from_db_time(r.try_get("expires_at")?),
                    consumed_at_ms: r
                        .try_get::<Option<i64>, _>("consumed_at")?
                        .map(from_db_time),
                })
            })
            .transpose()
        }

        async fn redeem_challenge(&self, s: &NewSession<'_>) -> Result<bool, sqlx::Error> {
            if let Some(writer) = &self.writer {
                return writer.redeem(s).await;
            }
            let mut tx = self.pool.begin().await?;
            let redeemed = Self::redeem_on(&mut tx, s).await?;
            if redeemed {
                tx.commit().await?;
            } else {
                tx.rollback().await?;
            }
            Ok(redeemed)
        }

        async fn find_session(&self, token_hash: &str) -> Result<Option<SessionRow>, sqlx::Error> {
            let row = sqlx::query(
                "SELECT s.host_fingerprint, s.expires_at, h.last_seen_at \
                 FROM push_sessions s LEFT JOIN push_hosts h ON h.host_fingerprint = s.host_fingerprint \
                 WHERE s.token_hash = $1",
            )
            .bind(token_hash)
            .fetch_optional(self.reader())
            .await?;
            row.map(|r| {
                Ok(SessionRow {
                    host_fingerprint: r.try_get("host_fingerprint")?,
                    expires_at_ms: from_db_time(r.try_get("expires_at")?),
                    last_seen_at_ms: r
                        .try_get::<Option<i64>, _>("last_seen_at")?
                        .map(from_db_time),
                })
            })
            .transpose()
        }

        async fn host_last_seen(&self, fp: &str) -> Result<Option<u64>, sqlx::Error> {
            let seen: Option<i64> =
                sqlx::query_scalar("SELECT last_seen_at FROM push_hosts WHERE host_fingerprint = $1")
                    .bind(fp)
                    .fetch_optional(self.reader())
                    .await?;
            Ok(seen.map(from_db_time))
        }

        async fn touch_host(
            &self,
            fp: &str,
            now_ms: u64,
            stale_before_ms: u64,
        ) -> Result<(), sqlx::Error> {
            sqlx::query(
                "UPDATE push_hosts SET last_seen_at = $1 WHERE host_fingerprint = $2 AND last_seen_at <= $3",
            )
            .bind(db_time(now_ms))
            .bind(fp)
            .bind(db_time(stale_before_ms))
            .execute(&self.pool)
            .await?;
            Ok(())
        }

        async fn stale_hosts(&self, before_ms: u64, after: &str, limit: i64) -> Result<Vec<String>, sqlx::Error> {
            sqlx::query_scalar(
                "SELECT host_fingerprint FROM push_hosts WHERE last_seen_at <= $1 AND host_fingerprint > $2 \
                 ORDER BY host_fingerprint LIMIT $3",
            )
            .bind(db_time(before_ms))
            .bind(after)
            .bind(limit)
            .fetch_all(self.reader())
            .await
        }

        async fn delete_stale_hosts(
            &self,
            hosts: &[String],
            before_ms: u64,
        ) -> Result<u64, sqlx::Error> {
            let mut deleted = 0;
            for host in hosts {
                deleted += sqlx::query(
                    "DELETE FROM push_hosts WHERE host_fingerprint = $1 AND last_seen_at <= $2",
                )
                .bind(host)
                .bind(db_time(before_ms))
                .execute(&self.pool)
                .await?
                .rows_affected();
            }
            Ok(deleted)
        }

        async fn prune(
            &self,
            challenges_before_ms: u64,
            sessions_before_ms: u64,
        ) -> Result<Pruned, sqlx::Error> {
            let challenges = sqlx::query("DELETE FROM push_challenges WHERE expires_at < $1")
                .bind(db_time(challenges_before_ms))
                .execute(&self.pool)
                .await?
                .rows_affected();
            let sessions = sqlx::query("DELETE FROM push_sessions WHERE expires_at < $1")
                .bind(db_time(sessions_before_ms))
                .execute(&self.pool)
                .await?
                .rows_affected();
            Ok(Pruned {
                challenges,
                sessions,
            })
        }
}
    };
}

const INSERT_CHALLENGE_SQL: &str = "INSERT INTO push_challenges \
     (challenge_id, host_fingerprint, host_public_key, secret_hash, transcript, issued_at, expires_at) \
     VALUES ($1, $2, $3, $4, $5, $6, $7)";
const CONSUME_CHALLENGE_SQL: &str = "UPDATE push_challenges SET consumed_at = $1 \
     WHERE challenge_id = $2 AND consumed_at IS NULL AND expires_at > $3";
const UPSERT_HOST_SQL: &str = "INSERT INTO push_hosts \
     (host_fingerprint, host_public_key, created_at, last_seen_at) VALUES ($1, $2, $3, $4) \
     ON CONFLICT (host_fingerprint) DO UPDATE SET \
     host_public_key = excluded.host_public_key, last_seen_at = excluded.last_seen_at";
const UPSERT_SESSION_SQL: &str = "INSERT INTO push_sessions \
     (token_hash, host_fingerprint, expires_at, created_at) VALUES ($1, $2, $3, $4) \
     ON CONFLICT (host_fingerprint) DO UPDATE SET \
     token_hash = excluded.token_hash, expires_at = excluded.expires_at, \
     created_at = excluded.created_at";

// One process owns a SQLite file: `HostAuth` announces its sessions itself.
auth_store!(
    SqliteAuthStore,
    sqlx::SqlitePool,
    sqlx::SqliteConnection,
    None
);
auth_store!(
    PgAuthStore,
    sqlx::PgPool,
    sqlx::PgConnection,
    Some(ANNOUNCE_SQL)
);

impl SqliteAuthStore {
    /// Commits the handshakes' writes that arrive together in one transaction (see
    /// `group_writer`). Must be called inside a Tokio runtime.
    pub fn grouped(pool: sqlx::SqlitePool) -> Self {
        let writer = crate::group_writer::GroupWriter::spawn(crate::group_writer::SqliteGroups(
            pool.clone(),
        ));
        Self {
            writer: Some(std::sync::Arc::new(writer)),
            ..Self::new(pool)
        }
    }
}

impl PgAuthStore {
    /// Commits the handshakes' writes that arrive together in one transaction of a few
    /// multi-row statements (see `pg_group`). Must be called inside a Tokio runtime.
    pub fn grouped(pool: sqlx::PgPool) -> Self {
        let alone = Self::new(pool);
        let writer =
            crate::group_writer::GroupWriter::spawn(crate::pg_group::PgGroups(alone.clone()));
        Self {
            writer: Some(std::sync::Arc::new(writer)),
            ..alone
        }
    }

    pub fn pool(&self) -> &sqlx::PgPool {
        &self.pool
    }
}
