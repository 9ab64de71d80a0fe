//! What every stateful service needs to reach its own tables: opening SQLite (WAL, busy timeout, one
//! file per service) or PostgreSQL (one schema per service in the shared database), and a clock that
//! tests can drive. Services embed and run their own migrations; this crate never touches a table.

mod checkpoint;
pub mod clock;
pub mod clock_offset;
pub mod health;
pub mod notify_relay;
pub mod pool_gauges;
#[cfg(feature = "testing")]
pub mod testing;
pub mod wal_sync;

use std::path::{Path, PathBuf};
use std::str::FromStr as _;
use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};
use sqlx::sqlite::{
    SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteSynchronous,
};

pub use clock::{Clock, ManualClock, SystemClock};
pub use pool_gauges::StorePools;
pub use wal_sync::{SyncFailed, WalSync};

/// Where a service keeps its state.
#[derive(Clone, Debug)]
pub enum DatabaseConfig {
    /// The embedded default: one SQLite file per service in this folder.
    Sqlite {
        data_dir: PathBuf,
        durability: SqliteDurability,
    },
    /// Production: one PostgreSQL database shared by all services, one schema each.
    /// The URL may carry a password: Debug never shows it.
    Postgres { url: secrecy::SecretString },
}

/// When a SQLite commit is on disk (`ORCA_PUSH_SQLITE_SYNCHRONOUS`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum SqliteDurability {
    /// `synchronous=FULL`: each commit is synced before it returns, so what was answered `queued`
    /// survives a power loss. Group commit makes one sync cover every admission of a group. A
    /// service that syncs the WAL itself (`ServiceStorage::sqlite_syncs_wal`) commits at NORMAL
    /// instead and syncs before it answers what it promised (`wal_sync`).
    #[default]
    Full,
    /// `synchronous=NORMAL`: durable across a process crash, but a power loss (or a kernel crash)
    /// can drop the last commits, sends already answered `queued` among them.
    Normal,
}

#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    #[error("cannot create the data folder {path}: {source}")]
    DataDir {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot open the database: {0}")]
    Connect(#[source] sqlx::Error),
    #[error(
        "cannot write the database {path} (SQLite opened it read-only: check the file's owner \
         and mode): {source}"
    )]
    ReadOnly { path: PathBuf, source: sqlx::Error },
    #[error("cannot migrate the database: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),
}

/// An open connection pool of either kind.
#[derive(Clone, Debug)]
pub enum Pool {
    Sqlite(SqlitePool),
    Postgres(PgPool),
}

impl Pool {
    /// A cheap round trip, for readiness.
    pub async fn ping(&self) -> Result<(), sqlx::Error> {
        match self {
            Self::Sqlite(pool) => sqlx::query("SELECT 1").execute(pool).await.map(drop),
            Self::Postgres(pool) => sqlx::query("SELECT 1").execute(pool).await.map(drop),
        }
    }

    pub fn backend(&self) -> &'static str {
        match self {
            Self::Sqlite(_) => "sqlite",
            Self::Postgres(_) => "postgresql",
        }
    }
}

/// How one service names its storage: its SQLite file name and its PostgreSQL schema.
#[derive(Debug, Clone, Copy)]
pub struct ServiceStorage {
    /// e.g. `auth.sqlite`.
    pub sqlite_file: &'static str,
    /// e.g. `push_auth`; the service's tables and migration history live in it.
    pub postgres_schema: &'static str,
    /// `CREATE SCHEMA IF NOT EXISTS <schema>`, spelled out so no SQL is ever formatted.
    pub create_schema_sql: &'static str,
    /// Upper bound on pooled PostgreSQL connections per process. SQLite always has one writer
    /// and `SQLITE_READERS` readers.
    pub max_connections: u32,
    /// `None`: the operator's `ORCA_PUSH_SQLITE_SYNCHRONOUS`. A service whose last commits may be
    /// lost to a power loss at no cost to a promise made to a host fixes its own.
    pub sqlite_durability: Option<SqliteDurability>,
    /// Under `SqliteDurability::Full`, the writer commits at NORMAL and the service syncs the WAL
    /// itself before it answers (`wal_sync`), so its next transaction is written while the last
    /// is synced. For a service that answers every durable write through a [`WalSync`].
    pub sqlite_syncs_wal: bool,
}

