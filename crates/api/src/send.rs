//! `POST /v1/send`.

use serde::{Deserialize, Deserializer, Serialize};

use crate::limits::{self, MAX_NOTIFICATION_BYTES, MAX_REGISTRATION_IDS, MAX_SAFE_INTEGER};
use crate::{AgentState, Invalid, Kind, Source, V1};

/// One notification, as the host sends it and the gateway admits it. Its JSON is at most 3,000
/// UTF-8 bytes; lengths are counted in UTF-16 code units.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct Notification {
    /// Absent only for a terminal bell; a dismissal needs one. Printable ASCII.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(
        feature = "openapi",
        schema(min_length = 1, max_length = 2048, pattern = "^[ -~]+$")
    )]
    pub notification_id: Option<String>,
    #[cfg_attr(feature = "openapi", schema(maximum = 9_007_199_254_740_991_u64))]
    pub notification_seq: u64,
    #[cfg_attr(feature = "openapi", schema(min_length = 1, max_length = 128))]
    pub notification_epoch: String,
    pub source: Source,
    /// Required, and may be null.
    #[serde(deserialize_with = "nullable")]
    #[cfg_attr(feature = "openapi", schema(required = true))]
    pub agent_state: Option<AgentState>,
    #[cfg_attr(feature = "openapi", schema(min_length = 1, max_length = 80))]
    pub title: String,
    #[cfg_attr(feature = "openapi", schema(max_length = 180))]
    pub body: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(max_length = 2048))]
    pub worktree_id: Option<String>,
    /// Alert when absent. Taken by gateways whose `/health` says `deliveryProtocol` 2 or more.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<Kind>,
    /// Unix ms; the gateway caps it at five minutes from first acceptance.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expires_at: Option<i64>,
    /// `Some(false)` asks for a silent alert.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sound: Option<bool>,
}

impl std::fmt::Debug for Notification {
    /// Never shows the title, body or ids: they are the user's text.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Notification")
            .field("notification_seq", &self.notification_seq)
            .field("source", &self.source)
            .field("agent_state", &self.agent_state)
            .field("kind", &self.kind)
            .field("expires_at", &self.expires_at)
            .field("sound", &self.sound)
            .finish_non_exhaustive()
    }
}

/// A required field that may be null: absent is an error, unlike a plain `Option`.
fn nullable<'de, D, T>(deserializer: D) -> Result<Option<T>, D::Error>
where
    D: Deserializer<'de>,
    T: Deserialize<'de>,
{
    Option::<T>::deserialize(deserializer)
}

impl Notification {
    /// The contract's bounds on each field (the size cap is the request's, see [`SendRequest`]).
    pub fn validate(&self) -> Result<(), Invalid> {
        if let Some(id) = &self.notification_id
            && !limits::is_notification_id(id)
        {
            return Err(Invalid("notificationId: 1 to 2048 printable ASCII"));
        }
        if self.notification_seq > MAX_SAFE_INTEGER {
            return Err(Invalid("notificationSeq: 0 to 2^53-1"));
        }
        if !limits::is_opaque_id(&self.notification_epoch) {
            return Err(Invalid("notificationEpoch: 1 to 128 characters"));
        }
        if !limits::is_title(&self.title) {
            return Err(Invalid("title: 1 to 80 characters"));
        }
        if !limits::is_body(&self.body) {
            return Err(Invalid("body: at most 180 characters"));
        }
        if let Some(w) = &self.worktree_id
            && !limits::is_worktree_id(w)
        {
            return Err(Invalid("worktreeId: at most 2048 characters"));
        }
        if self.kind == Some(Kind::Dismiss) && self.notification_id.is_none() {
            return Err(Invalid("a dismissal needs a notificationId"));
        }
        Ok(())
    }

    /// Bytes of this notification's UTF-8 JSON: what the 3000-byte cap measures.
    pub fn json_len(&self) -> usize {
        json_len(self).unwrap_or(usize::MAX)
    }

    /// The kind, with the contract's default.
    pub fn kind(&self) -> Kind {
        self.kind.unwrap_or(Kind::Alert)
    }

    /// `sound: false`.
    pub fn is_silent(&self) -> bool {
        self.sound == Some(false)
    }
}

/// The body of `POST /v1/send`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct SendRequest {
    pub v: V1,
    /// 1 to 20, counted as sent; the gateway answers each distinct id once, first-seen order.
    #[cfg_attr(feature = "openapi", schema(min_items = 1, max_items = 20))]
    pub registration_ids: Vec<String>,
    #[serde(deserialize_with = "within_size_cap")]
    pub notification: Notification,
}

/// The size cap is on the notification's JSON as parsed, so it is measured before the typed read.
fn within_size_cap<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Notification, D::Error> {
    let raw = serde_json::Value::deserialize(deserializer)?;
    let size = json_len(&raw).map_err(serde::de::Error::custom)?;
    if size > MAX_NOTIFICATION_BYTES {
        return Err(serde::de::Error::custom("notification over 3000 bytes"));
    }
    Notification::deserialize(raw).map_err(serde::de::Error::custom)
}

