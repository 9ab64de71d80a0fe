use orca_push_proto::status_with_code;
use tonic::Code;

#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    #[error("invalid request: {0}")]
    InvalidRequest(&'static str),
    #[error("the host already has the maximum number of devices")]
    TooManyDevices,
    #[error("no such registration for this host")]
    NotFound,
    #[error("storage: {0}")]
    Storage(#[from] sqlx::Error),
}

impl From<RegistryError> for tonic::Status {
    fn from(error: RegistryError) -> Self {
        match error {
            RegistryError::InvalidRequest(reason) => {
                tracing::debug!(reason, "registry: invalid request");
                status_with_code(Code::InvalidArgument, "invalid_request")
            }
            RegistryError::TooManyDevices => {
                status_with_code(Code::ResourceExhausted, "too_many_devices")
            }
            RegistryError::NotFound => status_with_code(Code::NotFound, "not_found"),
            RegistryError::Storage(error) => {
                tracing::error!(%error, "registry: storage failure");
                status_with_code(Code::Unavailable, "dependency_unavailable")
            }
        }
    }
}