/// Opens (creating if needed) the service's database.
pub async fn open(config: &DatabaseConfig, service: &ServiceStorage) -> Result<Pool, OpenError> {
    match config {
        DatabaseConfig::Sqlite {
            data_dir,
            durability,
        } => {
            let path = data_dir.join(service.sqlite_file);
            let durability = service.sqlite_durability.unwrap_or(*durability);
            let synced_by_service =
                service.sqlite_syncs_wal && durability == SqliteDurability::Full;
            let commits = if synced_by_service {
                SqliteDurability::Normal
            } else {
                durability
            };
            let writer = open_sqlite(&path, commits).await?;
            wal_sync::mark(&path, synced_by_service);
            Ok(Pool::Sqlite(writer))
        }
        DatabaseConfig::Postgres { url } => {
            use secrecy::ExposeSecret as _;
            open_postgres(url.expose_secret(), service)
                .await
                .map(Pool::Postgres)
        }
    }
}

/// The writer of a SQLite database (see `sqlite_readers` for reads outside a transaction), with
/// its WAL checkpointed in the background for as long as it is open.
pub async fn open_sqlite(
    path: &Path,
    durability: SqliteDurability,
) -> Result<SqlitePool, OpenError> {
    let (writer, options) = open_sqlite_writer(path, durability).await?;
    let checkpointer = sqlite_pool_options(1).connect_lazy_with(options);
    tokio::spawn(checkpoint::in_background(
        writer.clone(),
        checkpointer,
        checkpoint::sync_file(path),
    ));
    Ok(writer)
}

/// Makes the SQLite folder `dir` if it does not exist, owner only: the files hold push tokens,
/// payloads and the session key. A folder the operator made is left as it is.
pub fn data_dir(dir: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::DirBuilderExt as _;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
}

/// `open_sqlite` without its checkpoints, and the options its connections were made with.
async fn open_sqlite_writer(
    path: &Path,
    durability: SqliteDurability,
) -> Result<(SqlitePool, SqliteConnectOptions), OpenError> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        data_dir(dir).map_err(|source| OpenError::DataDir {
            path: dir.to_owned(),
            source,
        })?;
    }
    let options = SqliteConnectOptions::new()
        .filename(path)
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .synchronous(match durability {
            SqliteDurability::Full => SqliteSynchronous::Full,
            SqliteDurability::Normal => SqliteSynchronous::Normal,
        })
        .busy_timeout(Duration::from_secs(10))
        .foreign_keys(true)
        // Statement journals in memory: a multi-row write inside a transaction journals every
        // page it changes so that the statement alone can be undone, and past 64 KiB SQLite
        // spills that journal to a temporary file (a `pwrite` per page). Profiled on the queue's
        // writer in the admission benchmark: 17% of its time. Nothing here sorts or builds
        // temporary tables large enough to need the disk instead.
        .pragma("temp_store", "memory");
    // One writer: SQLite takes one write transaction at a time, and a second connection that
    // tries only sleeps in SQLite's busy handler (the benchmark saw p99 over a second with 16).
    // Writes queue in the pool instead, in order; reads use `sqlite_readers`. The writer never
    // checkpoints in its commits: a checkpoint in its commit path (with its fsync) stalled every
    // write queued behind it, so `checkpoint::in_background` does it beside the writer instead.
    let writer = sqlite_pool_options(1)
        .connect_with(
            options
                .clone()
                .pragma("wal_autocheckpoint", "0")
                .pragma("journal_size_limit", checkpoint::WAL_BYTES_KEPT)
                .statement_cache_capacity(SQLITE_WRITER_STATEMENTS),
        )
        .await
        .map_err(OpenError::Connect)?;
    writable(&writer)
        .await
        .map_err(|source| OpenError::ReadOnly {
            path: path.to_owned(),
            source,
        })?;
    Ok((writer, options))
}

/// Whether `writer` can write its file. SQLite opens a file it may not write (restored as another
/// user, say) read-only without a word: every write then fails (each send answered 503) while
/// reads, the health ping among them, go on answering. A write that changes nothing finds out at
/// start-up instead.
async fn writable(writer: &SqlitePool) -> Result<(), sqlx::Error> {
    // Not kept prepared: run once, they would take two places in the cache the writer's own
    // statements use.
    let version: i64 = sqlx::query_scalar("PRAGMA user_version")
        .persistent(false)
        .fetch_one(writer)
        .await?;
    // An integer read back from the file: nothing from outside is written into the statement.
    sqlx::query(&format!("PRAGMA user_version = {version}"))
        .persistent(false)
        .execute(writer)
        .await
        .map(drop)
}

