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
//! if anything was committed since the last checkpoint, the rest on the writer's own connection,
//! taken from its pool like any write, so nothing new is committed until it is done and the next
//! write starts the WAL over.
//!
//! SQLite syncs the database file only in a checkpoint that copies the whole WAL, since only then
//! may the WAL start over: under load the copy beside the writer never does, and the writer's step
//! synced everything copied since the last one. In the admission benchmark that was a second's
//! pages, 12-16 MB in some 2,000 writes (an `fsync` of 16-20 ms), and the writer was held 25-35 ms
//! every second: the p99 (docs/benchmarks.md, round 46). So each copy beside the writer is synced
//! beside it too, what comes in meanwhile is copied and synced beside before the writer's step,
//! and the step syncs only what it copies itself.
//!
//! Even so, those syncs made a bump of 20-50 ms in the admission benchmark's latency every second
//! and set its p99 (round 48): each kept the disk busy with a second's pages at once, and every
//! commit's sync of the WAL waited behind it. So the syncs beside the writer are paced (`Pace`):
//! the second's copy goes out in parts with pauses between them, then what came in meanwhile in
//! parts with shorter pauses, then the little left at once, and the writer's step is left with
//! what came in during that last, short pass.

use std::io;
use std::sync::Arc;
use std::time::Duration;

use sqlx::SqlitePool;

/// How often the WAL is copied back into the database file.
const CHECKPOINT_EVERY: Duration = Duration::from_secs(1);

/// The size a WAL is cut back to when it starts over (SQLite's `journal_size_limit`, in bytes):
/// room for a second of the heaviest load measured, so that the file's blocks are written over
/// rather than allocated again. The queue's WAL took 220-240 MB a second at the admission
/// benchmark's peak (docs/benchmarks.md, round 48); cut back to 64 MiB, half of each second's
/// syncs extended the file, and each such sync wrote its inode and block maps as well (round 26).
/// A WAL that started over only every 256 MiB was measured too (round 48): a fresh file then grew
/// for three to four seconds, and the 8-connection admission benchmark lost 5-10%.
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

    /// Whether anything was committed since `last` (frames may have come in while this copy
    /// ran), or some frames were left behind: there is something to copy and sync. A WAL that
    /// started over and holds as many frames as at `last` looks unchanged; that tick then does
    /// nothing, and the next does it all.
    fn changed_since(self, last: Self) -> bool {
        self.log != last.log || self.checkpointed != self.log
    }

    /// Whether the writer finishes the checkpoint, so that the WAL starts over: what this copy
    /// left behind (a reader of an older snapshot limits how far it copies) is small, since the
    /// writer waits for all of it. More left behind waits for the next tick's copy beside it.
    fn writer_finishes(self) -> bool {
        self.log - self.checkpointed <= WRITER_COPIES_AT_MOST
    }
}

/// Frames (of a page each, 4 KiB) the writer's step may have to copy beyond what was committed
/// while the copy beside it ran.
const WRITER_COPIES_AT_MOST: i64 = 1024;

/// How a sync of the database file writes its dirty pages out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Pace {
    /// In `WRITE_BACK_STEPS` parts of the file, this long apart, then synced.
    Steps(Duration),
    /// All at once.
    Now,
}

/// Makes what was copied into the database file durable (`fdatasync`), run on a blocking thread.
pub(crate) type SyncFile = Arc<dyn Fn(Pace) -> io::Result<()> + Send + Sync>;

/// The parts a paced sync writes the database file out in, one after another.
const WRITE_BACK_STEPS: u64 = 16;

/// The pause after each part of a second's paced sync.
const WRITE_BACK_PAUSE: Duration = Duration::from_millis(10);

/// The pause after each part of the paced sync that follows it before the writer's step.
const WRITE_BACK_PAUSE_BEFORE_STEP: Duration = Duration::from_millis(2);

/// Syncs the database file at `path` through a descriptor of its own, kept open for as long as
/// the checkpoints run: closing any descriptor of a file drops every POSIX lock the process holds
/// on it, SQLite's among them, so it is closed only once the writer's pool is. `None` for a file
/// that cannot be opened (a database in memory): its checkpoints then sync only in SQLite.
///
/// A second's copy is 12-16 MB of pages in the admission benchmark, scattered over the file.
/// Synced at once, it kept the disk busy for 30-50 ms, the WAL's syncs (each commit's) waited
/// behind it, 3-10 ms instead of under one, and every send in flight took 20-50 ms more: the p99
/// (docs/benchmarks.md, round 48). Paced (`Pace::Steps`), it goes out a sixteenth of the file at a
/// time, each part written before the next starts and a pause after it, so a commit's sync waits
/// for one part at most; the `fdatasync` after finds little left to write.
pub(crate) fn sync_file(path: &std::path::Path) -> Option<SyncFile> {
    let file = std::fs::File::open(path).ok()?;
    Some(Arc::new(move |pace| {
        if let Pace::Steps(pause) = pace {
            write_back_in_steps(&file, pause)?;
        }
        file.sync_data()
    }))
}

