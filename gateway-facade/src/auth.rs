//! The bearer check in front of every authenticated route, in the order the contract gives:
//! the IP's forged-bearer budget, bounded admission to the session look-up, then the host's bucket.

use axum::extract::FromRequestParts;
use axum::http::request::Parts;
use orca_push_proto::auth::v1 as pb;

use crate::app::AppState;
use crate::error::ApiError;

/// The host a valid bearer belongs to.
#[derive(Debug, Clone)]
pub struct AuthenticatedHost {
    pub fingerprint: String,
}

/// `Authorization: Bearer <43 chars of base64url>`; anything else is `invalid_token`.
fn bearer(parts: &Parts) -> Option<&str> {
    let value = parts
        .headers
        .get(axum::http::header::AUTHORIZATION)?
        .to_str()
        .ok()?;
    let (scheme, token) = value.split_once(' ')?;
    if !scheme.eq_ignore_ascii_case("bearer") {
        return None;
    }
    let token = token.trim();
    let well_formed = token.len() == 43
        && token
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
    well_formed.then_some(token)
}

impl FromRequestParts<AppState> for AuthenticatedHost {
    type Rejection = ApiError;

    async fn from_request_parts(
        parts: &mut Parts,
        state: &AppState,
    ) -> Result<Self, Self::Rejection> {
        let backends = state.backends()?;
        let limits = &state.limits;
        let client = limits.client(&parts.headers);
        limits.check_bearer_penalty(&client)?;
        let Some(token) = bearer(parts) else {
            limits.charge_invalid_bearer(client)?;
            return Err(ApiError::InvalidToken);
        };
        let answer = {
            let _permit = limits.admit_lookup().await?;
            orca_push_internal_auth::retry_unavailable(|| {
                let mut auth = backends.auth.clone();
                let request = pb::AuthenticateRequest {
                    session_token: token.to_owned(),
                };
                async move { auth.authenticate(request).await }
            })
            .await
        };
        match answer {
            Ok(response) => {
                let fingerprint = response.into_inner().host_fingerprint;
                limits.admit_host(&fingerprint)?;
                Ok(Self { fingerprint })
            }
            Err(status) => {
                let error = ApiError::from(status);
                if matches!(error, ApiError::InvalidToken | ApiError::SessionExpired) {
                    limits.charge_invalid_bearer(client)?;
                }
                Err(error)
            }
        }
    }
}
