//! The host-proof wire format, shared by the gateway (auth service) and the host SDK.
//!
//! A host's key is X25519, so it cannot sign. Instead the gateway seals a secret to the host's key
//! together with a transcript that pins every parameter of the exchange; the host opens it, checks
//! the transcript, and answers with an HMAC over the transcript keyed by the secret.
//!
//! Everything here is byte-exact with the original TypeScript implementation
//! (`tests/push-host-proof-vector.json` replays its vector). This crate does no I/O and keeps no
//! state; it must never log a key, secret or proof.

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use crypto_box::aead::Aead as _;
use crypto_box::{PublicKey, SalsaBox, SecretKey};
use hmac::{Hmac, Mac as _};
use sha2::{Digest as _, Sha256};

/// The transcript's `protocol` field.
pub const PROTOCOL: &str = "orca-push-host-proof/v1";
/// The transcript's `version` field, a single byte.
pub const VERSION: u8 = 0x01;
/// How long a challenge lives, gateway side. The host alone allows clock skew on top.
pub const CHALLENGE_TTL_MS: u64 = 10_000;
/// The host's allowance for clock skew when it checks the gateway's timestamps.
pub const HOST_CLOCK_SKEW_MS: u64 = 30_000;

const CHALLENGE_PLAINTEXT_PREFIX: &[u8] = b"orca-push-host-challenge/v1\0";
const PROOF_PREFIX: &[u8] = b"orca-push-host-proof/v1\0ack\0";
const FIELD_NAMES: [&str; 10] = [
    "protocol",
    "version",
    "gatewayOrigin",
    "gatewayEphemeralPublicKey",
    "challengeNonce",
    "challengeId",
    "issuedAt",
    "expiresAt",
    "hostFingerprint",
    "hostPublicKey",
];

pub const PUBLIC_KEY_LEN: usize = 32;
pub const NONCE_LEN: usize = 24;
pub const SECRET_LEN: usize = 32;
pub const PROOF_LEN: usize = 32;

/// Why a transcript or challenge plaintext could not be read.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum FormatError {
    #[error("truncated: {0}")]
    Truncated(&'static str),
    #[error("field {index} is named {found:?}, expected {expected:?}")]
    FieldName {
        index: usize,
        expected: &'static str,
        found: String,
    },
    #[error("field {0} has the wrong length")]
    FieldLength(&'static str),
    #[error("field {0} is not UTF-8")]
    NotUtf8(&'static str),
    #[error("trailing bytes after the last field")]
    Trailing,
    #[error("the plaintext does not start with the challenge prefix")]
    Prefix,
    #[error("the box does not open with this key")]
    BoxOpen,
}

/// The X25519 public keys of small order, as libsodium lists them (bit 255 ignored, as X25519
/// ignores it): 0, 1, the two points of order 8, and p - 1, p and p + 1. Every secret key's
/// shared secret with one of them is all zeros, so anyone can open a box sealed to it.
const SMALL_ORDER_KEYS: [[u8; PUBLIC_KEY_LEN]; 7] = {
    let mut keys = [[0u8; PUBLIC_KEY_LEN]; 7];
    keys[1][0] = 1;
    keys[2] = [
        0xe0, 0xeb, 0x7a, 0x7c, 0x3b, 0x41, 0xb8, 0xae, 0x16, 0x56, 0xe3, 0xfa, 0xf1, 0x9f, 0xc4,
        0x6a, 0xda, 0x09, 0x8d, 0xeb, 0x9c, 0x32, 0xb1, 0xfd, 0x86, 0x62, 0x05, 0x16, 0x5f, 0x49,
        0xb8, 0x00,
    ];
    keys[3] = [
        0x5f, 0x9c, 0x95, 0xbc, 0xa3, 0x50, 0x8c, 0x24, 0xb1, 0xd0, 0xb1, 0x55, 0x9c, 0x83, 0xef,
        0x5b, 0x04, 0x44, 0x5c, 0xc4, 0x58, 0x1c, 0x8e, 0x86, 0xd8, 0x22, 0x4e, 0xdd, 0xd0, 0x9f,
        0x11, 0x57,
    ];
    let mut i = 4;
    while i < 7 {
        let mut key = [0xff; PUBLIC_KEY_LEN];
        key[0] = 0xec + (i as u8 - 4);
        key[PUBLIC_KEY_LEN - 1] = 0x7f;
        keys[i] = key;
        i += 1;
    }
    keys
};

/// Whether `public_key` has small order (libsodium's check): a challenge sealed to it is open
/// to anyone, so whoever presents it could prove it; every such caller would share one host.
pub fn is_small_order(public_key: &[u8; PUBLIC_KEY_LEN]) -> bool {
    let mut key = *public_key;
    key[PUBLIC_KEY_LEN - 1] &= 0x7f;
    SMALL_ORDER_KEYS.contains(&key)
}

/// `hostFingerprint`: base64url(sha256(public key)), first 16 characters.
pub fn host_fingerprint(public_key: &[u8; PUBLIC_KEY_LEN]) -> String {
    let digest = Sha256::digest(public_key);
    let mut encoded = URL_SAFE_NO_PAD.encode(digest);
    encoded.truncate(16);
    encoded
}

/// The ten fields the proof is bound to, in their wire order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Transcript {
    pub gateway_origin: String,
    pub gateway_ephemeral_public_key: [u8; PUBLIC_KEY_LEN],
    pub challenge_nonce: [u8; NONCE_LEN],
    pub challenge_id: String,
    pub issued_at_ms: u64,
    pub expires_at_ms: u64,
    pub host_fingerprint: String,
    pub host_public_key: [u8; PUBLIC_KEY_LEN],
}

fn put_field(out: &mut Vec<u8>, name: &str, value: &[u8]) {
    out.extend_from_slice(&(name.len() as u32).to_be_bytes());
    out.extend_from_slice(name.as_bytes());
    out.extend_from_slice(&(value.len() as u32).to_be_bytes());
    out.extend_from_slice(value);
}

struct Reader<'a> {
    rest: &'a [u8],
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize, what: &'static str) -> Result<&'a [u8], FormatError> {
        if self.rest.len() < n {
            return Err(FormatError::Truncated(what));
        }
        let (head, tail) = self.rest.split_at(n);
        self.rest = tail;
        Ok(head)
    }

    fn u32(&mut self, what: &'static str) -> Result<usize, FormatError> {
        let bytes = self.take(4, what)?;
        Ok(u32::from_be_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]) as usize)
    }

    fn field(&mut self, index: usize) -> Result<&'a [u8], FormatError> {
        let expected = FIELD_NAMES[index];
        let name_len = self.u32(expected)?;
        let name = self.take(name_len, expected)?;
        if name != expected.as_bytes() {
            return Err(FormatError::FieldName {
                index,
                expected,
                found: String::from_utf8_lossy(name).into_owned(),
            });
        }
        let value_len = self.u32(expected)?;
        self.take(value_len, expected)
    }
}

