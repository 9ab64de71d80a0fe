//! The exact provider payloads of the contract's "Provider payloads": APNs headers and body, and the
//! FCM HTTP v1 message, for alerts, summaries, silent alerts and dismissals.

use orca_push_proto::queue::v1 as pb;
use serde_json::{Map, Value, json};
use sha2::{Digest as _, Sha256};

/// What one delivery attempt sends, independent of the provider.
#[derive(Debug, Clone)]
pub struct Job {
    pub batch_id: String,
    pub lease_token: String,
    pub registration_id: String,
    pub host_fingerprint: String,
    pub dismiss: bool,
    /// Provider answers so far, plus one.
    pub attempt: u32,
    /// Retries scheduled so far: the backoff grows with it.
    pub retries: u32,
    /// The earliest member's deadline: nothing goes after it.
    pub deadline_ms: i64,
    pub collapse_id: String,
    pub silent: bool,
    pub content: pb::DeliveryContent,
    pub member_traceparents: Vec<String>,
}

impl Job {
    pub fn from_claim(batch: pb::ClaimedBatch) -> Self {
        Self {
            dismiss: batch.kind == pb::Kind::Dismiss as i32,
            batch_id: batch.batch_id,
            lease_token: batch.lease_token,
            registration_id: batch.registration_id,
            host_fingerprint: batch.host_fingerprint,
            attempt: batch.attempt,
            retries: batch.retries,
            deadline_ms: batch.deadline_ms,
            collapse_id: batch.collapse_id,
            silent: batch.silent,
            content: batch.content.unwrap_or_default(),
            member_traceparents: batch.member_traceparents,
        }
    }
}

/// The `orca` fields the phone reads (APNs keeps their types). Serialized typed rather than built
/// as a JSON map (building and writing the map was 1.8% of the gateway's samples at 1,000 APNs
/// flows); the fields are declared in key order, so the bytes are those a map writes.
#[derive(serde::Serialize)]
#[serde(rename_all = "camelCase")]
struct OrcaFields<'a> {
    agent_state: Option<&'a str>,
    coalesced_count: u32,
    host_fingerprint: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    kind: Option<&'static str>,
    notification_epoch: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    notification_id: Option<&'a str>,
    notification_seq: u64,
    source: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    summary_members: Option<Vec<Member<'a>>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    worktree_id: Option<&'a str>,
}

#[derive(serde::Serialize)]
#[serde(rename_all = "camelCase")]
struct Member<'a> {
    notification_epoch: &'a str,
    notification_id: &'a str,
    notification_seq: u64,
}

impl<'a> OrcaFields<'a> {
    fn of(job: &'a Job) -> Self {
        let c = &job.content;
        Self {
            agent_state: c.agent_state.as_deref(),
            coalesced_count: c.coalesced_count,
            host_fingerprint: &job.host_fingerprint,
            kind: job.dismiss.then_some("dismiss"),
            notification_epoch: &c.notification_epoch,
            notification_id: c.notification_id.as_deref(),
            notification_seq: c.notification_seq,
            source: &c.source,
            summary_members: (!c.summary_members.is_empty()).then(|| {
                c.summary_members
                    .iter()
                    .map(|m| Member {
                        notification_epoch: &m.notification_epoch,
                        notification_id: &m.notification_id,
                        notification_seq: m.notification_seq,
                    })
                    .collect()
            }),
            worktree_id: c.worktree_id.as_deref(),
        }
    }
}

/// The APNs body, its keys in order as for `OrcaFields`.
#[derive(serde::Serialize)]
struct ApnsBody<'a> {
    aps: Aps<'a>,
    orca: OrcaFields<'a>,
}

#[derive(serde::Serialize)]
#[serde(untagged)]
enum Aps<'a> {
    Alert {
        alert: Alert<'a>,
        #[serde(skip_serializing_if = "Option::is_none")]
        sound: Option<&'static str>,
        #[serde(rename = "thread-id")]
        thread_id: &'a str,
    },
    Background {
        #[serde(rename = "content-available")]
        content_available: u8,
    },
}

