//! The SQLite writer's rounds on a connection of its own, on the caller's thread.
//!
//! sqlx's SQLite driver runs each connection on a thread of its own and hands every statement and
//! every row across a channel: a writer's round was a chain of some 50 such hand-offs at 100
//! end-to-end flows, each waiting for a core (docs/benchmarks.md, round 22). The writer's rounds
//! (`begin_group_write`: admissions, the lanes' claims and reports) run instead on a connection
//! opened here with rusqlite, which links the same SQLite library as sqlx, so a round's statements
//! run on the writer's own thread. Everything else (reads, lease renewals, retries, clean-up,
//! migrations, and what a failed round does apart: `claim`, `complete`) keeps sqlx's pools.
//!
//! The connection is opened on the writer's first round, with the pool writer's durability and
//! the pragmas `orca_push_storage::open_sqlite` gives it. A round holds the pool's one writer
//! connection while it runs, unused: the other writes (and the checkpoint's last step, which must
//! see no commit while it copies) still queue in that pool behind the rounds, in order, instead of
//! sleeping in SQLite's busy handler, as when every write took that connection.
//!
//! While the writer is busy, a round keeps that connection for the next (`super::gate`).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use rusqlite::types::{ToSqlOutput, Value, ValueRef};
use rusqlite::{Connection, OpenFlags};
use tokio::sync::{Mutex, OwnedMutexGuard};

use super::gate::{Gate, Kept};
use super::sql::{Arg, Col, Exec, Row, Stmt};

/// Prepared statements the connection keeps, as the pool's writer does
/// (`orca_push_storage::SQLITE_WRITER_STATEMENTS`).
const STATEMENTS_KEPT: usize = orca_push_storage::SQLITE_WRITER_STATEMENTS;

/// How long a statement waits for another connection's write transaction, as the pools do.
const BUSY_TIMEOUT: Duration = Duration::from_secs(10);

/// The writer's own connection, opened on first use.
#[derive(Debug, Default)]
pub struct Direct {
    conn: Arc<Mutex<Option<Connection>>>,
    /// The pool writer's connection, kept between rounds that follow each other.
    kept: Arc<Kept>,
    /// Set once opening failed (said in the log) or found the database in memory: the writer
    /// keeps sqlx's pool from then on.
    broken: AtomicBool,
}

impl Direct {
    /// A write transaction (`BEGIN IMMEDIATE`) on the connection, opening it first if need be;
    /// `None` if it cannot be opened (said once in the log), for the caller to use the pool.
    pub async fn begin(&self, pool: &sqlx::SqlitePool) -> Result<Option<DirectTx>, sqlx::Error> {
        if self.broken.load(Ordering::Relaxed) {
            return Ok(None);
        }
        let mut gate = self.kept.take(pool).await?;
        let mut conn = self.conn.clone().lock_owned().await;
        if conn.is_none() {
            match open(&mut gate.conn).await {
                Ok(Some(opened)) => *conn = Some(opened),
                // A database in memory, which a second connection would not share.
                Ok(None) => {
                    self.broken.store(true, Ordering::Relaxed);
                    return Ok(None);
                }
                Err(error) => {
                    tracing::warn!(%error, "the queue writer's own SQLite connection did not open; its rounds use the pool");
                    self.broken.store(true, Ordering::Relaxed);
                    return Ok(None);
                }
            }
        }
        let Some(c) = conn.as_ref() else {
            return Ok(None);
        };
        // A transaction left open (a ROLLBACK that failed as a round ended) would fail every
        // BEGIN after it: end it, or give the connection up and open another next round.
        if !c.is_autocommit() && c.execute_batch("ROLLBACK").is_err() {
            tracing::warn!(
                "the queue writer's own SQLite connection was left in a transaction; it is opened again"
            );
            *conn = None;
            return Ok(None);
        }
        let mut tx = DirectTx {
            conn,
            open: false,
            gate: Some(gate),
            home: self.kept.clone(),
        };
        tx.conn()?
            .execute_batch("BEGIN IMMEDIATE")
            .map_err(storage)?;
        tx.open = true;
        Ok(Some(tx))
    }

