//! The contract's bounds on single fields, as predicates every layer calls.

/// At most this many registration ids in one `POST /v1/send`, counted as sent.
pub const MAX_REGISTRATION_IDS: usize = 20;
/// A notification's UTF-8 JSON, as parsed, is at most this many bytes.
pub const MAX_NOTIFICATION_BYTES: usize = 3000;
/// JavaScript's largest exact integer: the bound on `notificationSeq`.
pub const MAX_SAFE_INTEGER: u64 = (1 << 53) - 1;
/// A host may hold at most this many registrations (distinct device ids).
pub const MAX_DEVICES_PER_HOST: usize = 64;
/// `GET /v1/devices` answers at most this many rows.
pub const LIST_LIMIT: usize = 1024;
pub const MAX_TITLE: usize = 80;
pub const MAX_BODY: usize = 180;
pub const MAX_NOTIFICATION_ID: usize = 2048;
pub const MAX_WORKTREE_ID: usize = 2048;
pub const MAX_OPAQUE_ID: usize = 128;
pub const MAX_TOKEN: usize = 4096;
/// FCM registration strings are at least this long.
pub const MIN_FCM_TOKEN: usize = 32;

/// Length as JavaScript counts it: UTF-16 code units.
pub fn utf16_len(value: &str) -> usize {
    value.encode_utf16().count()
}

/// PostgreSQL refuses U+0000 in text (SQLite would store it), so every layer refuses it alike.
pub fn has_nul(value: &str) -> bool {
    value.contains('\0')
}

/// An opaque id (deviceId, registrationId, notificationEpoch): 1 to 128 UTF-16 units, no NUL.
pub fn is_opaque_id(value: &str) -> bool {
    (1..=MAX_OPAQUE_ID).contains(&utf16_len(value)) && !has_nul(value)
}

/// `notificationId`: 1 to 2048 printable ASCII characters.
pub fn is_notification_id(value: &str) -> bool {
    (1..=MAX_NOTIFICATION_ID).contains(&value.len())
        && value.bytes().all(|b| (0x20..=0x7e).contains(&b))
}

pub fn is_title(value: &str) -> bool {
    (1..=MAX_TITLE).contains(&utf16_len(value)) && !has_nul(value)
}

pub fn is_body(value: &str) -> bool {
    utf16_len(value) <= MAX_BODY && !has_nul(value)
}

pub fn is_worktree_id(value: &str) -> bool {
    utf16_len(value) <= MAX_WORKTREE_ID && !has_nul(value)
}

/// An APNs device token: a non-empty run of hex pairs, at most 4096 characters.
pub fn is_apns_token(token: &str) -> bool {
    let t = token.as_bytes();
    !t.is_empty()
        && t.len() <= MAX_TOKEN
        && t.len().is_multiple_of(2)
        && t.iter().all(u8::is_ascii_hexdigit)
}

/// An FCM registration string: 32 to 4096 of `[A-Za-z0-9_:.-]`.
pub fn is_fcm_token(token: &str) -> bool {
    let allowed = |b: &u8| b.is_ascii_alphanumeric() || matches!(b, b'_' | b':' | b'.' | b'-');
    (MIN_FCM_TOKEN..=MAX_TOKEN).contains(&token.len()) && token.bytes().all(|b| allowed(&b))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lengths_are_utf16_units() {
        assert!(is_title(&"t".repeat(80)));
        assert!(!is_title(&"t".repeat(81)));
        assert!(is_title(&"😀".repeat(40)));
        assert!(!is_title(&"😀".repeat(41)));
        assert!(!is_title(""));
        assert!(is_body(""));
        assert!(!is_body(&"é".repeat(181)));
        assert!(is_opaque_id(&"é".repeat(128)));
        assert!(!is_opaque_id(&"😀".repeat(65)));
        assert!(!is_opaque_id("a\0b"));
    }

    #[test]
    fn notification_ids_are_printable_ascii() {
        assert!(is_notification_id(&"n".repeat(2048)));
        assert!(!is_notification_id(&"n".repeat(2049)));
        assert!(!is_notification_id("tab\there"));
        assert!(!is_notification_id("é"));
        assert!(!is_notification_id(""));
    }

    #[test]
    fn tokens_have_their_platform_shape() {
        assert!(is_apns_token("ab01"));
        assert!(!is_apns_token("ab0"));
        assert!(!is_apns_token("zz"));
        assert!(!is_apns_token(""));
        assert!(is_fcm_token(&"a:b_c.d-".repeat(4)));
        assert!(!is_fcm_token(&"a".repeat(31)));
        assert!(!is_fcm_token(&format!("{}/", "a".repeat(40))));
    }
}