/// A pool of connections to a SQLite file. Its connections are never pinged when taken from the
/// pool (sqlx's default): a ping checks that a server is still there, while a SQLite connection is
/// a thread in this process, and each ping was one more round trip to that thread before every
/// transaction of the one writer.
fn sqlite_pool_options(max_connections: u32) -> SqlitePoolOptions {
    SqlitePoolOptions::new()
        .max_connections(max_connections)
        .test_before_acquire(false)
}

/// Prepared statements a SQLite writer keeps (sqlx keeps 100). The queue's group statements differ
/// in text with the group's size (1-128 rows, six kinds) and are kept, so a round does not prepare
/// them again; one of 128 rows compiles to about 2,300 VDBE operations (some 70 KB), and the cache
/// fills only as group sizes occur.
pub const SQLITE_WRITER_STATEMENTS: usize = 1024;

/// Read connections per SQLite database.
pub const SQLITE_READERS: u32 = 4;

/// The pool a store reads from outside transactions: SQLite's readers beside its one writer;
/// PostgreSQL's one pool, which serves both.
pub trait ReadPool: Sized {
    fn readers(&self) -> Self;
}

impl ReadPool for SqlitePool {
    fn readers(&self) -> Self {
        sqlite_readers(self, SQLITE_READERS)
    }
}

impl ReadPool for PgPool {
    fn readers(&self) -> Self {
        self.clone()
    }
}

/// Connections to the same SQLite file as `writer`, for reads outside a transaction: WAL lets
/// them run beside the writer, each seeing every transaction committed before it started.
pub fn sqlite_readers(writer: &SqlitePool, max_connections: u32) -> SqlitePool {
    sqlite_pool_options(max_connections).connect_lazy_with((*writer.connect_options()).clone())
}

/// A pooled PostgreSQL connection idle for longer than this is pinged before it is handed out
/// (`postgres_pool_options`).
pub const PING_IDLE_AFTER: Duration = Duration::from_secs(1);

/// Options for a pool of PostgreSQL connections. sqlx pings a connection before every use by
/// default (`test_before_acquire`): one more round trip to the server, which wakes for it, before
/// every transaction and every statement run on the pool. The queue's admission writer paid it
/// before every round, between one commit and the next round's `BEGIN` (round 34,
/// docs/benchmarks.md). sqlx also pings every connection as it goes back to the pool, so one taken
/// again soon after was alive a moment ago; one idle for longer than `PING_IDLE_AFTER` is pinged
/// first, so that a connection the server closed meanwhile (a restart, a fail-over, an idle
/// timeout) is replaced rather than failing the next statement.
pub fn postgres_pool_options() -> PgPoolOptions {
    PgPoolOptions::new()
        .after_connect(|conn, _| {
            Box::pin(async move {
                sqlx::query(BOUND_IDLE_TRANSACTIONS)
                    .execute(conn)
                    .await
                    .map(drop)
            })
        })
        .test_before_acquire(false)
        .before_acquire(|conn, meta| {
            Box::pin(async move {
                if meta.idle_for >= PING_IDLE_AFTER {
                    sqlx::Connection::ping(conn).await?;
                }
                Ok(true)
            })
        })
}

/// Run on every new PostgreSQL connection: a transaction left idle for 30 s is ended by the server,
/// unless the operator chose a bound of their own (the URL's `options`, the role's or database's
/// settings). A gateway whose connection dies without a word (a frozen VM, a NAT that forgot it)
/// leaves its server session in its transaction, holding its locks, until TCP keepalive notices,
/// some two hours by default; an admission round holds its hosts' locks, and every other replica's
/// round for those hosts, with everything behind it on that replica's one writer, would wait.
/// None of the gateway's transactions waits on anything but the server.
const BOUND_IDLE_TRANSACTIONS: &str = "SELECT set_config('idle_in_transaction_session_timeout', \
     '30s', false) WHERE current_setting('idle_in_transaction_session_timeout') = '0'";

