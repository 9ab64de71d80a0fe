//! Copying a SQLite file's WAL back into the database file beside its one writer, so that the WAL
//! starts over instead of growing.
//!
//! SQLite starts the WAL over only when a write begins after a checkpoint has copied every frame.
//! A checkpoint beside the writer copies the frames that existed when it began; under a steady
//! load the writer commits more meanwhile, so that never happens and the WAL only grows: the
//! admission benchmark grew the queue's to 1 GB in 25 s, every commit's sync then extended the
//! file (a journal commit in the filesystem each time, waiting for the checkpoint's writes to the
//! database file), and the disk would have filled under a long enough load.
//!
//! So each checkpoint runs in steps: the bulk on a connection of its own, beside the writer; then,
//! if frames were committed meanwhile, the rest on the writer's own connection, taken from its
//! pool like any write, so nothing new is committed until it is done and the next write starts the
//! WAL over.
//!
//! SQLite syncs the database file only in a checkpoint that copies the whole WAL, since only then
//! may the WAL start over: under load the copy beside the writer never does, and the writer's step
//! synced everything copied since the last one. In the admission benchmark that was a second's
//! pages, 12-16 MB in some 2,000 writes (an `fsync` of 16-20 ms), and the writer was held 25-35 ms
//! every second: the p99 (docs/benchmarks.md, round 46). So each copy beside the writer is synced
//! beside it too, what comes in meanwhile is copied and synced beside before the writer's step,
//! and the step syncs only what it copies itself (the writer held 5-13 ms).
//!
//! Even so, that step made a bump of 20-35 ms in the admission benchmark's latency every second,
//! and those bumps set its p99 (round 47). The WAL need not start over every second, only before
//! it takes too much of the disk: so the writer's step runs once the WAL holds `RESTART_AT`
//! frames (every two to three seconds under the benchmark's load; a lighter load's WAL starts
//! over on its own, at the first write after a copy beside that caught up).

use std::io;
use std::sync::Arc;
use std::time::Duration;

use sqlx::SqlitePool;

/// How often the WAL is copied back into the database file.
const CHECKPOINT_EVERY: Duration = Duration::from_secs(1);

/// The frames (of a 4 KiB page each) a WAL may hold before the writer's step starts it over:
/// 256 MiB. The queue's took 120-135 MB a second at half the admission benchmark's peak and
/// 220-240 MB a second at its peak (docs/benchmarks.md, round 48), so the step runs every two to
/// three seconds there, rather than every second.
const RESTART_AT: i64 = 65_536;

/// The size a WAL is cut back to when it starts over (SQLite's `journal_size_limit`, in bytes):
/// room for `RESTART_AT` frames and a second of the heaviest load measured after them, so that
/// the file's blocks are written over rather than allocated again. Cut back to 64 MiB, half of
/// each second's syncs extended the file, and each such sync wrote its inode and block maps as
/// well (docs/benchmarks.md, round 26). The WAL is read whole at start-up after a crash: 0.26 s
/// for 358 MB with the page cache dropped (round 48).
pub(crate) const WAL_BYTES_KEPT: &str = "536870912";

/// What a PASSIVE checkpoint reports: the frames in the WAL when it began, and how many of them
/// are now in the database file. Frames committed while it ran are in neither.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Checkpointed {
    log: i64,
    checkpointed: i64,
}

