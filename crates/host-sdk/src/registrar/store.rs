//! The host's durable record of each paired phone's push registration: one JSON file in the host's
//! data directory, holding at most one [`Registration`] per device id.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};

use serde::{Deserialize, Serialize};

use super::json_file;
use crate::registration::{Registration, RegistrationSource};

/// The store's file name inside the host's data directory.
pub const REGISTRATIONS_FILE: &str = "push-registrations.json";

#[derive(Serialize, Deserialize)]
struct FileBody {
    v: u32,
    registrations: Vec<Registration>,
}

/// One registration per device id, in memory and in a 0600 file. Every change is written (by
/// atomic rename) before memory takes it, so a failed write leaves both at the old state: the
/// dispatcher never sends by a registration a restart would forget, nor misses one it would find.
///
/// Share it as `Arc<RegistrationStore>`; the mutex is held across the (short, blocking) file write
/// so the file and memory change in the same order.
#[derive(Debug)]
pub struct RegistrationStore {
    path: PathBuf,
    records: Mutex<BTreeMap<String, Registration>>,
}

impl RegistrationStore {
    /// Opens `<dir>/push-registrations.json`. A missing file is an empty store; an unreadable or
    /// corrupt one is an error, never silently replaced, since wiping it would orphan every
    /// registration it names at the gateway.
    pub fn open(dir: &Path) -> std::io::Result<Self> {
        let path = dir.join(REGISTRATIONS_FILE);
        let records = Self::read(&path)?;
        Ok(Self {
            path,
            records: Mutex::new(records),
        })
    }

    /// What the file holds now.
    fn read(path: &Path) -> std::io::Result<BTreeMap<String, Registration>> {
        let mut records = BTreeMap::new();
        if let Some(body) = json_file::read::<FileBody>(path)? {
            json_file::check_version(body.v, path)?;
            for registration in body.registrations {
                let device_id = registration.device_id.clone();
                if records.insert(device_id, registration).is_some() {
                    return Err(json_file::corrupt(path, "a device id appears twice"));
                }
            }
        }
        Ok(records)
    }

