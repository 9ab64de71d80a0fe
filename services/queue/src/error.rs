use orca_push_proto::status_with_code;
use tonic::Code;

#[derive(Debug, thiserror::Error)]
pub enum QueueError {
    #[error("invalid request: {0}")]
    InvalidRequest(&'static str),
    #[error("storage: {0}")]
    Storage(#[from] sqlx::Error),
    #[error("the claim task ended without an answer")]
    ClaimTask,
    #[error("the admission writer stopped")]
    WriterStopped,
    /// A round committed but could not be synced to disk (`orca_push_storage::wal_sync`).
    #[error("{0}")]
    NotDurable(#[from] orca_push_storage::SyncFailed),
    /// A writer's round failed for every report it carried.
    #[error("{0}")]
    Round(std::sync::Arc<QueueError>),
    /// A claim's commit failed, and the server may have committed it all the same (PostgreSQL:
    /// the answer lost with the connection): `leased` may be leased to no lane that will send
    /// them. Whoever ran the claim gives them back (`handoff::hand_back`) and answers `error`.
    #[error("{error}")]
    ClaimNotCommitted {
        leased: Vec<crate::store::ClaimedBatch>,
        error: Box<QueueError>,
    },
}

impl QueueError {
    /// Whether the database connection the work ran on was lost under it (`connection_lost`).
    pub fn connection_lost(&self) -> bool {
        match self {
            QueueError::Storage(error) => connection_lost(error),
            QueueError::ClaimNotCommitted { error, .. } => error.connection_lost(),
            _ => false,
        }
    }
}

/// Whether `error` says the connection it came on is gone: broken (an I/O error) or closed by
/// the server (a connection failure of class `08`; `57P01`-`57P03` a terminated backend, a
/// shutdown, a restart; `57P05` an idle session's timeout). The pool replaces such a connection,
/// so the work may succeed on the next. A protocol violation (`08P01`) or a dropped database
/// (`57P04`) would fail again, and is not counted.
pub fn connection_lost(error: &sqlx::Error) -> bool {
    match error {
        sqlx::Error::Io(_) => true,
        sqlx::Error::Database(error) => error.code().is_some_and(|code| {
            matches!(
                &*code,
                "08000"
                    | "08001"
                    | "08003"
                    | "08004"
                    | "08006"
                    | "08007"
                    | "57P01"
                    | "57P02"
                    | "57P03"
                    | "57P05"
            )
        }),
        _ => false,
    }
}

impl From<QueueError> for tonic::Status {
    fn from(error: QueueError) -> Self {
        match error {
            QueueError::InvalidRequest(reason) => {
                tracing::debug!(reason, "queue: invalid request");
                status_with_code(Code::InvalidArgument, "invalid_request")
            }
            QueueError::Storage(error) => {
                tracing::error!(%error, "queue: storage failure");
                status_with_code(Code::Unavailable, "dependency_unavailable")
            }
            QueueError::ClaimTask => {
                tracing::error!("queue: the claim task ended without an answer");
                status_with_code(Code::Unavailable, "dependency_unavailable")
            }
            QueueError::WriterStopped => {
                tracing::error!("queue: the admission writer stopped");
                status_with_code(Code::Unavailable, "dependency_unavailable")
            }
            QueueError::NotDurable(error) => {
                tracing::error!(%error, "queue: a committed round is not on disk");
                status_with_code(Code::Unavailable, "dependency_unavailable")
            }
            QueueError::Round(error) => {
                tracing::error!(%error, "queue: a writer's round failed");
                status_with_code(Code::Unavailable, "dependency_unavailable")
            }
            QueueError::ClaimNotCommitted { error, .. } => (*error).into(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::QueueError;

    #[test]
    fn a_broken_or_closed_connection_is_lost_and_nothing_else_is() {
        let io = std::io::Error::new(std::io::ErrorKind::ConnectionReset, "reset");
        assert!(QueueError::Storage(sqlx::Error::Io(io)).connection_lost());
        assert!(!QueueError::Storage(sqlx::Error::PoolTimedOut).connection_lost());
        assert!(!QueueError::Storage(sqlx::Error::RowNotFound).connection_lost());
        assert!(!QueueError::WriterStopped.connection_lost());
        assert!(!QueueError::InvalidRequest("bad").connection_lost());
    }
}
