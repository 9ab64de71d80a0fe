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
//! every second: the p99 (docs/benchmarks.md, round 46). So before the writer's step the database
//! file is synced beside the writer, what came in meanwhile is copied and synced beside it too,
//! and the step syncs only what it copies itself (the writer held 5-13 ms).

use std::io;
use std::sync::Arc;
use std::time::Duration;

use sqlx::SqlitePool;

/// How often the WAL is copied back into the database file.
const CHECKPOINT_EVERY: Duration = Duration::from_secs(1);

/// The size a WAL is cut back to when it starts over (SQLite's `journal_size_limit`, in bytes):
/// room for a second of the heaviest load measured, so that the file's blocks are written over
/// rather than allocated again. The queue's WAL took 100-134 MB a second in the admission
/// benchmark at 8 connections (docs/benchmarks.md, round 26); cut back to 64 MiB, half of each
/// second's syncs extended the file, and each such sync wrote its inode and block maps as well.
pub(crate) const WAL_BYTES_KEPT: &str = "268435456";

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

    /// Whether the writer finishes the checkpoint: the WAL changed since the last one, so frames
    /// may have been committed while this one ran, or some were left behind; and what this one
    /// left behind (a reader of an older snapshot limits how far it copies) is small, since the
    /// writer waits for all of it. More left behind waits for the next tick's copy beside it.
    fn writer_finishes(self, last: Self) -> bool {
        let left = self.log - self.checkpointed;
        (self.log != last.log || left > 0) && left <= WRITER_COPIES_AT_MOST
    }
}

/// Frames (of a page each, 4 KiB) the writer's step may have to copy beyond what was committed
/// while the copy beside it ran.
const WRITER_COPIES_AT_MOST: i64 = 1024;

/// Makes what was copied into the database file durable (`fdatasync`), run on a blocking thread.
pub(crate) type SyncFile = Arc<dyn Fn() -> io::Result<()> + Send + Sync>;

/// Syncs the database file at `path` through a descriptor of its own, kept open for as long as
/// the checkpoints run: closing any descriptor of a file drops every POSIX lock the process holds
/// on it, SQLite's among them, so it is closed only once the writer's pool is. `None` for a file
/// that cannot be opened (a database in memory): its checkpoints then sync only in SQLite.
pub(crate) fn sync_file(path: &std::path::Path) -> Option<SyncFile> {
    let file = std::fs::File::open(path).ok()?;
    Some(Arc::new(move || file.sync_data()))
}

