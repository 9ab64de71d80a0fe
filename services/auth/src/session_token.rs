//! Session tokens a holder of the session key can check without a look-up: 24 random bytes, then
//! the first 8 bytes of their HMAC-SHA256 under the key, 32 bytes in all, so the token is still the
//! contract's 43 characters of unpadded base64url. A forged bearer fails the tag and is refused for
//! the cost of one HMAC; only a tagged token (one this gateway minted) is ever looked up.
//!
//! The tag proves the gateway minted the token, never that its session is still current: replaced
//! and expired sessions still need the stored row. Nothing here logs a token or the key.

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use hmac::{Hmac, Mac as _};
use rand::RngCore as _;
use rand::rngs::OsRng;
use sha2::{Digest as _, Sha256};
use subtle::ConstantTimeEq as _;

/// Characters of a session token: 32 bytes of unpadded base64url.
pub const SESSION_TOKEN_LEN: usize = 43;
/// Bytes of the session key.
pub const SESSION_KEY_LEN: usize = 32;
const RANDOM_LEN: usize = 24;
const TAG_LEN: usize = 8;
/// Binds the tag to its purpose, so the key can never be confused with another HMAC's.
const TAG_CONTEXT: &[u8] = b"orca-push-session-token/v1\0";

/// The HMAC key session tokens are tagged with. Its Debug prints nothing.
#[derive(Clone, PartialEq, Eq)]
pub struct SessionKey([u8; SESSION_KEY_LEN]);

impl std::fmt::Debug for SessionKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SessionKey(..)")
    }
}

/// What a bearer's tag says about it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tag {
    /// This gateway minted it: worth a look-up.
    Valid,
    /// No valid tag, but tokens minted before the key existed may still be live: worth a look-up
    /// while the caller's forged-bearer budget lasts.
    Legacy,
    /// Not a token this key minted (or not 43 characters of base64url at all).
    Invalid,
}

/// The session key and the end of the window in which untagged tokens minted before it may still
/// be live (0 when there were none: a fresh database).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionTagging {
    pub key: SessionKey,
    pub legacy_until_ms: u64,
}

impl SessionTagging {
    pub fn check(&self, token: &str, now_ms: u64) -> Tag {
        match self.key.check(token) {
            Tag::Valid => Tag::Valid,
            _ if now_ms < self.legacy_until_ms && well_formed(token) => Tag::Legacy,
            _ => Tag::Invalid,
        }
    }
}

/// 43 characters of base64url: the only shape a session token, tagged or not, ever had.
pub fn well_formed(token: &str) -> bool {
    token.len() == SESSION_TOKEN_LEN
        && token
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}

impl SessionKey {
    pub fn generate() -> Self {
        let mut key = [0u8; SESSION_KEY_LEN];
        OsRng.fill_bytes(&mut key);
        Self(key)
    }

    /// None unless exactly 32 bytes.
    pub fn from_bytes(bytes: &[u8]) -> Option<Self> {
        bytes.try_into().ok().map(Self)
    }

    pub fn as_bytes(&self) -> &[u8; SESSION_KEY_LEN] {
        &self.0
    }

    /// None only if HMAC refused the key, which it never does for 32 bytes; callers fail closed.
    fn tag(&self, random: &[u8]) -> Option<[u8; TAG_LEN]> {
        let mut mac = Hmac::<Sha256>::new_from_slice(&self.0).ok()?;
        mac.update(TAG_CONTEXT);
        mac.update(random);
        let full = mac.finalize().into_bytes();
        let mut tag = [0u8; TAG_LEN];
        tag.copy_from_slice(full.get(..TAG_LEN)?);
        Some(tag)
    }

    /// A fresh token: 24 random bytes and their tag, unpadded base64url.
    pub fn mint(&self) -> Option<String> {
        let mut bytes = [0u8; RANDOM_LEN + TAG_LEN];
        OsRng.fill_bytes(&mut bytes[..RANDOM_LEN]);
        let tag = self.tag(&bytes[..RANDOM_LEN])?;
        bytes[RANDOM_LEN..].copy_from_slice(&tag);
        Some(URL_SAFE_NO_PAD.encode(bytes))
    }

    /// Checks the tag in constant time; no look-up. Valid or Invalid, never Legacy.
    pub fn check(&self, token: &str) -> Tag {
        if token.len() != SESSION_TOKEN_LEN {
            return Tag::Invalid;
        }
        // The engine refuses stray low bits in the last character, so each token has exactly
        // one spelling (and one hash in the store).
        let Ok(bytes) = URL_SAFE_NO_PAD.decode(token) else {
            return Tag::Invalid;
        };
        if bytes.len() != RANDOM_LEN + TAG_LEN {
            return Tag::Invalid;
        }
        let Some(expected) = self.tag(&bytes[..RANDOM_LEN]) else {
            return Tag::Invalid;
        };
        if bool::from(expected.ct_eq(&bytes[RANDOM_LEN..])) {
            Tag::Valid
        } else {
            Tag::Invalid
        }
    }
}

/// The sha256 of a token, as the store keys sessions (hex) and the facade keys its cache (bytes).
pub fn token_hash(token: &str) -> [u8; 32] {
    Sha256::digest(token.as_bytes()).into()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn minted_tokens_are_43_chars_of_base64url_and_check_valid() {
        let key = SessionKey::generate();
        for _ in 0..100 {
            let token = key.mint().unwrap();
            assert_eq!(token.len(), SESSION_TOKEN_LEN);
            assert!(
                token
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
            );
            assert_eq!(key.check(&token), Tag::Valid);
        }
    }

    #[test]
    fn forged_altered_and_foreign_tokens_fail_the_tag() {
        let key = SessionKey::generate();
        let token = key.mint().unwrap();
        assert_eq!(SessionKey::generate().check(&token), Tag::Invalid);
        assert_eq!(key.check(&"A".repeat(43)), Tag::Invalid);
        assert_eq!(key.check(&token[..42]), Tag::Invalid);
        assert_eq!(key.check(&format!("{token}A")), Tag::Invalid);
        assert_eq!(key.check("!".repeat(43).as_str()), Tag::Invalid);
        // Any one character changed breaks it.
        for i in 0..token.len() {
            let mut bytes = token.clone().into_bytes();
            bytes[i] = if bytes[i] == b'A' { b'B' } else { b'A' };
            let altered = String::from_utf8(bytes).unwrap();
            assert_eq!(key.check(&altered), Tag::Invalid, "position {i}");
        }
    }

    #[test]
    fn untagged_tokens_are_legacy_only_inside_the_window() {
        let tagging = SessionTagging {
            key: SessionKey::generate(),
            legacy_until_ms: 1_000,
        };
        let old = "A".repeat(43);
        assert_eq!(tagging.check(&old, 999), Tag::Legacy);
        assert_eq!(tagging.check(&old, 1_000), Tag::Invalid);
        assert_eq!(tagging.check("short", 0), Tag::Invalid);
        assert_eq!(
            tagging.check(&tagging.key.mint().unwrap(), 5_000),
            Tag::Valid
        );
    }

    #[test]
    fn the_key_never_shows_in_debug() {
        let key = SessionKey::from_bytes(&[0x41; 32]).unwrap();
        assert_eq!(format!("{key:?}"), "SessionKey(..)");
        assert!(SessionKey::from_bytes(&[0; 31]).is_none());
    }
}
