//! The one table from failures to the contract's HTTP statuses and `{"error": "<code>"}` bodies.

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use orca_push_api::ErrorCode;

/// Every error the public API can answer. The code strings are the contract's; never add detail.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum ApiError {
    #[error("invalid_request")]
    InvalidRequest,
    #[error("invalid_token")]
    InvalidToken,
    #[error("session_expired")]
    SessionExpired,
    #[error("invalid_challenge")]
    InvalidChallenge,
    #[error("invalid_proof")]
    InvalidProof,
    #[error("not_found")]
    NotFound,
    #[error("too_many_devices")]
    TooManyDevices,
    #[error("request_too_large")]
    RequestTooLarge,
    #[error("rate_limited")]
    RateLimited,
    #[error("busy")]
    Busy,
    #[error("shutting_down")]
    ShuttingDown,
    #[error("dependency_unavailable")]
    DependencyUnavailable,
    #[error("validation_only")]
    ValidationOnly,
    #[error("internal")]
    Internal,
}

impl ApiError {
    pub const ALL: [ApiError; 14] = [
        Self::InvalidRequest,
        Self::InvalidToken,
        Self::SessionExpired,
        Self::InvalidChallenge,
        Self::InvalidProof,
        Self::NotFound,
        Self::TooManyDevices,
        Self::RequestTooLarge,
        Self::RateLimited,
        Self::Busy,
        Self::ShuttingDown,
        Self::DependencyUnavailable,
        Self::ValidationOnly,
        Self::Internal,
    ];

    /// The API crate's code for this error: its spelling and its status are defined there, once.
    pub fn wire(self) -> ErrorCode {
        match self {
            Self::InvalidRequest => ErrorCode::InvalidRequest,
            Self::InvalidToken => ErrorCode::InvalidToken,
            Self::SessionExpired => ErrorCode::SessionExpired,
            Self::InvalidChallenge => ErrorCode::InvalidChallenge,
            Self::InvalidProof => ErrorCode::InvalidProof,
            Self::NotFound => ErrorCode::NotFound,
            Self::TooManyDevices => ErrorCode::TooManyDevices,
            Self::RequestTooLarge => ErrorCode::RequestTooLarge,
            Self::RateLimited => ErrorCode::RateLimited,
            Self::Busy => ErrorCode::Busy,
            Self::ShuttingDown => ErrorCode::ShuttingDown,
            Self::DependencyUnavailable => ErrorCode::DependencyUnavailable,
            Self::ValidationOnly => ErrorCode::ValidationOnly,
            Self::Internal => ErrorCode::Internal,
        }
    }

    pub fn code(self) -> &'static str {
        self.wire().as_str()
    }

    pub fn status(self) -> StatusCode {
        StatusCode::from_u16(self.wire().status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR)
    }

    fn from_code(code: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|e| e.code() == code)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = format!(r#"{{"error":"{}"}}"#, self.code());
        let mut response = (
            self.status(),
            [(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            )],
            body,
        )
            .into_response();
        // When to come back: the busy look-ups clear within a second; an empty request bucket
        // has a token again within 2 s (the slowest, 30 a minute, refills one every 2 s).
        let retry_after = match self {
            Self::Busy => Some("1"),
            Self::RateLimited => Some("2"),
            _ => None,
        };
        if let Some(seconds) = retry_after {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static(seconds));
        }
        response
    }
}

