//! Reading and writing the registrar's small JSON state files.

use std::path::Path;

use serde::Serialize;
use serde::de::DeserializeOwned;

/// The files' format version. A file of another version is refused rather than rewritten, so an
/// older host never wipes what a newer one stored.
pub(super) const VERSION: u32 = 1;

/// `None` when the file does not exist; an error when it cannot be read or parsed.
pub(super) fn read<T: DeserializeOwned>(path: &Path) -> std::io::Result<Option<T>> {
    let bytes = match std::fs::read(path) {
        Ok(bytes) => bytes,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    };
    // Only the position: serde's message can quote a value, and these files hold push tokens.
    serde_json::from_slice(&bytes).map(Some).map_err(|e| {
        let why = format!(
            "{:?} error at line {} column {}",
            e.classify(),
            e.line(),
            e.column()
        );
        corrupt(path, &why)
    })
}

pub(super) fn check_version(v: u32, path: &Path) -> std::io::Result<()> {
    if v == VERSION {
        Ok(())
    } else {
        Err(corrupt(path, "unknown format version"))
    }
}

pub(super) fn corrupt(path: &Path, why: &str) -> std::io::Error {
    std::io::Error::new(
        std::io::ErrorKind::InvalidData,
        format!("{} is corrupt: {why}", path.display()),
    )
}

/// Replaces the file atomically (0600, by rename).
pub(super) fn write<T: Serialize>(path: &Path, body: &T) -> std::io::Result<()> {
    let bytes = serde_json::to_vec_pretty(body).map_err(std::io::Error::other)?;
    crate::files::replace(path, &bytes)
}

/// [`crate::files::locked`], for the registrar's files.
pub(super) use crate::files::locked;
