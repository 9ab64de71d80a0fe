//! SQLite: the handshakes' writes that arrive together commit together. A challenge's insert and a
//! proof's redemption (consume the challenge, upsert the host, replace its session) queue here; a
//! writer task takes whatever is waiting, runs it in one `BEGIN IMMEDIATE` transaction in arrival
//! order, commits, and only then answers each caller. A handshake thus costs its statements, but
//! not a transaction of its own (two statement hops and a WAL commit each, on sqlx's worker
//! thread).
//!
//! Each write keeps its own outcome. A redemption whose challenge is spent writes nothing and
//! answers `false`, as alone. If any statement of a group fails, the whole transaction is rolled
//! back and the group is written again one write per transaction, so one bad write never fails its
//! neighbours and never leaves half of itself behind.

use tokio::sync::{mpsc, oneshot};

use crate::store::{NewChallenge, NewSession, SqliteAuthStore};

/// Writes in one transaction at most.
pub const MAX_GROUP: usize = 64;
/// Writes waiting at most; a caller past it waits for room.
const BACKLOG: usize = 1024;

/// A challenge, owned for the trip to the writer.
struct Challenge {
    challenge_id: String,
    host_fingerprint: String,
    host_public_key: Vec<u8>,
    secret_hash: String,
    transcript: Vec<u8>,
    issued_at_ms: u64,
    expires_at_ms: u64,
}

impl Challenge {
    fn of(c: &NewChallenge<'_>) -> Self {
        Self {
            challenge_id: c.challenge_id.to_owned(),
            host_fingerprint: c.host_fingerprint.to_owned(),
            host_public_key: c.host_public_key.to_owned(),
            secret_hash: c.secret_hash.to_owned(),
            transcript: c.transcript.to_owned(),
            issued_at_ms: c.issued_at_ms,
            expires_at_ms: c.expires_at_ms,
        }
    }

    fn borrowed(&self) -> NewChallenge<'_> {
        NewChallenge {
            challenge_id: &self.challenge_id,
            host_fingerprint: &self.host_fingerprint,
            host_public_key: &self.host_public_key,
            secret_hash: &self.secret_hash,
            transcript: &self.transcript,
            issued_at_ms: self.issued_at_ms,
            expires_at_ms: self.expires_at_ms,
        }
    }
}

/// A redemption, owned for the trip to the writer.
struct Redemption {
    challenge_id: String,
    host_fingerprint: String,
    host_public_key: Vec<u8>,
    token_hash: String,
    now_ms: u64,
    expires_at_ms: u64,
}

impl Redemption {
    fn of(s: &NewSession<'_>) -> Self {
        Self {
            challenge_id: s.challenge_id.to_owned(),
            host_fingerprint: s.host_fingerprint.to_owned(),
            host_public_key: s.host_public_key.to_owned(),
            token_hash: s.token_hash.to_owned(),
            now_ms: s.now_ms,
            expires_at_ms: s.expires_at_ms,
        }
    }

    fn borrowed(&self) -> NewSession<'_> {
        NewSession {
            challenge_id: &self.challenge_id,
            host_fingerprint: &self.host_fingerprint,
            host_public_key: &self.host_public_key,
            token_hash: &self.token_hash,
            now_ms: self.now_ms,
            expires_at_ms: self.expires_at_ms,
        }
    }
}

enum Write {
    Challenge(Challenge, oneshot::Sender<Result<(), sqlx::Error>>),
    Redemption(Redemption, oneshot::Sender<Result<bool, sqlx::Error>>),
}

/// What one write did, before its group commits.
enum Done {
    Challenge,
    Redemption(bool),
}

/// The queue to the writer task; the task ends when the last handle is dropped.
#[derive(Debug)]
pub struct GroupWriter {
    writes: mpsc::Sender<Write>,
    /// Transactions committed with more than one write in them.
    #[cfg(test)]
    shared_commits: std::sync::Arc<std::sync::atomic::AtomicU64>,
}

/// The writer task is gone (the store is shutting down): answered like a closed pool.
fn gone<T>(_: T) -> sqlx::Error {
    sqlx::Error::PoolClosed
}

