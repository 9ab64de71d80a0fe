//! The handshakes' writes that arrive together commit together. A challenge's insert and a
//! proof's redemption (consume the challenge, upsert the host, replace its session) queue here; a
//! writer task takes whatever is waiting, writes it in one transaction in arrival order, commits,
//! and only then answers each caller. A handshake thus costs its share of a commit, not a
//! transaction of its own.
//!
//! How a group is written is the backend's ([`GroupStore`]): SQLite runs each write's statements
//! in one `BEGIN IMMEDIATE` transaction on its one writer connection; PostgreSQL writes the whole
//! group with one multi-row statement per table (see `pg_group`).
//!
//! Each write keeps its own outcome. A redemption whose challenge is spent writes nothing and
//! answers `false`, as alone. If any statement of a group fails, the whole transaction is rolled
//! back and the group is written again one write per transaction, so one bad write never fails its
//! neighbours and never leaves half of itself behind.

use std::future::Future;
use std::sync::Arc;

use tokio::sync::{mpsc, oneshot};

use crate::store::{NewChallenge, NewSession, SqliteAuthStore};

/// Writes in one transaction at most.
pub const MAX_GROUP: usize = 64;
/// Writes waiting at most; a caller past it waits for room.
const BACKLOG: usize = 1024;

/// A challenge, owned for the trip to the writer.
pub(crate) struct Challenge {
    pub(crate) challenge_id: String,
    pub(crate) host_fingerprint: String,
    pub(crate) host_public_key: Vec<u8>,
    pub(crate) secret_hash: String,
    pub(crate) transcript: Vec<u8>,
    pub(crate) issued_at_ms: u64,
    pub(crate) expires_at_ms: u64,
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

    pub(crate) fn borrowed(&self) -> NewChallenge<'_> {
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
pub(crate) struct Redemption {
    pub(crate) challenge_id: String,
    pub(crate) host_fingerprint: String,
    pub(crate) host_public_key: Vec<u8>,
    pub(crate) token_hash: String,
    pub(crate) now_ms: u64,
    pub(crate) expires_at_ms: u64,
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

    pub(crate) fn borrowed(&self) -> NewSession<'_> {
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

pub(crate) enum Write {
    Challenge(Challenge, oneshot::Sender<Result<(), sqlx::Error>>),
    Redemption(Redemption, oneshot::Sender<Result<bool, sqlx::Error>>),
}

impl Write {
    /// Whether the caller stopped waiting for the answer.
    fn caller_gone(&self) -> bool {
        match self {
            Self::Challenge(_, to) => to.is_closed(),
            Self::Redemption(_, to) => to.is_closed(),
        }
    }
}

/// What one write did, before its group commits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Done {
    Challenge,
    Redemption(bool),
}

/// How a backend writes a group, and a write alone.
pub(crate) trait GroupStore: Send + Sync + 'static {
    /// Every write of `group` in one transaction, answering each in order; nothing committed if
    /// any statement fails.
    fn write_together(
        &self,
        group: &[Write],
    ) -> impl Future<Output = Result<Vec<Done>, sqlx::Error>> + Send;

    /// One write in a transaction of its own.
    fn write_alone(&self, write: &Write) -> impl Future<Output = Result<Done, sqlx::Error>> + Send;
}

/// The queue to the writer task; the task ends when the last handle is dropped.
#[derive(Debug)]
pub struct GroupWriter {
    writes: mpsc::Sender<Write>,
    /// Transactions committed with more than one write in them.
    #[cfg(test)]
    shared_commits: Arc<std::sync::atomic::AtomicU64>,
}

/// The writer task is gone (the store is shutting down): answered like a closed pool.
fn gone<T>(_: T) -> sqlx::Error {
    sqlx::Error::PoolClosed
}

