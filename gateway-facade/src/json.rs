//! Request bodies: strict JSON with every failure in the contract's shape, and canonical base64.

use axum::extract::{FromRequest, Request};
use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Deserializer};

use crate::error::ApiError;

/// Like `axum::Json`, but a rejected body (not JSON, a wrong type, an unknown field, too large)
/// answers the contract's `invalid_request` or `request_too_large`, and no content type is demanded.
pub struct StrictJson<T>(pub T);

impl<T: DeserializeOwned, S: Send + Sync> FromRequest<S> for StrictJson<T> {
    type Rejection = ApiError;

    async fn from_request(request: Request, state: &S) -> Result<Self, Self::Rejection> {
        let bytes = axum::body::Bytes::from_request(request, state)
            .await
            .map_err(|rejection| {
                if rejection.status() == axum::http::StatusCode::PAYLOAD_TOO_LARGE {
                    ApiError::RequestTooLarge
                } else {
                    ApiError::InvalidRequest
                }
            })?;
        serde_json::from_slice(&bytes)
            .map(StrictJson)
            .map_err(|_| ApiError::InvalidRequest)
    }
}

/// The protocol version field `v`, which must be exactly 1.
#[derive(Debug, Clone, Copy)]
pub struct V1;

impl<'de> Deserialize<'de> for V1 {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        match u64::deserialize(deserializer)? {
            1 => Ok(V1),
            _ => Err(serde::de::Error::custom("v must be 1")),
        }
    }
}

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
