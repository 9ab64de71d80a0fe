use orca_push_proto::status_with_code;
use tonic::Code;

/// Everything that can go wrong in the auth service.
#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    #[error("invalid request: {0}")]
    InvalidRequest(&'static str),
    #[error("unknown challenge")]
    InvalidChallenge,
    #[error("invalid proof: {0}")]
    InvalidProof(&'static str),
    #[error("unknown or malformed session token")]
    InvalidToken,
    #[error("session expired")]
    SessionExpired,
    #[error("the session key is unusable (not 32 bytes)")]
    CorruptSessionKey,
    #[error("the registry could not be asked")]
    DirectoryUnavailable,
    #[error("storage: {0}")]
    Storage(#[from] sqlx::Error),
    /// The task that commits a session ended without an answer (it panicked).
    #[error("the session's commit ended without an answer")]
    CommitTask,
}

impl From<AuthError> for tonic::Status {
    /// A host credential this service refuses (challenge, proof, session) is FAILED_PRECONDITION
    /// with its contract code: UNAUTHENTICATED and PERMISSION_DENIED only ever mean the caller's
    /// internal token was refused, which the facade answers as `dependency_unavailable`.
    fn from(error: AuthError) -> Self {
        match error {
            AuthError::InvalidRequest(reason) => {
                tracing::debug!(reason, "auth: invalid request");
                status_with_code(Code::InvalidArgument, "invalid_request")
            }
            AuthError::InvalidChallenge => {
                status_with_code(Code::FailedPrecondition, "invalid_challenge")
            }
            AuthError::InvalidProof(reason) => {
                tracing::debug!(reason, "auth: proof refused");
                status_with_code(Code::FailedPrecondition, "invalid_proof")
            }
            AuthError::InvalidToken => status_with_code(Code::FailedPrecondition, "invalid_token"),
            AuthError::SessionExpired => {
                status_with_code(Code::FailedPrecondition, "session_expired")
            }
            AuthError::CorruptSessionKey => {
                tracing::error!("auth: push_session_keys holds a key that is not 32 bytes");
                status_with_code(Code::Internal, "internal")
            }
            AuthError::DirectoryUnavailable => {
                status_with_code(Code::Unavailable, "dependency_unavailable")
            }
            AuthError::Storage(error) => {
                // The detail stays in our logs; callers get no internals.
                tracing::error!(%error, "auth: storage failure");
                status_with_code(Code::Unavailable, "dependency_unavailable")
            }
            AuthError::CommitTask => {
                tracing::error!("auth: a session's commit ended without an answer");
                status_with_code(Code::Unavailable, "dependency_unavailable")
            }
        }
    }
}