    /// Whether a round keeps the pool's writer connection for the next (`Kept::keep`).
    pub fn keep(&self, keep: bool) {
        self.kept.keep(keep);
    }

    /// A write outside the rounds needs the pool's writer connection (`Kept::release`).
    pub fn release(&self) {
        self.kept.release();
    }
}

/// Opens a connection to the file of the pool's writer connection `pool`, with its durability and
/// pragmas; `None` for a database in memory.
async fn open(pool: &mut sqlx::SqliteConnection) -> Result<Option<Connection>, sqlx::Error> {
    let path: String =
        sqlx::query_scalar("SELECT file FROM pragma_database_list WHERE name = 'main'")
            .fetch_one(&mut *pool)
            .await?;
    if path.is_empty() {
        return Ok(None);
    }
    let synchronous: i64 = sqlx::query_scalar("PRAGMA synchronous")
        .fetch_one(&mut *pool)
        .await?;
    let journal_size_limit: i64 = sqlx::query_scalar("PRAGMA journal_size_limit")
        .fetch_one(&mut *pool)
        .await?;
    let conn = Connection::open_with_flags(
        path,
        OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_NO_MUTEX,
    )
    .map_err(storage)?;
    conn.busy_timeout(BUSY_TIMEOUT).map_err(storage)?;
    for (pragma, value) in [
        ("synchronous", Value::Integer(synchronous)),
        ("foreign_keys", Value::Integer(1)),
        // As the pool's (see `open_sqlite`): statement journals in memory, checkpoints beside
        // the writer rather than in its commits, the WAL cut back to the same size.
        ("temp_store", Value::Text("memory".into())),
        ("wal_autocheckpoint", Value::Integer(0)),
        ("journal_size_limit", Value::Integer(journal_size_limit)),
    ] {
        conn.pragma_update(None, pragma, value).map_err(storage)?;
    }
    conn.set_prepared_statement_cache_capacity(STATEMENTS_KEPT);
    Ok(Some(conn))
}

/// A write transaction on the writer's own connection; rolled back if dropped uncommitted.
pub struct DirectTx {
    conn: OwnedMutexGuard<Option<Connection>>,
    open: bool,
    /// The pool writer's connection, held for the transaction (see the module), then kept in
    /// `home` for the next round.
    gate: Option<Gate>,
    home: Arc<Kept>,
}

impl DirectTx {
    fn conn(&self) -> Result<&Connection, sqlx::Error> {
        self.conn.as_ref().ok_or(sqlx::Error::PoolClosed)
    }

    fn end(&mut self, sql: &str) -> Result<(), sqlx::Error> {
        self.open = false;
        self.conn()?.execute_batch(sql).map_err(storage)
    }

    pub fn commit(mut self) -> Result<(), sqlx::Error> {
        let committed = self.end("COMMIT");
        if committed.is_err() {
            // A failed COMMIT may leave the transaction open (SQLITE_BUSY): end it.
            let _ = self.end("ROLLBACK");
        }
        committed
    }

    pub fn rollback(mut self) -> Result<(), sqlx::Error> {
        self.end("ROLLBACK")
    }

