//! `POST /v1/host/challenge` and `POST /v1/host/session`: the only unauthenticated routes.

use axum::Json;
use axum::extract::State;
use orca_push_api::{ChallengeReply, ErrorBody, SessionReply};
use orca_push_proto::auth::v1 as pb;

use crate::app::AppState;
use crate::error::ApiError;
use crate::json::{StrictJson, decode_base64_exact, encode_base64};

pub type ChallengeBody = orca_push_api::ChallengeRequest;
pub type SessionBody = orca_push_api::SessionRequest;

/// Starts the host's proof: a sealed challenge for its X25519 key. Unauthenticated, and charged to
/// the client IP's bucket of 30 a minute shared with `/v1/host/session`.
#[utoipa::path(
    post,
    path = "/v1/host/challenge",
    tag = "host",
    request_body = ChallengeBody,
    responses(
        (status = 200, description = "A challenge, valid for 10 s", body = ChallengeReply),
        (status = 400, description = "`invalid_request`: the body breaks the contract's schema or bounds", body = ErrorBody),
        (status = 413, description = "`request_too_large`: the body is over 16 KiB", body = ErrorBody),
        (status = 429, description = "`rate_limited`: a request bucket is empty (Retry-After says when to come back)", body = ErrorBody),
        (status = 500, description = "`internal`", body = ErrorBody),
        (status = 503, description = "`busy` (with Retry-After), `shutting_down`, `dependency_unavailable` or `validation_only`", body = ErrorBody),
    ),
)]
pub async fn challenge(
    State(state): State<AppState>,
    StrictJson(body): StrictJson<ChallengeBody>,
) -> Result<Json<ChallengeReply>, ApiError> {
    let host_public_key = decode_base64_exact::<32>(&body.host_public_key_b64)?;
    let issued = state
        .backends()?
        .auth
        .clone()
        .issue_challenge(pb::IssueChallengeRequest {
            host_public_key: host_public_key.to_vec(),
        })
        .await?
        .into_inner();
    Ok(Json(ChallengeReply {
        challenge_id: issued.challenge_id,
        gateway_ephemeral_public_key_b64: encode_base64(&issued.gateway_ephemeral_public_key),
        nonce_b64: encode_base64(&issued.nonce),
        ciphertext_b64: encode_base64(&issued.ciphertext),
        expires_at: issued.expires_at_ms,
    }))
}

/// Ends the proof: the HMAC answer to a challenge buys a 24 h session (and ends the host's earlier
/// one).
#[utoipa::path(
    post,
    path = "/v1/host/session",
    tag = "host",
    request_body = SessionBody,
    responses(
        (status = 200, description = "The session; its token is the bearer of every other /v1 call", body = SessionReply),
        (status = 400, description = "`invalid_request`: the body breaks the contract's schema or bounds", body = ErrorBody),
        (status = 401, description = "`invalid_challenge` (unknown, or pruned 30 s after it expired) or `invalid_proof` (a wrong proof, or a used or expired challenge)", body = ErrorBody),
        (status = 413, description = "`request_too_large`: the body is over 16 KiB", body = ErrorBody),
        (status = 429, description = "`rate_limited`: a request bucket is empty (Retry-After says when to come back)", body = ErrorBody),
        (status = 500, description = "`internal`", body = ErrorBody),
        (status = 503, description = "`busy` (with Retry-After), `shutting_down`, `dependency_unavailable` or `validation_only`", body = ErrorBody),
    ),
)]
pub async fn session(
    State(state): State<AppState>,
    StrictJson(body): StrictJson<SessionBody>,
) -> Result<Json<SessionReply>, ApiError> {
    if body.challenge_id.is_empty() || body.challenge_id.chars().count() > 128 {
        return Err(ApiError::InvalidRequest);
    }
    let proof = decode_base64_exact::<32>(&body.proof_b64)?;
    let session = state
        .backends()?
        .auth
        .clone()
        .create_session(pb::CreateSessionRequest {
            challenge_id: body.challenge_id,
            proof: proof.to_vec(),
        })
        .await?
        .into_inner();
    Ok(Json(SessionReply {
        session_token: session.session_token,
        expires_at: session.expires_at_ms,
        host_fingerprint: session.host_fingerprint,
    }))
}
