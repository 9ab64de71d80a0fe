//! Fuzz target `challenge` (docs/fuzzing.md): the host answering `POST /v1/host/challenge`. Replies
//! are read with `ChallengeEnvelope::from_reply` and answered with `answer_challenge`. Never a
//! panic; a proof only for a genuine challenge sealed to this key, from the expected origin, inside
//! its window; then exactly the HMAC the gateway expects.

#[path = "../../../tests/fuzz/replay.rs"]
mod replay;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use orca_push_host::{ChallengeEnvelope, HostKey, answer_challenge};
use orca_push_host_proof as hp;
use proptest::prelude::*;
use replay::{Expect, config, seeds};
use serde_json::{Value, json};

const ROOT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../..");
const ORIGIN: &str = "https://push.onorca.dev";
/// The vector's host key (`tests/push-host-proof-vector.json`), which the corpus seeds are sealed to.
const VECTOR_SECRET: [u8; 32] = [7; 32];

/// Reads and answers a reply; whether a proof came out.
fn answer(key: &HostKey, origin: &str, reply: Value, now_ms: u64) -> Option<[u8; 32]> {
    let envelope = ChallengeEnvelope::from_reply(reply).ok()?;
    answer_challenge(key, origin, &envelope, now_ms).ok()
}

#[test]
fn the_challenge_corpus_replays_with_every_seed_as_promised() {
    let key = HostKey::from_secret(VECTOR_SECRET);
    for seed in seeds(ROOT, "challenge") {
        let case: Value = serde_json::from_slice(&seed.bytes)
            .unwrap_or_else(|e| panic!("{} is not JSON: {e}", seed.name));
        let origin = case["origin"].as_str().unwrap_or(ORIGIN);
        let now = case["nowMs"].as_u64().expect("nowMs");
        let answered = answer(&key, origin, case["reply"].clone(), now).is_some();
        match seed.expect {
            Expect::Accept => assert!(answered, "{} must be answered", seed.name),
            Expect::Refuse => assert!(!answered, "{} must be refused", seed.name),
            Expect::Either => {}
        }
    }
}

fn field(out: &mut Vec<u8>, name: &str, value: &[u8]) {
    out.extend_from_slice(&(name.len() as u32).to_be_bytes());
    out.extend_from_slice(name.as_bytes());
    out.extend_from_slice(&(value.len() as u32).to_be_bytes());
    out.extend_from_slice(value);
}

/// What a gateway (honest or not) seals, and how the envelope and the clock may disagree with it.
#[derive(Debug, Clone)]
struct Case {
    host_secret: [u8; 32],
    gateway_secret: [u8; 32],
    nonce: [u8; 24],
    secret: [u8; 32],
    challenge_id: String,
    origin: &'static str,
    protocol: &'static str,
    version: Vec<u8>,
    other_fingerprint: bool,
    other_public_key: bool,
    issued_at: u64,
    window_ms: u64,
    clock_offset_ms: i64,
    envelope: EnvelopeEdit,
}

#[derive(Debug, Clone)]
enum EnvelopeEdit {
    None,
    ChallengeId,
    ExpiresAt,
    Nonce(u8),
    GatewayKey(u8),
    Ciphertext(prop::sample::Index, u8),
    CiphertextTruncated(prop::sample::Index),
}

fn case() -> impl Strategy<Value = Case> {
    let edit = prop_oneof![
        6 => Just(EnvelopeEdit::None),
        1 => Just(EnvelopeEdit::ChallengeId),
        1 => Just(EnvelopeEdit::ExpiresAt),
        1 => (1u8..).prop_map(EnvelopeEdit::Nonce),
        1 => (1u8..).prop_map(EnvelopeEdit::GatewayKey),
        1 => (any::<prop::sample::Index>(), 1u8..).prop_map(|(i, m)| EnvelopeEdit::Ciphertext(i, m)),
        1 => any::<prop::sample::Index>().prop_map(EnvelopeEdit::CiphertextTruncated),
    ];
    let origin = prop::sample::select(vec![
        ORIGIN,
        ORIGIN,
        ORIGIN,
        "https://evil.example",
        "http://push.onorca.dev",
        "https://push.onorca.dev/",
        "https://PUSH.onorca.dev",
        "",
    ]);
    let protocol = prop::sample::select(vec![
        hp::PROTOCOL,
        hp::PROTOCOL,
        "orca-push-host-proof/v2",
        "",
    ]);
    let version = prop::sample::select(vec![
        vec![hp::VERSION],
        vec![hp::VERSION],
        vec![2],
        vec![],
        vec![1, 1],
    ]);
    (
        (
            any::<[u8; 32]>(),
            any::<[u8; 32]>(),
            any::<[u8; 24]>(),
            any::<[u8; 32]>(),
            ".{0,24}",
        ),
        (
            origin,
            protocol,
            version,
            prop::bool::weighted(0.1),
            prop::bool::weighted(0.1),
        ),
        (
            0u64..=u64::MAX / 2,
            prop_oneof![0u64..=12_000, Just(hp::CHALLENGE_TTL_MS), any::<u64>()],
            prop_oneof![
                -45_000i64..=45_000,
                Just(-30_000),
                Just(30_000),
                Just(40_000),
                any::<i64>()
            ],
        ),
        edit,
    )
        .prop_map(
            |(
                (host_secret, gateway_secret, nonce, secret, challenge_id),
                (origin, protocol, version, other_fingerprint, other_public_key),
                (issued_at, window_ms, clock_offset_ms),
                envelope,
            )| Case {
                host_secret,
                gateway_secret,
                nonce,
                secret,
                challenge_id,
                origin,
                protocol,
                version,
                other_fingerprint,
                other_public_key,
                issued_at,
                window_ms,
                clock_offset_ms,
                envelope,
            },
        )
}

