//! `POST /v1/host/challenge` and `POST /v1/host/session`: the only unauthenticated routes.

use axum::Json;
use axum::extract::State;
use orca_push_api::{ChallengeReply, SessionReply};
use orca_push_proto::auth::v1 as pb;

use crate::app::AppState;
use crate::error::ApiError;
use crate::json::{StrictJson, decode_base64_exact, encode_base64};

pub type ChallengeBody = orca_push_api::ChallengeRequest;
pub type SessionBody = orca_push_api::SessionRequest;

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
