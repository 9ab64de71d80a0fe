//! A SQLite writer that commits without waiting for the disk, and a thread that syncs its WAL for
//! it, so that the writer's next transaction is written while the last one is synced.
//!
//! With `synchronous=FULL` each commit writes its frames to the WAL and syncs the file before it
//! returns, and the one writer connection waits for the disk once a transaction with nothing else
//! able to use it. A service that answers only once its commit is on disk may instead open its
//! writer at `synchronous=NORMAL` (`ServiceStorage::sqlite_syncs_wal`: SQLite stays consistent
//! after a power loss, and syncs the WAL before every checkpoint) and hand each commit's answers
//! to [`WalSync::after_sync`]. A thread of its own syncs the WAL and then runs every answer handed
//! to it before that sync began: every commit made before then is on disk. One sync covers every
//! commit that came while the one before it ran. A writer with nothing waiting can instead sync on
//! its own thread ([`WalSync::sync_now`]) and spare its answers the hop to another.
//!
//! The service's other commits on that writer are not synced on their own: they reach the disk
//! with the next sync or checkpoint, so only what the service answers through this must survive a
//! power loss.
//!
//! A failed sync fails every later one too, until the process restarts: after a failed `fsync`
//! the kernel may have dropped the pages it could not write, and a later `fsync` can succeed
//! without them (PostgreSQL stops for the same reason). Nothing is answered as if durable again.

use std::collections::BTreeSet;
use std::fs::File;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, mpsc};

/// Why a commit cannot be answered as durable.
#[derive(Debug, Clone, thiserror::Error)]
#[error("the SQLite write-ahead log could not be synced: {0}")]
pub struct SyncFailed(Arc<str>);

/// What runs once the commits before it are on disk (or known not to be).
type Then = Box<dyn FnOnce(Result<(), SyncFailed>) + Send>;

/// How the WAL reaches the disk: `fdatasync` on the file (the default), or a test's own.
type SyncFn = Box<dyn FnMut() -> io::Result<()> + Send>;

/// Syncs one SQLite file's WAL on a thread of its own (see the module). Dropping it (every
/// clone of the store that holds it) ends the thread once what was handed to it has run.
pub struct WalSync {
    requests: Mutex<Option<mpsc::Sender<Then>>>,
    state: Arc<State>,
}

/// What the thread and [`WalSync::sync_now`] share: one sync at a time.
struct State {
    sync: Mutex<Syncing>,
    syncs: AtomicU64,
    /// `Syncing::failed` is set, readable without waiting for a sync under way.
    failed: std::sync::atomic::AtomicBool,
}

struct Syncing {
    sync: SyncFn,
    /// Set by the first failed sync, for good (see the module).
    failed: Option<SyncFailed>,
}

impl State {
    fn sync(&self) -> Result<(), SyncFailed> {
        let mut syncing = self.sync.lock().map_err(|_| {
            self.failed.store(true, Ordering::Relaxed);
            SyncFailed("a WAL sync panicked".into())
        })?;
        if let Some(failed) = &syncing.failed {
            return Err(failed.clone());
        }
        self.syncs.fetch_add(1, Ordering::Relaxed);
        // A sync that panics fails like one that errs: for good, and said so (`has_failed`),
        // rather than kill the sync thread with the lock poisoned.
        let synced = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| (syncing.sync)()))
            .unwrap_or_else(|_| Err(io::Error::other("a WAL sync panicked")));
        if let Err(error) = synced {
            tracing::error!(%error, "the SQLite WAL could not be synced; nothing more is answered as durable until a restart");
            metrics::counter!("orca_push_sqlite_wal_sync_failures_total").increment(1);
            let failed = SyncFailed(error.to_string().into());
            syncing.failed = Some(failed.clone());
            self.failed.store(true, Ordering::Relaxed);
            return Err(failed);
        }
        Ok(())
    }
}

impl std::fmt::Debug for WalSync {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WalSync")
            .field("syncs", &self.syncs())
            .finish_non_exhaustive()
    }
}

impl WalSync {
    /// Syncs the WAL of the SQLite database at `database` (the file `<database>-wal`).
    pub fn for_database(database: &Path) -> Self {
        let mut wal = database.as_os_str().to_owned();
        wal.push("-wal");
        let mut file = WalFile::new(PathBuf::from(wal));
        Self::with_sync(Box::new(move || file.sync()))
    }

    /// Syncs with `sync` instead of the file: for tests that hold or fail a sync.
    pub fn with_sync(sync: SyncFn) -> Self {
        let (requests, waiting) = mpsc::channel::<Then>();
        let state = Arc::new(State {
            sync: Mutex::new(Syncing { sync, failed: None }),
            syncs: AtomicU64::new(0),
            failed: std::sync::atomic::AtomicBool::new(false),
        });
        let shared = state.clone();
        let thread = std::thread::Builder::new()
            .name("sqlite-wal-sync".into())
            .spawn(move || run(waiting, &shared));
        let requests = match thread {
            Ok(_) => Some(requests),
            Err(error) => {
                // Without its thread, `after_sync` syncs on the caller's.
                tracing::warn!(%error, "the SQLite WAL sync thread did not start; syncing inline");
                None
            }
        };
        Self {
            requests: Mutex::new(requests),
            state,
        }
    }