/// The contract's rules, restated independently of the SDK.
fn genuine(c: &Case, now: u64, expires: u64) -> bool {
    let skew = hp::HOST_CLOCK_SKEW_MS as i128;
    let (now, issued, expires) = (now as i128, c.issued_at as i128, expires as i128);
    c.origin == ORIGIN
        && c.protocol == hp::PROTOCOL
        && c.version == [hp::VERSION]
        && !c.other_fingerprint
        && !c.other_public_key
        && matches!(c.envelope, EnvelopeEdit::None)
        && (1..=hp::CHALLENGE_TTL_MS as i128).contains(&(expires - issued))
        && issued - now <= skew
        && expires + skew > now
}

fn flip<const N: usize>(mut bytes: [u8; N], mask: u8) -> [u8; N] {
    bytes[0] ^= mask;
    bytes
}

proptest! {
    #![proptest_config(config(2_000))]

    #[test]
    fn only_a_genuine_challenge_is_answered_and_with_the_gateways_proof(c in case()) {
        let key = HostKey::from_secret(c.host_secret);
        let stranger = flip(*key.public_key(), 0x55);
        let gateway_public = hp::public_key(&c.gateway_secret);
        let expires = c.issued_at.saturating_add(c.window_ms);
        let now = c.issued_at.saturating_add_signed(c.clock_offset_ms);
        let fingerprint = if c.other_fingerprint { hp::host_fingerprint(&stranger) } else { key.fingerprint() };
        let mut transcript = Vec::new();
        field(&mut transcript, "protocol", c.protocol.as_bytes());
        field(&mut transcript, "version", &c.version);
        field(&mut transcript, "gatewayOrigin", c.origin.as_bytes());
        field(&mut transcript, "gatewayEphemeralPublicKey", &gateway_public);
        field(&mut transcript, "challengeNonce", &c.nonce);
        field(&mut transcript, "challengeId", c.challenge_id.as_bytes());
        field(&mut transcript, "issuedAt", &c.issued_at.to_be_bytes());
        field(&mut transcript, "expiresAt", &expires.to_be_bytes());
        field(&mut transcript, "hostFingerprint", fingerprint.as_bytes());
        field(&mut transcript, "hostPublicKey", if c.other_public_key { &stranger } else { key.public_key() });
        let plaintext = hp::challenge_plaintext(&transcript, &c.secret);
        let mut ciphertext = hp::seal(&plaintext, &c.nonce, key.public_key(), &c.gateway_secret);
        let (mut id, mut nonce, mut gateway_key, mut envelope_expires) =
            (c.challenge_id.clone(), c.nonce, gateway_public, expires);
        match &c.envelope {
            EnvelopeEdit::None => {}
            EnvelopeEdit::ChallengeId => id.push('x'),
            EnvelopeEdit::ExpiresAt => envelope_expires ^= 1,
            EnvelopeEdit::Nonce(m) => nonce = flip(nonce, *m),
            EnvelopeEdit::GatewayKey(m) => gateway_key = flip(gateway_key, *m),
            EnvelopeEdit::Ciphertext(i, m) => {
                let i = i.index(ciphertext.len());
                ciphertext[i] ^= m;
            }
            EnvelopeEdit::CiphertextTruncated(i) => ciphertext.truncate(i.index(ciphertext.len())),
        }
        let reply = json!({
            "challengeId": id,
            "gatewayEphemeralPublicKeyB64": STANDARD.encode(gateway_key),
            "nonceB64": STANDARD.encode(nonce),
            "ciphertextB64": STANDARD.encode(&ciphertext),
            "expiresAt": envelope_expires,
        });
        let answered = answer(&key, ORIGIN, reply, now);
        if genuine(&c, now, expires) {
            prop_assert_eq!(answered, Some(hp::proof(&c.secret, &transcript)));
        } else {
            prop_assert_eq!(answered, None);
        }
    }

    #[test]
    fn arbitrary_replies_never_panic_and_are_never_answered(
        fields in proptest::collection::vec(
            prop_oneof!["[A-Za-z0-9+/=_-]{0,80}".prop_map(Value::from), any::<u64>().prop_map(Value::from), Just(Value::Null)], 5),
        bytes in proptest::collection::vec(any::<u8>(), 0..300),
        now in any::<u64>(),
    ) {
        let key = HostKey::from_secret(VECTOR_SECRET);
        let keys = ["challengeId", "gatewayEphemeralPublicKeyB64", "nonceB64", "ciphertextB64", "expiresAt"];
        let mut reply: serde_json::Map<String, Value> = keys.iter().map(|k| k.to_string()).zip(fields).collect();
        // Half the time a well-formed envelope around random ciphertext, to reach the box.
        if bytes.len() % 2 == 0 {
            reply.insert("gatewayEphemeralPublicKeyB64".into(), STANDARD.encode([9u8; 32]).into());
            reply.insert("nonceB64".into(), STANDARD.encode([3u8; 24]).into());
            reply.insert("ciphertextB64".into(), STANDARD.encode(&bytes).into());
        }
        prop_assert_eq!(answer(&key, ORIGIN, Value::Object(reply), now), None);
    }
}