impl From<tonic::Status> for ApiError {
    /// A service names the contract code in metadata; otherwise the gRPC code decides.
    ///
    /// UNAUTHENTICATED or PERMISSION_DENIED without a contract code is a service refusing this
    /// gateway's own internal token (e.g. `ORCA_PUSH_INTERNAL_KEY` differs between processes):
    /// a fault between services, so the host gets `dependency_unavailable` and keeps its session,
    /// never `invalid_token` (which would make every desktop prove itself again, in a loop). A
    /// host's own bad bearer always comes back from auth with its contract code.
    fn from(status: tonic::Status) -> Self {
        if let Some(error) = orca_push_proto::error_code(&status).and_then(Self::from_code) {
            return error;
        }
        match status.code() {
            tonic::Code::InvalidArgument => Self::InvalidRequest,
            code @ (tonic::Code::Unauthenticated | tonic::Code::PermissionDenied) => {
                tracing::error!(
                    ?code,
                    refusal = status.message(),
                    "a service refused this gateway's internal token; check that every process \
                     has the same ORCA_PUSH_INTERNAL_KEY"
                );
                Self::DependencyUnavailable
            }
            tonic::Code::NotFound => Self::NotFound,
            // A replica that went away mid-call: the caller may retry. No service answers
            // RESOURCE_EXHAUSTED or INTERNAL without a contract code (too_many_devices and
            // internal carry theirs): uncoded, they are HTTP/2 itself (an ENHANCE_YOUR_CALM reset
            // or GOAWAY, a connection that died), a fault between services, not the host's
            // bucket or a bug to answer 500 for.
            tonic::Code::Unavailable
            | tonic::Code::DeadlineExceeded
            | tonic::Code::Unknown
            | tonic::Code::Cancelled
            | tonic::Code::ResourceExhausted
            | tonic::Code::Internal => Self::DependencyUnavailable,
            code => {
                tracing::error!(?code, "unexpected gRPC status from a service");
                Self::Internal
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use orca_push_proto::status_with_code;
    use tonic::Code;

    /// What the OpenAPI document and the host SDK expect: every 429 and every `busy` says when to
    /// come back; no other answer does.
    #[test]
    fn rate_limited_and_busy_answers_carry_retry_after() {
        for error in ApiError::ALL {
            let response = error.into_response();
            let retry_after = response
                .headers()
                .get(header::RETRY_AFTER)
                .map(|v| v.to_str().unwrap().to_owned());
            let expected = match error {
                ApiError::RateLimited => Some("2"),
                ApiError::Busy => Some("1"),
                _ => None,
            };
            assert_eq!(retry_after.as_deref(), expected, "{error:?}");
        }
    }

    #[test]
    fn every_api_code_is_answered_by_exactly_one_error() {
        let wire: Vec<ErrorCode> = ApiError::ALL.iter().map(|e| e.wire()).collect();
        assert_eq!(
            wire,
            ErrorCode::ALL,
            "one ApiError per API code, in the same order"
        );
    }

    #[test]
    fn uncoded_transport_failures_are_dependency_faults() {
        for code in [Code::ResourceExhausted, Code::Internal, Code::Cancelled] {
            let error = ApiError::from(tonic::Status::new(code, "h2 protocol error"));
            assert_eq!(error, ApiError::DependencyUnavailable, "{code:?}");
        }
        // Coded, they keep their meaning.
        assert_eq!(
            ApiError::from(status_with_code(
                Code::ResourceExhausted,
                "too_many_devices"
            )),
            ApiError::TooManyDevices
        );
        assert_eq!(
            ApiError::from(status_with_code(Code::Internal, "internal")),
            ApiError::Internal
        );
    }

    #[test]
    fn a_refused_internal_token_is_a_dependency_fault_not_the_hosts() {
        for code in [Code::Unauthenticated, Code::PermissionDenied] {
            let error = ApiError::from(tonic::Status::new(code, "no internal token"));
            assert_eq!(error, ApiError::DependencyUnavailable, "{code:?}");
            assert_eq!(error.status(), StatusCode::SERVICE_UNAVAILABLE);
        }
    }

    #[test]
    fn the_hosts_own_credentials_keep_their_contract_codes() {
        for (error, code) in [
            (ApiError::InvalidToken, "invalid_token"),
            (ApiError::SessionExpired, "session_expired"),
            (ApiError::InvalidChallenge, "invalid_challenge"),
            (ApiError::InvalidProof, "invalid_proof"),
        ] {
            // As auth answers now, and as an auth from before FAILED_PRECONDITION answered.
            for grpc in [Code::FailedPrecondition, Code::Unauthenticated] {
                assert_eq!(ApiError::from(status_with_code(grpc, code)), error);
            }
            assert_eq!(error.status(), StatusCode::UNAUTHORIZED);
        }
    }
}