/// The length of `value`'s compact JSON, counted as it is written rather than kept.
fn json_len(value: &impl Serialize) -> serde_json::Result<usize> {
    struct Count(usize);
    impl std::io::Write for Count {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.0 += bytes.len();
            Ok(bytes.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut count = Count(0);
    serde_json::to_writer(&mut count, value)?;
    Ok(count.0)
}

impl SendRequest {
    pub fn new(registration_ids: Vec<String>, notification: Notification) -> Self {
        Self {
            v: V1,
            registration_ids,
            notification,
        }
    }

    /// Every bound of the contract on a send.
    pub fn validate(&self) -> Result<(), Invalid> {
        self.validate_parsed()?;
        if self.notification.json_len() > MAX_NOTIFICATION_BYTES {
            return Err(Invalid("notification over 3000 bytes of JSON"));
        }
        Ok(())
    }

    /// Every bound but the size, for a request read from JSON: deserializing measured the
    /// notification as sent (and the typed form is never longer), so it is not serialized again.
    pub fn validate_parsed(&self) -> Result<(), Invalid> {
        if self.registration_ids.is_empty() || self.registration_ids.len() > MAX_REGISTRATION_IDS {
            return Err(Invalid("1 to 20 registrationIds"));
        }
        if !self
            .registration_ids
            .iter()
            .all(|id| limits::is_opaque_id(id))
        {
            return Err(Invalid("registrationId: 1 to 128 characters"));
        }
        self.notification.validate()
    }

    /// The distinct ids, in first-seen order: what the gateway answers for.
    pub fn distinct_ids(&self) -> Vec<String> {
        let mut ids: Vec<String> = Vec::with_capacity(self.registration_ids.len());
        for id in &self.registration_ids {
            if !ids.contains(id) {
                ids.push(id.clone());
            }
        }
        ids
    }
}

/// What became of one registration of a send.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum SendStatus {
    /// Committed: it reaches the phone or expires at its deadline.
    Queued,
    /// The registration's token is dead: the host should drop it.
    Dead,
    /// The host's quota is spent.
    RateLimited,
    /// Unknown id, another host's, a changed duplicate, or past its deadline.
    Error,
}

impl SendStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Queued => "queued",
            Self::Dead => "dead",
            Self::RateLimited => "rate_limited",
            Self::Error => "error",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct SendResult {
    pub registration_id: String,
    pub status: SendStatus,
}

#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct SendReply {
    pub results: Vec<SendResult>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{Value, json};

    fn base() -> Value {
        json!({
            "notificationId": "n-1", "notificationSeq": 7, "notificationEpoch": "e-1",
            "source": "agent-task-complete", "agentState": null, "title": "Done", "body": "",
        })
    }

    fn parse(notification: Value) -> Result<SendRequest, Invalid> {
        let body = json!({ "v": 1, "registrationIds": ["r"], "notification": notification });
        let request: SendRequest =
            serde_json::from_value(body).map_err(|_| Invalid("does not parse"))?;
        request.validate()?;
        Ok(request)
    }

    #[test]
    fn accepts_the_contract_shape() {
        let n = parse(base()).unwrap().notification;
        assert_eq!(n.kind(), Kind::Alert);
        assert!(!n.is_silent());
        let mut v = base();
        v["sound"] = json!(false);
        v["kind"] = json!("dismiss");
        v["expiresAt"] = json!(1_800_000_000_000u64);
        v["worktreeId"] = json!("wt");
        let n = parse(v.clone()).unwrap().notification;
        assert!(n.is_silent());
        assert_eq!(n.kind(), Kind::Dismiss);
        // What the SDK writes is what the gateway reads.
        assert_eq!(serde_json::to_value(&n).unwrap(), v);
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
            assert!(parse(v).is_err(), "case {i}");
        }
    }

    #[test]
    fn the_notification_is_at_most_3000_bytes_of_json() {
        let mut v = base();
        v["worktreeId"] = json!("w".repeat(2048));
        let room = 3000 - serde_json::to_vec(&v).unwrap().len() + "n-1".len();
        v["notificationId"] = json!("n".repeat(room));
        assert_eq!(serde_json::to_vec(&v).unwrap().len(), 3000);
        let request = parse(v.clone()).unwrap();
        assert_eq!(request.notification.json_len(), 3000);
        v["body"] = json!("!");
        assert_eq!(serde_json::to_vec(&v).unwrap().len(), 3001);
        assert!(parse(v).is_err());
    }

    #[test]
    fn ids_are_capped_as_sent_and_answered_once() {
        let n: Notification = serde_json::from_value(base()).unwrap();
        let ids = |n: usize| (0..n).map(|i| format!("r{}", i % 3)).collect::<Vec<_>>();
        assert!(SendRequest::new(ids(20), n.clone()).validate().is_ok());
        assert!(SendRequest::new(ids(21), n.clone()).validate().is_err());
        assert!(SendRequest::new(vec![], n.clone()).validate().is_err());
        assert_eq!(
            SendRequest::new(ids(5), n).distinct_ids(),
            ["r0", "r1", "r2"]
        );
    }

    #[test]
    fn statuses_are_the_contract_words() {
        let reply: SendReply = serde_json::from_value(json!({"results": [
            {"registrationId": "a", "status": "queued"},
            {"registrationId": "b", "status": "rate_limited"},
        ]}))
        .unwrap();
        assert_eq!(reply.results[1].status, SendStatus::RateLimited);
        assert_eq!(SendStatus::Dead.as_str(), "dead");
    }
}