    /// Runs `stmt` (one statement), each row handed to `row`: the rows it changed.
    fn step(
        &self,
        stmt: &Stmt<'_>,
        mut row: impl FnMut(&rusqlite::Row<'_>) -> Result<(), sqlx::Error>,
    ) -> Result<u64, sqlx::Error> {
        let conn = self.conn()?;
        if stmt.keep() {
            let mut kept = conn.prepare_cached(stmt.sql()).map_err(storage)?;
            bind_and_run(&mut kept, stmt, &mut row, conn)
        } else {
            // Not kept: finalized once run, as sqlx's `persistent(false)`.
            let mut once = conn.prepare(stmt.sql()).map_err(storage)?;
            bind_and_run(&mut once, stmt, &mut row, conn)
        }
    }
}

/// Binds `stmt`'s arguments to `prepared` (`$N` takes the Nth, as sqlx binds it; `?` the next),
/// then steps it.
fn bind_and_run(
    prepared: &mut rusqlite::Statement<'_>,
    stmt: &Stmt<'_>,
    row: &mut impl FnMut(&rusqlite::Row<'_>) -> Result<(), sqlx::Error>,
    conn: &Connection,
) -> Result<u64, sqlx::Error> {
    let args = stmt.args();
    for index in 1..=prepared.parameter_count() {
        // A name is looked up along a list (see `Stmt`): only numbered statements have them.
        let n = if stmt.numbered() {
            prepared
                .parameter_name(index)
                .and_then(|name| name.strip_prefix('$'))
                .and_then(|n| n.parse::<usize>().ok())
                .ok_or_else(|| sqlx::Error::Protocol(format!("parameter {index} is not $N")))?
        } else {
            index
        };
        let arg = args
            .get(n - 1)
            .ok_or_else(|| sqlx::Error::Protocol(format!("no argument for parameter {n}")))?;
        let value = to_sql(arg)
            .ok_or_else(|| sqlx::Error::Protocol("a list is bound only on PostgreSQL".into()))?;
        prepared.raw_bind_parameter(index, value).map_err(storage)?;
    }
    let mut rows = prepared.raw_query();
    while let Some(r) = rows.next().map_err(storage)? {
        row(r)?;
    }
    drop(rows);
    // The rows this statement changed (not its triggers'), as sqlx counts them; a read changes
    // none, where SQLite would repeat the last write's count.
    Ok(if prepared.readonly() {
        0
    } else {
        conn.changes()
    })
}

/// `arg` as SQLite binds it; a list (PostgreSQL's arrays) it cannot.
fn to_sql<'a>(arg: &'a Arg<'_>) -> Option<ToSqlOutput<'a>> {
    Some(match arg {
        Arg::Text(Some(text)) => ToSqlOutput::Borrowed(ValueRef::Text(text.as_bytes())),
        Arg::Int(Some(v)) => ToSqlOutput::Owned(Value::Integer(*v)),
        Arg::Int32(Some(v)) => ToSqlOutput::Owned(Value::Integer(i64::from(*v))),
        Arg::Text(None) | Arg::Int(None) | Arg::Int32(None) => ToSqlOutput::Owned(Value::Null),
        Arg::List(_) => return None,
    })
}

impl Drop for DirectTx {
    fn drop(&mut self) {
        if self.open {
            let _ = self.end("ROLLBACK");
        }
        if let Some(gate) = self.gate.take() {
            self.home.round_ended(gate);
        }
    }
}

/// A row read from the writer's own connection.
#[derive(Debug)]
pub struct DirectRow {
    names: Arc<[String]>,
    values: Vec<Value>,
}

impl Row for DirectRow {
    fn col<T: Col>(&self, name: &str) -> Result<T, sqlx::Error> {
        let index = self
            .names
            .iter()
            .position(|n| n == name)
            .ok_or_else(|| sqlx::Error::ColumnNotFound(name.to_owned()))?;
        T::from_direct(ValueRef::from(&self.values[index])).ok_or_else(|| {
            sqlx::Error::ColumnDecode {
                index: name.to_owned(),
                source: format!("unexpected {:?}", self.values[index].data_type()).into(),
            }
        })
    }
}

impl Exec for DirectTx {
    type Row = DirectRow;

    fn joins(&self) -> bool {
        false
    }

    async fn run(&mut self, stmt: Stmt<'_>) -> Result<u64, sqlx::Error> {
        self.step(&stmt, |_| Ok(()))
    }

    async fn rows(&mut self, stmt: Stmt<'_>) -> Result<Vec<DirectRow>, sqlx::Error> {
        let mut names: Option<Arc<[String]>> = None;
        let mut rows = Vec::new();
        self.step(&stmt, |row| {
            let statement = row.as_ref();
            let count = statement.column_count();
            let names = names
                .get_or_insert_with(|| {
                    statement
                        .column_names()
                        .into_iter()
                        .map(str::to_owned)
                        .collect()
                })
                .clone();
            let values = (0..count)
                .map(|i| row.get::<_, Value>(i).map_err(storage))
                .collect::<Result<_, _>>()?;
            rows.push(DirectRow { names, values });
            Ok(())
        })?;
        Ok(rows)
    }
}

/// A rusqlite error as sqlx's, for the store's callers.
fn storage(error: rusqlite::Error) -> sqlx::Error {
    sqlx::Error::Database(Box::new(DirectError(error)))
}

#[derive(Debug, thiserror::Error)]
#[error("{0}")]
struct DirectError(rusqlite::Error);

impl sqlx::error::DatabaseError for DirectError {
    fn message(&self) -> &str {
        match &self.0 {
            rusqlite::Error::SqliteFailure(_, Some(message)) => message,
            _ => "SQLite error",
        }
    }

    fn code(&self) -> Option<std::borrow::Cow<'_, str>> {
        self.0
            .sqlite_error()
            .map(|e| e.extended_code.to_string().into())
    }

    fn as_error(&self) -> &(dyn std::error::Error + Send + Sync + 'static) {
        self
    }

    fn as_error_mut(&mut self) -> &mut (dyn std::error::Error + Send + Sync + 'static) {
        self
    }

    fn into_error(self: Box<Self>) -> Box<dyn std::error::Error + Send + Sync + 'static> {
        self
    }

