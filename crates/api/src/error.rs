//! The contract's error codes: every `{"error": "<code>"}` the public API answers.

use serde::{Deserialize, Serialize};

macro_rules! error_codes {
    ($($variant:ident = $code:literal, $status:literal, $doc:literal;)+) => {
        /// Every error code of the public API, with its HTTP status. `Unknown` is what a client
        /// reads for a code it does not know (a newer gateway's); the gateway never answers it.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum ErrorCode {
            $(#[doc = $doc] $variant,)+
            Unknown,
        }

        impl ErrorCode {
            /// Every code the gateway answers.
            pub const ALL: &'static [Self] = &[$(Self::$variant),+];

            pub fn as_str(self) -> &'static str {
                match self {
                    $(Self::$variant => $code,)+
                    Self::Unknown => "unknown",
                }
            }

            /// The HTTP status the gateway answers this code with.
            pub fn status(self) -> u16 {
                match self {
                    $(Self::$variant => $status,)+
                    Self::Unknown => 500,
                }
            }

            pub fn parse(code: &str) -> Self {
                match code {
                    $($code => Self::$variant,)+
                    _ => Self::Unknown,
                }
            }

            /// What the code means, for documentation.
            pub fn description(self) -> &'static str {
                match self {
                    $(Self::$variant => $doc,)+
                    Self::Unknown => "a code this client does not know",
                }
            }
        }
    };
}

error_codes! {
    InvalidRequest = "invalid_request", 400, "The body or a parameter breaks the contract's schema or bounds.";
    InvalidToken = "invalid_token", 401, "The bearer is not a session token the gateway knows.";
    SessionExpired = "session_expired", 401, "The session expired or was replaced: run the challenge again.";
    InvalidChallenge = "invalid_challenge", 401, "The challenge is unknown (or was pruned, 30 s after it expired).";
    InvalidProof = "invalid_proof", 401, "The proof does not answer the challenge, or the challenge was used or has expired.";
    NotFound = "not_found", 404, "No such route, or no such registration of this host.";
    TooManyDevices = "too_many_devices", 409, "The host already holds 64 registrations.";
    RequestTooLarge = "request_too_large", 413, "The body is over 16 KiB.";
    RateLimited = "rate_limited", 429, "A request bucket is empty: wait for Retry-After.";
    Busy = "busy", 503, "The gateway is saturated: retry after Retry-After.";
    ShuttingDown = "shutting_down", 503, "The instance is draining: retry on another.";
    DependencyUnavailable = "dependency_unavailable", 503, "A service or the database is unreachable.";
    ValidationOnly = "validation_only", 503, "The revision runs in validation mode and serves no API.";
    Internal = "internal", 500, "An unexpected failure; nothing was half-done.";
}

impl ErrorCode {
    /// Worth repeating the same request later: the gateway was busy, not the request wrong.
    pub fn is_retryable(self) -> bool {
        matches!(
            self,
            Self::RateLimited
                | Self::Busy
                | Self::ShuttingDown
                | Self::DependencyUnavailable
                | Self::Internal
        )
    }

    /// The session is not (or no longer) good: prove the key again.
    pub fn needs_login(self) -> bool {
        matches!(self, Self::InvalidToken | Self::SessionExpired)
    }
}

impl Serialize for ErrorCode {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(self.as_str())
    }
}

impl<'de> Deserialize<'de> for ErrorCode {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let code = String::deserialize(deserializer)?;
        Ok(Self::parse(&code))
    }
}

impl std::fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(feature = "openapi")]
impl utoipa::PartialSchema for ErrorCode {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        utoipa::openapi::ObjectBuilder::new()
            .schema_type(utoipa::openapi::schema::Type::String)
            .enum_values(Some(Self::ALL.iter().map(|c| c.as_str())))
            .description(Some("One of the contract's error codes."))
            .into()
    }
}

#[cfg(feature = "openapi")]
impl utoipa::ToSchema for ErrorCode {}

/// Every error answer's body.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ErrorBody {
    pub error: ErrorCode,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_round_trip_and_unknown_ones_are_tolerated() {
        for code in ErrorCode::ALL {
            assert_eq!(ErrorCode::parse(code.as_str()), *code);
            let body = serde_json::to_string(&ErrorBody { error: *code }).unwrap();
            assert_eq!(body, format!("{{\"error\":\"{}\"}}", code.as_str()));
        }
        let body: ErrorBody = serde_json::from_str(r#"{"error":"brand_new"}"#).unwrap();
        assert_eq!(body.error, ErrorCode::Unknown);
    }
}
