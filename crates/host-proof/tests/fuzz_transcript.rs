//! Fuzz targets `transcript` and `plaintext` (docs/fuzzing.md): the parsers a host runs on bytes
//! the gateway (or anyone on the path) chose. Never a panic; whatever parses re-encodes to the very
//! same bytes, so no two byte strings read as one transcript; a box with any byte changed never
//! opens.

#[path = "../../../tests/fuzz/replay.rs"]
mod replay;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use orca_push_host_proof as hp;
use proptest::prelude::*;
use replay::{Expect, config, seeds};

const ROOT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../..");

/// Decodes; when it parses with the canonical protocol and version, re-encoding gives `bytes` back.
fn check_transcript(bytes: &[u8]) -> Result<bool, TestCaseError> {
    let Ok(decoded) = hp::Transcript::decode(bytes) else {
        return Ok(false);
    };
    if decoded.protocol == hp::PROTOCOL.as_bytes() && decoded.version == [hp::VERSION] {
        prop_assert_eq!(decoded.transcript.encode(), bytes);
    }
    Ok(true)
}

/// Splits; when it parses, rebuilding the plaintext gives `bytes` back.
fn check_plaintext(bytes: &[u8]) -> Result<bool, TestCaseError> {
    let Ok((transcript, secret)) = hp::parse_challenge_plaintext(bytes) else {
        return Ok(false);
    };
    prop_assert_eq!(hp::challenge_plaintext(transcript, &secret), bytes);
    Ok(true)
}

fn replay(target: &str, check: fn(&[u8]) -> Result<bool, TestCaseError>) {
    for seed in seeds(ROOT, target) {
        let text: String = String::from_utf8_lossy(&seed.bytes)
            .split_whitespace()
            .collect();
        let bytes = STANDARD
            .decode(text)
            .unwrap_or_else(|e| panic!("{} is not base64: {e}", seed.name));
        let accepted = check(&bytes).unwrap_or_else(|e| panic!("{}: {e}", seed.name));
        match seed.expect {
            Expect::Accept => assert!(accepted, "{} must parse", seed.name),
            Expect::Refuse => assert!(!accepted, "{} must be refused", seed.name),
            Expect::Either => {}
        }
    }
}

#[test]
fn the_transcript_corpus_replays_with_every_seed_as_promised() {
    replay("transcript", check_transcript);
}

#[test]
fn the_plaintext_corpus_replays_with_every_seed_as_promised() {
    replay("plaintext", check_plaintext);
}

fn transcript() -> impl Strategy<Value = hp::Transcript> {
    (
        (".{0,40}", any::<[u8; 32]>(), any::<[u8; 24]>(), ".{0,40}"),
        (any::<u64>(), any::<u64>(), ".{0,20}", any::<[u8; 32]>()),
    )
        .prop_map(
            |((origin, gateway_key, nonce, id), (issued, expires, fingerprint, host_key))| {
                hp::Transcript {
                    gateway_origin: origin,
                    gateway_ephemeral_public_key: gateway_key,
                    challenge_nonce: nonce,
                    challenge_id: id,
                    issued_at_ms: issued,
                    expires_at_ms: expires,
                    host_fingerprint: fingerprint,
                    host_public_key: host_key,
                }
            },
        )
}

/// One edit of a byte string: flip bits of a byte, drop a byte, insert one, or cut the tail.
#[derive(Debug, Clone)]
enum Edit {
    Flip(prop::sample::Index, u8),
    Remove(prop::sample::Index),
    Insert(prop::sample::Index, u8),
    Truncate(prop::sample::Index),
}

fn edit() -> impl Strategy<Value = Edit> {
    prop_oneof![
        (any::<prop::sample::Index>(), 1u8..).prop_map(|(i, m)| Edit::Flip(i, m)),
        any::<prop::sample::Index>().prop_map(Edit::Remove),
        (any::<prop::sample::Index>(), any::<u8>()).prop_map(|(i, b)| Edit::Insert(i, b)),
        any::<prop::sample::Index>().prop_map(Edit::Truncate),
    ]
}

/// Applies `edit`; the result always differs from `bytes` (a no-op insert cannot happen: the
/// string grows).
fn apply(bytes: &[u8], edit: &Edit) -> Vec<u8> {
    let mut out = bytes.to_vec();
    match edit {
        Edit::Flip(i, mask) if !out.is_empty() => out[i.index(bytes.len())] ^= mask,
        Edit::Remove(i) if !out.is_empty() => drop(out.remove(i.index(bytes.len()))),
        Edit::Truncate(i) if !out.is_empty() => out.truncate(i.index(bytes.len())),
        Edit::Insert(i, b) => out.insert(i.index(bytes.len() + 1), *b),
        _ => out.push(0),
    }
    out
}

proptest! {
    #![proptest_config(config(5_000))]

    #[test]
    fn arbitrary_bytes_never_panic_the_transcript_decoder_and_round_trip(
        bytes in proptest::collection::vec(any::<u8>(), 0..400),
    ) {
        check_transcript(&bytes)?;
    }

    #[test]
    fn every_transcript_round_trips_and_an_edited_one_never_reads_the_same(
        t in transcript(),
        edit in edit(),
    ) {
        let bytes = t.encode();
        let decoded = hp::Transcript::decode(&bytes).map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert_eq!(&decoded.transcript, &t);
        let edited = apply(&bytes, &edit);
        if let Ok(other) = hp::Transcript::decode(&edited) {
            prop_assert!(other.transcript != t || other.protocol != hp::PROTOCOL.as_bytes()
                || other.version != [hp::VERSION], "an edited transcript read as the original");
        }
        check_transcript(&edited)?;
    }

    #[test]
    fn arbitrary_plaintexts_never_panic_and_round_trip(
        transcript in proptest::collection::vec(any::<u8>(), 0..300),
        secret in any::<[u8; 32]>(),
        edit in proptest::option::of(edit()),
    ) {
        let plaintext = hp::challenge_plaintext(&transcript, &secret);
        let (t, s) = hp::parse_challenge_plaintext(&plaintext).map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert_eq!((t, s), (&transcript[..], secret));
        if let Some(edit) = edit {
            check_plaintext(&apply(&plaintext, &edit))?;
        }
    }

}

proptest! {
    // X25519 and XSalsa20-Poly1305 are slow unoptimised: fewer cases keep the default run short.
    #![proptest_config(config(300))]

    #[test]
    fn a_sealed_challenge_opens_only_unedited_and_with_the_right_keys(
        plaintext in proptest::collection::vec(any::<u8>(), 0..300),
        (host_secret, gateway_secret, nonce) in (any::<[u8; 32]>(), any::<[u8; 32]>(), any::<[u8; 24]>()),
        edit in edit(),
        stranger in any::<[u8; 32]>(),
    ) {
        let host_public = hp::public_key(&host_secret);
        let gateway_public = hp::public_key(&gateway_secret);
        let sealed = hp::seal(&plaintext, &nonce, &host_public, &gateway_secret);
        let opened = hp::open(&sealed, &nonce, &gateway_public, &host_secret);
        prop_assert_eq!(opened.as_deref(), Ok(&plaintext[..]));
        let edited = apply(&sealed, &edit);
        prop_assert_eq!(hp::open(&edited, &nonce, &gateway_public, &host_secret), Err(hp::FormatError::BoxOpen));
        if hp::public_key(&stranger) != host_public {
            prop_assert_eq!(hp::open(&sealed, &nonce, &gateway_public, &stranger), Err(hp::FormatError::BoxOpen));
        }
    }
}