    fn kind(&self) -> sqlx::error::ErrorKind {
        use rusqlite::ffi;
        use sqlx::error::ErrorKind;
        match self.0.sqlite_error().map(|e| e.extended_code) {
            Some(ffi::SQLITE_CONSTRAINT_UNIQUE | ffi::SQLITE_CONSTRAINT_PRIMARYKEY) => {
                ErrorKind::UniqueViolation
            }
            Some(ffi::SQLITE_CONSTRAINT_FOREIGNKEY) => ErrorKind::ForeignKeyViolation,
            Some(ffi::SQLITE_CONSTRAINT_NOTNULL) => ErrorKind::NotNullViolation,
            Some(ffi::SQLITE_CONSTRAINT_CHECK) => ErrorKind::CheckViolation,
            _ => ErrorKind::Other,
        }
    }
}

/// A SQLite queue transaction: on the writer's own connection (its rounds) or sqlx's pool.
pub enum SqliteTx {
    Pool(sqlx::Transaction<'static, sqlx::Sqlite>),
    Direct(DirectTx),
}

impl SqliteTx {
    pub async fn commit(self) -> Result<(), sqlx::Error> {
        match self {
            SqliteTx::Pool(tx) => tx.commit().await,
            SqliteTx::Direct(tx) => tx.commit(),
        }
    }

    pub async fn rollback(self) -> Result<(), sqlx::Error> {
        match self {
            SqliteTx::Pool(tx) => tx.rollback().await,
            SqliteTx::Direct(tx) => tx.rollback(),
        }
    }
}

/// A row of either.
pub enum SqliteTxRow {
    Pool(sqlx::sqlite::SqliteRow),
    Direct(DirectRow),
}

impl Row for SqliteTxRow {
    fn col<T: Col>(&self, name: &str) -> Result<T, sqlx::Error> {
        match self {
            SqliteTxRow::Pool(row) => row.col(name),
            SqliteTxRow::Direct(row) => row.col(name),
        }
    }
}

impl Exec for SqliteTx {
    type Row = SqliteTxRow;

    fn joins(&self) -> bool {
        match self {
            SqliteTx::Pool(tx) => tx.joins(),
            SqliteTx::Direct(tx) => tx.joins(),
        }
    }

    async fn run(&mut self, stmt: Stmt<'_>) -> Result<u64, sqlx::Error> {
        match self {
            SqliteTx::Pool(tx) => tx.run(stmt).await,
            SqliteTx::Direct(tx) => tx.run(stmt).await,
        }
    }