impl GroupWriter {
    /// Starts the writer task on `store`. One writer on either backend: on PostgreSQL, four
    /// writing side by side made smaller groups and cost the server more CPU per handshake
    /// (1,040-1,220 handshakes/s against 1,231-1,405 with one, alternating runs).
    pub(crate) fn spawn<S: GroupStore>(store: S) -> Self {
        let (writes, queued) = mpsc::channel(BACKLOG);
        let shared_commits = Arc::default();
        tokio::spawn(write_groups(store, queued, Arc::clone(&shared_commits)));
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

async fn write_groups<S: GroupStore>(
    store: S,
    mut queued: mpsc::Receiver<Write>,
    shared_commits: Arc<std::sync::atomic::AtomicU64>,
) {
    let mut group = Vec::with_capacity(MAX_GROUP);
    while queued.recv_many(&mut group, MAX_GROUP).await > 0 {
        // A caller that gave up (its client timed out) is not written for later: its redemption
        // could otherwise replace a session the host has since minted elsewhere.
        group.retain(|write| !write.caller_gone());
        if group.is_empty() {
            continue;
        }
        // Their ratio is the mean group size.
        metrics::counter!("orca_push_auth_group_commits_total").increment(1);
        metrics::counter!("orca_push_auth_grouped_writes_total").increment(group.len() as u64);
        match store.write_together(&group).await {
            Ok(done) => {
                if done.len() > 1 {
                    shared_commits.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
                for (write, done) in group.drain(..).zip(done) {
                    answer(write, Ok(done));
                }
            }
            // A statement failed: one write may be to blame, so each is tried alone.
            Err(sqlx::Error::Database(error)) => {
                tracing::debug!(%error, writes = group.len(), "auth group failed; writing it one by one");
                for write in group.drain(..) {
                    if !write.caller_gone() {
                        let done = store.write_alone(&write).await;
                        answer(write, done);
                    }
                }
            }
            // The database could not be reached or the connection failed: every write would
            // fail (or wait) alone just the same, so each caller is told now.
            Err(error) => {
                tracing::debug!(%error, writes = group.len(), "auth group failed");
                for write in group.drain(..) {
                    answer(write, Err(std::io::Error::other(error.to_string()).into()));
                }
            }
        }
    }
}

/// SQLite: each write's statements in turn, on the store's one writer connection.
pub(crate) struct SqliteGroups(pub(crate) sqlx::SqlitePool);

impl GroupStore for SqliteGroups {
    async fn write_together(&self, group: &[Write]) -> Result<Vec<Done>, sqlx::Error> {
        let mut tx = self.0.begin_with("BEGIN IMMEDIATE").await?;
        let mut done = Vec::with_capacity(group.len());
        for write in group {
            done.push(write_on(&mut tx, write).await?);
        }
        tx.commit().await?;
        Ok(done)
    }

    async fn write_alone(&self, write: &Write) -> Result<Done, sqlx::Error> {
        let mut tx = self.0.begin_with("BEGIN IMMEDIATE").await?;
        let done = write_on(&mut tx, write).await?;
        tx.commit().await?;
        Ok(done)
    }
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

    /// A writer on a fresh database of `backend`, as the store starts it.
    async fn writer(backend: Backend) -> (GroupWriter, Pool, TestDbGuard) {
        let (config, guard) = fresh(backend).await;
        let pool = crate::open_and_migrate(&config).await.unwrap();
        let writer = match &pool {
            Pool::Sqlite(p) => GroupWriter::spawn(SqliteGroups(p.clone())),
            Pool::Postgres(p) => GroupWriter::spawn(crate::pg_group::PgGroups(
                crate::store::PgAuthStore::new(p.clone()),
            )),
        };
        (writer, pool, guard)
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

    async fn count(pool: &Pool, sql: &str) -> i64 {
        match pool {
            Pool::Sqlite(p) => sqlx::query_scalar(sql).fetch_one(p).await.unwrap(),
            Pool::Postgres(p) => sqlx::query_scalar(sql).fetch_one(p).await.unwrap(),
        }
    }

    fn shared_commits(writer: &GroupWriter) -> u64 {
        writer
            .shared_commits
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    macro_rules! on_both_backends {
        ($($name:ident),* $(,)?) => {$(
            mod $name {
                // The writer tasks run on the same (current-thread) runtime: every write of a
                // test's `join!` is queued before any writer runs, so they form one group.
                #[tokio::test]
                async fn sqlite() {
                    super::$name(super::Backend::Sqlite).await;
                }
                #[tokio::test]
                async fn postgres() {
                    super::$name(super::Backend::Postgres).await;
                }
            }
        )*};
    }

    on_both_backends!(
        a_write_whose_caller_gave_up_is_not_written,
        a_failing_write_fails_alone_and_its_neighbours_commit,
        of_two_proofs_for_one_challenge_in_a_group_exactly_one_redeems_it,
        of_two_logins_of_one_host_in_a_group_the_later_session_stands,
        a_spent_challenge_fails_its_proof_and_not_the_group,
        writes_waiting_together_share_one_commit,
    );

    async fn a_write_whose_caller_gave_up_is_not_written(backend: Backend) {
        use futures::FutureExt as _;
        let (writer, pool, _db) = writer(backend).await;
        let (abandoned, kept) = (challenge("abandoned"), challenge("kept"));
        // Queued, then dropped before the writer ran (as a client that timed out).
        assert!(
            writer
                .insert_challenge(&abandoned.borrowed())
                .now_or_never()
                .is_none()
        );
        writer.insert_challenge(&kept.borrowed()).await.unwrap();
        assert_eq!(
            count(
                &pool,
                "SELECT COUNT(*) FROM push_challenges WHERE challenge_id = 'kept'"
            )
            .await,
            1
        );
        assert_eq!(
            count(&pool, "SELECT COUNT(*) FROM push_challenges").await,
            1
        );
    }

    async fn a_failing_write_fails_alone_and_its_neighbours_commit(backend: Backend) {
        let (writer, pool, _db) = writer(backend).await;
        let taken = challenge("c0");
        writer.insert_challenge(&taken.borrowed()).await.unwrap();
        let (c1, c2) = (challenge("c1"), challenge("c2"));
        let r1 = redemption("c1", "t1");
        let r0 = redemption("c0", "t0");
        writer.insert_challenge(&c1.borrowed()).await.unwrap();
        let (c2, taken, r1, r0) = (
            c2.borrowed(),
            taken.borrowed(),
            r1.borrowed(),
            r0.borrowed(),
        );
        let (second, duplicate, redeemed, also_redeemed) = tokio::join!(
            writer.insert_challenge(&c2),
            writer.insert_challenge(&taken),
            writer.redeem(&r1),
            writer.redeem(&r0),
        );
        assert!(second.is_ok(), "{second:?}");
        assert!(duplicate.is_err(), "the same challenge id twice");
        assert!(redeemed.unwrap() && also_redeemed.unwrap());
        assert_eq!(
            count(&pool, "SELECT COUNT(*) FROM push_challenges").await,
            3
        );
        assert_eq!(
            count(
                &pool,
                "SELECT COUNT(*) FROM push_sessions WHERE token_hash IN ('t0', 't1')"
            )
            .await,
            2
        );
        assert_eq!(count(&pool, "SELECT COUNT(*) FROM push_hosts").await, 2);
    }

    async fn of_two_proofs_for_one_challenge_in_a_group_exactly_one_redeems_it(backend: Backend) {
        let (writer, pool, _db) = writer(backend).await;
        writer
            .insert_challenge(&challenge("c").borrowed())
            .await
            .unwrap();
        let (a, b) = (redemption("c", "ta"), redemption("c", "tb"));
        let (a, b) = (a.borrowed(), b.borrowed());
        let (a, b) = tokio::join!(writer.redeem(&a), writer.redeem(&b));
        assert_eq!((a.unwrap(), b.unwrap()), (true, false));
        assert_eq!(count(&pool, "SELECT COUNT(*) FROM push_sessions").await, 1);
        assert_eq!(
            count(
                &pool,
                "SELECT COUNT(*) FROM push_sessions WHERE token_hash = 'ta'"
            )
            .await,
            1
        );
        assert_eq!(shared_commits(&writer), 1);
    }

    async fn of_two_logins_of_one_host_in_a_group_the_later_session_stands(backend: Backend) {
        let (writer, pool, _db) = writer(backend).await;
        let (mut c1, mut c2) = (challenge("c1"), challenge("c2"));
        c1.host_fingerprint = "one-host".to_owned();
        c2.host_fingerprint = "one-host".to_owned();
        writer.insert_challenge(&c1.borrowed()).await.unwrap();
        writer.insert_challenge(&c2.borrowed()).await.unwrap();
        let (mut earlier, mut later) = (redemption("c1", "earlier"), redemption("c2", "later"));
        earlier.host_fingerprint = "one-host".to_owned();
        later.host_fingerprint = "one-host".to_owned();
        later.host_public_key = vec![9; 32];
        let (earlier, later) = (earlier.borrowed(), later.borrowed());
        let (a, b) = tokio::join!(writer.redeem(&earlier), writer.redeem(&later));
        assert_eq!((a.unwrap(), b.unwrap()), (true, true));
        assert_eq!(
            count(
                &pool,
                "SELECT COUNT(*) FROM push_sessions WHERE host_fingerprint = 'one-host' \
                 AND token_hash = 'later'"
            )
            .await,
            1
        );
        assert_eq!(count(&pool, "SELECT COUNT(*) FROM push_sessions").await, 1);
        assert_eq!(
            count(
                &pool,
                "SELECT COUNT(*) FROM push_hosts WHERE host_fingerprint = 'one-host'"
            )
            .await,
            1
        );
        let key: Vec<u8> = match &pool {
            Pool::Sqlite(p) => sqlx::query_scalar("SELECT host_public_key FROM push_hosts")
                .fetch_one(p)
                .await
                .unwrap(),
            Pool::Postgres(p) => sqlx::query_scalar("SELECT host_public_key FROM push_hosts")
                .fetch_one(p)
                .await
                .unwrap(),
        };
        assert_eq!(key, vec![9; 32], "the later login's key");
        assert_eq!(shared_commits(&writer), 1);
    }

    async fn a_spent_challenge_fails_its_proof_and_not_the_group(backend: Backend) {
        let (writer, pool, _db) = writer(backend).await;
        for id in ["spent", "fresh", "old"] {
            writer
                .insert_challenge(&challenge(id).borrowed())
                .await
                .unwrap();
        }
        assert!(
            writer
                .redeem(&redemption("spent", "first").borrowed())
                .await
                .unwrap()
        );
        let (mut late, fresh) = (redemption("spent", "replay"), redemption("fresh", "ok"));
        late.now_ms = 3_000;
        // "old" expires at 60,000.
        let expired = Redemption {
            now_ms: 70_000,
            ..redemption("old", "too-late")
        };
        let (late, fresh, expired) = (late.borrowed(), fresh.borrowed(), expired.borrowed());
        let (late, fresh, expired) = tokio::join!(
            writer.redeem(&late),
            writer.redeem(&fresh),
            writer.redeem(&expired),
        );
        assert_eq!(
            (late.unwrap(), fresh.unwrap(), expired.unwrap()),
            (false, true, false)
        );
        assert_eq!(
            count(
                &pool,
                "SELECT COUNT(*) FROM push_sessions WHERE token_hash IN ('first', 'ok')"
            )
            .await,
            2
        );
        assert_eq!(count(&pool, "SELECT COUNT(*) FROM push_sessions").await, 2);
        assert_eq!(shared_commits(&writer), 1);
    }

    async fn writes_waiting_together_share_one_commit(backend: Backend) {
        let (writer, pool, _db) = writer(backend).await;
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
        assert_eq!(shared_commits(&writer), 1);
    }
}
