//! `POST /v1/send`: validate the contract's schema, resolve the host's registrations with the
//! registry, admit the event with the queue, and answer one status per distinct id.

use axum::Json;
use axum::extract::State;
use orca_push_proto::queue::v1 as queue_pb;
use orca_push_proto::registry::v1 as registry_pb;
use serde::{Deserialize, Deserializer, Serialize};
use serde_json::Value;

use crate::app::AppState;
use crate::auth::AuthenticatedHost;
use crate::error::ApiError;
use crate::json::{StrictJson, V1};

/// The contract's caps.
pub const MAX_REGISTRATION_IDS: usize = 20;
pub const MAX_NOTIFICATION_BYTES: usize = 3000;
const MAX_SAFE_INTEGER: u64 = (1 << 53) - 1;

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct SendBody {
    #[allow(dead_code)]
    v: V1,
    registration_ids: Vec<String>,
    notification: Value,
}

#[derive(Deserialize, Clone, Copy)]
#[serde(rename_all = "kebab-case")]
enum SourceJson {
    AgentTaskComplete,
    TerminalBell,
    Plugin,
}

#[derive(Deserialize, Clone, Copy)]
#[serde(rename_all = "kebab-case")]
enum AgentStateJson {
    NeedsInput,
    Finished,
}

#[derive(Deserialize, Clone, Copy, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
enum KindJson {
    Alert,
    Dismiss,
}

