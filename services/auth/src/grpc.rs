//! The tonic face of [`HostAuth`].

use std::sync::Arc;

use orca_push_proto::auth::v1 as pb;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

use crate::host_auth::{HostAuth, SessionNews};
use crate::store::AuthStore;

pub struct AuthGrpc<S> {
    auth: Arc<HostAuth<S>>,
    /// Ends session watches, so a draining server is not held open by them.
    shutdown: CancellationToken,
}

impl<S> AuthGrpc<S> {
    pub fn new(auth: Arc<HostAuth<S>>, shutdown: CancellationToken) -> Self {
        Self { auth, shutdown }
    }
}

type EventStream =
    std::pin::Pin<Box<dyn futures::Stream<Item = Result<pb::SessionEvent, Status>> + Send>>;

/// Session news as it comes, until `shutdown`; ABORTED (then the end) if the watcher fell behind or
/// news was lost.
fn session_events(
    news: tokio::sync::broadcast::Receiver<SessionNews>,
    shutdown: CancellationToken,
) -> EventStream {
    use tokio::sync::broadcast::error::RecvError;
    let lost = || Status::aborted("session news was lost: watch again");
    Box::pin(futures::stream::unfold(
        Some((news, shutdown)),
        move |state| async move {
            let (mut news, shutdown) = state?;
            let event = tokio::select! {
                biased;
                () = shutdown.cancelled() => return None,
                next = news.recv() => match next {
                    Ok(SessionNews::Replaced(host)) => pb::SessionEvent {
                        replaced_host_fingerprint: host,
                    },
                    Ok(SessionNews::Heard) => pb::SessionEvent::default(),
                    Ok(SessionNews::Lost) | Err(RecvError::Lagged(_)) => {
                        return Some((Err(lost()), None));
                    }
                    Err(RecvError::Closed) => return None,
                },
            };
            Some((Ok(event), Some((news, shutdown))))
        },
    ))
}

#[tonic::async_trait]
impl<S: AuthStore> pb::auth_service_server::AuthService for AuthGrpc<S> {
    type WatchSessionsStream = EventStream;

    async fn watch_sessions(
        &self,
        _request: Request<pb::WatchSessionsRequest>,
    ) -> Result<Response<Self::WatchSessionsStream>, Status> {
        let minted = self.auth.watch_sessions().ok_or_else(|| {
            Status::failed_precondition("this auth offers no session watch (re-check within 1 s)")
        })?;
        Ok(Response::new(session_events(minted, self.shutdown.clone())))
    }

    async fn issue_challenge(
        &self,
        request: Request<pb::IssueChallengeRequest>,
    ) -> Result<Response<pb::IssueChallengeResponse>, Status> {
        let issued = self
            .auth
            .issue_challenge(&request.into_inner().host_public_key)
            .await?;
        Ok(Response::new(pb::IssueChallengeResponse {
            challenge_id: issued.challenge_id,
            gateway_ephemeral_public_key: issued.gateway_ephemeral_public_key.to_vec(),
            nonce: issued.nonce.to_vec(),
            ciphertext: issued.ciphertext,
            expires_at_ms: to_wire_time(issued.expires_at_ms),
        }))
    }

    async fn create_session(
        &self,
        request: Request<pb::CreateSessionRequest>,
    ) -> Result<Response<pb::CreateSessionResponse>, Status> {
        let request = request.into_inner();
        let session = self
            .auth
            .create_session(&request.challenge_id, &request.proof)
            .await?;
        Ok(Response::new(pb::CreateSessionResponse {
            session_token: session.token,
            expires_at_ms: to_wire_time(session.expires_at_ms),
            host_fingerprint: session.host_fingerprint,
        }))
    }

    async fn authenticate(
        &self,
        request: Request<pb::AuthenticateRequest>,
    ) -> Result<Response<pb::AuthenticateResponse>, Status> {
        let host = self
            .auth
            .authenticate(&request.into_inner().session_token)
            .await?;
        Ok(Response::new(pb::AuthenticateResponse {
            host_fingerprint: host.host_fingerprint,
            expires_at_ms: to_wire_time(host.expires_at_ms),
        }))
    }

    async fn get_session_key(
        &self,
        _request: Request<pb::GetSessionKeyRequest>,
    ) -> Result<Response<pb::GetSessionKeyResponse>, Status> {
        let tagging = self.auth.session_tagging().await?;
        Ok(Response::new(pb::GetSessionKeyResponse {
            key: tagging.key.as_bytes().to_vec(),
            legacy_until_ms: to_wire_time(tagging.legacy_until_ms),
        }))
    }
}

fn to_wire_time(ms: u64) -> i64 {
    i64::try_from(ms).unwrap_or(i64::MAX)
}