fn fixed<const N: usize>(value: &[u8], name: &'static str) -> Result<[u8; N], FormatError> {
    value.try_into().map_err(|_| FormatError::FieldLength(name))
}

fn text(value: &[u8], name: &'static str) -> Result<String, FormatError> {
    String::from_utf8(value.to_vec()).map_err(|_| FormatError::NotUtf8(name))
}

/// A transcript as read off the wire, before its values are judged. `protocol` and `version` are
/// kept raw so the host can refuse a wrong one with a precise reason.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecodedTranscript {
    pub protocol: Vec<u8>,
    pub version: Vec<u8>,
    pub transcript: Transcript,
}

impl Transcript {
    /// The length-prefixed field encoding: `u32be(len(name)) || name || u32be(len(value)) || value`.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(400);
        put_field(&mut out, FIELD_NAMES[0], PROTOCOL.as_bytes());
        put_field(&mut out, FIELD_NAMES[1], &[VERSION]);
        put_field(&mut out, FIELD_NAMES[2], self.gateway_origin.as_bytes());
        put_field(&mut out, FIELD_NAMES[3], &self.gateway_ephemeral_public_key);
        put_field(&mut out, FIELD_NAMES[4], &self.challenge_nonce);
        put_field(&mut out, FIELD_NAMES[5], self.challenge_id.as_bytes());
        put_field(&mut out, FIELD_NAMES[6], &self.issued_at_ms.to_be_bytes());
        put_field(&mut out, FIELD_NAMES[7], &self.expires_at_ms.to_be_bytes());
        put_field(&mut out, FIELD_NAMES[8], self.host_fingerprint.as_bytes());
        put_field(&mut out, FIELD_NAMES[9], &self.host_public_key);
        out
    }

    /// Reads the ten fields in order; names, lengths and order must be exact.
    pub fn decode(bytes: &[u8]) -> Result<DecodedTranscript, FormatError> {
        let mut reader = Reader { rest: bytes };
        let protocol = reader.field(0)?.to_vec();
        let version = reader.field(1)?.to_vec();
        let gateway_origin = text(reader.field(2)?, "gatewayOrigin")?;
        let gateway_ephemeral_public_key = fixed(reader.field(3)?, "gatewayEphemeralPublicKey")?;
        let challenge_nonce = fixed(reader.field(4)?, "challengeNonce")?;
        let challenge_id = text(reader.field(5)?, "challengeId")?;
        let issued_at_ms = u64::from_be_bytes(fixed(reader.field(6)?, "issuedAt")?);
        let expires_at_ms = u64::from_be_bytes(fixed(reader.field(7)?, "expiresAt")?);
        let host_fingerprint = text(reader.field(8)?, "hostFingerprint")?;
        let host_public_key = fixed(reader.field(9)?, "hostPublicKey")?;
        if !reader.rest.is_empty() {
            return Err(FormatError::Trailing);
        }
        Ok(DecodedTranscript {
            protocol,
            version,
            transcript: Transcript {
                gateway_origin,
                gateway_ephemeral_public_key,
                challenge_nonce,
                challenge_id,
                issued_at_ms,
                expires_at_ms,
                host_fingerprint,
                host_public_key,
            },
        })
    }
}

