//! `POST /v1/send`: validate the contract's schema, resolve the host's registrations with the
//! registry, admit the event with the queue, and answer one status per distinct id.

use axum::Json;
use axum::extract::State;
use orca_push_api::{ErrorBody, SendReply, SendResult, SendStatus};
use orca_push_proto::queue::v1 as queue_pb;
use orca_push_proto::registry::v1 as registry_pb;

use crate::app::AppState;
use crate::auth::AuthenticatedHost;
use crate::error::ApiError;
use crate::json::StrictJson;

/// The contract's caps, from the API crate.
pub use orca_push_api::limits::{MAX_NOTIFICATION_BYTES, MAX_REGISTRATION_IDS};

/// The body as the public API defines it.
pub type SendBody = orca_push_api::SendRequest;

/// A send body that passed every check of the contract: what the handler asks the registry and
/// the queue about.
#[derive(Debug, Clone, PartialEq)]
pub struct SendRequest {
    /// Distinct, in first-seen order.
    pub registration_ids: Vec<String>,
    pub notification: queue_pb::Notification,
    /// `sound: false`.
    pub silent: bool,
}

/// Validates a whole send body (the API crate's rules); any failure is `invalid_request`.
pub fn parse_send(body: SendBody) -> Result<SendRequest, ApiError> {
    // The size was measured as the body was read (`SendRequest`'s deserializer).
    body.validate_parsed()
        .map_err(|_| ApiError::InvalidRequest)?;
    let registration_ids = body.distinct_ids();
    let silent = body.notification.is_silent();
    Ok(SendRequest {
        registration_ids,
        notification: body.notification.into(),
        silent,
    })
}

/// One notification to at most 20 of this host's registrations: one result per distinct id.
#[utoipa::path(
    post,
    path = "/v1/send",
    tag = "send",
    request_body = SendBody,
    responses(
        (status = 200, description = "One status per distinct registration id, in first-seen order; `queued` means committed", body = SendReply),
        (status = 400, description = "`invalid_request`: the body breaks the contract's schema or bounds", body = ErrorBody),
        (status = 401, description = "`invalid_token` or `session_expired`: prove the key again", body = ErrorBody),
        (status = 413, description = "`request_too_large`: the body is over 16 KiB", body = ErrorBody),
        (status = 429, description = "`rate_limited`: a request bucket is empty (Retry-After says when to come back)", body = ErrorBody),
        (status = 500, description = "`internal`", body = ErrorBody),
        (status = 503, description = "`busy` (with Retry-After), `shutting_down`, `dependency_unavailable` or `validation_only`", body = ErrorBody),
    ),
    security(("bearer" = [])),
)]
pub async fn send(
    State(state): State<AppState>,
    host: AuthenticatedHost,
    StrictJson(body): StrictJson<SendBody>,
) -> Result<Json<SendReply>, ApiError> {
    let SendRequest {
        registration_ids: ids,
        notification,
        silent,
    } = parse_send(body)?;
    let backends = state.backends()?;
    // Both calls are idempotent (a repeated admission of one event identity is a no-op), so a
    // replica lost mid-call is retried once on another.
    let read = || async {
        let resolved = orca_push_internal_auth::retry_unavailable(|| {
            let mut registry = backends.registry.clone();
            let request = registry_pb::ResolveRegistrationsRequest {
                host_fingerprint: host.fingerprint.clone(),
                registration_ids: ids.clone(),
            };
            async move { registry.resolve_registrations(request).await }
        })
        .await?;
        Ok::<_, ApiError>(resolved.into_inner().registrations)
    };
    let resolved = backends
        .resolves
        .resolve(&host.fingerprint, &ids, read)
        .await?;
    let status_of_registration = |id: &str| -> SendStatus {
        match resolved.iter().find(|r| r.registration_id == id) {
            None => SendStatus::Error,
            Some(r) if r.dead => SendStatus::Dead,
            Some(_) => SendStatus::Queued,
        }
    };
    // In request order.
    let deliverable: Vec<queue_pb::Recipient> = ids
        .iter()
        .filter_map(|id| {
            resolved
                .iter()
                .find(|r| &r.registration_id == id && !r.dead)
        })
        .map(|r| queue_pb::Recipient {
            registration_id: r.registration_id.clone(),
            silent,
            provider: if r.platform == registry_pb::Platform::Ios as i32 {
                queue_pb::Provider::Apns
            } else {
                queue_pb::Provider::Fcm
            } as i32,
        })
        .collect();
    let admitted = if deliverable.is_empty() {
        Vec::new()
    } else {
        let request = queue_pb::EnqueueRequest {
            host_fingerprint: host.fingerprint,
            notification: Some(notification),
            recipients: deliverable,
        };
        orca_push_internal_auth::retry_unavailable(|| backends.enqueue(request.clone()))
            .await?
            .results
    };
    let results = ids
        .into_iter()
        .map(|id| {
            let status = match status_of_registration(&id) {
                SendStatus::Queued => match admitted
                    .iter()
                    .find(|r| r.registration_id == id)
                    .and_then(|r| queue_pb::EnqueueStatus::try_from(r.status).ok())
                {
                    Some(queue_pb::EnqueueStatus::Queued) => SendStatus::Queued,
                    Some(queue_pb::EnqueueStatus::RateLimited) => SendStatus::RateLimited,
                    _ => SendStatus::Error,
                },
                other => other,
            };
            SendResult {
                registration_id: id,
                status,
            }
        })
        .collect();
    Ok(Json(SendReply { results }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn body(notification: serde_json::Value) -> Result<SendRequest, ApiError> {
        let bytes = serde_json::to_vec(&json!({
            "v": 1, "registrationIds": ["a", "b", "a"], "notification": notification,
        }))
        .unwrap();
        crate::json::parse_body::<SendBody>(&bytes).and_then(parse_send)
    }

    /// The field rules themselves are tested in the API crate; this proves the facade applies
    /// them and converts to the wire once.
    #[test]
    fn the_facade_parses_with_the_api_types() {
        let notification = json!({
            "notificationId": "n-1", "notificationSeq": 7, "notificationEpoch": "e-1",
            "source": "terminal-bell", "agentState": "finished", "title": "Done", "body": "",
            "kind": "dismiss", "sound": false,
        });
        let request = body(notification.clone()).unwrap();
        assert_eq!(request.registration_ids, ["a", "b"]);
        assert!(request.silent);
        assert_eq!(request.notification.kind, queue_pb::Kind::Dismiss as i32);
        assert_eq!(request.notification.source, "terminal-bell");
        assert_eq!(
            request.notification.agent_state.as_deref(),
            Some("finished")
        );
        let mut long = notification;
        long["title"] = json!("t".repeat(81));
        assert_eq!(body(long), Err(ApiError::InvalidRequest));
    }
}
