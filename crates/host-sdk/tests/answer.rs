//! The host side of the original implementation's vector, and every transcript check.

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use orca_push_host::{ChallengeEnvelope, ChallengeRefusal, HostKey, answer_challenge};
use orca_push_host_proof as hp;

const EXPECTED_PROOF: &str = "2Nh9zDL6YwmjYRFXcaAxYXA4tChm37/XZNR3ilucdsQ=";
const ORIGIN: &str = "https://push.onorca.dev";

fn vector() -> (HostKey, ChallengeEnvelope, u64) {
    let json: serde_json::Value =
        serde_json::from_str(include_str!("push-host-proof-vector.json")).unwrap();
    let b = |v: &serde_json::Value| STANDARD.decode(v.as_str().unwrap()).unwrap();
    let key = HostKey::from_secret(b(&json["hostSecretKeyB64"]).try_into().unwrap());
    let c = &json["challenge"];
    let envelope = ChallengeEnvelope {
        challenge_id: c["challengeId"].as_str().unwrap().to_owned(),
        gateway_ephemeral_public_key: b(&c["gatewayEphemeralPublicKeyB64"]).try_into().unwrap(),
        nonce: b(&c["nonceB64"]).try_into().unwrap(),
        ciphertext: b(&c["ciphertextB64"]),
        expires_at_ms: c["expiresAt"].as_u64().unwrap(),
    };
    (key, envelope, json["issuedAt"].as_u64().unwrap())
}

#[test]
fn sdk_answers_the_vector_challenge_with_the_expected_proof() {
    let (key, envelope, issued_at) = vector();
    assert_eq!(key.fingerprint(), "D20lU_8MD0R64gLt");
    let proof = answer_challenge(&key, ORIGIN, &envelope, issued_at + 1000).expect("answers");
    assert_eq!(STANDARD.encode(proof), EXPECTED_PROOF);
}

#[test]
fn sdk_allows_thirty_seconds_of_skew_and_no_more() {
    let (key, envelope, issued_at) = vector();
    // A host clock behind the gateway's: issued at most 30 s in the host's future.
    assert!(answer_challenge(&key, ORIGIN, &envelope, issued_at - 30_000).is_ok());
    assert_eq!(
        answer_challenge(&key, ORIGIN, &envelope, issued_at - 30_001),
        Err(ChallengeRefusal::IssuedAt)
    );
    // A host clock ahead: expired at most 30 s in the host's past, as the original desktop
    // judges it (issued up to 40 s before the host's now).
    let expires_at = envelope.expires_at_ms;
    assert!(expires_at > issued_at);
    assert!(answer_challenge(&key, ORIGIN, &envelope, expires_at + 29_999).is_ok());
    assert_eq!(
        answer_challenge(&key, ORIGIN, &envelope, expires_at + 30_000),
        Err(ChallengeRefusal::Expired)
    );
}

#[test]
fn sdk_refuses_a_challenge_from_another_origin() {
    let (key, envelope, issued_at) = vector();
    let refusal =
        answer_challenge(&key, "https://evil.example", &envelope, issued_at + 1000).unwrap_err();
    assert!(
        matches!(refusal, ChallengeRefusal::Origin { .. }),
        "{refusal:?}"
    );
}

#[test]
fn sdk_refuses_an_envelope_that_disagrees_with_the_transcript() {
    let (key, envelope, now) = vector();
    let now = now + 1000;
    let mut e = envelope.clone();
    e.challenge_id = "vector-challenge-2".into();
    assert_eq!(
        answer_challenge(&key, ORIGIN, &e, now),
        Err(ChallengeRefusal::ChallengeId)
    );
    let mut e = envelope.clone();
    e.expires_at_ms += 1;
    assert_eq!(
        answer_challenge(&key, ORIGIN, &e, now),
        Err(ChallengeRefusal::Window)
    );
    let mut e = envelope.clone();
    e.ciphertext[20] ^= 1;
    assert_eq!(
        answer_challenge(&key, ORIGIN, &e, now),
        Err(ChallengeRefusal::BoxDoesNotOpen)
    );
    let other = HostKey::from_secret([8u8; 32]);
    assert_eq!(
        answer_challenge(&other, ORIGIN, &envelope, now),
        Err(ChallengeRefusal::BoxDoesNotOpen)
    );
}

