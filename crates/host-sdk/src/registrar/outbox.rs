//! The unregister outbox: gateway deletes the host still owes, in a file, so a delete queued
//! before a crash, an outage or a refused login is sent after it rather than forgotten (a
//! forgotten delete leaves a registration at the gateway that nothing will ever push to).

use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};

use serde::{Deserialize, Serialize};

use super::json_file;

/// The outbox's file name inside the host's data directory.
pub const OUTBOX_FILE: &str = "push-unregister-outbox.json";

/// One gateway delete the host still owes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PendingDelete {
    pub registration_id: String,
    /// The phone it belonged to: deletes are serialized with that phone's registrations.
    pub device_id: String,
    /// Unix ms when it was queued.
    pub queued_at: u64,
    /// Failed attempts so far.
    pub attempts: u32,
}

#[derive(Serialize, Deserialize)]
struct FileBody {
    v: u32,
    pending: Vec<PendingDelete>,
}

/// The queue, oldest first, in memory and in a 0600 file. As with the registration store, memory
/// only takes a change once the file has it.
#[derive(Debug)]
pub struct UnregisterOutbox {
    path: PathBuf,
    entries: Mutex<Vec<PendingDelete>>,
}

impl UnregisterOutbox {
    /// Opens `<dir>/push-unregister-outbox.json`. A missing file is an empty queue; a corrupt one
    /// is an error rather than a silently emptied queue.
    pub fn open(dir: &Path) -> std::io::Result<Self> {
        let path = dir.join(OUTBOX_FILE);
        let entries = Self::read(&path)?;
        Ok(Self {
            path,
            entries: Mutex::new(entries),
        })
    }

