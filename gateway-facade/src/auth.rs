//! The bearer check in front of every authenticated route: the token's tag (no look-up), then the
//! verified session (cache, else bounded admission to one shared look-up), then the host's bucket.
//! A bearer without a valid tag, or whose session is gone, spends the IP's forged-bearer budget
//! (401, then 429 once spent); a tagged bearer is checked even when that budget is spent.

use axum::extract::FromRequestParts;
use axum::http::request::Parts;
use orca_push_auth::Tag;
use orca_push_proto::auth::v1 as pb;

use crate::app::AppState;
use crate::backends::Backends;
use crate::error::ApiError;
use crate::limits::{ClientKey, Limits};
use crate::sessions::Verdict;

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
    orca_push_auth::session_token::well_formed(token).then_some(token)
}

/// A bearer refused before any look-up: an IP whose budget is spent waits it out (429), else the
/// budget is charged and the bearer refused (401, or 429 if that spent the last of it).
fn refuse(
    limits: &Limits,
    client: ClientKey,
    error: ApiError,
) -> Result<AuthenticatedHost, ApiError> {
    limits.check_bearer_penalty(&client)?;
    limits.charge_invalid_bearer(client)?;
    Err(error)
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
        let Some(token) = bearer(parts) else {
            return refuse(limits, client, ApiError::InvalidToken);
        };
        match state.sessions.tag(&backends.auth, token).await? {
            // Minted here: checked even when the IP's budget is spent, so a valid host behind a
            // flooding address keeps working.
            Tag::Valid => {}
            // Possibly a session from before tagging: looked up only while the budget lasts.
            Tag::Legacy => limits.check_bearer_penalty(&client)?,
            Tag::Invalid => {
                metrics::counter!("orca_push_bearer_checks_total", "outcome" => "forged")
                    .increment(1);
                return refuse(limits, client, ApiError::InvalidToken);
            }
        }
        let verdict = state
            .sessions
            .verify(token, || look_up(state, backends, token))
            .await?;
        match verdict {
            Verdict::Host { fingerprint, .. } => {
                limits.admit_host(&fingerprint)?;
                Ok(Self { fingerprint })
            }
            // A replaced or expired session spends the budget like a forgery, but once refused it
            // is remembered, so repeating it costs no look-up either.
            Verdict::Unknown => {
                limits.charge_invalid_bearer(client)?;
                Err(ApiError::InvalidToken)
            }
            Verdict::Expired => {
                limits.charge_invalid_bearer(client)?;
                Err(ApiError::SessionExpired)
            }
        }
    }
}

/// One session look-up at auth, behind bounded admission. Only auth's own refusals become
/// verdicts (they are final and may be remembered); anything else is an error for this request.
async fn look_up(state: &AppState, backends: &Backends, token: &str) -> Result<Verdict, ApiError> {
    let _permit = state.limits.admit_lookup().await?;
    let answer = orca_push_internal_auth::retry_unavailable(|| {
        let mut auth = backends.auth.clone();
        let request = pb::AuthenticateRequest {
            session_token: token.to_owned(),
        };
        async move { auth.authenticate(request).await }
    })
    .await;
    match answer {
        Ok(response) => {
            let response = response.into_inner();
            Ok(Verdict::Host {
                fingerprint: response.host_fingerprint,
                expires_at_ms: u64::try_from(response.expires_at_ms).unwrap_or(0),
            })
        }
        Err(status) => match orca_push_proto::error_code(&status) {
            Some("invalid_token") => Ok(Verdict::Unknown),
            Some("session_expired") => Ok(Verdict::Expired),
            _ => Err(ApiError::from(status)),
        },
    }
}
