//! Replays the original implementation's host-proof vector: our transcript builder, sealing and proof
//! must reproduce its bytes exactly.

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use orca_push_host_proof as hp;

struct Vector {
    host_secret: [u8; 32],
    host_public: [u8; 32],
    fingerprint: String,
    origin: String,
    challenge_id: String,
    gateway_public: [u8; 32],
    nonce: [u8; 24],
    ciphertext: Vec<u8>,
    expires_at: u64,
    issued_at: u64,
    secret: [u8; 32],
    transcript: Vec<u8>,
}

fn b64(v: &serde_json::Value) -> Vec<u8> {
    STANDARD
        .decode(v.as_str().expect("string"))
        .expect("base64")
}

fn vector() -> Vector {
    let json: serde_json::Value =
        serde_json::from_str(include_str!("push-host-proof-vector.json")).expect("vector json");
    let c = &json["challenge"];
    Vector {
        host_secret: b64(&json["hostSecretKeyB64"]).try_into().unwrap(),
        host_public: b64(&json["hostPublicKeyB64"]).try_into().unwrap(),
        fingerprint: json["hostFingerprint"].as_str().unwrap().to_owned(),
        origin: json["gatewayOrigin"].as_str().unwrap().to_owned(),
        challenge_id: c["challengeId"].as_str().unwrap().to_owned(),
        gateway_public: b64(&c["gatewayEphemeralPublicKeyB64"]).try_into().unwrap(),
        nonce: b64(&c["nonceB64"]).try_into().unwrap(),
        ciphertext: b64(&c["ciphertextB64"]),
        expires_at: c["expiresAt"].as_u64().unwrap(),
        issued_at: json["issuedAt"].as_u64().unwrap(),
        secret: b64(&json["challengeSecretB64"]).try_into().unwrap(),
        transcript: b64(&json["transcriptB64"]),
    }
}

const EXPECTED_PROOF: &str = "2Nh9zDL6YwmjYRFXcaAxYXA4tChm37/XZNR3ilucdsQ=";

#[test]
fn fingerprint_and_public_key_match_the_vector() {
    let v = vector();
    assert_eq!(hp::public_key(&v.host_secret), v.host_public);
    assert_eq!(hp::host_fingerprint(&v.host_public), v.fingerprint);
    assert_eq!(hp::public_key(&[9u8; 32]), v.gateway_public);
}

#[test]
fn gateway_transcript_builder_reproduces_the_vector_byte_for_byte() {
    let v = vector();
    let transcript = hp::Transcript {
        gateway_origin: v.origin.clone(),
        gateway_ephemeral_public_key: v.gateway_public,
        challenge_nonce: v.nonce,
        challenge_id: v.challenge_id.clone(),
        issued_at_ms: v.issued_at,
        expires_at_ms: v.expires_at,
        host_fingerprint: v.fingerprint.clone(),
        host_public_key: v.host_public,
    };
    let encoded = transcript.encode();
    assert_eq!(encoded.len(), 388);
    assert_eq!(encoded, v.transcript);
    assert_eq!(v.expires_at, v.issued_at + hp::CHALLENGE_TTL_MS);

    // Sealing the plaintext with the gateway's ephemeral secret and the nonce gives the same box.
    let plaintext = hp::challenge_plaintext(&encoded, &v.secret);
    let sealed = hp::seal(&plaintext, &v.nonce, &v.host_public, &[9u8; 32]);
    assert_eq!(sealed, v.ciphertext);
    assert_eq!(
        STANDARD.encode(hp::proof(&v.secret, &encoded)),
        EXPECTED_PROOF
    );
}

#[test]
fn host_side_opens_the_vector_box_and_computes_its_proof() {
    let v = vector();
    let plaintext =
        hp::open(&v.ciphertext, &v.nonce, &v.gateway_public, &v.host_secret).expect("box opens");
    let (transcript, secret) = hp::parse_challenge_plaintext(&plaintext).expect("plaintext");
    assert_eq!(transcript, v.transcript.as_slice());
    assert_eq!(secret, v.secret);
    let decoded = hp::Transcript::decode(transcript).expect("transcript decodes");
    assert_eq!(decoded.protocol, hp::PROTOCOL.as_bytes());
    assert_eq!(decoded.version, vec![hp::VERSION]);
    assert_eq!(decoded.transcript.challenge_id, v.challenge_id);
    assert_eq!(decoded.transcript.encode(), v.transcript);
    assert_eq!(
        STANDARD.encode(hp::proof(&secret, transcript)),
        EXPECTED_PROOF
    );
}

#[test]
fn decode_refuses_reordered_truncated_or_padded_transcripts() {
    let v = vector();
    assert!(matches!(
        hp::Transcript::decode(&v.transcript[..v.transcript.len() - 1]),
        Err(hp::FormatError::Truncated(_))
    ));
    let mut padded = v.transcript.clone();
    padded.push(0);
    assert_eq!(
        hp::Transcript::decode(&padded),
        Err(hp::FormatError::Trailing)
    );
    let mut renamed = v.transcript.clone();
    renamed[4] = b'P'; // "protocol" -> "Protocol"
    assert!(matches!(
        hp::Transcript::decode(&renamed),
        Err(hp::FormatError::FieldName { index: 0, .. })
    ));
    let wrong_key = hp::open(&v.ciphertext, &v.nonce, &v.gateway_public, &[8u8; 32]);
    assert_eq!(wrong_key, Err(hp::FormatError::BoxOpen));
}