    /// Applies `change` to what the file holds now (another process may have changed it since
    /// this one read it), under the host's lock of the file; writes and commits it to memory if
    /// `change` says it changed anything. Memory takes the file's state either way.
    fn update<R>(
        &self,
        change: impl FnOnce(&mut BTreeMap<String, Registration>) -> (bool, R),
    ) -> std::io::Result<R> {
        let mut records = self.lock();
        json_file::locked(&self.path, || {
            let mut next = Self::read(&self.path)?;
            let (changed, result) = change(&mut next);
            if changed {
                self.write(&next)?;
            }
            *records = next;
            Ok(result)
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// A poisoned lock still holds a consistent map: memory only changes after a write succeeds.
    fn lock(&self) -> MutexGuard<'_, BTreeMap<String, Registration>> {
        self.records.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn get(&self, device_id: &str) -> Option<Registration> {
        self.lock().get(device_id).cloned()
    }

    /// Every stored registration, expired ones included, ordered by device id.
    pub fn all(&self) -> Vec<Registration> {
        self.lock().values().cloned().collect()
    }

    /// Stores `registration` as its device's only one, replacing any earlier record.
    pub fn put(&self, registration: Registration) -> std::io::Result<()> {
        self.update(|records| {
            records.insert(registration.device_id.clone(), registration);
            (true, ())
        })
    }

    /// Removes the device's record, returning it. Nothing to remove writes nothing.
    pub fn remove(&self, device_id: &str) -> std::io::Result<Option<Registration>> {
        self.update(|records| {
            let removed = records.remove(device_id);
            (removed.is_some(), removed)
        })
    }

    fn write(&self, records: &BTreeMap<String, Registration>) -> std::io::Result<()> {
        let body = FileBody {
            v: json_file::VERSION,
            registrations: records.values().cloned().collect(),
        };
        json_file::write(&self.path, &body)
    }
}

impl RegistrationSource for RegistrationStore {
    fn active(&self, now_ms: u64) -> Vec<Registration> {
        self.lock()
            .values()
            .filter(|r| !r.is_expired(now_ms))
            .cloned()
            .collect()
    }

    fn drop_dead(&self, sent: &Registration) -> bool {
        let dropped = self.update(|records| {
            let dead = records
                .get(&sent.device_id)
                .is_some_and(|stored| stored.same_target(sent));
            if dead {
                records.remove(&sent.device_id);
            }
            (dead, dead)
        });
        match dropped {
            Ok(dropped) => dropped,
            Err(error) => {
                tracing::warn!(
                    device = super::short(&sent.device_id),
                    %error,
                    "could not drop a dead push registration; it stays until the next report"
                );
                false
            }
        }
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use crate::registration::{HostFilter, REGISTRATION_LIFETIME_MS};
    use orca_push_api::{ApnsEnvironment, Platform};

    pub(crate) fn registration(device: &str, id: &str, token: &str, at: u64) -> Registration {
        Registration {
            device_id: device.into(),
            registration_id: id.into(),
            platform: Platform::Ios,
            token: token.into(),
            apns_environment: Some(ApnsEnvironment::Sandbox),
            filter: HostFilter::everything(),
            registered_at: at,
        }
    }

    /// Makes every later write to the store's file fail, even as root: a rename cannot replace a
    /// non-empty directory.
    pub(crate) fn break_writes(path: &Path) {
        let _ = std::fs::remove_file(path);
        std::fs::create_dir_all(path.join("blocker")).unwrap();
    }

    #[test]
    fn a_missing_file_is_empty_and_records_survive_reopening() {
        let dir = tempfile::tempdir().unwrap();
        let store = RegistrationStore::open(dir.path()).unwrap();
        assert!(store.all().is_empty());
        store.put(registration("a", "r1", "aa", 1)).unwrap();
        store.put(registration("b", "r2", "bb", 2)).unwrap();
        store.put(registration("a", "r3", "cc", 3)).unwrap();
        assert_eq!(store.remove("b").unwrap().unwrap().registration_id, "r2");
        assert_eq!(store.remove("b").unwrap(), None);

        let reopened = RegistrationStore::open(dir.path()).unwrap();
        assert_eq!(reopened.all(), vec![registration("a", "r3", "cc", 3)]);
        assert_eq!(reopened.get("a").unwrap().token, "cc");
        assert!(reopened.get("b").is_none());
    }

    #[test]
    fn a_corrupt_file_is_an_error_and_is_left_alone() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(REGISTRATIONS_FILE);
        std::fs::write(&path, b"{not json").unwrap();
        let error = RegistrationStore::open(dir.path()).unwrap_err();
        assert_eq!(error.kind(), std::io::ErrorKind::InvalidData);
        assert_eq!(std::fs::read(&path).unwrap(), b"{not json");

        std::fs::write(&path, br#"{"v":2,"registrations":[]}"#).unwrap();
        assert!(RegistrationStore::open(dir.path()).is_err());
    }

    /// Two processes on one folder (the desktop and a `host` command, or two commands), each
    /// with the store open: every change applies to what the file holds then, so neither writes
    /// over the other's, and a record one removed is not brought back by the other.
    #[test]
    fn two_processes_keep_each_others_changes() {
        let dir = tempfile::tempdir().unwrap();
        let desktop = RegistrationStore::open(dir.path()).unwrap();
        let command = RegistrationStore::open(dir.path()).unwrap();
        desktop.put(registration("a", "r1", "aa", 1)).unwrap();
        command.put(registration("b", "r2", "bb", 2)).unwrap();
        assert_eq!(command.all().len(), 2, "it saw the other's record");
        command.remove("a").unwrap();
        desktop.put(registration("c", "r3", "cc", 3)).unwrap();
        let ids = |store: &RegistrationStore| {
            store
                .all()
                .into_iter()
                .map(|r| r.device_id)
                .collect::<Vec<_>>()
        };
        assert_eq!(ids(&desktop), ["b", "c"]);
        assert_eq!(
            ids(&RegistrationStore::open(dir.path()).unwrap()),
            ["b", "c"]
        );
        // A dead registration the other process already replaced is not dropped.
        command.put(registration("b", "r2", "b2", 4)).unwrap();
        assert!(!desktop.drop_dead(&registration("b", "r2", "bb", 2)));
        assert_eq!(desktop.get("b").unwrap().token, "b2");
    }

    #[test]
    fn a_failed_write_changes_nothing_in_memory() {
        let dir = tempfile::tempdir().unwrap();
        let store = RegistrationStore::open(dir.path()).unwrap();
        store.put(registration("a", "r1", "aa", 1)).unwrap();
        break_writes(store.path());

        assert!(store.put(registration("a", "r2", "bb", 2)).is_err());
        assert!(store.put(registration("b", "r3", "cc", 3)).is_err());
        assert!(store.remove("a").is_err());
        assert!(!store.drop_dead(&registration("a", "r1", "aa", 1)));
        assert_eq!(store.all(), vec![registration("a", "r1", "aa", 1)]);
    }

    #[test]
    fn expired_registrations_are_not_active() {
        let dir = tempfile::tempdir().unwrap();
        let store = RegistrationStore::open(dir.path()).unwrap();
        store.put(registration("old", "r1", "aa", 1_000)).unwrap();
        store.put(registration("new", "r2", "bb", 5_000)).unwrap();
        let ids =
            |now| -> Vec<String> { store.active(now).into_iter().map(|r| r.device_id).collect() };
        assert_eq!(ids(1_000 + REGISTRATION_LIFETIME_MS - 1), ["new", "old"]);
        assert_eq!(ids(1_000 + REGISTRATION_LIFETIME_MS), ["new"]);
        assert!(ids(5_000 + REGISTRATION_LIFETIME_MS).is_empty());
        // Expired records are kept (a new registration renews them), just not sent to.
        assert_eq!(store.all().len(), 2);
    }

    #[test]
    fn drop_dead_only_drops_the_exact_target_that_was_sent() {
        let dir = tempfile::tempdir().unwrap();
        let store = RegistrationStore::open(dir.path()).unwrap();
        let sent = registration("a", "r1", "aa", 1);
        // The phone re-registered a new token under the same registration id meanwhile.
        store.put(registration("a", "r1", "bb", 2)).unwrap();
        assert!(!store.drop_dead(&sent));
        assert_eq!(store.get("a").unwrap().token, "bb");

        let mut other_env = registration("a", "r1", "bb", 2);
        other_env.apns_environment = Some(ApnsEnvironment::Production);
        assert!(!store.drop_dead(&other_env));
        assert!(!store.drop_dead(&registration("a", "r9", "bb", 2)));
        assert!(!store.drop_dead(&registration("zz", "r1", "bb", 2)));

        // A later registration time alone does not protect it: the target is the same.
        assert!(store.drop_dead(&registration("a", "r1", "bb", 1)));
        assert!(store.get("a").is_none());
        assert!(
            RegistrationStore::open(dir.path())
                .unwrap()
                .all()
                .is_empty()
        );
    }

    #[test]
    fn the_file_is_private_and_never_half_written() {
        let dir = tempfile::tempdir().unwrap();
        let store = RegistrationStore::open(dir.path()).unwrap();
        store.put(registration("a", "r1", "aa", 1)).unwrap();
        let mut names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        names.sort();
        // No temporary file is left; the lock file stays, empty, for the next change.
        assert_eq!(
            names,
            ["push-registrations.json", "push-registrations.lock"]
        );
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt as _;
            let lock = std::fs::metadata(dir.path().join("push-registrations.lock")).unwrap();
            assert_eq!(lock.permissions().mode() & 0o777, 0o600);
            assert_eq!(lock.len(), 0);
        }
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt as _;
            let mode = std::fs::metadata(store.path())
                .unwrap()
                .permissions()
                .mode();
            assert_eq!(mode & 0o777, 0o600);
        }
    }
}