    /// What the file holds now.
    fn read(path: &Path) -> std::io::Result<Vec<PendingDelete>> {
        Ok(match json_file::read::<FileBody>(path)? {
            Some(body) => {
                json_file::check_version(body.v, path)?;
                body.pending
            }
            None => Vec::new(),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    fn lock(&self) -> MutexGuard<'_, Vec<PendingDelete>> {
        self.entries.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Queues a delete. A registration id already queued keeps its entry (and attempt count).
    pub fn push(&self, registration_id: &str, device_id: &str, now_ms: u64) -> std::io::Result<()> {
        self.update(|entries| {
            if entries.iter().any(|e| e.registration_id == registration_id) {
                return false;
            }
            entries.push(PendingDelete {
                registration_id: registration_id.to_owned(),
                device_id: device_id.to_owned(),
                queued_at: now_ms,
                attempts: 0,
            });
            true
        })
    }

    /// Every queued delete, oldest first.
    pub fn pending(&self) -> Vec<PendingDelete> {
        self.lock().clone()
    }

    /// The queued deletes of one phone, oldest first.
    pub fn pending_for(&self, device_id: &str) -> Vec<PendingDelete> {
        self.lock()
            .iter()
            .filter(|e| e.device_id == device_id)
            .cloned()
            .collect()
    }

    pub fn contains(&self, registration_id: &str) -> bool {
        self.lock()
            .iter()
            .any(|e| e.registration_id == registration_id)
    }

    pub fn len(&self) -> usize {
        self.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.lock().is_empty()
    }

    /// Takes a delete off the queue (done, or superseded), returning it.
    pub fn remove(&self, registration_id: &str) -> std::io::Result<Option<PendingDelete>> {
        let mut removed = None;
        self.update(|entries| {
            let at = entries
                .iter()
                .position(|e| e.registration_id == registration_id);
            removed = at.map(|i| entries.remove(i));
            removed.is_some()
        })?;
        Ok(removed)
    }

    /// Counts one more failed attempt of a queued delete.
    pub fn record_failure(&self, registration_id: &str) -> std::io::Result<()> {
        self.update(|entries| {
            let entry = entries
                .iter_mut()
                .find(|e| e.registration_id == registration_id);
            match entry {
                Some(entry) => {
                    entry.attempts = entry.attempts.saturating_add(1);
                    true
                }
                None => false,
            }
        })
    }

    /// Applies `change` to what the file holds now (another process may have changed it since this
    /// one read it), under the host's lock of the file; writes it if `change` says it changed
    /// anything. Memory takes the file's state either way.
    fn update(&self, change: impl FnOnce(&mut Vec<PendingDelete>) -> bool) -> std::io::Result<()> {
        let mut entries = self.lock();
        json_file::locked(&self.path, || {
            let mut next = Self::read(&self.path)?;
            if change(&mut next) {
                let body = FileBody {
                    v: json_file::VERSION,
                    pending: next,
                };
                json_file::write(&self.path, &body)?;
                next = body.pending;
            }
            *entries = next;
            Ok(())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn queued_deletes_survive_reopening() {
        let dir = tempfile::tempdir().unwrap();
        let outbox = UnregisterOutbox::open(dir.path()).unwrap();
        assert!(outbox.is_empty());
        outbox.push("r1", "a", 10).unwrap();
        outbox.push("r2", "b", 20).unwrap();
        outbox.push("r3", "a", 30).unwrap();
        outbox.record_failure("r2").unwrap();
        outbox.record_failure("r2").unwrap();
        assert_eq!(outbox.remove("r1").unwrap().unwrap().queued_at, 10);
        assert_eq!(outbox.remove("r1").unwrap(), None);
        drop(outbox);

        let reopened = UnregisterOutbox::open(dir.path()).unwrap();
        let expected = vec![
            PendingDelete {
                registration_id: "r2".into(),
                device_id: "b".into(),
                queued_at: 20,
                attempts: 2,
            },
            PendingDelete {
                registration_id: "r3".into(),
                device_id: "a".into(),
                queued_at: 30,
                attempts: 0,
            },
        ];
        assert_eq!(reopened.pending(), expected);
        assert_eq!(reopened.pending_for("a"), expected[1..]);
        assert!(reopened.contains("r3") && !reopened.contains("r1"));
        let text = std::fs::read_to_string(reopened.path()).unwrap();
        assert!(text.contains("\"registrationId\"") && text.contains("\"queuedAt\""));
    }

    /// Two processes on one folder, each with the outbox open, queue deletes while the gateway is
    /// down: both stay queued, and a failure one records keeps the other's entry.
    #[test]
    fn two_processes_keep_each_others_deletes() {
        let dir = tempfile::tempdir().unwrap();
        let desktop = UnregisterOutbox::open(dir.path()).unwrap();
        let command = UnregisterOutbox::open(dir.path()).unwrap();
        desktop.push("r1", "a", 10).unwrap();
        command.push("r2", "b", 20).unwrap();
        desktop.record_failure("r1").unwrap();
        command.record_failure("r2").unwrap();
        let reopened = UnregisterOutbox::open(dir.path()).unwrap();
        let queued: Vec<(String, u32)> = reopened
            .pending()
            .into_iter()
            .map(|p| (p.registration_id, p.attempts))
            .collect();
        assert_eq!(queued, [("r1".to_owned(), 1), ("r2".to_owned(), 1)]);
    }

    #[test]
    fn queuing_a_queued_id_again_keeps_the_first_entry() {
        let dir = tempfile::tempdir().unwrap();
        let outbox = UnregisterOutbox::open(dir.path()).unwrap();
        outbox.push("r1", "a", 10).unwrap();
        outbox.record_failure("r1").unwrap();
        outbox.push("r1", "a", 99).unwrap();
        let pending = outbox.pending();
        assert_eq!(pending.len(), 1);
        assert_eq!((pending[0].queued_at, pending[0].attempts), (10, 1));
    }

    #[test]
    fn a_corrupt_outbox_is_an_error_not_an_empty_queue() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(OUTBOX_FILE);
        std::fs::write(&path, br#"{"v":1,"pending":[{"registrationId":"r1"}]}"#).unwrap();
        let error = UnregisterOutbox::open(dir.path()).unwrap_err();
        assert_eq!(error.kind(), std::io::ErrorKind::InvalidData);
        assert!(std::fs::read(&path).unwrap().starts_with(b"{\"v\":1"));
    }

    #[test]
    fn a_failed_write_is_not_claimed_in_memory() {
        let dir = tempfile::tempdir().unwrap();
        let outbox = UnregisterOutbox::open(dir.path()).unwrap();
        outbox.push("r1", "a", 10).unwrap();
        super::super::store::tests::break_writes(outbox.path());
        assert!(outbox.push("r2", "a", 20).is_err());
        assert!(outbox.remove("r1").is_err());
        assert!(outbox.record_failure("r1").is_err());
        assert_eq!(outbox.pending().len(), 1);
        assert_eq!(outbox.pending()[0].attempts, 0);
    }
}