/// Whether sqlx can read `url` as a PostgreSQL connection URL, checked at start-up so that a
/// URL it cannot read stops the gateway naming its variable. The error never holds the URL (it
/// may hold a password). A Unix socket goes in the `host` parameter or, percent-encoded, as the
/// host: `postgres://user:pw@/db?host=/sock` has credentials and no host, which URLs cannot have.
pub fn check_postgres_url(url: &str) -> Result<(), String> {
    PgConnectOptions::from_str(url)
        .map(drop)
        .map_err(|error| match error {
            sqlx::Error::Configuration(cause) => cause.to_string(),
            _ => "cannot be read as a PostgreSQL URL".to_owned(),
        })
}

async fn open_postgres(url: &str, service: &ServiceStorage) -> Result<PgPool, OpenError> {
    let options = PgConnectOptions::from_str(url)
        .map_err(OpenError::Connect)?
        .options([("search_path", service.postgres_schema)]);
    let pool = postgres_pool_options()
        .max_connections(service.max_connections)
        .acquire_timeout(Duration::from_secs(10))
        .connect_with(options)
        .await
        .map_err(OpenError::Connect)?;
    // Replicas starting together may race to create the schema; the loser sees it exists.
    if let Err(first) = sqlx::query(service.create_schema_sql).execute(&pool).await {
        tracing::debug!(error = %first, "schema creation raced; retrying once");
        sqlx::query(service.create_schema_sql)
            .execute(&pool)
            .await
            .map_err(OpenError::Connect)?;
    }
    Ok(pool)
}