impl Checkpointed {
    async fn passive<'c>(on: impl sqlx::SqliteExecutor<'c>) -> Result<Self, sqlx::Error> {
        let (_busy, log, checkpointed): (i64, i64, i64) =
            sqlx::query_as("PRAGMA wal_checkpoint(PASSIVE)")
                // Not kept: on the writer it would take a place in the cache that its rounds'
                // statements use (once a second, preparing it again costs microseconds).
                .persistent(false)
                .fetch_one(on)
                .await?;
        Ok(Self { log, checkpointed })
    }

    /// Whether anything was committed since `last`: there is something to copy and sync. A WAL
    /// that started over and holds as many frames as at `last` looks unchanged; that tick then
    /// skips its sync, which costs nothing but latency: a copy that caught up was synced by
    /// SQLite, and the writer's step syncs beside it first.
    fn changed_since(self, last: Self) -> bool {
        self.log != last.log || self.checkpointed != self.log
    }

    /// Whether the writer finishes the checkpoint, so that the WAL starts over: it holds
    /// `restart_at` frames or more, and what this copy left behind (a reader of an older
    /// snapshot limits how far it copies) is small, since the writer waits for all of it. More
    /// left behind waits for the next tick's copy beside it.
    fn writer_finishes(self, restart_at: i64) -> bool {
        self.log >= restart_at && self.log - self.checkpointed <= WRITER_COPIES_AT_MOST
    }
}

/// Frames (of a page each, 4 KiB) the writer's step may have to copy beyond what was committed
/// while the copy beside it ran.
const WRITER_COPIES_AT_MOST: i64 = 1024;

/// How a sync of the database file writes its dirty pages out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Pace {
    /// In `WRITE_BACK_STEPS` parts of the file, `WRITE_BACK_PAUSE` apart, then synced.
    Steps,
    /// All at once.
    Now,
}

/// Makes what was copied into the database file durable (`fdatasync`), run on a blocking thread.
pub(crate) type SyncFile = Arc<dyn Fn(Pace) -> io::Result<()> + Send + Sync>;

/// The parts a paced sync writes the database file out in, one after another.
const WRITE_BACK_STEPS: u64 = 16;

/// The pause after each part of a paced sync.
const WRITE_BACK_PAUSE: Duration = Duration::from_millis(10);

/// Syncs the database file at `path` through a descriptor of its own, kept open for as long as
/// the checkpoints run: closing any descriptor of a file drops every POSIX lock the process holds
/// on it, SQLite's among them, so it is closed only once the writer's pool is. `None` for a file
/// that cannot be opened (a database in memory): its checkpoints then sync only in SQLite.
///
/// A second's copy is 12-16 MB of pages in the admission benchmark, scattered over the file.
/// Synced at once, it kept the disk busy for 30-50 ms, the WAL's syncs (each commit's) waited
/// behind it, 3-10 ms instead of under one, and every send in flight took 20-50 ms more: the p99
/// (docs/benchmarks.md, round 48). Paced, it goes out a sixteenth of the file at a time, each part
/// written before the next starts and a pause after it, so a commit's sync waits for one part at
/// most; the `fdatasync` after finds little left to write.
pub(crate) fn sync_file(path: &std::path::Path) -> Option<SyncFile> {
    let file = std::fs::File::open(path).ok()?;
    Some(Arc::new(move |pace| {
        if pace == Pace::Steps {
            let part = file.metadata()?.len().div_ceil(WRITE_BACK_STEPS).max(1);
            for step in 0..WRITE_BACK_STEPS {
                write_back(&file, step * part, part)?;
                std::thread::sleep(WRITE_BACK_PAUSE);
            }
        }
        file.sync_data()
    }))
}