impl GroupWriter {
    /// Starts the writer task on `pool` (the store's one writer connection).
    pub fn spawn(pool: sqlx::SqlitePool) -> Self {
        let (writes, queued) = mpsc::channel(BACKLOG);
        let shared_commits = std::sync::Arc::default();
        tokio::spawn(write_groups(
            pool,
            queued,
            std::sync::Arc::clone(&shared_commits),
        ));
        Self {
            writes,
            #[cfg(test)]
            shared_commits,
        }
    }

    pub async fn insert_challenge(&self, c: &NewChallenge<'_>) -> Result<(), sqlx::Error> {
        let (answer, answered) = oneshot::channel();
        self.writes
            .send(Write::Challenge(Challenge::of(c), answer))
            .await
            .map_err(gone)?;
        answered.await.map_err(gone)?
    }

    pub async fn redeem(&self, s: &NewSession<'_>) -> Result<bool, sqlx::Error> {
        let (answer, answered) = oneshot::channel();
        self.writes
            .send(Write::Redemption(Redemption::of(s), answer))
            .await
            .map_err(gone)?;
        answered.await.map_err(gone)?
    }
}

async fn write_groups(
    pool: sqlx::SqlitePool,
    mut queued: mpsc::Receiver<Write>,
    shared_commits: std::sync::Arc<std::sync::atomic::AtomicU64>,
) {
    let mut group = Vec::with_capacity(MAX_GROUP);
    while queued.recv_many(&mut group, MAX_GROUP).await > 0 {
        // Their ratio is the mean group size.
        metrics::counter!("orca_push_auth_group_commits_total").increment(1);
        metrics::counter!("orca_push_auth_grouped_writes_total").increment(group.len() as u64);
        match write_together(&pool, &group).await {
            Ok(done) => {
                if done.len() > 1 {
                    shared_commits.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
                for (write, done) in group.drain(..).zip(done) {
                    answer(write, Ok(done));
                }
            }
            Err(error) => {
                tracing::debug!(%error, writes = group.len(), "auth group failed; writing it one by one");
                for write in group.drain(..) {
                    let done = write_alone(&pool, &write).await;
                    answer(write, done);
                }
            }
        }
    }
}

/// Every write of `group` in one transaction, in order; nothing committed if any fails.
async fn write_together(
    pool: &sqlx::SqlitePool,
    group: &[Write],
) -> Result<Vec<Done>, sqlx::Error> {
    let mut tx = pool.begin_with("BEGIN IMMEDIATE").await?;
    let mut done = Vec::with_capacity(group.len());
    for write in group {
        done.push(write_on(&mut tx, write).await?);
    }
    tx.commit().await?;
    Ok(done)
}

/// One write in a transaction of its own.
async fn write_alone(pool: &sqlx::SqlitePool, write: &Write) -> Result<Done, sqlx::Error> {
    let mut tx = pool.begin_with("BEGIN IMMEDIATE").await?;
    let done = write_on(&mut tx, write).await?;
    tx.commit().await?;
    Ok(done)
}

async fn write_on(conn: &mut sqlx::SqliteConnection, write: &Write) -> Result<Done, sqlx::Error> {
    Ok(match write {
        Write::Challenge(c, _) => {
            SqliteAuthStore::insert_challenge_on(conn, &c.borrowed()).await?;
            Done::Challenge
        }
        Write::Redemption(r, _) => {
            Done::Redemption(SqliteAuthStore::redeem_on(conn, &r.borrowed()).await?)
        }
    })
}

/// Answers the caller (who may have gone: its answer is dropped).
fn answer(write: Write, done: Result<Done, sqlx::Error>) {
    match (write, done) {
        (Write::Challenge(_, to), Ok(_)) => {
            let _ = to.send(Ok(()));
        }
        (Write::Redemption(_, to), Ok(Done::Redemption(redeemed))) => {
            let _ = to.send(Ok(redeemed));
        }
        (Write::Redemption(_, to), Ok(Done::Challenge)) => {
            let _ = to.send(Err(sqlx::Error::Protocol(
                "a redemption was answered as a challenge".into(),
            )));
        }
        (Write::Challenge(_, to), Err(error)) => {
            let _ = to.send(Err(error));
        }
        (Write::Redemption(_, to), Err(error)) => {
            let _ = to.send(Err(error));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use orca_push_storage::Pool;
    use orca_push_storage::testing::{Backend, TestDbGuard, fresh};

    async fn writer() -> (GroupWriter, sqlx::SqlitePool, TestDbGuard) {
        let (config, guard) = fresh(Backend::Sqlite).await;
        let Pool::Sqlite(pool) = crate::open_and_migrate(&config).await.unwrap() else {
            unreachable!("a SQLite database")
        };
        (GroupWriter::spawn(pool.clone()), pool, guard)
    }

    fn challenge(id: &str) -> Challenge {
        Challenge {
            challenge_id: id.to_owned(),
            host_fingerprint: format!("host-of-{id}"),
            host_public_key: vec![7; 32],
            secret_hash: "hash".to_owned(),
            transcript: vec![1, 2, 3],
            issued_at_ms: 1_000,
            expires_at_ms: 60_000,
        }
    }

    fn redemption(id: &str, token: &str) -> Redemption {
        Redemption {
            challenge_id: id.to_owned(),
            host_fingerprint: format!("host-of-{id}"),
            host_public_key: vec![7; 32],
            token_hash: token.to_owned(),
            now_ms: 2_000,
            expires_at_ms: 90_000,
        }
    }

    async fn count(pool: &sqlx::SqlitePool, sql: &str) -> i64 {
        sqlx::query_scalar(sql).fetch_one(pool).await.unwrap()
    }

    // The writer task runs on the same (current-thread) runtime: every write below is queued
    // before it runs, so each test's writes form one group.

    #[tokio::test]
    async fn a_failing_write_fails_alone_and_its_neighbours_commit() {
        let (writer, pool, _db) = writer().await;
        let taken = challenge("c0");
        writer.insert_challenge(&taken.borrowed()).await.unwrap();
        let (c1, c2) = (challenge("c1"), challenge("c2"));
        let r1 = redemption("c1", "t1");
        let (c1, taken, c2, r1) = (
            c1.borrowed(),
            taken.borrowed(),
            c2.borrowed(),
            r1.borrowed(),
        );
        let (first, duplicate, second, redeemed) = tokio::join!(
            writer.insert_challenge(&c1),
            writer.insert_challenge(&taken),
            writer.insert_challenge(&c2),
            writer.redeem(&r1),
        );
        assert!(first.is_ok() && second.is_ok(), "{first:?} {second:?}");
        assert!(duplicate.is_err(), "the same challenge id twice");
        assert!(redeemed.unwrap());
        assert_eq!(
            count(&pool, "SELECT COUNT(*) FROM push_challenges").await,
            3
        );
        assert_eq!(
            count(
                &pool,
                "SELECT COUNT(*) FROM push_sessions WHERE token_hash = 't1'"
            )
            .await,
            1
        );
    }

    #[tokio::test]
    async fn of_two_proofs_for_one_challenge_in_a_group_exactly_one_redeems_it() {
        let (writer, pool, _db) = writer().await;
        writer
            .insert_challenge(&challenge("c").borrowed())
            .await
            .unwrap();
        let (a, b) = (redemption("c", "ta"), redemption("c", "tb"));
        let (a, b) = (a.borrowed(), b.borrowed());
        let (a, b) = tokio::join!(writer.redeem(&a), writer.redeem(&b));
        assert_eq!((a.unwrap(), b.unwrap()), (true, false));
        assert_eq!(
            count(
                &pool,
                "SELECT COUNT(*) FROM push_sessions WHERE token_hash = 'ta'"
            )
            .await,
            1
        );
        assert_eq!(
            writer
                .shared_commits
                .load(std::sync::atomic::Ordering::Relaxed),
            1
        );
    }

    #[tokio::test]
    async fn writes_waiting_together_share_one_commit() {
        let (writer, pool, _db) = writer().await;
        let challenges: Vec<Challenge> = (0..20).map(|i| challenge(&format!("c{i}"))).collect();
        let all = futures::future::join_all(
            challenges
                .iter()
                .map(|c| async { writer.insert_challenge(&c.borrowed()).await }),
        )
        .await;
        assert!(all.iter().all(Result::is_ok));
        assert_eq!(
            count(&pool, "SELECT COUNT(*) FROM push_challenges").await,
            20
        );
        assert_eq!(
            writer
                .shared_commits
                .load(std::sync::atomic::Ordering::Relaxed),
            1
        );
    }
}
