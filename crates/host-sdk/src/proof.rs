//! Answering a challenge: open the box, judge every transcript field, return the HMAC proof.

use orca_push_host_proof as hp;

use crate::key::HostKey;

/// What `POST /v1/host/challenge` returned, decoded from base64.
#[derive(Debug, Clone)]
pub struct ChallengeEnvelope {
    pub challenge_id: String,
    pub gateway_ephemeral_public_key: [u8; 32],
    pub nonce: [u8; 24],
    pub ciphertext: Vec<u8>,
    pub expires_at_ms: u64,
}

/// Why the host refused to answer a challenge.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ChallengeRefusal {
    #[error("the challenge box does not open with this host's key")]
    BoxDoesNotOpen,
    #[error("the challenge plaintext or transcript is malformed: {0}")]
    Malformed(String),
    #[error("unexpected protocol")]
    Protocol,
    #[error("unexpected version")]
    Version,
    #[error("the transcript names origin {found:?}, but this host called {expected:?}")]
    Origin { expected: String, found: String },
    #[error("the transcript's gateway key differs from the envelope's")]
    GatewayKey,
    #[error("the transcript's nonce differs from the envelope's")]
    Nonce,
    #[error("the transcript's challenge id differs from the envelope's")]
    ChallengeId,
    #[error("issuedAt is outside the allowed clock skew")]
    IssuedAt,
    #[error("the challenge has expired")]
    Expired,
    #[error("the challenge window is longer than 10 s, or its expiry differs from the envelope's")]
    Window,
    #[error("the transcript is for another host fingerprint")]
    Fingerprint,
    #[error("the transcript is for another host public key")]
    PublicKey,
}

/// Answers a challenge from `expected_origin` (the gateway this host called) at `now_ms`.
pub fn answer_challenge(
    key: &HostKey,
    expected_origin: &str,
    envelope: &ChallengeEnvelope,
    now_ms: u64,
) -> Result<[u8; 32], ChallengeRefusal> {
    let plaintext = hp::open(
        &envelope.ciphertext,
        &envelope.nonce,
        &envelope.gateway_ephemeral_public_key,
        key.secret_key(),
    )
    .map_err(|_| ChallengeRefusal::BoxDoesNotOpen)?;
    let (transcript_bytes, secret) = hp::parse_challenge_plaintext(&plaintext)
        .map_err(|e| ChallengeRefusal::Malformed(e.to_string()))?;
    let decoded = hp::Transcript::decode(transcript_bytes)
        .map_err(|e| ChallengeRefusal::Malformed(e.to_string()))?;
    if decoded.protocol != hp::PROTOCOL.as_bytes() {
        return Err(ChallengeRefusal::Protocol);
    }
    if decoded.version != [hp::VERSION] {
        return Err(ChallengeRefusal::Version);
    }
    let t = &decoded.transcript;
    if t.gateway_origin != expected_origin {
        return Err(ChallengeRefusal::Origin {
            expected: expected_origin.to_owned(),
            found: t.gateway_origin.clone(),
        });
    }
    if t.gateway_ephemeral_public_key != envelope.gateway_ephemeral_public_key {
        return Err(ChallengeRefusal::GatewayKey);
    }
    if t.challenge_nonce != envelope.nonce {
        return Err(ChallengeRefusal::Nonce);
    }
    if t.challenge_id != envelope.challenge_id {
        return Err(ChallengeRefusal::ChallengeId);
    }
    // The host alone allows for clock skew: it judges timestamps the gateway chose. Not issued
    // in this host's future, and (below) not expired in its past, each by more than the skew;
    // as the original desktop does, a host clock ahead of the gateway's is bounded by the
    // expiry alone (issued up to skew + TTL ago), not by the issue time as well.
    let skew = hp::HOST_CLOCK_SKEW_MS;
    if t.issued_at_ms > now_ms.saturating_add(skew) {
        return Err(ChallengeRefusal::IssuedAt);
    }
    if t.expires_at_ms <= t.issued_at_ms
        || t.expires_at_ms - t.issued_at_ms > hp::CHALLENGE_TTL_MS
        || t.expires_at_ms != envelope.expires_at_ms
    {
        return Err(ChallengeRefusal::Window);
    }
    if t.expires_at_ms.saturating_add(skew) <= now_ms {
        return Err(ChallengeRefusal::Expired);
    }
    if t.host_fingerprint != key.fingerprint() {
        return Err(ChallengeRefusal::Fingerprint);
    }
    if &t.host_public_key != key.public_key() {
        return Err(ChallengeRefusal::PublicKey);
    }
    Ok(hp::proof(&secret, transcript_bytes))
}
