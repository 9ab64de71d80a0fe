//! Fuzz targets `devices` and `host` (docs/fuzzing.md): a `POST /v1/devices` body through the
//! facade's `StrictJson` path and the registry's own reading and validation of the request, and the
//! two unauthenticated host bodies with their canonical base64. Never a panic; only
//! `invalid_request` as a refusal; valid bodies accepted; whatever is accepted within the contract.

#[path = "../../tests/fuzz/replay.rs"]
mod replay;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use orca_push::ApiError;
use orca_push::json::{decode_base64_exact, parse_body};
use orca_push::routes::devices::{RegisterBody, registration_request};
use orca_push::routes::host::{ChallengeBody, SessionBody};
use orca_push_registry::device::{AGENT_STATES, Platform, Registration, SOURCES};
use orca_push_registry::{RegistryError, registration_from_wire};
use proptest::prelude::*;
use replay::{Expect, config, seeds};
use serde_json::{Value, json};

const ROOT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/..");
const FINGERPRINT: &str = "D20lU_8MD0R64gLt";

/// Whether the pair facade + registry accepts the body; any refusal must be `invalid_request`.
fn register(bytes: &[u8]) -> Result<Option<Registration>, TestCaseError> {
    let body = match parse_body::<RegisterBody>(bytes) {
        Err(error) => {
            prop_assert_eq!(error, ApiError::InvalidRequest);
            return Ok(None);
        }
        Ok(body) => body,
    };
    let checked = registration_from_wire(registration_request(body, FINGERPRINT.to_owned()))
        .and_then(|r| r.validate().map(|()| r));
    match checked {
        Ok(registration) => Ok(Some(registration)),
        Err(RegistryError::InvalidRequest(_)) => Ok(None),
        Err(other) => Err(TestCaseError::fail(format!("refused as {other:?}"))),
    }
}

fn check(bytes: &[u8]) -> Result<bool, TestCaseError> {
    let Some(r) = register(bytes)? else {
        return Ok(false);
    };
    let id_units = r.device_id.encode_utf16().count();
    prop_assert!((1..=128).contains(&id_units) && !r.device_id.contains('\0'));
    let t = r.token.as_bytes();
    match r.platform {
        Platform::Ios => {
            prop_assert!(r.apns_environment.is_some());
            prop_assert!((2..=4096).contains(&t.len()) && t.len().is_multiple_of(2));
            prop_assert!(t.iter().all(u8::is_ascii_hexdigit));
        }
        Platform::Android => {
            prop_assert!(r.apns_environment.is_none());
            prop_assert!((32..=4096).contains(&t.len()));
            let fcm = |b: &u8| b.is_ascii_alphanumeric() || b"_:.-".contains(b);
            prop_assert!(t.iter().all(fcm));
        }
    }
    if let Some(f) = &r.filter {
        for (values, allowed) in [
            (&f.sources, &SOURCES[..]),
            (&f.agent_states, &AGENT_STATES[..]),
        ] {
            for (i, v) in values.iter().enumerate() {
                prop_assert!(allowed.contains(&v.as_str()) && !values[..i].contains(v));
            }
        }
    }
    Ok(true)
}

fn host_body(bytes: &[u8]) -> Result<bool, TestCaseError> {
    // Either body shape: each field set is distinct, so at most one of them parses.
    let key = parse_body::<ChallengeBody>(bytes)
        .map(|b| b.host_public_key_b64)
        .or_else(|_| parse_body::<SessionBody>(bytes).map(|b| b.proof_b64));
    let text = match key {
        Err(error) => {
            prop_assert_eq!(error, ApiError::InvalidRequest);
            return Ok(false);
        }
        Ok(text) => text,
    };
    canonical_32(&text)
}

/// `decode_base64_exact::<32>`: a refusal is `invalid_request`, an acceptance canonical.
fn canonical_32(text: &str) -> Result<bool, TestCaseError> {
    match decode_base64_exact::<32>(text) {
        Err(error) => {
            prop_assert_eq!(error, ApiError::InvalidRequest);
            Ok(false)
        }
        Ok(bytes) => {
            prop_assert_eq!(STANDARD.encode(bytes), text);
            Ok(true)
        }
    }
}

fn replay(target: &str, check: fn(&[u8]) -> Result<bool, TestCaseError>) {
    for seed in seeds(ROOT, target) {
        let accepted = check(&seed.bytes).unwrap_or_else(|e| panic!("{}: {e}", seed.name));
        match seed.expect {
            Expect::Accept => assert!(accepted, "{} must be accepted", seed.name),
            Expect::Refuse => assert!(!accepted, "{} must be refused", seed.name),
            Expect::Either => {}
        }
    }
}

#[test]
fn the_devices_corpus_replays_with_every_seed_as_promised() {
    replay("devices", check);
}

#[test]
fn the_host_corpus_replays_with_every_seed_as_promised() {
    replay("host", host_body);
}

fn subset(all: &'static [&'static str]) -> impl Strategy<Value = Vec<&'static str>> {
    prop::sample::subsequence(all.to_vec(), 0..=all.len()).prop_shuffle()
}