    /// Whether a sync failed: from then on nothing is answered as durable until a restart.
    pub fn has_failed(&self) -> bool {
        self.state.failed.load(Ordering::Relaxed)
    }

    /// Syncs on this thread, now (blocking it for the sync): every commit made before this call
    /// is on disk when it returns `Ok`. For a writer with nothing else to do meanwhile, which
    /// would only wait for the thread's answer.
    pub fn sync_now(&self) -> Result<(), SyncFailed> {
        self.state.sync()
    }

    /// Runs `then` once every commit made before this call is on disk, with the error instead if
    /// it cannot be.
    pub fn after_sync(&self, then: impl FnOnce(Result<(), SyncFailed>) + Send + 'static) {
        let then: Then = Box::new(then);
        let refused = match self.requests.lock() {
            Ok(requests) => match requests.as_ref() {
                Some(requests) => requests.send(then).err().map(|e| e.0),
                None => Some(then),
            },
            Err(_) => Some(then),
        };
        if let Some(then) = refused {
            then(self.sync_now());
        }
    }

    /// Syncs done so far: fewer than the commits they covered when commits come together.
    pub fn syncs(&self) -> u64 {
        self.state.syncs.load(Ordering::Relaxed)
    }
}

/// The sync thread: waits for the first answer handed over, takes every other one waiting, syncs
/// once, runs them all; until the sender is dropped.
fn run(waiting: mpsc::Receiver<Then>, state: &State) {
    while let Ok(first) = waiting.recv() {
        let mut covered = vec![first];
        covered.extend(waiting.try_iter());
        let result = state.sync();
        for then in covered {
            then(result.clone());
        }
    }
}

/// The WAL file, opened again whenever the path names another file than the one open: SQLite
/// deletes the WAL when its last connection closes (after copying it into the database file and
/// syncing that) and makes a new one at the next write.
struct WalFile {
    path: PathBuf,
    open: Option<(File, u64)>,
}

impl WalFile {
    fn new(path: PathBuf) -> Self {
        Self { path, open: None }
    }

    fn sync(&mut self) -> io::Result<()> {
        use std::os::unix::fs::MetadataExt as _;
        let named = match std::fs::metadata(&self.path) {
            Ok(meta) => meta.ino(),
            // No WAL: the last connection closed after copying it into the database file and
            // syncing that, and nothing was written since.
            Err(error) if error.kind() == io::ErrorKind::NotFound => return Ok(()),
            Err(error) => return Err(error),
        };
        if self.open.as_ref().is_none_or(|(_, ino)| *ino != named) {
            let file = File::open(&self.path)?;
            let ino = file.metadata()?.ino();
            self.open = Some((file, ino));
        }
        match &self.open {
            Some((file, _)) => file.sync_data(),
            None => Ok(()),
        }
    }
}

/// SQLite files whose writer commits at NORMAL for its service to sync the WAL (see the module).
static SYNCED_BY_SERVICE: Mutex<BTreeSet<PathBuf>> = Mutex::new(BTreeSet::new());

/// Records whether the writer of `database` was opened for its service to sync.
pub(crate) fn mark(database: &Path, synced_by_service: bool) {
    if let Ok(mut files) = SYNCED_BY_SERVICE.lock() {
        if synced_by_service {
            files.insert(database.to_owned());
        } else {
            files.remove(database);
        }
    }
}

/// A [`WalSync`] for `writer` if it was opened to commit at NORMAL for its service to sync
/// (`ServiceStorage::sqlite_syncs_wal` under `SqliteDurability::Full`); `None` if its own commits
/// are synced as the operator chose.
pub fn for_writer(writer: &sqlx::SqlitePool) -> Option<WalSync> {
    let database = writer.connect_options().get_filename().to_owned();
    let synced_by_service = SYNCED_BY_SERVICE
        .lock()
        .map(|files| files.contains(&database))
        // A poisoned set: sync as if it said so; a sync the writer did not need costs only time.
        .unwrap_or(true);
    synced_by_service.then(|| WalSync::for_database(&opened_file(&database)))
}