/// `"orca-push-host-challenge/v1\0" || u32be(len(transcript)) || transcript || secret`.
pub fn challenge_plaintext(transcript: &[u8], secret: &[u8; SECRET_LEN]) -> Vec<u8> {
    let mut out =
        Vec::with_capacity(CHALLENGE_PLAINTEXT_PREFIX.len() + 4 + transcript.len() + SECRET_LEN);
    out.extend_from_slice(CHALLENGE_PLAINTEXT_PREFIX);
    out.extend_from_slice(&(transcript.len() as u32).to_be_bytes());
    out.extend_from_slice(transcript);
    out.extend_from_slice(secret);
    out
}

/// Splits an opened challenge plaintext into its transcript bytes and secret.
pub fn parse_challenge_plaintext(
    plaintext: &[u8],
) -> Result<(&[u8], [u8; SECRET_LEN]), FormatError> {
    let rest = plaintext
        .strip_prefix(CHALLENGE_PLAINTEXT_PREFIX)
        .ok_or(FormatError::Prefix)?;
    let mut reader = Reader { rest };
    let len = reader.u32("transcript length")?;
    let transcript = reader.take(len, "transcript")?;
    let secret = fixed(reader.take(SECRET_LEN, "secret")?, "secret")?;
    if !reader.rest.is_empty() {
        return Err(FormatError::Trailing);
    }
    Ok((transcript, secret))
}

/// `HMAC-SHA256(secret, "orca-push-host-proof/v1\0ack\0" || transcript)`.
pub fn proof(secret: &[u8; SECRET_LEN], transcript: &[u8]) -> [u8; PROOF_LEN] {
    let mut mac = <Hmac<Sha256>>::new_from_slice(secret).expect("HMAC takes a key of any length");
    mac.update(PROOF_PREFIX);
    mac.update(transcript);
    mac.finalize().into_bytes().into()
}

/// `nacl.box(plaintext, nonce, recipient public key, sender secret key)`: tag, then sealed text.
pub fn seal(
    plaintext: &[u8],
    nonce: &[u8; NONCE_LEN],
    recipient: &[u8; PUBLIC_KEY_LEN],
    sender_secret: &[u8; SECRET_LEN],
) -> Vec<u8> {
    let sealer = SalsaBox::new(
        &PublicKey::from(*recipient),
        &SecretKey::from(*sender_secret),
    );
    sealer
        .encrypt(nonce.into(), plaintext)
        .expect("XSalsa20-Poly1305 sealing has no failure for in-memory plaintexts")
}

/// `nacl.box.open`: the inverse of [`seal`], from the recipient's side.
pub fn open(
    ciphertext: &[u8],
    nonce: &[u8; NONCE_LEN],
    sender: &[u8; PUBLIC_KEY_LEN],
    recipient_secret: &[u8; SECRET_LEN],
) -> Result<Vec<u8>, FormatError> {
    let opener = SalsaBox::new(
        &PublicKey::from(*sender),
        &SecretKey::from(*recipient_secret),
    );
    opener
        .decrypt(nonce.into(), ciphertext)
        .map_err(|_| FormatError::BoxOpen)
}

/// The X25519 public key of a secret key.
pub fn public_key(secret: &[u8; SECRET_LEN]) -> [u8; PUBLIC_KEY_LEN] {
    *SecretKey::from(*secret).public_key().as_bytes()
}