/// Any char but NUL, which becomes a space: a filter would reject too often over a long run
/// (proptest stops after 65,536 local rejects).
fn not_nul() -> impl Strategy<Value = char> {
    any::<char>().prop_map(|c| if c == '\0' { ' ' } else { c })
}

/// A registration the contract accepts.
fn valid_body() -> impl Strategy<Value = Value> {
    let device_id = proptest::collection::vec(not_nul(), 1..=64)
        .prop_map(|c| c.into_iter().collect::<String>());
    let ios = (
        proptest::collection::vec(any::<u8>(), 1..=200),
        any::<bool>(),
        any::<bool>(),
    )
        .prop_map(|(token, upper, production)| {
            let hex: String = token.iter().map(|b| format!("{b:02x}")).collect();
            let token = if upper { hex.to_uppercase() } else { hex };
            let env = if production { "production" } else { "sandbox" };
            json!({ "platform": "ios", "token": token, "apnsEnvironment": env })
        });
    let android =
        proptest::collection::vec(prop::sample::select(b"abcXYZ019_:.-".to_vec()), 32..=300)
            .prop_map(|t| json!({ "platform": "android", "token": String::from_utf8_lossy(&t) }));
    let filter = proptest::option::of((subset(&SOURCES), subset(&AGENT_STATES)));
    (device_id, prop_oneof![ios, android], filter).prop_map(|(id, mut platform, filter)| {
        platform["v"] = json!(1);
        platform["deviceId"] = json!(id);
        if let Some((sources, agent_states)) = filter {
            platform["filter"] = json!({ "sources": sources, "agentStates": agent_states });
        }
        platform
    })
}

fn hostile_value() -> impl Strategy<Value = Value> {
    prop_oneof![
        prop::sample::select(vec![
            json!(null),
            json!(2),
            json!(-1),
            json!(1e308),
            json!(""),
            json!("\u{0}"),
            json!("ios"),
            json!("android"),
            json!("sandbox"),
            json!("production"),
            json!("ab"),
            json!("abc"),
            json!("x".repeat(31)),
            json!("x".repeat(32)),
            json!("a".repeat(4096)),
            json!("a".repeat(4097)),
            json!("r".repeat(128)),
            json!("r".repeat(129)),
            json!("😀".repeat(64)),
            json!("😀".repeat(65)),
            json!([]),
            json!({}),
            json!({ "sources": ["plugin", "plugin"], "agentStates": [] }),
            json!({ "sources": ["email"], "agentStates": [] }),
            json!({ "sources": [], "agentStates": [], "extra": 1 }),
        ]),
        "[ -~]{0,40}".prop_map(Value::from),
    ]
}

const KEYS: [&str; 7] = [
    "v",
    "deviceId",
    "platform",
    "token",
    "apnsEnvironment",
    "filter",
    "extra",
];

proptest! {
    #![proptest_config(config(2_000))]

    #[test]
    fn arbitrary_device_bytes_are_refused_or_within_the_contract(bytes in proptest::collection::vec(any::<u8>(), 0..400)) {
        check(&bytes)?;
    }

    #[test]
    fn valid_device_bodies_are_accepted(body in valid_body()) {
        prop_assert!(check(&serde_json::to_vec(&body).map_err(|e| TestCaseError::fail(e.to_string()))?)?);
    }

    #[test]
    fn mutated_device_bodies_are_refused_or_within_the_contract(
        mut body in valid_body(),
        edits in proptest::collection::vec((0..KEYS.len(), proptest::option::weighted(0.8, hostile_value())), 1..4),
        splice in proptest::option::of((any::<prop::sample::Index>(), prop::sample::select(vec!["\\u0000", "\\ud800", "\u{0}", "\""]))),
    ) {
        for (key, value) in edits {
            if let Some(map) = body.as_object_mut() {
                match value {
                    Some(value) => drop(map.insert(KEYS[key].to_owned(), value)),
                    None => drop(map.remove(KEYS[key])),
                }
            }
        }
        let mut bytes = serde_json::to_vec(&body).map_err(|e| TestCaseError::fail(e.to_string()))?;
        if let Some((at, text)) = splice {
            let at = at.index(bytes.len() + 1);
            bytes.splice(at..at, text.bytes());
        }
        check(&bytes)?;
    }

    #[test]
    fn host_bodies_take_only_canonical_base64_of_32_bytes(
        key in proptest::collection::vec(any::<u8>(), 0..40),
        edit in proptest::option::of((any::<prop::sample::Index>(), prop::sample::select(b"=A/+_-\n \0".to_vec()))),
        session in any::<bool>(),
    ) {
        let mut text = STANDARD.encode(&key).into_bytes();
        if let Some((at, byte)) = edit {
            let at = at.index(text.len() + 1);
            text.insert(at, byte);
        }
        let text = String::from_utf8_lossy(&text).into_owned();
        let body = if session {
            json!({ "v": 1, "challengeId": "c", "proofB64": text })
        } else {
            json!({ "v": 1, "hostPublicKeyB64": text })
        };
        let accepted = host_body(&serde_json::to_vec(&body).map_err(|e| TestCaseError::fail(e.to_string()))?)?;
        if edit.is_none() {
            prop_assert_eq!(accepted, key.len() == 32);
        }
    }
}