/// Checkpoints every `CHECKPOINT_EVERY` until the writer's pool is closed (see the module's doc).
pub(crate) async fn in_background(
    writer: SqlitePool,
    checkpointer: SqlitePool,
    sync: Option<SyncFile>,
) {
    let mut tick = tokio::time::interval(CHECKPOINT_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut last = Checkpointed::default();
    let mut sync_failed = false;
    loop {
        tick.tick().await;
        if writer.is_closed() {
            checkpointer.close().await;
            return;
        }
        match checkpoint(
            &writer,
            &checkpointer,
            sync.as_ref(),
            &mut sync_failed,
            last,
        )
        .await
        {
            Ok(done) => last = done,
            // Closed while the writer's step waited for its connection: shutting down.
            Err(sqlx::Error::PoolClosed) => {
                checkpointer.close().await;
                return;
            }
            Err(error) => tracing::warn!(%error, "SQLite checkpoint failed; retrying in a second"),
        }
    }
}

/// One checkpoint after `last`: the bulk beside the writer (a PASSIVE checkpoint never waits for
/// the writer or readers), then, if the WAL changed (`writer_finishes`), the database file synced
/// beside the writer, and the rest on the writer's connection. That last step holds the writer
/// back while it copies what the first left and what was committed meanwhile, and syncs those
/// pages; an idle WAL skips both.
///
/// A sync beside that fails sets `sync_failed`, and from then on the writer's step never runs:
/// pages copied into the file may not be on the disk, and a later sync can succeed without them
/// (the kernel reports a failed write once per descriptor), so the WAL, their only copy known to
/// be on disk, must never start over. It grows instead, said in the log, until a restart (as
/// `wal_sync` stops answering anything as durable after a failed sync of the WAL).
async fn checkpoint(
    writer: &SqlitePool,
    checkpointer: &SqlitePool,
    sync: Option<&SyncFile>,
    sync_failed: &mut bool,
    last: Checkpointed,
) -> Result<Checkpointed, sqlx::Error> {
    let beside = Checkpointed::passive(checkpointer).await?;
    if *sync_failed || !beside.writer_finishes(last) {
        return Ok(beside);
    }
    if let Some(sync) = sync {
        let synced = async {
            sync_beside(sync).await?;
            // What was committed during that copy and sync, copied and synced beside the writer
            // too, so that its step is left with what comes in during this shorter pass.
            Checkpointed::passive(checkpointer).await?;
            sync_beside(sync).await
        };
        if let Err(error) = synced.await {
            if matches!(error, sqlx::Error::Io(_)) {
                *sync_failed = true;
                tracing::error!(%error, "a SQLite database file could not be synced; its WAL is not started over again until a restart");
            }
            return Err(error);
        }
    }
    let mut connection = writer.acquire().await?;
    Checkpointed::passive(&mut *connection).await
}

async fn sync_beside(sync: &SyncFile) -> Result<(), sqlx::Error> {
    let sync = sync.clone();
    tokio::task::spawn_blocking(move || sync())
        .await
        .map_err(|joined| io::Error::other(joined.to_string()))??;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{SqliteDurability, open_sqlite};

    #[test]
    fn the_writer_finishes_a_checkpoint_when_the_wal_changed_and_little_is_left() {
        let at = |log, checkpointed| Checkpointed { log, checkpointed };
        // Idle: nothing new since the last checkpoint, everything copied.
        assert!(!at(500, 500).writer_finishes(at(500, 500)));
        // Frames committed since: they may have come in during this copy.
        assert!(at(800, 800).writer_finishes(at(500, 500)));
        // A reader held this copy back a little: the writer copies the rest.
        assert!(at(500, 400).writer_finishes(at(500, 500)));
        // Held back a lot: the writer would wait for all of it; the next tick copies it beside.
        assert!(!at(5_000, 100).writer_finishes(at(500, 500)));
    }

    async fn wal_frames(pool: &SqlitePool) -> i64 {
        Checkpointed::passive(pool).await.unwrap().log
    }

    #[tokio::test]
    async fn the_wal_starts_over_under_a_steady_stream_of_writes() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("store.db");
        let writer = open_sqlite(&path, SqliteDurability::Normal).await.unwrap();
        let checkpointer = crate::sqlite_readers(&writer, 1);
        let sync = sync_file(&path);
        assert!(sync.is_some(), "the database file opens for its syncs");
        sqlx::query("CREATE TABLE t (v BLOB)")
            .execute(&writer)
            .await
            .unwrap();
        // Commits back to back, as a busy writer makes them, while checkpoints run beside it.
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let writes = tokio::spawn({
            let (writer, stop) = (writer.clone(), stop.clone());
            async move {
                let mut commits = 0_i64;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    sqlx::query("INSERT INTO t VALUES (zeroblob(1024))")
                        .execute(&writer)
                        .await
                        .unwrap();
                    commits += 1;
                }
                commits
            }
        });
        let mut last = Checkpointed::default();
        for _ in 0..20 {
            tokio::time::sleep(Duration::from_millis(50)).await;
            last = checkpoint(&writer, &checkpointer, sync.as_ref(), &mut false, last)
                .await
                .unwrap();
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
    async fn the_database_file_is_synced_beside_the_writer_when_its_step_runs() {
        let dir = tempfile::tempdir().unwrap();
        let writer = open_sqlite(&dir.path().join("store.db"), SqliteDurability::Normal)
            .await
            .unwrap();
        let checkpointer = crate::sqlite_readers(&writer, 1);
        let syncs = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let fails = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let sync: SyncFile = {
            let (syncs, fails) = (syncs.clone(), fails.clone());
            Arc::new(move || {
                syncs.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                if fails.load(std::sync::atomic::Ordering::SeqCst) {
                    return Err(io::Error::other("the disk is gone"));
                }
                Ok(())
            })
        };
        let synced = || syncs.load(std::sync::atomic::Ordering::SeqCst);
        sqlx::query("CREATE TABLE t (v BLOB)")
            .execute(&writer)
            .await
            .unwrap();
        // Frames since the last checkpoint: the writer's step runs, after two passes beside it,
        // each synced.
        let mut sync_failed = false;
        let last = checkpoint(
            &writer,
            &checkpointer,
            Some(&sync),
            &mut sync_failed,
            Checkpointed::default(),
        )
        .await
        .unwrap();
        assert_eq!(synced(), 2);
        // Nothing new: none of it runs.
        let last = checkpoint(&writer, &checkpointer, Some(&sync), &mut sync_failed, last)
            .await
            .unwrap();
        assert_eq!(synced(), 2);
        // A sync that fails ends the checkpoint there, as an error.
        let write = || async {
            sqlx::query("INSERT INTO t VALUES (zeroblob(1024))")
                .execute(&writer)
                .await
                .unwrap();
        };
        write().await;
        fails.store(true, std::sync::atomic::Ordering::SeqCst);
        let failed = checkpoint(&writer, &checkpointer, Some(&sync), &mut sync_failed, last).await;
        assert!(matches!(failed, Err(sqlx::Error::Io(_))), "{failed:?}");
        assert_eq!(synced(), 3, "stopped at the first sync");
        // The disk answers again: the writer's step still never runs (nor the syncs before it).
        fails.store(false, std::sync::atomic::Ordering::SeqCst);
        write().await;
        checkpoint(&writer, &checkpointer, Some(&sync), &mut sync_failed, last)
            .await
            .unwrap();
        assert_eq!(synced(), 3, "no step after a failed sync");
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
