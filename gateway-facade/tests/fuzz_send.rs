//! Fuzz target `send` (docs/fuzzing.md): the bytes of a `POST /v1/send` body through the
//! `StrictJson` path and the contract's checks. Never a panic; only `invalid_request` as a refusal;
//! every valid body accepted; whatever is accepted within the contract's limits.

#[path = "../../tests/fuzz/replay.rs"]
mod replay;

use orca_push::ApiError;
use orca_push::json::parse_body;
use orca_push::routes::send::{
    MAX_NOTIFICATION_BYTES, MAX_REGISTRATION_IDS, SendBody, SendRequest, parse_send,
};
use proptest::prelude::*;
use replay::{Expect, config, seeds};
use serde_json::{Value, json};

const ROOT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/..");

fn run(bytes: &[u8]) -> Result<SendRequest, ApiError> {
    parse_body::<SendBody>(bytes).and_then(parse_send)
}

fn utf16(s: &str) -> usize {
    s.encode_utf16().count()
}

/// The oracle: a refusal is `invalid_request`; an accepted body is within every limit.
fn check(bytes: &[u8]) -> Result<bool, TestCaseError> {
    let request = match run(bytes) {
        Err(error) => {
            prop_assert_eq!(error, ApiError::InvalidRequest);
            return Ok(false);
        }
        Ok(request) => request,
    };
    let raw: Value =
        serde_json::from_slice(bytes).map_err(|e| TestCaseError::fail(e.to_string()))?;
    let sent_ids = raw["registrationIds"].as_array().map_or(0, Vec::len);
    prop_assert!((1..=MAX_REGISTRATION_IDS).contains(&sent_ids));
    prop_assert!(request.registration_ids.len() <= sent_ids);
    for (i, id) in request.registration_ids.iter().enumerate() {
        prop_assert!((1..=128).contains(&utf16(id)) && !id.contains('\0'));
        prop_assert!(
            !request.registration_ids[..i].contains(id),
            "ids are distinct"
        );
    }
    let size = serde_json::to_vec(&raw["notification"]).map_or(usize::MAX, |v| v.len());
    prop_assert!(
        size <= MAX_NOTIFICATION_BYTES,
        "notification of {size} bytes"
    );
    let n = &request.notification;
    prop_assert!((1..=80).contains(&utf16(&n.title)), "title");
    prop_assert!(utf16(&n.body) <= 180, "body");
    prop_assert!((1..=128).contains(&utf16(&n.notification_epoch)));
    prop_assert!(n.notification_seq < 1 << 53);
    if let Some(id) = &n.notification_id {
        prop_assert!((1..=2048).contains(&id.len()));
        prop_assert!(id.bytes().all(|b| (0x20..=0x7e).contains(&b)));
    }
    prop_assert!(n.worktree_id.as_deref().is_none_or(|w| utf16(w) <= 2048));
    let texts = [&n.title, &n.body, &n.notification_epoch, &n.source];
    prop_assert!(texts.iter().all(|t| !t.contains('\0')), "no NUL");
    prop_assert!(n.worktree_id.as_deref().is_none_or(|w| !w.contains('\0')));
    prop_assert!(["agent-task-complete", "terminal-bell", "plugin"].contains(&n.source.as_str()));
    Ok(true)
}

#[test]
fn the_send_corpus_replays_with_every_seed_as_promised() {
    for seed in seeds(ROOT, "send") {
        let accepted = check(&seed.bytes).unwrap_or_else(|e| panic!("{}: {e}", seed.name));
        match seed.expect {
            Expect::Accept => assert!(accepted, "{} must be accepted", seed.name),
            Expect::Refuse => assert!(!accepted, "{} must be refused", seed.name),
            Expect::Either => {}
        }
    }
}

/// Any char but NUL, which becomes a space: a filter would reject too often over a long run
/// (proptest stops after 65,536 local rejects).
fn not_nul() -> impl Strategy<Value = char> {
    any::<char>().prop_map(|c| if c == '\0' { ' ' } else { c })
}

/// Text without NUL, at most `max` chars (so at most `2 * max` UTF-16 units).
fn text(min: usize, max: usize) -> impl Strategy<Value = String> {
    proptest::collection::vec(not_nul(), min..=max).prop_map(|chars| chars.into_iter().collect())
}

fn ascii_id(max: usize) -> impl Strategy<Value = String> {
    proptest::collection::vec(0x20u8..=0x7e, 1..=max)
        .prop_map(|b| b.into_iter().map(char::from).collect())
}