/// `agentState` must be present, though it may be null: `Some(None)` is null, `None` is absent.
fn present<'de, D, T>(deserializer: D) -> Result<Option<Option<T>>, D::Error>
where
    D: Deserializer<'de>,
    T: Deserialize<'de>,
{
    Option::<T>::deserialize(deserializer).map(Some)
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct NotificationJson {
    #[serde(default)]
    notification_id: Option<String>,
    notification_seq: u64,
    notification_epoch: String,
    source: SourceJson,
    #[serde(default, deserialize_with = "present")]
    agent_state: Option<Option<AgentStateJson>>,
    title: String,
    body: String,
    #[serde(default)]
    worktree_id: Option<String>,
    #[serde(default)]
    kind: Option<KindJson>,
    #[serde(default)]
    expires_at: Option<i64>,
    #[serde(default)]
    sound: Option<bool>,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
pub struct SendResult {
    registration_id: String,
    status: &'static str,
}

#[derive(Serialize)]
pub struct SendReply {
    results: Vec<SendResult>,
}

fn utf16_len(value: &str) -> usize {
    value.encode_utf16().count()
}

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

/// Validates a whole send body; any failure is `invalid_request`.
pub fn parse_send(body: SendBody) -> Result<SendRequest, ApiError> {
    // The cap counts ids as sent; duplicates are folded afterwards, keeping first-seen order.
    if body.registration_ids.is_empty() || body.registration_ids.len() > MAX_REGISTRATION_IDS {
        return Err(ApiError::InvalidRequest);
    }
    if !body
        .registration_ids
        .iter()
        .all(|id| (1..=128).contains(&utf16_len(id)))
    {
        return Err(ApiError::InvalidRequest);
    }
    let (notification, silent) = parse_notification(body.notification)?;
    let mut registration_ids: Vec<String> = Vec::with_capacity(body.registration_ids.len());
    for id in body.registration_ids {
        if !registration_ids.contains(&id) {
            registration_ids.push(id);
        }
    }
    Ok(SendRequest {
        registration_ids,
        notification,
        silent,
    })
}

/// The contract's bounds on a notification; any failure is `invalid_request`.
fn parse_notification(raw: Value) -> Result<(queue_pb::Notification, bool), ApiError> {
    // The 3000-byte cap is on the UTF-8 JSON of the notification as parsed.
    let size = serde_json::to_vec(&raw)
        .map_err(|_| ApiError::InvalidRequest)?
        .len();
    if size > MAX_NOTIFICATION_BYTES {
        return Err(ApiError::InvalidRequest);
    }
    let n: NotificationJson = serde_json::from_value(raw).map_err(|_| ApiError::InvalidRequest)?;
    let printable = |s: &str| s.bytes().all(|b| (0x20..=0x7e).contains(&b));
    let valid = n
        .notification_id
        .as_deref()
        .is_none_or(|id| (1..=2048).contains(&id.len()) && printable(id))
        && n.notification_seq <= MAX_SAFE_INTEGER
        && (1..=128).contains(&utf16_len(&n.notification_epoch))
        && (1..=80).contains(&utf16_len(&n.title))
        && utf16_len(&n.body) <= 180
        && n.worktree_id
            .as_deref()
            .is_none_or(|w| utf16_len(w) <= 2048)
        && n.agent_state.is_some()
        && !(n.kind == Some(KindJson::Dismiss) && n.notification_id.is_none());
    if !valid {
        return Err(ApiError::InvalidRequest);
    }
    let notification = queue_pb::Notification {
        notification_id: n.notification_id,
        notification_seq: n.notification_seq,
        notification_epoch: n.notification_epoch,
        source: match n.source {
            SourceJson::AgentTaskComplete => "agent-task-complete",
            SourceJson::TerminalBell => "terminal-bell",
            SourceJson::Plugin => "plugin",
        }
        .to_owned(),
        agent_state: n.agent_state.flatten().map(|s| {
            match s {
                AgentStateJson::NeedsInput => "needs-input",
                AgentStateJson::Finished => "finished",
            }
            .to_owned()
        }),
        title: n.title,
        body: n.body,
        worktree_id: n.worktree_id,
        kind: match n.kind {
            Some(KindJson::Dismiss) => queue_pb::Kind::Dismiss,
            _ => queue_pb::Kind::Alert,
        } as i32,
        expires_at_ms: n.expires_at,
    };
    Ok((notification, n.sound == Some(false)))
}

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
    let resolved = orca_push_internal_auth::retry_unavailable(|| {
        let mut registry = backends.registry.clone();
        let request = registry_pb::ResolveRegistrationsRequest {
            host_fingerprint: host.fingerprint.clone(),
            registration_ids: ids.clone(),
        };
        async move { registry.resolve_registrations(request).await }
    })
    .await?
    .into_inner()
    .registrations;
    let status_of_registration = |id: &str| -> &'static str {
        match resolved.iter().find(|r| r.registration_id == id) {
            None => "error",
            Some(r) if r.dead => "dead",
            Some(_) => "queued",
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
        orca_push_internal_auth::retry_unavailable(|| {
            let mut queue = backends.queue.clone();
            let request = request.clone();
            async move { queue.enqueue(request).await }
        })
        .await?
        .into_inner()
        .results
    };
    let results = ids
        .into_iter()
        .map(|id| {
            let status = match status_of_registration(&id) {
                "queued" => match admitted
                    .iter()
                    .find(|r| r.registration_id == id)
                    .and_then(|r| queue_pb::EnqueueStatus::try_from(r.status).ok())
                {
                    Some(queue_pb::EnqueueStatus::Queued) => "queued",
                    Some(queue_pb::EnqueueStatus::RateLimited) => "rate_limited",
                    _ => "error",
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

    fn base() -> Value {
        json!({
            "notificationId": "n-1", "notificationSeq": 7, "notificationEpoch": "e-1",
            "source": "agent-task-complete", "agentState": null, "title": "Done", "body": "",
        })
    }

    #[test]
    fn accepts_the_contract_shape() {
        let (n, silent) = parse_notification(base()).unwrap();
        assert_eq!(n.kind, queue_pb::Kind::Alert as i32);
        assert!(!silent);
        let mut v = base();
        v["sound"] = json!(false);
        v["kind"] = json!("dismiss");
        v["expiresAt"] = json!(1_800_000_000_000u64);
        v["worktreeId"] = json!("wt");
        let (n, silent) = parse_notification(v).unwrap();
        assert!(silent);
        assert_eq!(n.kind, queue_pb::Kind::Dismiss as i32);
    }

    #[test]
    fn refuses_what_the_contract_refuses() {
        type Mutation = Box<dyn Fn(&mut Value)>;
        let cases: Vec<Mutation> = vec![
            Box::new(|v| drop(v.as_object_mut().unwrap().remove("agentState"))),
            Box::new(|v| v["agentState"] = json!("working")),
            Box::new(|v| v["title"] = json!("")),
            Box::new(|v| v["title"] = json!("t".repeat(81))),
            Box::new(|v| v["title"] = json!("😀".repeat(41))),
            Box::new(|v| v["body"] = json!("b".repeat(181))),
            Box::new(|v| v["notificationId"] = json!("x".repeat(2049))),
            Box::new(|v| v["notificationId"] = json!("tab\there")),
            Box::new(|v| v["notificationSeq"] = json!(-1)),
            Box::new(|v| v["notificationSeq"] = json!(9_007_199_254_740_992u64)),
            Box::new(|v| v["notificationEpoch"] = json!("")),
            Box::new(|v| v["source"] = json!("email")),
            Box::new(|v| v["kind"] = json!("delete")),
            Box::new(|v| v["sound"] = json!("off")),
            Box::new(|v| v["extra"] = json!(1)),
            Box::new(|v| {
                v.as_object_mut().unwrap().remove("notificationId");
                v["kind"] = json!("dismiss");
            }),
            Box::new(|v| v["worktreeId"] = json!("w".repeat(2049))),
        ];
        for (i, mutate) in cases.iter().enumerate() {
            let mut v = base();
            mutate(&mut v);
            assert!(parse_notification(v).is_err(), "case {i}");
        }
    }

    #[test]
    fn the_notification_is_at_most_3000_bytes_of_json() {
        let mut v = base();
        v["worktreeId"] = json!("w".repeat(2048));
        let room = 3000 - serde_json::to_vec(&v).unwrap().len() + "n-1".len();
        v["notificationId"] = json!("n".repeat(room));
        assert_eq!(serde_json::to_vec(&v).unwrap().len(), 3000);
        assert!(parse_notification(v.clone()).is_ok());
        v["body"] = json!("!");
        assert_eq!(serde_json::to_vec(&v).unwrap().len(), 3001);
        assert!(parse_notification(v).is_err());
    }
}
