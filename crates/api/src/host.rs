//! `POST /v1/host/challenge`, `POST /v1/host/session` and `GET /health`.

use serde::{Deserialize, Serialize};

use crate::V1;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct ChallengeRequest {
    pub v: V1,
    /// Standard, padded base64 of the host's 32-byte X25519 public key.
    pub host_public_key_b64: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct ChallengeReply {
    pub challenge_id: String,
    pub gateway_ephemeral_public_key_b64: String,
    pub nonce_b64: String,
    pub ciphertext_b64: String,
    /// Unix ms.
    pub expires_at: i64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct SessionRequest {
    pub v: V1,
    pub challenge_id: String,
    /// Standard, padded base64 of the 32-byte proof.
    pub proof_b64: String,
}

/// A minted session. Debug never shows the token.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct SessionReply {
    pub session_token: String,
    /// Unix ms.
    pub expires_at: i64,
    pub host_fingerprint: String,
}

impl std::fmt::Debug for SessionReply {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SessionReply")
            .field("expires_at", &self.expires_at)
            .field(
                "host_fingerprint",
                &self.host_fingerprint.chars().take(4).collect::<String>(),
            )
            .finish_non_exhaustive()
    }
}

/// `GET /health`. Hosts read `deliveryProtocol` to learn which notification fields a gateway takes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct Health {
    pub ok: bool,
    pub push_protocol: u32,
    /// Absent on the oldest gateways: read as 1.
    #[serde(default = "first_protocol")]
    pub delivery_protocol: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<String>,
}

/// `GET /ready` when every dependency answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Ready {
    pub ok: bool,
}

fn first_protocol() -> u32 {
    1
}
