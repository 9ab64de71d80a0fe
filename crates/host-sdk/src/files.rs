//! Files only the host's user can read, replaced atomically: a crash leaves the old file or the new
//! one, never half of either. The temporary file gets a random name beside the target (never a
//! fixed one, which two processes would fight over), is synced, then renamed into place.

use std::io::Write as _;
use std::path::Path;

/// Writes `bytes` to `path` (mode 0600 on Unix) by rename, replacing what is there.
pub fn replace(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let temp = write_temp(path, bytes)?;
    temp.persist(path).map_err(|e| e.error)?;
    sync_parent(path);
    Ok(())
}

/// Writes `bytes` to `path` by rename, failing with `AlreadyExists` if `path` exists.
pub fn create_new(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let temp = write_temp(path, bytes)?;
    temp.persist_noclobber(path).map_err(|e| e.error)?;
    sync_parent(path);
    Ok(())
}

fn write_temp(path: &Path, bytes: &[u8]) -> std::io::Result<tempfile::NamedTempFile> {
    let dir = match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir,
        _ => Path::new("."),
    };
    std::fs::create_dir_all(dir)?;
    // tempfile creates the file with mode 0600 on Unix; on Windows the user's profile ACLs apply.
    let mut temp = tempfile::Builder::new()
        .prefix(".orca-push-")
        .suffix(".tmp")
        .tempfile_in(dir)?;
    temp.write_all(bytes)?;
    temp.as_file().sync_all()?;
    Ok(temp)
}

/// Makes the rename itself durable where the platform allows it.
fn sync_parent(path: &Path) {
    #[cfg(unix)]
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty())
        && let Ok(dir) = std::fs::File::open(dir)
    {
        let _ = dir.sync_all();
    }
    #[cfg(not(unix))]
    let _ = path;
}

/// Runs `change` holding an exclusive lock shared by every process of the host: a file beside
/// `path` (`.lock` for its extension, 0600), locked by the operating system and let go when
/// `change` returns (or the process dies). A change re-reads the file under it, so two processes
/// (the desktop and a `host` command, or two commands) never write over each other's changes.
pub(crate) fn locked<R>(
    path: &Path,
    change: impl FnOnce() -> std::io::Result<R>,
) -> std::io::Result<R> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)?;
    }
    let mut options = std::fs::OpenOptions::new();
    options.read(true).write(true).create(true).truncate(false);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
    let lock = options.open(path.with_extension("lock"))?;
    lock.lock()?;
    let result = change();
    // Closing the file lets the lock go too; unlocking first says so.
    let _ = lock.unlock();
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replaces_whole_files_and_leaves_no_temporary_behind() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("nested").join("state.json");
        replace(&path, b"one").unwrap();
        replace(&path, b"two").unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"two");
        let names: Vec<_> = std::fs::read_dir(path.parent().unwrap())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, ["state.json"]);
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt as _;
            let mode = std::fs::metadata(&path).unwrap().permissions().mode();
            assert_eq!(mode & 0o777, 0o600);
        }
    }

    #[test]
    fn create_new_never_overwrites() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("host.key");
        create_new(&path, b"first").unwrap();
        let refused = create_new(&path, b"second").unwrap_err();
        assert_eq!(refused.kind(), std::io::ErrorKind::AlreadyExists);
        assert_eq!(std::fs::read(&path).unwrap(), b"first");
    }
}
