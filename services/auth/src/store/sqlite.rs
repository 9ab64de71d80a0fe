use sqlx::{Row as _, SqlitePool};

use super::{
    AuthStore, ChallengeRow, NewChallenge, NewSession, Pruned, SessionRow, db_time, from_db_time,
};

#[derive(Debug, Clone)]
pub struct SqliteAuthStore {
    pool: SqlitePool,
}

impl SqliteAuthStore {
    pub fn new(pool: SqlitePool) -> Self {
        Self { pool }
    }
}

impl AuthStore for SqliteAuthStore {
    async fn insert_challenge(&self, c: &NewChallenge<'_>) -> Result<(), sqlx::Error> {
        sqlx::query(
            "INSERT INTO push_challenges \
             (challenge_id, host_fingerprint, host_public_key, secret_hash, transcript, issued_at, expires_at) \
             VALUES (?, ?, ?, ?, ?, ?, ?)",
        )
        .bind(c.challenge_id)
        .bind(c.host_fingerprint)
        .bind(c.host_public_key)
        .bind(c.secret_hash)
        .bind(c.transcript)
        .bind(db_time(c.issued_at_ms))
        .bind(db_time(c.expires_at_ms))
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    async fn find_challenge(
        &self,
        challenge_id: &str,
    ) -> Result<Option<ChallengeRow>, sqlx::Error> {
        let row = sqlx::query(
            "SELECT host_fingerprint, host_public_key, secret_hash, expires_at, consumed_at \
             FROM push_challenges WHERE challenge_id = ?",
        )
        .bind(challenge_id)
        .fetch_optional(&self.pool)
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
        let now = db_time(s.now_ms);
        let mut tx = self.pool.begin().await?;
        // The first statement writes, so SQLite takes the write lock at once (waiting on busy_timeout)
        // instead of failing a read-to-write upgrade later.
        let consumed = sqlx::query(
            "UPDATE push_challenges SET consumed_at = ? \
             WHERE challenge_id = ? AND consumed_at IS NULL AND expires_at > ?",
        )
        .bind(now)
        .bind(s.challenge_id)
        .bind(now)
        .execute(&mut *tx)
        .await?;
        if consumed.rows_affected() != 1 {
            tx.rollback().await?;
            return Ok(false);
        }
        sqlx::query(
            "INSERT INTO push_hosts (host_fingerprint, host_public_key, created_at, last_seen_at) \
             VALUES (?, ?, ?, ?) \
             ON CONFLICT (host_fingerprint) DO UPDATE SET \
             host_public_key = excluded.host_public_key, last_seen_at = excluded.last_seen_at",
        )
        .bind(s.host_fingerprint)
        .bind(s.host_public_key)
        .bind(now)
        .bind(now)
        .execute(&mut *tx)
        .await?;
        sqlx::query(
            "INSERT INTO push_sessions (token_hash, host_fingerprint, expires_at, created_at) \
             VALUES (?, ?, ?, ?) \
             ON CONFLICT (host_fingerprint) DO UPDATE SET \
             token_hash = excluded.token_hash, expires_at = excluded.expires_at, \
             created_at = excluded.created_at",
        )
        .bind(s.token_hash)
        .bind(s.host_fingerprint)
        .bind(db_time(s.expires_at_ms))
        .bind(now)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(true)
    }

    async fn find_session(&self, token_hash: &str) -> Result<Option<SessionRow>, sqlx::Error> {
        let row = sqlx::query(
            "SELECT s.host_fingerprint, s.expires_at, h.last_seen_at \
             FROM push_sessions s LEFT JOIN push_hosts h ON h.host_fingerprint = s.host_fingerprint \
             WHERE s.token_hash = ?",
        )
        .bind(token_hash)
        .fetch_optional(&self.pool)
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
            sqlx::query_scalar("SELECT last_seen_at FROM push_hosts WHERE host_fingerprint = ?")
                .bind(fp)
                .fetch_optional(&self.pool)
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
            "UPDATE push_hosts SET last_seen_at = ? WHERE host_fingerprint = ? AND last_seen_at <= ?",
        )
        .bind(db_time(now_ms))
        .bind(fp)
        .bind(db_time(stale_before_ms))
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    async fn stale_hosts(&self, before_ms: u64, limit: i64) -> Result<Vec<String>, sqlx::Error> {
        sqlx::query_scalar(
            "SELECT host_fingerprint FROM push_hosts WHERE last_seen_at <= ? \
             ORDER BY last_seen_at LIMIT ?",
        )
        .bind(db_time(before_ms))
        .bind(limit)
        .fetch_all(&self.pool)
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
                "DELETE FROM push_hosts WHERE host_fingerprint = ? AND last_seen_at <= ?",
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
        let challenges = sqlx::query("DELETE FROM push_challenges WHERE expires_at < ?")
            .bind(db_time(challenges_before_ms))
            .execute(&self.pool)
            .await?
            .rows_affected();
        let sessions = sqlx::query("DELETE FROM push_sessions WHERE expires_at < ?")
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
