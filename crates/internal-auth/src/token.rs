//! The tokens: the shared key, what a token claims, minting and verifying.

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use jsonwebtoken::{Algorithm, DecodingKey, EncodingKey, Header, Validation};
use rand::RngCore as _;
use serde::{Deserialize, Serialize};

use crate::{CLOCK_SKEW, MAX_FULL_TTL, MAX_READ_TTL, MAX_SUBJECT_LEN};

/// The shared signing key. Debug never shows it.
#[derive(Clone, Debug)]
pub struct InternalKey(pub(crate) Arc<secrecy::SecretSlice<u8>>);

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum KeyError {
    #[error("must be at least 32 bytes of secret (e.g. `openssl rand -base64 48`)")]
    TooShort,
}

impl InternalKey {
    /// A random key for a process that talks only to itself (all in one).
    pub fn generate() -> Self {
        let mut bytes = vec![0u8; 48];
        rand::rngs::OsRng.fill_bytes(&mut bytes);
        Self(Arc::new(bytes.into()))
    }

    /// The configured secret, as text (base64 or not: its bytes are the key).
    pub fn from_secret(secret: &str) -> Result<Self, KeyError> {
        let secret = secret.trim();
        if secret.len() < 32 {
            return Err(KeyError::TooShort);
        }
        Ok(Self(Arc::new(secret.as_bytes().to_vec().into())))
    }
}

/// What a token may call.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Scope {
    /// The read-only methods of [`orca_push_proto::access`] and reflection. Also what a token
    /// without a scope claim gets.
    #[default]
    Read,
    /// Every method: what services mint for each other.
    Full,
}

impl Scope {
    /// The longest a token of this scope may live.
    pub fn max_ttl(self) -> Duration {
        match self {
            Self::Read => MAX_READ_TTL,
            Self::Full => MAX_FULL_TTL,
        }
    }

    /// Whether this scope may call the method at `path`.
    pub fn allows(self, path: &str) -> bool {
        use orca_push_proto::access::{self, Access};
        match self {
            Self::Full => true,
            Self::Read => access::of(path) == Access::Read,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Read => "read",
            Self::Full => "full",
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Claims {
    /// The caller: a service name or an internal team.
    pub sub: String,
    /// The service called.
    pub aud: String,
    pub iat: u64,
    pub exp: u64,
    /// Absent in tokens minted before scopes: read-only. An unknown value makes the token invalid.
    #[serde(default)]
    pub scope: Scope,
}

/// A caller name: 1 to 64 ASCII letters, digits, `.`, `_`, `-` or `@` (it is logged and traced).
pub fn valid_subject(subject: &str) -> bool {
    (1..=MAX_SUBJECT_LEN).contains(&subject.len())
        && subject
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-' | b'@'))
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum Refusal {
    #[error("no internal token")]
    Missing,
    #[error("internal token expired")]
    Expired,
    #[error("internal token for another service")]
    WrongAudience,
    #[error("invalid internal token")]
    Invalid,
    #[error("internal token names no well-formed caller")]
    BadSubject,
    #[error("internal token lives longer than its scope allows")]
    TooLong,
}

pub(crate) fn now_s() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// A token for `subject` to call `audience` within `scope`, valid from `iat` to `exp` (Unix
/// seconds). Mints whatever it is asked; [`verify`] enforces the subject's form and the lifetime.
pub fn mint_between(
    key: &InternalKey,
    subject: &str,
    audience: &str,
    scope: Scope,
    iat: u64,
    exp: u64,
) -> String {
    let claims = Claims {
        sub: subject.to_owned(),
        aud: audience.to_owned(),
        iat,
        exp,
        scope,
    };
    jsonwebtoken::encode(
        &Header::new(Algorithm::HS256),
        &claims,
        &EncodingKey::from_secret(secrecy::ExposeSecret::expose_secret(&*key.0)),
    )
    .unwrap_or_default()
}

/// A token for `subject` to call `audience` within `scope` for `ttl`.
pub fn mint(
    key: &InternalKey,
    subject: &str,
    audience: &str,
    scope: Scope,
    ttl: Duration,
) -> String {
    let now = now_s();
    mint_between(key, subject, audience, scope, now, now + ttl.as_secs())
}

/// Whether a token lives longer than its scope allows (plus clock skew) at `now` (Unix seconds):
/// in all, from its `iat` to its `exp`, as well as from now. A token minted for 30 days with the
/// shared key by any tool but ours would otherwise be refused at first and accepted for its last
/// hours; one dated in the future, likewise.
fn lives_too_long(claims: &Claims, now: u64) -> bool {
    let most = (claims.scope.max_ttl() + CLOCK_SKEW).as_secs();
    claims.exp > now.saturating_add(most)
        || claims.exp.saturating_sub(claims.iat) > most
        || claims.iat > now.saturating_add(CLOCK_SKEW.as_secs())
}

/// Checks a token for `audience`: signature, audience, expiry, a well-formed caller, and a
/// remaining lifetime within its scope's maximum (plus clock skew). Which methods its scope may
/// call is the caller's check ([`Scope::allows`]).
pub fn verify(key: &InternalKey, token: &str, audience: &str) -> Result<Claims, Refusal> {
    verify_any(key, token, &[audience])
}

/// [`verify`], for a token of any of `audiences` (the all-in-one listener's reflection).
pub fn verify_any(key: &InternalKey, token: &str, audiences: &[&str]) -> Result<Claims, Refusal> {
    let mut validation = Validation::new(Algorithm::HS256);
    validation.set_audience(audiences);
    validation.leeway = 0;
    validation.set_required_spec_claims(&["exp", "aud", "sub"]);
    jsonwebtoken::decode::<Claims>(
        token,
        &DecodingKey::from_secret(secrecy::ExposeSecret::expose_secret(&*key.0)),
        &validation,
    )
    .map(|data| data.claims)
    .map_err(|error| match error.kind() {
        jsonwebtoken::errors::ErrorKind::ExpiredSignature => Refusal::Expired,
        jsonwebtoken::errors::ErrorKind::InvalidAudience => Refusal::WrongAudience,
        _ => Refusal::Invalid,
    })
    .and_then(|claims| {
        if !valid_subject(&claims.sub) {
            Err(Refusal::BadSubject)
        } else if lives_too_long(&claims, now_s()) {
            Err(Refusal::TooLong)
        } else {
            Ok(claims)
        }
    })
}