/// A body the contract accepts, unless its notification JSON exceeds 3000 bytes.
fn valid_body() -> impl Strategy<Value = Value> {
    let notification = (
        proptest::option::of(ascii_id(64)),
        0u64..(1 << 53),
        text(1, 64),
        prop::sample::select(vec!["agent-task-complete", "terminal-bell", "plugin"]),
        prop::sample::select(vec![json!(null), json!("needs-input"), json!("finished")]),
        (text(1, 40), text(0, 90)),
        proptest::option::of(text(0, 200)),
        prop::sample::select(vec![None, Some("alert"), Some("dismiss")]),
        (
            proptest::option::of(any::<i64>()),
            proptest::option::of(any::<bool>()),
        ),
    )
        .prop_map(
            |(id, seq, epoch, source, state, (title, body), wt, kind, (exp, sound))| {
                let mut n = json!({
                    "notificationSeq": seq, "notificationEpoch": epoch, "source": source,
                    "agentState": state, "title": title, "body": body,
                });
                // A dismissal names the event it dismisses.
                let id = id.or_else(|| (kind == Some("dismiss")).then(|| "n-1".to_owned()));
                let optional = [
                    ("notificationId", id.map(Value::from)),
                    ("worktreeId", wt.map(Value::from)),
                    ("kind", kind.map(Value::from)),
                    ("expiresAt", exp.map(Value::from)),
                    ("sound", sound.map(Value::from)),
                ];
                for (key, value) in optional {
                    if let Some(value) = value {
                        n[key] = value;
                    }
                }
                n
            },
        );
    let ids = proptest::collection::vec(text(1, 64), 1..=MAX_REGISTRATION_IDS);
    (ids, notification)
        .prop_map(|(ids, n)| json!({ "v": 1, "registrationIds": ids, "notification": n }))
}

/// Values chosen to sit on or just past a limit, or to be of the wrong type.
fn hostile_value() -> impl Strategy<Value = Value> {
    prop_oneof![
        prop::sample::select(vec![
            json!(null),
            json!(true),
            json!(0),
            json!(-1),
            json!(1.5),
            json!(1e308),
            json!(u64::MAX),
            json!(i64::MIN),
            json!(9_007_199_254_740_991u64),
            json!(9_007_199_254_740_992u64),
            json!(""),
            json!("\u{0}"),
            json!("a\u{0}b"),
            json!("t".repeat(80)),
            json!("t".repeat(81)),
            json!("😀".repeat(40)),
            json!("😀".repeat(41)),
            json!("b".repeat(181)),
            json!("x".repeat(3000)),
            json!("tab\there"),
            json!([]),
            json!({}),
            json!(["a"]),
            json!({"a": 1}),
            json!("dismiss"),
            json!("alert"),
            json!("plugin"),
            json!("needs-input"),
        ]),
        text(0, 200).prop_map(Value::from),
        proptest::collection::vec(text(0, 130).prop_map(Value::from), 0..=22).prop_map(Value::from),
        proptest::collection::vec(Just(json!("r")), 19..=21).prop_map(Value::from),
    ]
}

const TOP_KEYS: [&str; 4] = ["v", "registrationIds", "notification", "extra"];
const NOTIFICATION_KEYS: [&str; 12] = [
    "notificationId",
    "notificationSeq",
    "notificationEpoch",
    "source",
    "agentState",
    "title",
    "body",
    "worktreeId",
    "kind",
    "expiresAt",
    "sound",
    "unknownKey",
];

/// Sets (or with `None`, removes) one key of the body or of its notification.
fn mutate(body: &mut Value, top: bool, key: usize, value: Option<Value>) {
    let target = if top { body } else { &mut body["notification"] };
    let key = if top {
        TOP_KEYS[key % 4]
    } else {
        NOTIFICATION_KEYS[key % 12]
    };
    if let Some(map) = target.as_object_mut() {
        match value {
            Some(value) => drop(map.insert(key.to_owned(), value)),
            None => drop(map.remove(key)),
        }
    }
}

/// Raw escapes a serializer never writes: NUL, lone and reversed surrogates, bad escapes.
const RAW_SPLICES: [&str; 8] = [
    "\\u0000",
    "\\ud800",
    "\\udc00\\ud800",
    "\\ud83d\\ude00",
    "\\\\u0000",
    "\\x",
    "\"",
    "\u{0}",
];

proptest! {
    #![proptest_config(config(2_000))]

    #[test]
    fn arbitrary_bytes_are_refused_or_within_the_limits(bytes in proptest::collection::vec(any::<u8>(), 0..600)) {
        check(&bytes)?;
    }

    #[test]
    fn valid_bodies_are_accepted_unless_the_notification_is_over_3000_bytes(body in valid_body()) {
        let bytes = serde_json::to_vec(&body).map_err(|e| TestCaseError::fail(e.to_string()))?;
        let size = serde_json::to_vec(&body["notification"]).map_or(usize::MAX, |v| v.len());
        prop_assert_eq!(check(&bytes)?, size <= MAX_NOTIFICATION_BYTES);
    }

    #[test]
    fn mutated_bodies_are_refused_or_within_the_limits(
        mut body in valid_body(),
        edits in proptest::collection::vec(
            (any::<bool>(), any::<usize>(), proptest::option::weighted(0.8, hostile_value())), 1..4),
    ) {
        for (top, key, value) in edits {
            mutate(&mut body, top, key, value);
        }
        let bytes = serde_json::to_vec(&body).map_err(|e| TestCaseError::fail(e.to_string()))?;
        check(&bytes)?;
    }

    #[test]
    fn spliced_or_flipped_texts_are_refused_or_within_the_limits(
        body in valid_body(),
        at in any::<prop::sample::Index>(),
        splice in prop::sample::select(RAW_SPLICES.to_vec()),
        flip in proptest::option::of((any::<prop::sample::Index>(), 1u8..)),
    ) {
        let mut bytes = serde_json::to_vec(&body).map_err(|e| TestCaseError::fail(e.to_string()))?;
        let at = at.index(bytes.len() + 1);
        bytes.splice(at..at, splice.bytes());
        if let Some((i, mask)) = flip {
            let i = i.index(bytes.len());
            bytes[i] ^= mask;
        }
        check(&bytes)?;
    }
}