/// The file SQLite opened for `database`, which its WAL is named after: symlinks resolved, as
/// SQLite resolves them. The WAL beside a symlink is never written, and a sync of it would find
/// no file and report every commit synced. As named if it cannot be resolved.
fn opened_file(database: &Path) -> PathBuf {
    std::fs::canonicalize(database).unwrap_or_else(|_| database.to_owned())
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    /// A database file reached through a symlink has its WAL beside the file it links to, and
    /// that is the WAL synced.
    #[tokio::test]
    async fn the_wal_synced_is_the_one_sqlite_writes_beside_a_linked_file() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("disk")).unwrap();
        std::fs::create_dir(dir.path().join("data")).unwrap();
        let real = dir.path().join("disk/store.db");
        std::fs::File::create(&real).unwrap();
        let linked = dir.path().join("data/store.db");
        std::os::unix::fs::symlink(&real, &linked).unwrap();
        let writer = crate::open_sqlite(&linked, crate::SqliteDurability::Normal)
            .await
            .unwrap();
        sqlx::query("CREATE TABLE t (x INTEGER)")
            .execute(&writer)
            .await
            .unwrap();
        let wal = |db: &Path| {
            let mut wal = db.as_os_str().to_owned();
            wal.push("-wal");
            PathBuf::from(wal)
        };
        assert!(
            wal(&real).exists(),
            "SQLite writes its WAL beside the real file"
        );
        assert!(!wal(&linked).exists());
        let database = writer.connect_options().get_filename().to_owned();
        assert_eq!(opened_file(&database), real.canonicalize().unwrap());
    }

    /// A sync that panics is a failed sync: reported, and every later one fails too.
    #[test]
    fn a_sync_that_panics_has_failed() {
        let sync = WalSync::with_sync(Box::new(|| panic!("a broken sync")));
        assert!(sync.sync_now().is_err());
        assert!(sync.has_failed());
        assert!(sync.sync_now().is_err());
    }

    /// What a test hands to `after_sync`, and where its result arrives.
    type Answered = (
        Box<dyn FnOnce(Result<(), SyncFailed>) + Send>,
        std::sync::mpsc::Receiver<Result<(), SyncFailed>>,
    );

    fn answered() -> Answered {
        let (tx, rx) = std::sync::mpsc::channel();
        (Box::new(move |r| drop(tx.send(r))), rx)
    }

    #[test]
    fn answers_wait_for_the_sync_after_them_and_share_it() {
        // A sync that waits for the test's word.
        let (go, gate) = std::sync::mpsc::channel::<()>();
        let sync = WalSync::with_sync(Box::new(move || {
            gate.recv().ok();
            Ok(())
        }));
        let (first, first_answer) = answered();
        sync.after_sync(first);
        // The first sync has begun and waits: nothing is answered meanwhile.
        std::thread::sleep(Duration::from_millis(50));
        assert!(first_answer.try_recv().is_err());
        let later: Vec<_> = (0..10)
            .map(|_| {
                let (then, answer) = answered();
                sync.after_sync(then);
                answer
            })
            .collect();
        go.send(()).unwrap();
        first_answer
            .recv_timeout(Duration::from_secs(5))
            .unwrap()
            .unwrap();
        // The ten came while the first sync ran: none is covered by it.
        std::thread::sleep(Duration::from_millis(50));
        assert!(later.iter().all(|a| a.try_recv().is_err()));
        go.send(()).unwrap();
        for answer in later {
            answer
                .recv_timeout(Duration::from_secs(5))
                .unwrap()
                .unwrap();
        }
        assert_eq!(sync.syncs(), 2, "one sync for the ten that waited together");
    }

    #[test]
    fn a_failed_sync_fails_every_later_one() {
        let calls = Arc::new(AtomicU64::new(0));
        let counted = calls.clone();
        let sync = WalSync::with_sync(Box::new(move || {
            if counted.fetch_add(1, Ordering::SeqCst) == 0 {
                Err(io::Error::other("the disk went away"))
            } else {
                Ok(())
            }
        }));
        for _ in 0..3 {
            let (then, answer) = answered();
            sync.after_sync(then);
            let result = answer.recv_timeout(Duration::from_secs(5)).unwrap();
            assert!(result.is_err(), "a later sync that succeeds proves nothing");
        }
        assert!(sync.sync_now().is_err(), "nor one on the caller's thread");
        assert_eq!(calls.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn the_wal_file_is_synced_and_found_again_when_sqlite_makes_a_new_one() {
        let dir = tempfile::tempdir().unwrap();
        let mut wal = WalFile::new(dir.path().join("t.db-wal"));
        // No WAL yet: nothing to sync.
        wal.sync().unwrap();
        assert!(wal.open.is_none());
        std::fs::write(dir.path().join("t.db-wal"), b"frames").unwrap();
        wal.sync().unwrap();
        let first = wal.open.as_ref().unwrap().1;
        // Deleted and made again (the open one keeps its inode from being reused): the new file
        // is the one synced.
        std::fs::remove_file(dir.path().join("t.db-wal")).unwrap();
        std::fs::write(dir.path().join("t.db-wal"), b"new frames").unwrap();
        wal.sync().unwrap();
        assert_ne!(wal.open.as_ref().unwrap().1, first);
    }
}
