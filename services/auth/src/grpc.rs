//! The tonic face of [`HostAuth`].

use std::sync::Arc;

use orca_push_internal_auth::news::{NewsStream, Told, news_stream};
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

type EventStream = NewsStream<pb::SessionEvent>;

/// What a `WatchSessions` watcher is told of each piece of session news.
fn tell(news: SessionNews) -> Told<pb::SessionEvent> {
    match news {
        SessionNews::Replaced(host) => Told::Event(pb::SessionEvent {
            replaced_host_fingerprint: host,
        }),
        SessionNews::Heard => Told::Event(pb::SessionEvent::default()),
        SessionNews::Lost => Told::Lost,
    }
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
        Ok(Response::new(news_stream(
            minted,
            self.shutdown.clone(),
            "session",
            tell,
        )))
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