/// Seals a transcript the way a (possibly hostile) gateway would, to exercise each field check.
fn sealed(key: &HostKey, mutate: impl FnOnce(&mut hp::Transcript)) -> (ChallengeEnvelope, u64) {
    let gateway_secret = [9u8; 32];
    let nonce = [3u8; 24];
    let now = 1_800_000_000_000;
    let mut t = hp::Transcript {
        gateway_origin: ORIGIN.into(),
        gateway_ephemeral_public_key: hp::public_key(&gateway_secret),
        challenge_nonce: nonce,
        challenge_id: "c1".into(),
        issued_at_ms: now,
        expires_at_ms: now + 10_000,
        host_fingerprint: key.fingerprint(),
        host_public_key: *key.public_key(),
    };
    mutate(&mut t);
    let plaintext = hp::challenge_plaintext(&t.encode(), &[5u8; 32]);
    let envelope = ChallengeEnvelope {
        challenge_id: "c1".into(),
        gateway_ephemeral_public_key: hp::public_key(&gateway_secret),
        nonce,
        ciphertext: hp::seal(&plaintext, &nonce, key.public_key(), &gateway_secret),
        expires_at_ms: t.expires_at_ms,
    };
    (envelope, now)
}

#[test]
fn sdk_checks_every_transcript_field() {
    let key = HostKey::from_secret([7u8; 32]);
    let (ok, now) = sealed(&key, |_| {});
    assert!(answer_challenge(&key, ORIGIN, &ok, now).is_ok());
    type Mutation = Box<dyn FnOnce(&mut hp::Transcript)>;
    let cases: Vec<(ChallengeRefusal, Mutation)> = vec![
        (
            ChallengeRefusal::GatewayKey,
            Box::new(|t| t.gateway_ephemeral_public_key[0] ^= 1),
        ),
        (
            ChallengeRefusal::Nonce,
            Box::new(|t| t.challenge_nonce[0] ^= 1),
        ),
        (
            ChallengeRefusal::ChallengeId,
            Box::new(|t| t.challenge_id = "c2".into()),
        ),
        (
            ChallengeRefusal::Window,
            Box::new(|t| t.expires_at_ms = t.issued_at_ms + 10_001),
        ),
        (
            ChallengeRefusal::Fingerprint,
            Box::new(|t| t.host_fingerprint = "AAAAAAAAAAAAAAAA".into()),
        ),
        (
            ChallengeRefusal::PublicKey,
            Box::new(|t| t.host_public_key[0] ^= 1),
        ),
    ];
    for (expected, mutate) in cases {
        let (envelope, now) = sealed(&key, mutate);
        let mut envelope = envelope;
        // Keep the envelope's own expiry consistent so only the mutated field is judged.
        envelope.expires_at_ms = if expected == ChallengeRefusal::Window {
            envelope.expires_at_ms
        } else {
            now + 10_000
        };
        assert_eq!(
            answer_challenge(&key, ORIGIN, &envelope, now),
            Err(expected)
        );
    }
    let (stale, now) = sealed(&key, |_| {});
    assert_eq!(
        answer_challenge(&key, ORIGIN, &stale, now + 40_000),
        Err(ChallengeRefusal::Expired)
    );
}

#[test]
fn key_file_is_owner_only_and_never_overwritten() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("host.key");
    let key = HostKey::generate();
    key.save_new(&path).unwrap();
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt as _;
        assert_eq!(
            std::fs::metadata(&path).unwrap().permissions().mode() & 0o777,
            0o600
        );
    }
    assert_eq!(
        HostKey::load(&path).unwrap().fingerprint(),
        key.fingerprint()
    );
    assert!(matches!(
        HostKey::generate().save_new(&path),
        Err(orca_push_host::KeyError::Exists(_))
    ));
    let debug = format!("{key:?}");
    // At most the first 4 characters of the fingerprint, as logs may show it.
    assert!(debug.contains(&key.fingerprint()[..4]), "{debug}");
    assert!(!debug.contains(&key.fingerprint()), "{debug}");
    let secret_b64 = std::fs::read_to_string(&path).unwrap();
    let secret_b64: serde_json::Value = serde_json::from_str(&secret_b64).unwrap();
    assert!(!debug.contains(secret_b64["secretKeyB64"].as_str().unwrap()));
}

#[test]
fn origin_is_the_bare_scheme_host_port() {
    assert_eq!(
        orca_push_host::origin_of("https://push.onorca.dev/").unwrap(),
        ORIGIN
    );
    assert_eq!(
        orca_push_host::origin_of("https://push.onorca.dev:443").unwrap(),
        ORIGIN
    );
    assert_eq!(
        orca_push_host::origin_of("http://127.0.0.1:8080/x").unwrap(),
        "http://127.0.0.1:8080"
    );
    assert!(orca_push_host::origin_of("ftp://x").is_err());
}