/// A client span for one storage operation, with the OpenTelemetry database conventions. It names
/// the operation, never its arguments.
pub fn db_span(system: &'static str, operation: &'static str) -> tracing::Span {
    tracing::info_span!(
        "db",
        otel.name = operation,
        otel.kind = "client",
        db.system = system,
        db.operation.name = operation,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A file SQLite can only read is found at start-up, not at the first write.
    #[tokio::test]
    async fn a_database_opened_read_only_is_found_before_any_write() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ro.sqlite");
        let writer = open_sqlite(&path, SqliteDurability::Full).await.unwrap();
        writable(&writer).await.unwrap();
        writer.close().await;
        // As SQLite opens a file it may not write (this test runs as root, whom file modes do
        // not stop): read-only.
        let read_only = sqlite_pool_options(1)
            .connect_with(SqliteConnectOptions::new().filename(&path).read_only(true))
            .await
            .unwrap();
        sqlx::query("SELECT 1").execute(&read_only).await.unwrap();
        let refused = writable(&read_only).await.unwrap_err();
        assert!(refused.to_string().contains("readonly"), "{refused}");
    }

    /// Every pooled PostgreSQL connection bounds its idle transactions, unless the operator did.
    #[tokio::test]
    async fn postgresql_connections_end_transactions_left_idle_unless_the_operator_chose() {
        let url = std::env::var("ORCA_PUSH_TEST_POSTGRES_URL")
            .expect("ORCA_PUSH_TEST_POSTGRES_URL: scripts/test starts a throwaway PostgreSQL");
        let chosen = format!(
            "{url}{}options=-c%20idle_in_transaction_session_timeout%3D5s",
            if url.contains('?') { '&' } else { '?' }
        );
        for (url, expected) in [(url, "30s"), (chosen, "5s")] {
            let pool = postgres_pool_options()
                .max_connections(1)
                .connect(&url)
                .await
                .unwrap();
            let bound: String = sqlx::query_scalar("SHOW idle_in_transaction_session_timeout")
                .fetch_one(&pool)
                .await
                .unwrap();
            assert_eq!(bound, expected);
            pool.close().await;
        }
    }

    /// A data folder the gateway makes is its owner's alone.
    #[tokio::test]
    async fn a_data_folder_it_makes_is_the_owners_alone() {
        use std::os::unix::fs::PermissionsExt as _;
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("made/here");
        open_sqlite(&data.join("store.db"), SqliteDurability::Full)
            .await
            .unwrap();
        for made in [dir.path().join("made"), data] {
            let mode = std::fs::metadata(&made).unwrap().permissions().mode();
            assert_eq!(mode & 0o777, 0o700, "{}", made.display());
        }
    }

    #[tokio::test]
    async fn sqlite_syncs_every_commit_unless_told_otherwise() {
        let dir = tempfile::tempdir().unwrap();
        for (durability, expected) in [(SqliteDurability::Full, 2), (SqliteDurability::Normal, 1)] {
            let path = dir.path().join(format!("{durability:?}.db"));
            let writer = open_sqlite(&path, durability).await.unwrap();
            let readers = sqlite_readers(&writer, 1);
            for pool in [&writer, &readers] {
                let level: i64 = sqlx::query_scalar("PRAGMA synchronous")
                    .fetch_one(pool)
                    .await
                    .unwrap();
                assert_eq!(level, expected, "{durability:?}");
            }
        }
    }

    /// Multi-row writes journal their pages for a statement rollback; on disk that was a `pwrite`
    /// per page on the writer's path (17% of the queue writer's time).
    #[tokio::test]
    async fn statement_journals_stay_in_memory() {
        let dir = tempfile::tempdir().unwrap();
        let writer = open_sqlite(&dir.path().join("t.db"), SqliteDurability::Full)
            .await
            .unwrap();
        let memory = 2;
        let store: i64 = sqlx::query_scalar("PRAGMA temp_store")
            .fetch_one(&writer)
            .await
            .unwrap();
        assert_eq!(store, memory);
    }

    /// The queue keeps a prepared statement per group size and kind; sqlx's default of 100 would
    /// evict them round after round.
    #[tokio::test]
    async fn the_writer_keeps_many_prepared_statements() {
        use sqlx::Connection as _;
        let dir = tempfile::tempdir().unwrap();
        let writer = open_sqlite(&dir.path().join("t.db"), SqliteDurability::Full)
            .await
            .unwrap();
        let mut conn = writer.acquire().await.unwrap();
        for n in 0..300 {
            sqlx::query(&format!("SELECT {n}"))
                .execute(&mut *conn)
                .await
                .unwrap();
        }
        assert_eq!(conn.cached_statements_size(), 300);
    }

    #[tokio::test]
    async fn a_service_may_fix_its_own_durability() {
        let dir = tempfile::tempdir().unwrap();
        let config = DatabaseConfig::Sqlite {
            data_dir: dir.path().to_owned(),
            durability: SqliteDurability::Full,
        };
        let service = |file, sqlite_durability| ServiceStorage {
            sqlite_file: file,
            postgres_schema: "unused",
            create_schema_sql: "unused",
            max_connections: 1,
            sqlite_durability,
            sqlite_syncs_wal: false,
        };
        for (file, own, expected) in [
            ("configured.db", None, 2),
            ("fixed.db", Some(SqliteDurability::Normal), 1),
        ] {
            let Pool::Sqlite(pool) = open(&config, &service(file, own)).await.unwrap() else {
                unreachable!("a SQLite configuration opens SQLite");
            };
            let level: i64 = sqlx::query_scalar("PRAGMA synchronous")
                .fetch_one(&pool)
                .await
                .unwrap();
            assert_eq!(level, expected, "{file}");
        }
    }

    /// A service that syncs the WAL itself gets a writer that commits at NORMAL only when the
    /// operator asked for full durability, and a `WalSync` only then.
    #[tokio::test]
    async fn a_service_that_syncs_its_wal_gets_a_writer_that_does_not() {
        let dir = tempfile::tempdir().unwrap();
        let open_writer = |file: &'static str, operator, sqlite_syncs_wal| {
            let config = DatabaseConfig::Sqlite {
                data_dir: dir.path().to_owned(),
                durability: operator,
            };
            async move {
                let service = ServiceStorage {
                    sqlite_file: file,
                    postgres_schema: "unused",
                    create_schema_sql: "unused",
                    max_connections: 1,
                    sqlite_durability: None,
                    sqlite_syncs_wal,
                };
                let Pool::Sqlite(writer) = open(&config, &service).await.unwrap() else {
                    unreachable!("a SQLite configuration opens SQLite");
                };
                writer
            }
        };
        for (file, operator, syncs_wal, level, synced_by_service) in [
            ("synced.db", SqliteDurability::Full, true, 1, true),
            ("normal.db", SqliteDurability::Normal, true, 1, false),
            ("full.db", SqliteDurability::Full, false, 2, false),
        ] {
            let writer = open_writer(file, operator, syncs_wal).await;
            let found: i64 = sqlx::query_scalar("PRAGMA synchronous")
                .fetch_one(&writer)
                .await
                .unwrap();
            assert_eq!(found, level, "{file}");
            assert_eq!(
                wal_sync::for_writer(&writer).is_some(),
                synced_by_service,
                "{file}"
            );
        }
        // A file opened for its service to sync, then opened again under NORMAL, is not synced.
        let writer = open_writer("synced.db", SqliteDurability::Normal, true).await;
        assert!(wal_sync::for_writer(&writer).is_none());
    }

    /// What a WAL sync covers is on disk: the commits before it are in the WAL file it synced.
    #[tokio::test]
    async fn a_wal_sync_covers_the_commits_before_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.db");
        let writer = open_sqlite(&path, SqliteDurability::Normal).await.unwrap();
        sqlx::query("CREATE TABLE t (v INTEGER)")
            .execute(&writer)
            .await
            .unwrap();
        sqlx::query("INSERT INTO t VALUES (1)")
            .execute(&writer)
            .await
            .unwrap();
        let sync = WalSync::for_database(&path);
        let (tx, rx) = tokio::sync::oneshot::channel();
        sync.after_sync(move |r| drop(tx.send(r)));
        rx.await.unwrap().unwrap();
        assert_eq!(sync.syncs(), 1);
        assert!(
            std::fs::metadata(dir.path().join("t.db-wal"))
                .unwrap()
                .len()
                > 0
        );
    }

    /// A PostgreSQL connection is pinged before use only once it sat idle for `PING_IDLE_AFTER`
    /// (`postgres_pool_options`); what happens after the server closes one is shown on the queue
    /// (`postgresql_work_goes_on_after_the_server_closes_idle_connections`).
    #[test]
    fn postgresql_pools_do_not_ping_before_every_use() {
        assert!(!postgres_pool_options().get_test_before_acquire());
    }

    #[tokio::test]
    async fn sqlite_has_one_writer_and_readers_that_do_not_wait_for_it() {
        let dir = tempfile::tempdir().unwrap();
        let writer = open_sqlite(&dir.path().join("store.db"), SqliteDurability::Full)
            .await
            .unwrap();
        assert_eq!(writer.options().get_max_connections(), 1);
        let readers = writer.readers();
        assert_eq!(readers.options().get_max_connections(), SQLITE_READERS);
        // Nothing to ping in a connection that lives in this process.
        assert!(!writer.options().get_test_before_acquire());
        assert!(!readers.options().get_test_before_acquire());
        sqlx::query("CREATE TABLE t (v INTEGER)")
            .execute(&writer)
            .await
            .unwrap();
        // A write transaction in progress holds the writer; readers still answer (WAL), with
        // what was committed before it.
        let mut tx = writer.begin().await.unwrap();
        sqlx::query("INSERT INTO t VALUES (1)")
            .execute(&mut *tx)
            .await
            .unwrap();
        let count = |pool: SqlitePool| async move {
            sqlx::query_scalar::<_, i64>("SELECT COUNT(*) FROM t")
                .fetch_one(&pool)
                .await
                .unwrap()
        };
        assert_eq!(count(readers.clone()).await, 0);
        // A second writer waits in the pool (not in SQLite's busy handler) until the first commits.
        let second = tokio::spawn({
            let writer = writer.clone();
            async move {
                sqlx::query("INSERT INTO t VALUES (2)")
                    .execute(&writer)
                    .await
                    .unwrap();
            }
        });
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!second.is_finished());
        tx.commit().await.unwrap();
        second.await.unwrap();
        assert_eq!(count(readers).await, 2);
    }

    #[tokio::test]
    async fn the_wal_reaches_the_database_file_without_the_writer_checkpointing() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("store.db");
        let writer = open_sqlite(&path, SqliteDurability::Full).await.unwrap();
        let autocheckpoint: i64 = sqlx::query_scalar("PRAGMA wal_autocheckpoint")
            .fetch_one(&writer)
            .await
            .unwrap();
        assert_eq!(
            autocheckpoint, 0,
            "the writer must not checkpoint in its commits"
        );
        sqlx::query("CREATE TABLE t (v BLOB)")
            .execute(&writer)
            .await
            .unwrap();
        let file_len = || std::fs::metadata(&path).unwrap().len();
        let before = file_len();
        for _ in 0..200 {
            sqlx::query("INSERT INTO t VALUES (zeroblob(4096))")
                .execute(&writer)
                .await
                .unwrap();
        }
        // 800 KiB written: in the WAL at first, in the database file after a checkpoint.
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while file_len() < before + 800 * 1024 {
            assert!(
                std::time::Instant::now() < deadline,
                "no checkpoint in 10 s"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}
