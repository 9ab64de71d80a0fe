//! The desktop host's side of orca-push: its X25519 keypair on disk, answering the gateway's
//! challenge (after checking every transcript field), a typed API client that keeps one session
//! per gateway, and the desktop's duties from the contract (see README.md in this crate).
//!
//! It never prints or logs the secret key, the session token, push tokens or notification text.

mod client;
mod dispatch;
mod error;
mod files;
mod gateway;
mod key;
mod proof;
mod registrar;
mod registration;
mod session;

pub use client::GatewayClient;
pub use dispatch::{
    DispatchConfig, DispatchEvent, DispatchReport, Dispatcher, Outcome, RequestReport, Skip,
    gateway_agent_state,
};
pub use error::GatewayError;
pub use gateway::Gateway;
pub use key::{HostKey, KeyError, default_key_path};
pub use orca_push_api as api;
pub use proof::{ChallengeEnvelope, ChallengeRefusal, answer_challenge};
pub use registrar::{
    Clock, DrainReport, NotRegistered, OUTBOX_FILE, PendingDelete, REGISTRATIONS_FILE,
    RegisterOutcome, Registrar, RegistrarConfig, RegistrationStore, UnregisterOutbox,
};
pub use registration::{HostFilter, REGISTRATION_LIFETIME_MS, Registration, RegistrationSource};
pub use session::{SessionFile, SessionInfo};

/// At most the first 4 characters of a host fingerprint, as logs and Debug output may show it.
pub fn short_fingerprint(fingerprint: &str) -> String {
    let mut short: String = fingerprint.chars().take(4).collect();
    if fingerprint.chars().count() > 4 {
        short.push('…');
    }
    short
}

/// The origin (scheme://host[:port]) of a gateway base URL, as the gateway writes it into the
/// transcript: no path, no trailing slash, default ports dropped, host lower-cased.
pub fn origin_of(base_url: &str) -> Result<String, GatewayError> {
    let url = reqwest::Url::parse(base_url).map_err(|_| GatewayError::BadUrl)?;
    match url.scheme() {
        "http" | "https" => {}
        _ => return Err(GatewayError::BadUrl),
    }
    let origin = url.origin().ascii_serialization();
    if origin == "null" {
        return Err(GatewayError::BadUrl);
    }
    Ok(origin)
}
