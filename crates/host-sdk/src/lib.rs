//! The desktop host's side of orca-push: its X25519 keypair on disk, answering the gateway's
//! challenge (after checking every transcript field), and an API client that keeps one session and
//! re-proves on 401.
//!
//! It never prints or logs the secret key or the session token.

mod client;
mod key;
mod proof;

pub use client::{GatewayClient, GatewayError, SessionInfo};
pub use key::{HostKey, KeyError};
pub use proof::{ChallengeEnvelope, ChallengeRefusal, answer_challenge};

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
