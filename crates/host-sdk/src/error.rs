//! Everything a gateway call can fail with, typed so a caller can decide without string matching.

use std::time::Duration;

use orca_push_api::{ErrorCode, Invalid};

use crate::key::KeyError;
use crate::proof::ChallengeRefusal;

#[derive(Debug, thiserror::Error)]
pub enum GatewayError {
    #[error("the gateway URL must be an http(s) URL")]
    BadUrl,
    /// Refused here, before anything was sent: the request breaks the contract.
    #[error("the request breaks the contract: {0}")]
    Invalid(#[from] Invalid),
    #[error("cannot reach the gateway: {0}")]
    Http(#[from] reqwest::Error),
    /// The gateway answered with one of the contract's error codes.
    #[error("the gateway answered {status}: {code}")]
    Api {
        status: u16,
        code: ErrorCode,
        /// From the `Retry-After` header, when the gateway sent one.
        retry_after: Option<Duration>,
    },
    #[error("refused the gateway's challenge: {0}")]
    Refused(#[from] ChallengeRefusal),
    #[error("the gateway's answer is malformed: {0}")]
    Malformed(&'static str),
    #[error(transparent)]
    Key(#[from] KeyError),
}

impl GatewayError {
    /// The contract's error code, when the gateway answered with one.
    pub fn code(&self) -> Option<ErrorCode> {
        match self {
            Self::Api { code, .. } => Some(*code),
            _ => None,
        }
    }

    pub fn status(&self) -> Option<u16> {
        match self {
            Self::Api { status, .. } => Some(*status),
            _ => None,
        }
    }

    /// How long the gateway asked the caller to wait.
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            Self::Api { retry_after, .. } => *retry_after,
            _ => None,
        }
    }

    /// Worth sending again later unchanged: the network, a busy or draining gateway, a 5xx.
    pub fn is_retryable(&self) -> bool {
        match self {
            Self::Http(_) => true,
            Self::Api { status, code, .. } => code.is_retryable() || *status >= 500,
            _ => false,
        }
    }

    /// The host could not get or keep a session (a refused proof, a broken key file). Durable work
    /// waits for the next attempt rather than being dropped.
    pub fn is_auth(&self) -> bool {
        match self {
            Self::Api { status, .. } => *status == 401,
            Self::Refused(_) | Self::Key(_) => true,
            _ => false,
        }
    }

    /// A short, payload-free name for counting failures.
    pub fn category(&self) -> &'static str {
        match self {
            Self::BadUrl => "bad_url",
            Self::Invalid(_) => "invalid_request_local",
            Self::Http(e) if e.is_timeout() => "timeout",
            Self::Http(_) => "unreachable",
            Self::Api { code, .. } => code.as_str(),
            Self::Refused(_) => "challenge_refused",
            Self::Malformed(_) => "malformed_reply",
            Self::Key(_) => "key_file",
        }
    }
}

/// `Retry-After`: delta-seconds or an HTTP date.
pub(crate) fn parse_retry_after(value: &str) -> Option<Duration> {
    let value = value.trim();
    if let Ok(seconds) = value.parse::<u64>() {
        return Some(Duration::from_secs(seconds));
    }
    let at = httpdate::parse_http_date(value).ok()?;
    Some(
        at.duration_since(std::time::SystemTime::now())
            .unwrap_or(Duration::ZERO),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_after_reads_seconds_and_dates() {
        assert_eq!(parse_retry_after("7"), Some(Duration::from_secs(7)));
        assert_eq!(
            parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT"),
            Some(Duration::ZERO)
        );
        assert_eq!(parse_retry_after("soon"), None);
    }

    #[test]
    fn busy_and_outages_are_retryable_refusals_are_not() {
        let api = |status, code| GatewayError::Api {
            status,
            code,
            retry_after: None,
        };
        assert!(api(503, ErrorCode::Busy).is_retryable());
        assert!(api(429, ErrorCode::RateLimited).is_retryable());
        assert!(api(502, ErrorCode::Unknown).is_retryable());
        assert!(!api(400, ErrorCode::InvalidRequest).is_retryable());
        assert!(!api(404, ErrorCode::NotFound).is_retryable());
        assert!(api(401, ErrorCode::SessionExpired).is_auth());
        assert_eq!(api(503, ErrorCode::Busy).category(), "busy");
    }
}