    async fn rows(&mut self, stmt: Stmt<'_>) -> Result<Vec<SqliteTxRow>, sqlx::Error> {
        Ok(match self {
            SqliteTx::Pool(tx) => tx
                .rows(stmt)
                .await?
                .into_iter()
                .map(SqliteTxRow::Pool)
                .collect(),
            SqliteTx::Direct(tx) => tx
                .rows(stmt)
                .await?
                .into_iter()
                .map(SqliteTxRow::Direct)
                .collect(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::gate::GATE_HELD_AT_MOST;
    use crate::store::{QueueStore as _, SqliteQueueStore, migrate};
    use orca_push_storage::SqliteDurability;

    /// A migrated queue database in a fresh folder, at `durability`.
    async fn store(durability: SqliteDurability) -> (SqliteQueueStore, std::path::PathBuf) {
        let dir = std::env::temp_dir().join(format!("orca-push-direct-{}", random_id_for_test()));
        let pool = orca_push_storage::open_sqlite(&dir.join("queue.sqlite"), durability)
            .await
            .unwrap();
        migrate(&orca_push_storage::Pool::Sqlite(pool.clone()))
            .await
            .unwrap();
        (SqliteQueueStore::new(pool), dir)
    }

    fn random_id_for_test() -> String {
        crate::store::random_id().replace(['-', '_'], "x")
    }

    async fn pragma(tx: &mut SqliteTx, name: &str) -> i64 {
        Stmt::new(&format!("PRAGMA {name}"))
            .fetch_one(tx)
            .await
            .unwrap()
            .col(name)
            .unwrap()
    }

    /// The writer's rounds run on its own connection, which writes what the pools then read, with
    /// the pool writer's durability and pragmas.
    #[tokio::test]
    async fn rounds_run_on_the_writers_own_connection_set_as_the_pools() {
        for durability in [SqliteDurability::Full, SqliteDurability::Normal] {
            let (store, dir) = store(durability).await;
            let mut pools = Vec::new();
            for name in ["synchronous", "journal_size_limit", "temp_store"] {
                let value: i64 = sqlx::query_scalar(&format!("PRAGMA {name}"))
                    .fetch_one(&store.pool)
                    .await
                    .unwrap();
                pools.push((name, value));
            }
            let mut tx = store.begin_group_write(&[]).await.unwrap();
            assert!(matches!(tx, SqliteTx::Direct(_)));
            for (name, value) in pools {
                assert_eq!(pragma(&mut tx, name).await, value, "{name}");
            }
            assert_eq!(pragma(&mut tx, "foreign_keys").await, 1);
            assert_eq!(pragma(&mut tx, "wal_autocheckpoint").await, 0);
            Stmt::new("INSERT INTO push_dismissed_events (host_fingerprint, notification_epoch, notification_id, dismissed_seq, created_at) VALUES ($1, $2, $3, $4, $5)")
                .bind("host").bind("epoch").bind("n").bind(3_i64).bind(1_i64)
                .execute(&mut tx)
                .await
                .unwrap();
            tx.commit().await.unwrap();
            let seq: i64 = sqlx::query_scalar("SELECT dismissed_seq FROM push_dismissed_events")
                .fetch_one(store.reader())
                .await
                .unwrap();
            assert_eq!(seq, 3);
            std::fs::remove_dir_all(dir).unwrap();
        }
    }

    /// `$N` takes the Nth argument wherever and however often it appears, as sqlx binds it; typed
    /// NULLs read back as `None`.
    #[tokio::test]
    async fn parameters_bind_by_number() {
        let (store, dir) = store(SqliteDurability::Full).await;
        let mut tx = store.begin_group_write(&[]).await.unwrap();
        let row = Stmt::new("SELECT $2 AS a, $1 AS b, $1 + $1 AS c, $3 AS d")
            .bind(2_i64)
            .bind("two")
            .bind(None::<&str>)
            .fetch_one(&mut tx)
            .await
            .unwrap();
        assert_eq!(row.col::<String>("a").unwrap(), "two");
        assert_eq!(row.col::<i64>("b").unwrap(), 2);
        assert_eq!(row.col::<i32>("c").unwrap(), 4);
        assert_eq!(row.col::<Option<String>>("d").unwrap(), None);
        assert!(row.col::<i64>("a").is_err());
        assert!(row.col::<i64>("e").is_err());
        std::fs::remove_dir_all(dir).unwrap();
    }

    /// A transaction dropped before its commit writes nothing and leaves the connection free for
    /// the next round; a constraint it breaks comes back as sqlx's error of that kind.
    #[tokio::test]
    async fn a_round_dropped_or_failed_writes_nothing() {
        let (store, dir) = store(SqliteDurability::Full).await;
        let insert = || {
            Stmt::new(
                "INSERT INTO push_dismissed_events (host_fingerprint, notification_epoch, notification_id, dismissed_seq, created_at) VALUES ('h', 'e', 'n', 1, 1)",
            )
        };
        let mut tx = store.begin_group_write(&[]).await.unwrap();
        insert().execute(&mut tx).await.unwrap();
        drop(tx);
        let mut tx = store.begin_group_write(&[]).await.unwrap();
        assert_eq!(insert().execute(&mut tx).await.unwrap(), 1);
        let error = insert().execute(&mut tx).await.unwrap_err();
        let kind = error.as_database_error().map(|e| e.kind());
        assert!(
            matches!(kind, Some(sqlx::error::ErrorKind::UniqueViolation)),
            "{error}"
        );
        tx.rollback().await.unwrap();
        let rows: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM push_dismissed_events")
            .fetch_one(store.reader())
            .await
            .unwrap();
        assert_eq!(rows, 0);
        std::fs::remove_dir_all(dir).unwrap();
    }

    /// A round holds the pool's writer: a write there (a retry, the checkpoint's last step)
    /// waits for the round's end instead of meeting its lock in SQLite's busy handler.
    #[tokio::test]
    async fn the_pools_writer_waits_for_a_round() {
        let (store, dir) = store(SqliteDurability::Full).await;
        let tx = store.begin_group_write(&[]).await.unwrap();
        let pool = store.pool.clone();
        let mut waiting = tokio::spawn(async move { pool.acquire().await.map(drop) });
        let early = tokio::time::timeout(Duration::from_millis(100), &mut waiting).await;
        assert!(early.is_err(), "the pool's writer was free during a round");
        tx.commit().await.unwrap();
        tokio::time::timeout(Duration::from_secs(5), waiting)
            .await
            .expect("given back at the round's end while the writer is not busy")
            .unwrap()
            .unwrap();
        std::fs::remove_dir_all(dir).unwrap();
    }

    /// Runs rounds of nothing for a busy writer until one ends inside the hold and so keeps the
    /// pool's writer (a loaded machine may stall one past it).
    async fn round_kept(store: &SqliteQueueStore) {
        store.writers_busy(true);
        for _ in 0..50 {
            let tx = store.begin_group_write(&[]).await.unwrap();
            tx.commit().await.unwrap();
            if store.direct.kept.holds() {
                return;
            }
        }
        panic!("no round ended inside the hold");
    }

    /// While the writer is busy, a round keeps the pool's writer for the next, until the writer
    /// says it has no work.
    #[tokio::test]
    async fn a_busy_writers_round_keeps_the_pools_writer_until_the_writer_idles() {
        let (store, dir) = store(SqliteDurability::Full).await;
        round_kept(&store).await;
        let pool = store.pool.clone();
        let mut waiting = tokio::spawn(async move { pool.acquire().await.map(drop) });
        let kept = tokio::time::timeout(Duration::from_millis(100), &mut waiting).await;
        assert!(kept.is_err(), "the round gave the pool's writer back");
        store.writers_busy(false);
        tokio::time::timeout(Duration::from_secs(5), waiting)
            .await
            .expect("given back once the writer idles")
            .unwrap()
            .unwrap();
        std::fs::remove_dir_all(dir).unwrap();
    }

    /// A round that begins more than `GATE_HELD_AT_MOST` after the pool's writer was taken gives
    /// it back first: a write waiting there goes before it.
    #[tokio::test]
    async fn a_write_waiting_in_the_pool_goes_before_a_round_once_the_hold_is_over() {
        let (store, dir) = store(SqliteDurability::Full).await;
        round_kept(&store).await;
        let pool = store.pool.clone();
        let (took, mut taken) = tokio::sync::oneshot::channel();
        let waiting = tokio::spawn(async move {
            let conn = pool.acquire().await.unwrap();
            took.send(()).unwrap();
            tokio::time::sleep(Duration::from_millis(50)).await;
            drop(conn);
        });
        tokio::time::sleep(GATE_HELD_AT_MOST * 2).await;
        assert!(taken.try_recv().is_err(), "the kept writer was taken");
        let tx = store.begin_group_write(&[]).await.unwrap();
        assert!(
            taken.try_recv().is_ok(),
            "the round went before the write waiting in the pool"
        );
        tx.commit().await.unwrap();
        waiting.await.unwrap();
        std::fs::remove_dir_all(dir).unwrap();
    }

    /// A round that ends more than `GATE_HELD_AT_MOST` after the pool's writer was taken gives it
    /// back at its end, though the writer is busy.
    #[tokio::test]
    async fn a_round_ending_after_the_hold_gives_the_pools_writer_back() {
        let (store, dir) = store(SqliteDurability::Full).await;
        store.writers_busy(true);
        let tx = store.begin_group_write(&[]).await.unwrap();
        tokio::time::sleep(GATE_HELD_AT_MOST * 2).await;
        tx.commit().await.unwrap();
        tokio::time::timeout(Duration::from_secs(5), store.pool.acquire())
            .await
            .expect("the pool's writer kept past the hold")
            .unwrap();
        std::fs::remove_dir_all(dir).unwrap();
    }

    /// A write of the store's outside the rounds (a lease renewal) that asks while a busy
    /// writer's round holds the pool's writer gets it at that round's end.
    #[tokio::test]
    async fn a_write_asking_during_a_round_gets_the_pools_writer_at_its_end() {
        let (store, dir) = store(SqliteDurability::Full).await;
        store.writers_busy(true);
        // Until a round ends inside the hold, so that the renewal's asking, not the hold's end,
        // is what gives the pool's writer back (a loaded machine may stall one past it).
        for attempt in 0.. {
            assert!(attempt < 50, "no round ended inside the hold");
            let began = std::time::Instant::now();
            let tx = store.begin_group_write(&[]).await.unwrap();
            let renewing = store.clone();
            let renew = tokio::spawn(async move { renewing.renew("batch", "token", 1).await });
            let asked = async {
                while !store.direct.kept.wanted() {
                    tokio::task::yield_now().await;
                }
            };
            tokio::time::timeout(Duration::from_secs(5), asked)
                .await
                .expect("the renewal never asked for the pool's writer");
            assert!(!renew.is_finished(), "the renewal wrote during a round");
            tx.commit().await.unwrap();
            let inside_the_hold = began.elapsed() < GATE_HELD_AT_MOST;
            let renewed = tokio::time::timeout(Duration::from_secs(5), renew)
                .await
                .expect("the round kept the pool's writer from a write that asked for it")
                .unwrap()
                .unwrap();
            assert!(!renewed, "no such lease");
            if inside_the_hold {
                break;
            }
        }
        // Asked for once: the rounds after it keep the connection again.
        round_kept(&store).await;
        std::fs::remove_dir_all(dir).unwrap();
    }

    /// A transaction on the pool (a failed round's work done apart, on the writer's own thread)
    /// takes the pool's writer a round kept rather than wait for it.
    #[tokio::test]
    async fn a_pool_transaction_takes_the_writer_a_round_kept() {
        let (store, dir) = store(SqliteDurability::Full).await;
        round_kept(&store).await;
        let tx = tokio::time::timeout(Duration::from_secs(5), store.begin_claim())
            .await
            .expect("the pool's writer was kept from a transaction on the pool")
            .unwrap();
        assert!(matches!(tx, SqliteTx::Pool(_)));
        tx.rollback().await.unwrap();
        std::fs::remove_dir_all(dir).unwrap();
    }

    /// A database in memory has no file a second connection could open: its rounds use the pool.
    #[tokio::test]
    async fn a_database_in_memory_keeps_the_pool() {
        let pool = sqlx::SqlitePool::connect("sqlite::memory:").await.unwrap();
        let store = SqliteQueueStore::new(pool);
        let tx = store.begin_group_write(&[]).await.unwrap();
        assert!(matches!(tx, SqliteTx::Pool(_)));
    }
}
