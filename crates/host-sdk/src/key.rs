//! The host's X25519 keypair, kept in a file only its owner can read.

use std::path::{Path, PathBuf};

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use orca_push_host_proof as hp;
use rand::RngCore as _;
use serde::{Deserialize, Serialize};
use zeroize::{Zeroize as _, Zeroizing};

#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    #[error("cannot read or write the key file {path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("{0} already exists; refusing to overwrite a host key")]
    Exists(String),
    #[error("the key file {0} is not a host key")]
    Malformed(String),
}

/// A host's X25519 keypair. Debug shows only the fingerprint; the secret is wiped on drop.
#[derive(Clone)]
pub struct HostKey {
    secret: [u8; 32],
    public: [u8; 32],
}

impl std::fmt::Debug for HostKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostKey")
            .field(
                "fingerprint",
                &crate::short_fingerprint(&self.fingerprint()),
            )
            .finish_non_exhaustive()
    }
}

impl Drop for HostKey {
    fn drop(&mut self) {
        self.secret.zeroize();
    }
}

#[derive(Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct KeyFile {
    secret_key_b64: Zeroizing<String>,
    public_key_b64: String,
}

/// Where the CLI and the example keep the host key when no path is given: the platform's config
/// directory (`~/.config` on Linux, `~/Library/Application Support` on macOS, `%APPDATA%` on
/// Windows), under `orca-push/`, or the working directory where there is none. A key at the
/// earlier default, `~/.orca-push/host.key`, is still used while none exists at the new place, so
/// an existing host keeps its identity and its registrations.
pub fn default_key_path() -> PathBuf {
    let current = dirs::config_dir()
        .unwrap_or_else(|| PathBuf::from("."))
        .join("orca-push")
        .join("host.key");
    let legacy = dirs::home_dir().map(|home| home.join(".orca-push").join("host.key"));
    match legacy {
        Some(legacy) if !current.exists() && legacy.exists() => legacy,
        _ => current,
    }
}

impl HostKey {
    pub fn generate() -> Self {
        let mut secret = [0u8; 32];
        rand::rngs::OsRng.fill_bytes(&mut secret);
        let key = Self::from_secret(secret);
        secret.zeroize();
        key
    }

    pub fn from_secret(secret: [u8; 32]) -> Self {
        Self {
            secret,
            public: hp::public_key(&secret),
        }
    }

    pub fn public_key(&self) -> &[u8; 32] {
        &self.public
    }

    pub(crate) fn secret_key(&self) -> &[u8; 32] {
        &self.secret
    }

    /// base64url(sha256(public key)), first 16 characters.
    pub fn fingerprint(&self) -> String {
        hp::host_fingerprint(&self.public)
    }

    /// Writes a new key file with mode 0600, atomically (a crash leaves no half key), creating its
    /// directory. Never overwrites an existing one.
    pub fn save_new(&self, path: &Path) -> Result<(), KeyError> {
        let io = |source| KeyError::Io {
            path: path.display().to_string(),
            source,
        };
        let body = Zeroizing::new(
            serde_json::to_vec_pretty(&KeyFile {
                secret_key_b64: Zeroizing::new(STANDARD.encode(self.secret)),
                public_key_b64: STANDARD.encode(self.public),
            })
            .map_err(|e| io(std::io::Error::other(e)))?,
        );
        crate::files::create_new(path, &body).map_err(|e| {
            if e.kind() == std::io::ErrorKind::AlreadyExists {
                KeyError::Exists(path.display().to_string())
            } else {
                io(e)
            }
        })
    }

    pub fn load(path: &Path) -> Result<Self, KeyError> {
        let text = Zeroizing::new(std::fs::read(path).map_err(|source| KeyError::Io {
            path: path.display().to_string(),
            source,
        })?);
        let malformed = || KeyError::Malformed(path.display().to_string());
        let file: KeyFile = serde_json::from_slice(&text).map_err(|_| malformed())?;
        let decoded = Zeroizing::new(
            STANDARD
                .decode(file.secret_key_b64.as_bytes())
                .map_err(|_| malformed())?,
        );
        let mut secret: [u8; 32] = decoded.as_slice().try_into().map_err(|_| malformed())?;
        let key = Self::from_secret(secret);
        secret.zeroize();
        if STANDARD.encode(key.public) != file.public_key_b64 {
            return Err(malformed());
        }
        Ok(key)
    }
}