/// Writes `file`'s dirty pages out in `WRITE_BACK_STEPS` parts, `pause` between each two.
#[cfg(target_os = "linux")]
fn write_back_in_steps(file: &std::fs::File, pause: Duration) -> io::Result<()> {
    let part = file.metadata()?.len().div_ceil(WRITE_BACK_STEPS).max(1);
    for step in 0..WRITE_BACK_STEPS {
        if step > 0 {
            std::thread::sleep(pause);
        }
        write_back(file, step * part, part)?;
    }
    Ok(())
}

/// Elsewhere the `fdatasync` after writes everything at once.
#[cfg(not(target_os = "linux"))]
fn write_back_in_steps(_: &std::fs::File, _: Duration) -> io::Result<()> {
    Ok(())
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

/// Checkpoints every `CHECKPOINT_EVERY` until the writer's pool is closed (see the module's doc).
pub(crate) async fn in_background(
    writer: SqlitePool,
    checkpointer: SqlitePool,
    sync: Option<SyncFile>,
) {
    let mut tick = tokio::time::interval(CHECKPOINT_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut checkpoints = Checkpoints::new(writer, checkpointer, sync);
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
    /// Set by a sync beside the writer that failed, or a checkpoint's I/O error (see `run`).
    sync_failed: bool,
    /// What the last copy beside the writer reported.
    last: Checkpointed,
}

impl Checkpoints {
    fn new(writer: SqlitePool, checkpointer: SqlitePool, sync: Option<SyncFile>) -> Self {
        Self {
            writer,
            checkpointer,
            sync,
            sync_failed: false,
            last: Checkpointed::default(),
        }
    }

    /// One checkpoint: the WAL copied beside the writer (a PASSIVE checkpoint never waits for the
    /// writer or readers) and the database file synced beside it, paced. Unless a reader held
    /// that copy back too far (`writer_finishes`), what came in meanwhile is then copied and
    /// synced beside the writer in two shorter passes, and the rest on the writer's connection:
    /// that step holds the writer back while it copies and syncs what the last pass left, and the
    /// next write starts the WAL over. An idle WAL skips all of it.
    ///
    /// A sync beside that fails, or a checkpoint that fails with an I/O error (`lost_writes`),
    /// sets `sync_failed`, and from then on no checkpoint runs: pages copied into the file may
    /// not be on the disk, and a later sync can succeed without them (the kernel reports a failed
    /// write once per descriptor), so the WAL, their only copy known to be on disk, must never
    /// start over. Not even a copy beside the writer runs: one that caught up with the WAL would
    /// sync the file through SQLite's own descriptor, which can then succeed, and mark the whole
    /// WAL copied, and the next write would start it over. It grows instead, said in the log,
    /// until a restart (as `wal_sync` stops answering anything as durable after a failed sync of
    /// the WAL).
    async fn run(&mut self) -> Result<(), sqlx::Error> {
        if self.sync_failed {
            return Ok(());
        }
        let ran = self.copy_and_sync().await;
        if let Err(error) = &ran
            && lost_writes(error)
        {
            self.sync_failed = true;
            tracing::error!(%error, "a SQLite database file could not be synced; its WAL is not copied back or started over again until a restart");
        }
        ran
    }

    /// `run`'s copies, syncs and the writer's step, stopping at the first error.
    async fn copy_and_sync(&mut self) -> Result<(), sqlx::Error> {
        let beside = Checkpointed::passive(&self.checkpointer).await?;
        let changed = beside.changed_since(self.last);
        self.last = beside;
        if !changed {
            return Ok(());
        }
        let finish = beside.writer_finishes();
        if let Some(sync) = self.sync.clone() {
            sync_beside(&sync, Pace::Steps(WRITE_BACK_PAUSE)).await?;
            if finish {
                // What was committed during that copy and sync, copied and synced beside the
                // writer too, in passes each shorter than the one before, so that its step is
                // left with what comes in during the shortest.
                for pace in [Pace::Steps(WRITE_BACK_PAUSE_BEFORE_STEP), Pace::Now] {
                    Checkpointed::passive(&self.checkpointer).await?;
                    sync_beside(&sync, pace).await?;
                }
            }
        }
        if finish {
            let mut connection = self.writer.acquire().await?;
            self.last = Checkpointed::passive(&mut *connection).await?;
        }
        Ok(())
    }
}

/// SQLite's result code for an I/O error (`SQLITE_IOERR`), the low byte of its extended codes
/// (`SQLITE_IOERR_FSYNC`, `SQLITE_IOERR_WRITE`, ...).
const SQLITE_IOERR: i32 = 10;

/// Whether `error` may mean that writes to the file were lost: a failed sync of our own, or a
/// checkpoint that failed to read, write or sync (SQLite's `SQLITE_IOERR` codes).
fn lost_writes(error: &sqlx::Error) -> bool {
    match error {
        sqlx::Error::Io(_) => true,
        sqlx::Error::Database(error) => error
            .code()
            .and_then(|code| code.parse::<i32>().ok())
            .is_some_and(|code| code & 0xff == SQLITE_IOERR),
        _ => false,
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
    fn a_checkpoint_syncs_what_changed_and_the_writer_finishes_it_unless_much_is_left() {
        let at = |log, checkpointed| Checkpointed { log, checkpointed };
        // Idle: nothing new since the last checkpoint, everything copied.
        assert!(!at(500, 500).changed_since(at(500, 500)));
        // Frames committed since, or some left behind by a reader: copied, then synced.
        assert!(at(800, 800).changed_since(at(500, 500)));
        assert!(at(500, 400).changed_since(at(500, 400)));
        // The writer copies the rest, including a little a reader held back.
        assert!(at(800, 800).writer_finishes());
        assert!(at(5_000, 4_000).writer_finishes());
        // Held back a lot: the writer would wait for all of it; the next tick copies it beside.
        assert!(!at(5_000, 100).writer_finishes());
    }

    #[tokio::test]
    async fn only_io_errors_are_taken_for_lost_writes() {
        let (_dir, writer, _, _) = opened().await;
        assert!(lost_writes(&sqlx::Error::Io(io::Error::other("EIO"))));
        let not_io = sqlx::query("SELECT * FROM no_such_table")
            .execute(&writer)
            .await
            .unwrap_err();
        assert!(matches!(not_io, sqlx::Error::Database(_)), "{not_io:?}");
        assert!(!lost_writes(&not_io));
        assert!(!lost_writes(&sqlx::Error::PoolClosed));
    }

    async fn wal_frames(pool: &SqlitePool) -> i64 {
        Checkpointed::passive(pool).await.unwrap().log
    }

    /// The WAL's checkpoint sequence (its header's), one more each time it starts over.
    fn wal_generation(path: &std::path::Path) -> u32 {
        let header = std::fs::read(path).unwrap();
        u32::from_be_bytes(header[12..16].try_into().unwrap())
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
        let mut checkpoints = Checkpoints::new(writer, checkpointer.clone(), sync);
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
    async fn the_database_file_is_synced_beside_the_writer_in_shorter_passes_before_its_step() {
        let (dir, writer, checkpointer, _) = opened().await;
        let path = dir.path().join("store.db-wal");
        let paces = Arc::new(std::sync::Mutex::new(Vec::new()));
        let fails = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let sync: SyncFile = {
            let (paces, fails) = (paces.clone(), fails.clone());
            Arc::new(move |pace| {
                paces.lock().unwrap().push(pace);
                if fails.load(std::sync::atomic::Ordering::SeqCst) {
                    return Err(io::Error::other("the disk is gone"));
                }
                Ok(())
            })
        };
        let synced = || paces.lock().unwrap().clone();
        let mut checkpoints = Checkpoints::new(writer.clone(), checkpointer.clone(), Some(sync));
        // Frames since the last checkpoint: three passes beside the writer, each paced closer,
        // then its step, which starts the WAL over at the next write.
        checkpoints.run().await.unwrap();
        let passes = [
            Pace::Steps(WRITE_BACK_PAUSE),
            Pace::Steps(WRITE_BACK_PAUSE_BEFORE_STEP),
            Pace::Now,
        ];
        assert_eq!(synced(), passes);
        let generation = wal_generation(&path);
        write(&writer, 1).await;
        assert_eq!(
            wal_generation(&path),
            generation + 1,
            "the WAL started over"
        );
        // Nothing new since the last checkpoint: none of it runs.
        checkpoints.run().await.unwrap();
        let runs = synced().len();
        checkpoints.run().await.unwrap();
        assert_eq!(synced().len(), runs);
        // A sync that fails ends the checkpoint there, as an error. (A checkpoint tells that the
        // WAL changed by its count of frames: written until that differs.)
        while wal_frames(&checkpointer).await == checkpoints.last.log {
            write(&writer, 1).await;
        }
        fails.store(true, std::sync::atomic::Ordering::SeqCst);
        let failed = checkpoints.run().await;
        assert!(matches!(failed, Err(sqlx::Error::Io(_))), "{failed:?}");
        assert_eq!(synced().len(), runs + 1, "stopped at the first sync");
        // The disk answers again: no checkpoint runs again (no sync, no copy), so the WAL never
        // starts over. (The first write may: the failed pass's copy had caught up, and SQLite's
        // own sync of it, which this test does not fail, succeeded.)
        fails.store(false, std::sync::atomic::Ordering::SeqCst);
        write(&writer, 1).await;
        let generation = wal_generation(&path);
        checkpoints.run().await.unwrap();
        write(&writer, 1).await;
        assert_eq!(synced().len(), runs + 1, "no sync after a failed one");
        assert_eq!(wal_generation(&path), generation, "the WAL started over");
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
