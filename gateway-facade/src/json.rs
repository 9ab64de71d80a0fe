//! Request bodies: strict JSON with every failure in the contract's shape, and canonical base64.

use axum::extract::{FromRequest, Request};
use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use serde::de::DeserializeOwned;

use crate::connections::BodyTimeout;
use crate::error::ApiError;

/// Like `axum::Json`, but a rejected body (not JSON, a wrong type, an unknown field, too large)
/// answers the contract's `invalid_request` or `request_too_large`, and no content type is demanded.
/// A body with U+0000 in any string is `invalid_request` too: PostgreSQL refuses NUL in text, so
/// letting it through would store it on SQLite and fail with 503 on PostgreSQL.
pub struct StrictJson<T>(pub T);

impl<T: DeserializeOwned, S: Send + Sync> FromRequest<S> for StrictJson<T> {
    type Rejection = ApiError;

    async fn from_request(request: Request, state: &S) -> Result<Self, Self::Rejection> {
        let timeout = request.extensions().get::<BodyTimeout>().copied();
        let read = axum::body::Bytes::from_request(request, state);
        let read = match timeout {
            // A body still not whole in time is refused, which frees the connection.
            Some(BodyTimeout(within)) => tokio::time::timeout(within, read)
                .await
                .map_err(|_| ApiError::InvalidRequest)?,
            None => read.await,
        };
        let bytes = read.map_err(|rejection| {
            if rejection.status() == axum::http::StatusCode::PAYLOAD_TOO_LARGE {
                ApiError::RequestTooLarge
            } else {
                ApiError::InvalidRequest
            }
        })?;
        parse_body(&bytes).map(StrictJson)
    }
}

/// What [`StrictJson`] does with the bytes of a body: no NUL in any string, then strict serde.
/// A plain function so the fuzz targets (docs/fuzzing.md) drive exactly the extractor's path.
pub fn parse_body<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    if has_nul_in_strings(bytes) {
        return Err(ApiError::InvalidRequest);
    }
    serde_json::from_slice(bytes).map_err(|_| ApiError::InvalidRequest)
}

/// Whether a JSON text carries U+0000 in a string (or a key). JSON can only spell it as the escape
/// `\u0000` (a raw control byte inside a string is invalid JSON, refused by the parser anyway), so
/// this walks the strings and looks at their escapes; `\\u0000` is a backslash, not a NUL.
pub fn has_nul_in_strings(json: &[u8]) -> bool {
    let mut in_string = false;
    let mut i = 0;
    while i < json.len() {
        match (in_string, json[i]) {
            (_, 0) => return true,
            (true, b'\\') => {
                if json.get(i + 1) == Some(&b'u') && json.get(i + 2..i + 6) == Some(b"0000") {
                    return true;
                }
                // Skip the escaped character, so `\"` does not end the string.
                i += 1;
            }
            (_, b'"') => in_string = !in_string,
            _ => {}
        }
        i += 1;
    }
    false
}

/// Refuses U+0000 in a string that did not come through a JSON body (a path segment).
pub fn refuse_nul(value: &str) -> Result<(), ApiError> {
    if value.contains('\0') {
        Err(ApiError::InvalidRequest)
    } else {
        Ok(())
    }
}

/// The protocol version field `v`, which must be exactly 1.
pub use orca_push_api::V1;

/// Decodes standard, padded, canonical base64 of exactly `len` bytes.
pub fn decode_base64_exact<const N: usize>(text: &str) -> Result<[u8; N], ApiError> {
    let bytes = STANDARD
        .decode(text)
        .map_err(|_| ApiError::InvalidRequest)?;
    // The engine already refuses bad padding and non-zero trailing bits; re-encoding catches
    // anything else a lenient decoder might let through.
    if STANDARD.encode(&bytes) != text {
        return Err(ApiError::InvalidRequest);
    }
    bytes.try_into().map_err(|_| ApiError::InvalidRequest)
}

pub fn encode_base64(bytes: &[u8]) -> String {
    STANDARD.encode(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_nul_escape_in_any_string_is_found() {
        for nul in [
            r#"{"deviceId":"a\u0000b"}"#,
            r#"{"a\u0000":1}"#,
            r#"{"x":["ok","\u0000"]}"#,
            r#"{"x":"\\\u0000"}"#,
            r#"{"x":"\"\u0000"}"#,
            "{\"x\":\"\0\"}",
        ] {
            assert!(has_nul_in_strings(nul.as_bytes()), "{nul}");
        }
        for clean in [
            r#"{"deviceId":"ab","n":0}"#,
            r#"{"x":"\\u0000"}"#,
            r#"{"x":"\u0001\u0030"}"#,
            r#"{"x":"u0000"}"#,
            r#"{"x":"\\","y":"u0000"}"#,
        ] {
            assert!(!has_nul_in_strings(clean.as_bytes()), "{clean}");
        }
    }

    #[test]
    fn the_scan_agrees_with_the_parser() {
        for text in [
            r#"{"a":"\u0000"}"#,
            r#"{"a":"\\u0000"}"#,
            r#"{"a":"\\\\\u0000"}"#,
            r#"{"a":"\"\\","b":"\u0000x"}"#,
            r#"{"a":"\ud83d\ude00","b":"0000"}"#,
        ] {
            fn nul_inside(value: &serde_json::Value) -> bool {
                match value {
                    serde_json::Value::String(s) => s.contains('\0'),
                    serde_json::Value::Array(items) => items.iter().any(nul_inside),
                    serde_json::Value::Object(map) => {
                        map.iter().any(|(k, v)| k.contains('\0') || nul_inside(v))
                    }
                    _ => false,
                }
            }
            let parsed: serde_json::Value = serde_json::from_str(text).unwrap();
            let really = nul_inside(&parsed);
            assert_eq!(has_nul_in_strings(text.as_bytes()), really, "{text}");
        }
    }
}