#[derive(serde::Serialize)]
struct Alert<'a> {
    body: &'a str,
    title: &'a str,
}

/// An APNs request: path, headers (without authorization) and body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApnsRequest {
    pub path: String,
    pub headers: Vec<(&'static str, String)>,
    pub body: Vec<u8>,
}

/// The APNs request for `job` to `token`. `apns-expiration` is the event's fixed deadline.
pub fn apns_request(job: &Job, token: &str, topic: &str) -> ApnsRequest {
    let expiration = (job.deadline_ms / 1000).max(0).to_string();
    let mut headers = vec![("apns-topic", topic.to_owned())];
    let aps = if job.dismiss {
        headers.push(("apns-push-type", "background".to_owned()));
        headers.push(("apns-priority", "5".to_owned()));
        headers.push(("apns-expiration", expiration));
        Aps::Background {
            content_available: 1,
        }
    } else {
        headers.push(("apns-push-type", "alert".to_owned()));
        headers.push(("apns-priority", "10".to_owned()));
        headers.push(("apns-expiration", expiration));
        headers.push(("apns-collapse-id", job.collapse_id.clone()));
        Aps::Alert {
            alert: Alert {
                body: &job.content.body,
                title: &job.content.title,
            },
            sound: (!job.silent).then_some("default"),
            thread_id: &job.host_fingerprint,
        }
    };
    let body = ApnsBody {
        aps,
        orca: OrcaFields::of(job),
    };
    ApnsRequest {
        path: format!("/3/device/{token}"),
        headers,
        body: serde_json::to_vec(&body).unwrap_or_default(),
    }
}

/// FCM `collapse_key`: the first 32 hex characters of sha256(collapse id).
pub fn fcm_collapse_key(collapse_id: &str) -> String {
    let mut key = hex::encode(Sha256::digest(collapse_id.as_bytes()));
    key.truncate(32);
    key
}

/// The FCM HTTP v1 message for `job` to `token`, `now_ms` deciding the remaining lifetime.
pub fn fcm_message(job: &Job, token: &str, now_ms: i64) -> Value {
    let remaining_s = ((job.deadline_ms - now_ms).max(0) / 1000).clamp(0, 300);
    // FCM data values are strings: numbers as text, summaryMembers as a JSON string, null omitted.
    // Strings, numbers and a list of them: `to_value` cannot fail on these fields, and a struct
    // always becomes an object.
    let orca = match serde_json::to_value(OrcaFields::of(job)) {
        Ok(Value::Object(orca)) => orca,
        _ => Map::new(),
    };
    let data: Map<String, Value> = orca
        .into_iter()
        .filter_map(|(k, v)| match v {
            Value::Null => None,
            Value::String(s) => Some((k, Value::String(s))),
            other => Some((k, Value::String(other.to_string()))),
        })
        .collect();
    let mut android = Map::new();
    android.insert("priority".into(), json!("HIGH"));
    android.insert("ttl".into(), json!(format!("{remaining_s}s")));
    // Every message, a dismissal too (the contract's shape; the original gateway's): a dismissal
    // has its alert's collapse id, so FCM keeps only the dismissal for a phone that is offline.
    android.insert(
        "collapse_key".into(),
        json!(fcm_collapse_key(&job.collapse_id)),
    );
    let mut message = Map::new();
    message.insert("token".into(), json!(token));
    if !job.dismiss {
        message.insert(
            "notification".into(),
            json!({ "title": job.content.title, "body": job.content.body }),
        );
        android.insert(
            "notification".into(),
            json!({
                "channel_id": if job.silent { "orca-desktop-silent" } else { "orca-desktop" },
                "tag": job.collapse_id,
            }),
        );
    }
    message.insert("android".into(), Value::Object(android));
    message.insert("data".into(), Value::Object(data));
    json!({ "message": Value::Object(message) })
}

