//! The session cache file: one session per gateway origin, so a host that talks to two gateways
//! (production and a dev one) never hands one gateway the other's token.
//!
//! Every process of the host (the desktop, the CLI) shares the file. A process that is refused with
//! a 401 reads it again before proving its key: another process may already have replaced the
//! session, and proving again would in turn revoke that process's new session.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// A session as the gateway minted it. Debug never shows the token.
#[derive(Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct SessionInfo {
    pub session_token: String,
    pub expires_at: u64,
    pub host_fingerprint: String,
}

impl std::fmt::Debug for SessionInfo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SessionInfo")
            .field("expires_at", &self.expires_at)
            .field(
                "host_fingerprint",
                &crate::short_fingerprint(&self.host_fingerprint),
            )
            .finish_non_exhaustive()
    }
}

#[derive(Default, Serialize, Deserialize)]
struct CacheFile {
    /// Keyed by gateway origin (`https://push.onorca.dev`).
    sessions: BTreeMap<String, SessionInfo>,
}

/// The file's sessions, keyed by origin. A missing or unreadable file is an empty cache: the worst
/// it costs is one login.
#[derive(Debug, Clone)]
pub struct SessionFile {
    path: PathBuf,
}

impl SessionFile {
    pub fn new(path: PathBuf) -> Self {
        Self { path }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    fn read_all(&self) -> CacheFile {
        std::fs::read(&self.path)
            .ok()
            .and_then(|bytes| serde_json::from_slice(&bytes).ok())
            .unwrap_or_default()
    }

    /// The cached session for `origin`, if it belongs to `fingerprint`.
    pub fn load(&self, origin: &str, fingerprint: &str) -> Option<SessionInfo> {
        self.read_all()
            .sessions
            .remove(origin)
            .filter(|s| s.host_fingerprint == fingerprint)
    }

    /// Replaces `origin`'s session, keeping every other origin's: read and written under the
    /// host's lock of the file (`crate::files::locked`), so two processes storing sessions of two
    /// origins at once keep both.
    pub fn store(&self, origin: &str, session: &SessionInfo) -> std::io::Result<()> {
        crate::files::locked(&self.path, || {
            let mut all = self.read_all();
            all.sessions.insert(origin.to_owned(), session.clone());
            let body = serde_json::to_vec(&all).map_err(std::io::Error::other)?;
            crate::files::replace(&self.path, &body)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn session(token: &str) -> SessionInfo {
        SessionInfo {
            session_token: token.into(),
            expires_at: 1,
            host_fingerprint: "fp".into(),
        }
    }

    #[test]
    fn sessions_are_kept_per_origin() {
        let dir = tempfile::tempdir().unwrap();
        let file = SessionFile::new(dir.path().join("host.session"));
        assert_eq!(file.load("https://a", "fp"), None);
        file.store("https://a", &session("a")).unwrap();
        file.store("https://b", &session("b")).unwrap();
        file.store("https://a", &session("a2")).unwrap();
        assert_eq!(file.load("https://a", "fp"), Some(session("a2")));
        assert_eq!(file.load("https://b", "fp"), Some(session("b")));
        assert_eq!(file.load("https://b", "another host"), None);
        assert_eq!(file.load("https://c", "fp"), None);
    }

    /// A store reads and writes the file under the host's lock of it: while another process holds
    /// that lock (reading the file to change it), a store waits, so neither writes over the
    /// other's origin.
    #[test]
    fn a_store_waits_for_another_process_changing_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("host.session");
        let file = SessionFile::new(path.clone());
        let (held, holding) = std::sync::mpsc::channel();
        let other = std::thread::spawn(move || {
            crate::files::locked(&path, || {
                held.send(()).unwrap();
                std::thread::sleep(std::time::Duration::from_millis(300));
                let mut all = CacheFile::default();
                all.sessions.insert("https://b".into(), session("b"));
                crate::files::replace(&path, &serde_json::to_vec(&all).unwrap())
            })
        });
        holding.recv().unwrap();
        file.store("https://a", &session("a")).unwrap();
        other.join().unwrap().unwrap();
        assert_eq!(file.load("https://a", "fp"), Some(session("a")));
        assert_eq!(file.load("https://b", "fp"), Some(session("b")), "kept");
    }

    #[test]
    fn a_corrupt_file_is_an_empty_cache() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("host.session");
        std::fs::write(&path, b"{ not json").unwrap();
        let file = SessionFile::new(path);
        assert_eq!(file.load("https://a", "fp"), None);
        file.store("https://a", &session("a")).unwrap();
        assert_eq!(file.load("https://a", "fp"), Some(session("a")));
    }
}