/// Writes the dirty pages of `len` bytes of `file` from `offset` out to the disk, and waits for
/// them (`sync_file_range`): neither the file's metadata nor the disk's cache, which the
/// `fdatasync` after sees to. A write that failed is reported here and not again by that
/// `fdatasync` (the kernel reports it once per descriptor), so an error here is a failed sync.
#[cfg(target_os = "linux")]
#[allow(unsafe_code)]
fn write_back(file: &std::fs::File, offset: u64, len: u64) -> io::Result<()> {
    use std::os::fd::AsRawFd as _;
    let flags = libc::SYNC_FILE_RANGE_WAIT_BEFORE
        | libc::SYNC_FILE_RANGE_WRITE
        | libc::SYNC_FILE_RANGE_WAIT_AFTER;
    let (offset, len) = (
        i64::try_from(offset).map_err(io::Error::other)?,
        i64::try_from(len).map_err(io::Error::other)?,
    );
    // SAFETY: a system call on a descriptor that `file` owns and keeps open for the call; it
    // reads and writes no memory of this process.
    let done = unsafe { libc::sync_file_range(file.as_raw_fd(), offset, len, flags) };
    if done == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Elsewhere the `fdatasync` after writes everything at once.
#[cfg(not(target_os = "linux"))]
fn write_back(_: &std::fs::File, _: u64, _: u64) -> io::Result<()> {
    Ok(())
}

/// Checkpoints every `CHECKPOINT_EVERY` until the writer's pool is closed (see the module's doc).
pub(crate) async fn in_background(
    writer: SqlitePool,
    checkpointer: SqlitePool,
    sync: Option<SyncFile>,
) {
    let mut tick = tokio::time::interval(CHECKPOINT_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut checkpoints = Checkpoints::new(writer, checkpointer, sync, RESTART_AT);
    loop {
        tick.tick().await;
        if checkpoints.writer.is_closed() {
            checkpoints.checkpointer.close().await;
            return;
        }
        match checkpoints.run().await {
            Ok(()) => {}
            // Closed while the writer's step waited for its connection: shutting down.
            Err(sqlx::Error::PoolClosed) => {
                checkpoints.checkpointer.close().await;
                return;
            }
            Err(error) => tracing::warn!(%error, "SQLite checkpoint failed; retrying in a second"),
        }
    }
}

/// One file's checkpoints, one `run` at a time.
struct Checkpoints {
    writer: SqlitePool,
    checkpointer: SqlitePool,
    sync: Option<SyncFile>,
    /// Set by a sync beside the writer that failed (see `run`).
    sync_failed: bool,
    /// What the last copy beside the writer reported.
    last: Checkpointed,
    /// The frames at which the writer's step starts the WAL over (`RESTART_AT`; tests set less).
    restart_at: i64,
}

impl Checkpoints {
    fn new(
        writer: SqlitePool,
        checkpointer: SqlitePool,
        sync: Option<SyncFile>,
        restart_at: i64,
    ) -> Self {
        Self {
            writer,
            checkpointer,
            sync,
            sync_failed: false,
            last: Checkpointed::default(),
            restart_at,
        }
    }

    /// One checkpoint: the WAL copied beside the writer (a PASSIVE checkpoint never waits for the
    /// writer or readers) and, if that copied anything, the database file synced beside it too.
    /// Once the WAL is long enough (`writer_finishes`), what came in meanwhile is copied and
    /// synced beside the writer, and the rest on the writer's connection: that step holds the
    /// writer back while it copies and syncs what this pass left, and the next write starts the
    /// WAL over. An idle WAL skips all of it.
    ///
    /// A sync beside that fails sets `sync_failed`, and from then on the writer's step never
    /// runs: pages copied into the file may not be on the disk, and a later sync can succeed
    /// without them (the kernel reports a failed write once per descriptor), so the WAL, their
    /// only copy known to be on disk, must never start over. It grows instead, said in the log,
    /// until a restart (as `wal_sync` stops answering anything as durable after a failed sync of
    /// the WAL).
    async fn run(&mut self) -> Result<(), sqlx::Error> {
        let beside = Checkpointed::passive(&self.checkpointer).await?;
        let changed = beside.changed_since(self.last);
        self.last = beside;
        if self.sync_failed || !changed {
            return Ok(());
        }
        let finish = beside.writer_finishes(self.restart_at);
        if let Some(sync) = self.sync.clone() {
            let checkpointer = &self.checkpointer;
            let synced = async {
                sync_beside(&sync, Pace::Steps).await?;
                if finish {
                    // What was committed during that copy and sync, copied and synced beside the
                    // writer too, so that its step is left with what comes in during this
                    // shorter pass.
                    Checkpointed::passive(checkpointer).await?;
                    sync_beside(&sync, Pace::Now).await?;
                }
                Ok(())
            };
            if let Err(error) = synced.await {
                if matches!(error, sqlx::Error::Io(_)) {
                    self.sync_failed = true;
                    tracing::error!(%error, "a SQLite database file could not be synced; its WAL is not started over again until a restart");
                }
                return Err(error);
            }
        }
        if finish {
            let mut connection = self.writer.acquire().await?;
            self.last = Checkpointed::passive(&mut *connection).await?;
        }
        Ok(())
    }
}

async fn sync_beside(sync: &SyncFile, pace: Pace) -> Result<(), sqlx::Error> {
    let sync = sync.clone();
    tokio::task::spawn_blocking(move || sync(pace))
        .await
        .map_err(|joined| io::Error::other(joined.to_string()))??;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{SqliteDurability, open_sqlite, open_sqlite_writer};

    #[test]
    fn a_checkpoint_syncs_what_changed_and_the_writer_finishes_a_long_wal() {
        let at = |log, checkpointed| Checkpointed { log, checkpointed };
        // Idle: nothing new since the last checkpoint, everything copied.
        assert!(!at(500, 500).changed_since(at(500, 500)));
        // Frames committed since, or some left behind by a reader: copied, then synced.
        assert!(at(800, 800).changed_since(at(500, 500)));
        assert!(at(500, 400).changed_since(at(500, 400)));
        // Short of `restart_at`: the writer is left alone.
        assert!(!at(999, 999).writer_finishes(1_000));
        // Long enough: the writer copies the rest, including a little a reader held back.
        assert!(at(1_000, 1_000).writer_finishes(1_000));
        assert!(at(5_000, 4_000).writer_finishes(1_000));
        // Held back a lot: the writer would wait for all of it; the next tick copies it beside.
        assert!(!at(5_000, 100).writer_finishes(1_000));
    }

    async fn wal_frames(pool: &SqlitePool) -> i64 {
        Checkpointed::passive(pool).await.unwrap().log
    }

    async fn opened() -> (tempfile::TempDir, SqlitePool, SqlitePool, Option<SyncFile>) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("store.db");
        // No checkpoints in the background: only the test's run.
        let (writer, _) = open_sqlite_writer(&path, SqliteDurability::Normal)
            .await
            .unwrap();
        let checkpointer = crate::sqlite_readers(&writer, 1);
        let sync = sync_file(&path);
        assert!(sync.is_some(), "the database file opens for its syncs");
        sqlx::query("CREATE TABLE t (v BLOB)")
            .execute(&writer)
            .await
            .unwrap();
        (dir, writer, checkpointer, sync)
    }

    async fn write(writer: &SqlitePool, rows: usize) {
        for _ in 0..rows {
            sqlx::query("INSERT INTO t VALUES (zeroblob(1024))")
                .execute(writer)
                .await
                .unwrap();
        }
    }

    #[tokio::test]
    async fn the_wal_starts_over_under_a_steady_stream_of_writes() {
        let (_dir, writer, checkpointer, sync) = opened().await;
        // Commits back to back, as a busy writer makes them, while checkpoints run beside it.
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let writes = tokio::spawn({
            let (writer, stop) = (writer.clone(), stop.clone());
            async move {
                let mut commits = 0_i64;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    write(&writer, 1).await;
                    commits += 1;
                }
                commits
            }
        });
        let mut checkpoints = Checkpoints::new(writer, checkpointer.clone(), sync, 200);
        for _ in 0..20 {
            tokio::time::sleep(Duration::from_millis(50)).await;
            checkpoints.run().await.unwrap();
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let commits = writes.await.unwrap();
        // Each commit appends at least one frame. A WAL that never started over would hold them
        // all; one that starts over after each checkpoint holds the last 50 ms of them.
        let frames = wal_frames(&checkpointer).await;
        assert!(commits >= 500, "too few commits to tell: {commits}");
        assert!(
            frames < commits / 2,
            "{frames} frames left in the WAL after {commits} commits"
        );
    }

    #[tokio::test]
    async fn the_writer_is_left_alone_until_the_wal_is_long() {
        let (_dir, writer, checkpointer, sync) = opened().await;
        // Whether a checkpoint ends while the writer's one connection is taken, as a long round
        // would take it.
        let runs_beside_a_busy_writer = |mut checkpoints: Checkpoints| {
            let writer = writer.clone();
            async move {
                let busy = writer.acquire().await.unwrap();
                let ran = tokio::time::timeout(Duration::from_millis(300), checkpoints.run()).await;
                drop(busy);
                ran.map(|ran| ran.unwrap()).is_ok()
            }
        };
        write(&writer, 50).await;
        let short = Checkpoints::new(writer.clone(), checkpointer.clone(), sync.clone(), i64::MAX);
        assert!(
            runs_beside_a_busy_writer(short).await,
            "short of the restart point: copied and synced beside, the writer not waited for"
        );
        write(&writer, 1).await;
        let long = Checkpoints::new(writer.clone(), checkpointer, sync, 1);
        assert!(
            !runs_beside_a_busy_writer(long).await,
            "past it: the checkpoint waits for the writer's connection to finish there"
        );
    }

    #[tokio::test]
    async fn the_database_file_is_synced_beside_the_writer_when_its_step_runs() {
        let (_dir, writer, checkpointer, _) = opened().await;
        let syncs = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let fails = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let sync: SyncFile = {
            let (syncs, fails) = (syncs.clone(), fails.clone());
            Arc::new(move |_| {
                syncs.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                if fails.load(std::sync::atomic::Ordering::SeqCst) {
                    return Err(io::Error::other("the disk is gone"));
                }
                Ok(())
            })
        };
        let synced = || syncs.load(std::sync::atomic::Ordering::SeqCst);
        let mut short = Checkpoints::new(
            writer.clone(),
            checkpointer.clone(),
            Some(sync.clone()),
            i64::MAX,
        );
        // Frames since the last checkpoint, short of the restart point: one pass beside, synced.
        short.run().await.unwrap();
        assert_eq!(synced(), 1);
        // Past it: the writer's step runs, after two passes beside it, each synced.
        let mut checkpoints = Checkpoints::new(writer.clone(), checkpointer, Some(sync), 1);
        write(&writer, 1).await;
        checkpoints.run().await.unwrap();
        assert_eq!(synced(), 3);
        // Nothing new: none of it runs.
        checkpoints.run().await.unwrap();
        assert_eq!(synced(), 3);
        // A sync that fails ends the checkpoint there, as an error. (Three commits: a WAL that
        // started over holds more frames than the one or two of the last checkpoint.)
        write(&writer, 3).await;
        fails.store(true, std::sync::atomic::Ordering::SeqCst);
        let failed = checkpoints.run().await;
        assert!(matches!(failed, Err(sqlx::Error::Io(_))), "{failed:?}");
        assert_eq!(synced(), 4, "stopped at the first sync");
        // The disk answers again: the writer's step still never runs (nor the syncs before it).
        fails.store(false, std::sync::atomic::Ordering::SeqCst);
        write(&writer, 1).await;
        checkpoints.run().await.unwrap();
        assert_eq!(synced(), 4, "no step after a failed sync");
    }

    #[tokio::test]
    async fn the_wal_is_cut_back_when_it_starts_over() {
        let dir = tempfile::tempdir().unwrap();
        let writer = open_sqlite(&dir.path().join("store.db"), SqliteDurability::Normal)
            .await
            .unwrap();
        let limit: i64 = sqlx::query_scalar("PRAGMA journal_size_limit")
            .fetch_one(&writer)
            .await
            .unwrap();
        assert_eq!(limit.to_string(), WAL_BYTES_KEPT);
    }
}
