//! What the dispatcher and the outbox need of a gateway: a trait, so their tests can stand in a
//! scripted gateway, and [`crate::GatewayClient`] is the real one.

use std::future::Future;

use orca_push_api::{Health, RegisterReply, RegisterRequest, SendReply, SendRequest};

use crate::{GatewayClient, GatewayError};

pub trait Gateway: Send + Sync + 'static {
    fn register(
        &self,
        request: &RegisterRequest,
    ) -> impl Future<Output = Result<RegisterReply, GatewayError>> + Send;

    /// A registration that is already gone answers `not_found`.
    fn unregister(
        &self,
        registration_id: &str,
    ) -> impl Future<Output = Result<(), GatewayError>> + Send;

    fn send(
        &self,
        request: &SendRequest,
    ) -> impl Future<Output = Result<SendReply, GatewayError>> + Send;

    fn health(&self) -> impl Future<Output = Result<Health, GatewayError>> + Send;
}

impl Gateway for GatewayClient {
    async fn register(&self, request: &RegisterRequest) -> Result<RegisterReply, GatewayError> {
        GatewayClient::register(self, request).await
    }

    async fn unregister(&self, registration_id: &str) -> Result<(), GatewayError> {
        GatewayClient::unregister(self, registration_id).await
    }

    async fn send(&self, request: &SendRequest) -> Result<SendReply, GatewayError> {
        GatewayClient::send(self, request).await
    }

    async fn health(&self) -> Result<Health, GatewayError> {
        GatewayClient::health(self).await
    }
}

impl<G: Gateway> Gateway for std::sync::Arc<G> {
    fn register(
        &self,
        request: &RegisterRequest,
    ) -> impl Future<Output = Result<RegisterReply, GatewayError>> + Send {
        G::register(self, request)
    }

    fn unregister(
        &self,
        registration_id: &str,
    ) -> impl Future<Output = Result<(), GatewayError>> + Send {
        G::unregister(self, registration_id)
    }

    fn send(
        &self,
        request: &SendRequest,
    ) -> impl Future<Output = Result<SendReply, GatewayError>> + Send {
        G::send(self, request)
    }

    fn health(&self) -> impl Future<Output = Result<Health, GatewayError>> + Send {
        G::health(self)
    }
}
