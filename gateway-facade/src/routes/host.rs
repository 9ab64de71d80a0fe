//! `POST /v1/host/challenge` and `POST /v1/host/session`: the only unauthenticated routes.

use axum::Json;
use axum::extract::State;
use orca_push_proto::auth::v1 as pb;
use serde::{Deserialize, Serialize};

use crate::app::AppState;
use crate::error::ApiError;
use crate::json::{StrictJson, V1, decode_base64_exact, encode_base64};

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct ChallengeBody {
    #[allow(dead_code)]
    v: V1,
    pub host_public_key_b64: String,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ChallengeReply {
    challenge_id: String,
    gateway_ephemeral_public_key_b64: String,
    nonce_b64: String,
    ciphertext_b64: String,
    expires_at: i64,
}

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

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct SessionBody {
    #[allow(dead_code)]
    v: V1,
    challenge_id: String,
    pub proof_b64: String,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
pub struct SessionReply {
    session_token: String,
    expires_at: i64,
    host_fingerprint: String,
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