#[cfg(test)]
mod tests {
    use super::*;

    pub fn job(dismiss: bool, silent: bool, members: usize) -> Job {
        let summary_members = if members > 1 {
            (0..members)
                .map(|i| pb::SummaryMember {
                    notification_id: format!("n-{i}"),
                    notification_epoch: "e".into(),
                    notification_seq: i as u64,
                })
                .collect()
        } else {
            Vec::new()
        };
        Job {
            batch_id: "b".into(),
            lease_token: "l".into(),
            registration_id: "r".into(),
            host_fingerprint: "D20lU_8MD0R64gLt".into(),
            dismiss,
            attempt: 1,
            retries: 0,
            deadline_ms: 1_800_000_300_000,
            collapse_id: "c".repeat(64),
            silent,
            content: pb::DeliveryContent {
                title: "Agent finished".into(),
                body: "Refactor done".into(),
                notification_id: Some("n-1".into()),
                notification_seq: 12,
                notification_epoch: "e".into(),
                source: "agent-task-complete".into(),
                agent_state: Some("finished".into()),
                worktree_id: Some("wt".into()),
                coalesced_count: members.max(1) as u32,
                summary_members,
            },
            member_traceparents: Vec::new(),
        }
    }

    fn header<'a>(r: &'a ApnsRequest, name: &str) -> Option<&'a str> {
        r.headers
            .iter()
            .find(|(k, _)| *k == name)
            .map(|(_, v)| v.as_str())
    }

    #[test]
    fn apns_alert_is_exactly_the_contract() {
        let r = apns_request(&job(false, false, 1), "abcd", "com.stably.orca.mobile");
        assert_eq!(r.path, "/3/device/abcd");
        assert_eq!(header(&r, "apns-topic"), Some("com.stably.orca.mobile"));
        assert_eq!(header(&r, "apns-push-type"), Some("alert"));
        assert_eq!(header(&r, "apns-priority"), Some("10"));
        assert_eq!(header(&r, "apns-expiration"), Some("1800000300"));
        assert_eq!(
            header(&r, "apns-collapse-id"),
            Some("c".repeat(64).as_str())
        );
        // Byte for byte what a JSON map writes (keys in order): the body as it always was.
        assert_eq!(
            String::from_utf8(r.body).unwrap(),
            json!({
                "aps": { "alert": { "title": "Agent finished", "body": "Refactor done" }, "sound": "default", "thread-id": "D20lU_8MD0R64gLt" },
                "orca": {
                    "hostFingerprint": "D20lU_8MD0R64gLt", "worktreeId": "wt", "notificationId": "n-1",
                    "notificationSeq": 12, "notificationEpoch": "e", "source": "agent-task-complete",
                    "agentState": "finished", "coalescedCount": 1
                }
            })
            .to_string()
        );
    }

    /// Optional fields left out or null as the contract has them, byte for byte as a map writes
    /// them: a silent summary without a notification id, worktree or agent state, and a dismissal.
    #[test]
    fn apns_bodies_are_byte_for_byte_what_a_json_map_writes() {
        let mut summary = job(false, true, 2);
        summary.content.notification_id = None;
        summary.content.worktree_id = None;
        summary.content.agent_state = None;
        let r = apns_request(&summary, "abcd", "t");
        assert_eq!(
            String::from_utf8(r.body).unwrap(),
            json!({
                "aps": { "alert": { "title": "Agent finished", "body": "Refactor done" }, "thread-id": "D20lU_8MD0R64gLt" },
                "orca": {
                    "hostFingerprint": "D20lU_8MD0R64gLt", "notificationSeq": 12, "notificationEpoch": "e",
                    "source": "agent-task-complete", "agentState": null, "coalescedCount": 2,
                    "summaryMembers": [
                        { "notificationId": "n-0", "notificationEpoch": "e", "notificationSeq": 0 },
                        { "notificationId": "n-1", "notificationEpoch": "e", "notificationSeq": 1 }
                    ]
                }
            })
            .to_string()
        );
        let d = apns_request(&job(true, false, 1), "abcd", "t");
        assert_eq!(
            String::from_utf8(d.body).unwrap(),
            json!({
                "aps": { "content-available": 1 },
                "orca": {
                    "hostFingerprint": "D20lU_8MD0R64gLt", "worktreeId": "wt", "notificationId": "n-1",
                    "notificationSeq": 12, "notificationEpoch": "e", "source": "agent-task-complete",
                    "agentState": "finished", "coalescedCount": 1, "kind": "dismiss"
                }
            })
            .to_string()
        );
    }

    #[test]
    fn apns_silent_summary_and_dismissal() {
        let r = apns_request(&job(false, true, 3), "abcd", "t");
        let body: Value = serde_json::from_slice(&r.body).unwrap();
        assert!(body["aps"].get("sound").is_none());
        assert_eq!(body["orca"]["coalescedCount"], 3);
        assert_eq!(
            body["orca"]["summaryMembers"][2],
            json!({ "notificationId": "n-2", "notificationEpoch": "e", "notificationSeq": 2 })
        );
        let d = apns_request(&job(true, false, 1), "abcd", "t");
        assert_eq!(header(&d, "apns-push-type"), Some("background"));
        assert_eq!(header(&d, "apns-priority"), Some("5"));
        assert_eq!(header(&d, "apns-collapse-id"), None);
        let body: Value = serde_json::from_slice(&d.body).unwrap();
        assert_eq!(body["aps"], json!({ "content-available": 1 }));
        assert_eq!(body["orca"]["kind"], "dismiss");
    }

    #[test]
    fn fcm_alert_summary_silent_and_dismissal() {
        let now = 1_800_000_300_000 - 120_500;
        let m = fcm_message(&job(false, false, 2), "tok", now);
        let msg = &m["message"];
        assert_eq!(msg["token"], "tok");
        assert_eq!(
            msg["notification"],
            json!({ "title": "Agent finished", "body": "Refactor done" })
        );
        assert_eq!(msg["android"]["priority"], "HIGH");
        assert_eq!(msg["android"]["ttl"], "120s");
        assert_eq!(
            msg["android"]["collapse_key"],
            fcm_collapse_key(&"c".repeat(64))
        );
        assert_eq!(msg["android"]["collapse_key"].as_str().unwrap().len(), 32);
        assert_eq!(
            msg["android"]["notification"],
            json!({ "channel_id": "orca-desktop", "tag": "c".repeat(64) })
        );
        assert_eq!(msg["data"]["notificationSeq"], "12");
        assert_eq!(msg["data"]["coalescedCount"], "2");
        let members: Value =
            serde_json::from_str(msg["data"]["summaryMembers"].as_str().unwrap()).unwrap();
        assert_eq!(members.as_array().unwrap().len(), 2);
        assert!(
            msg["data"]
                .as_object()
                .unwrap()
                .values()
                .all(Value::is_string)
        );
        let silent = fcm_message(&job(false, true, 1), "tok", now);
        assert_eq!(
            silent["message"]["android"]["notification"]["channel_id"],
            "orca-desktop-silent"
        );
        let d = fcm_message(&job(true, false, 1), "tok", now);
        assert!(d["message"].get("notification").is_none());
        assert!(d["message"]["android"].get("notification").is_none());
        assert_eq!(
            d["message"]["android"]["collapse_key"],
            fcm_collapse_key(&job(true, false, 1).collapse_id),
            "a dismissal keeps its collapse key"
        );
        assert_eq!(d["message"]["data"]["kind"], "dismiss");
        // The lifetime is capped at 300 s and never negative.
        assert_eq!(
            fcm_message(&job(false, false, 1), "t", 0)["message"]["android"]["ttl"],
            "300s"
        );
        assert_eq!(
            fcm_message(&job(false, false, 1), "t", i64::MAX / 2)["message"]["android"]["ttl"],
            "0s"
        );
    }
}
