//! What the queue stores and hands out: events, their identities and content, batch budgets,
//! summaries and collapse identities.

use serde::{Deserialize, Serialize};
use sha2::{Digest as _, Sha256};

use orca_push_api::limits;

use crate::error::QueueError;

/// Alerts and, independently, dismissals a host may have accepted per rolling window.
pub const QUOTA_PER_KIND: i64 = 300;
pub const QUOTA_WINDOW_MS: i64 = 15 * 60 * 1000;
/// Every event's deadline is at most this long after its first acceptance.
pub const MAX_LIFETIME_MS: i64 = 5 * 60 * 1000;
/// A batch holds at most this many members.
pub const MAX_BATCH_MEMBERS: i64 = 32;
/// Providers refuse payloads over 4 KB.
pub const PROVIDER_PAYLOAD_LIMIT: i64 = 4096;
/// Room kept for the provider envelope around the orca fields: `aps`/`android` structure, keys,
/// the summary title and body, thread id and fingerprint, with FCM's string escaping.
pub const ENVELOPE_RESERVE: i64 = 700;
/// Identities, outcomes and fences are kept this long.
pub const RETENTION_MS: i64 = 24 * 60 * 60 * 1000;
/// Cleanup touches at most this many rows per statement; it repeats a full round while its budget
/// lasts.
pub const CLEANUP_BATCH: i64 = 1000;
/// How long one cleanup pass (each minute) may go on deleting: a sixth of the minute, so a backlog
/// is worked off over a few passes while admissions keep most of the writer.
pub const CLEANUP_BUDGET: std::time::Duration = std::time::Duration::from_secs(10);
/// The clean-up's payload sweep reads events by acceptance time, this much at a time.
pub const PAYLOAD_SWEEP_STEP_MS: i64 = 60 * 1000;
/// Events accepted this long ago have all expired (their lifetime is capped at `MAX_LIFETIME_MS`,
/// and a minute is left for clocks that differ between replicas): once swept, they are not read
/// again.
pub const PAYLOAD_SWEEP_LAG_MS: i64 = MAX_LIFETIME_MS + 60 * 1000;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Alert,
    Dismiss,
}

impl Kind {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Alert => "alert",
            Self::Dismiss => "dismiss",
        }
    }

    pub fn parse(value: &str) -> Option<Self> {
        match value {
            "alert" => Some(Self::Alert),
            "dismiss" => Some(Self::Dismiss),
            _ => None,
        }
    }
}

/// What a phone is shown for one event. Stored as JSON until the event completes or expires.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Content {
    pub notification_id: Option<String>,
    pub source: String,
    pub agent_state: Option<String>,
    pub title: String,
    pub body: String,
    pub worktree_id: Option<String>,
}

impl Content {
    /// The content a retry of the same identity must repeat exactly. Deadline and sound are not
    /// part of it: a host may send one event in several requests (silent and audible devices).
    pub fn hash(&self) -> String {
        let canonical = serde_json::to_vec(&(
            &self.notification_id,
            &self.source,
            &self.agent_state,
            &self.title,
            &self.body,
            &self.worktree_id,
        ))
        .unwrap_or_default();
        hex::encode(Sha256::digest(canonical))
    }

    pub fn to_json(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }

    /// Bytes the routing fields add to a summary payload.
    pub fn routing_bytes(&self) -> i64 {
        json_len(&self.notification_id)
            + json_len(&self.agent_state)
            + json_len(&self.worktree_id)
            + self.source.len() as i64
    }
}

fn json_len(value: &Option<String>) -> i64 {
    value.as_deref().map_or(0, json_str_len)
}

/// A string's bytes as a JSON string, quotes and escapes included, as serde_json writes it
/// (counted, not written: every admission measures several fields).
fn json_str_len(value: &str) -> i64 {
    let escaped: usize = value
        .chars()
        .map(|c| match c {
            '"' | '\\' | '\u{8}' | '\u{c}' | '\n' | '\r' | '\t' => 2,
            c if u32::from(c) < 0x20 => 6,
            c => c.len_utf8(),
        })
        .sum();
    (escaped + 2) as i64
}

/// Bytes one member adds to a summary's `summaryMembers`, exactly as FCM carries it (a JSON string
/// inside the JSON message, so every quote and backslash is escaped twice: the larger of the two
/// providers' encodings), with the longest possible sequence and the separating comma.
pub fn member_bytes(notification_id: &str, epoch: &str) -> i64 {
    let entry = serde_json::json!({
        "notificationId": notification_id,
        "notificationEpoch": epoch,
        "notificationSeq": MAX_SAFE_INTEGER,
    })
    .to_string();
    let nested = serde_json::to_string(&entry).map_or(entry.len() * 2, |s| s.len() - 2);
    nested as i64 + 1
}

/// Whether a summary with these totals still fits the provider payload with its envelope.
pub fn summary_fits(members_bytes: i64, routing_bytes: i64) -> bool {
    ENVELOPE_RESERVE + routing_bytes + members_bytes <= PROVIDER_PAYLOAD_LIMIT
}

/// A coalescing window is due at least this long before the deadline of any member it holds,
/// so that a member whose deadline falls inside the window is still sent: the window comes due
/// early rather than at its end, past a deadline the member would then be expired at.
pub const SEND_AHEAD_OF_DEADLINE_MS: i64 = 1000;

/// When a window holding a member with `deadline` is due, given the end it would otherwise have
/// (`now` plus the coalescing time for a new window, the window's end for a join): no later than
/// `SEND_AHEAD_OF_DEADLINE_MS` before that deadline, and never before `now`.
pub fn window_due(end: i64, deadline: i64, now: i64) -> i64 {
    end.min(deadline.saturating_sub(SEND_AHEAD_OF_DEADLINE_MS))
        .max(now)
}

/// One notification as a host asked for it.
#[derive(Debug, Clone)]
pub struct Admission {
    pub host_fingerprint: String,
    pub kind: Kind,
    pub notification_epoch: String,
    pub notification_seq: i64,
    pub content: Content,
    pub expires_at_ms: Option<i64>,
    pub recipients: Vec<AdmissionRecipient>,
    pub trace_parent: Option<String>,
}

#[derive(Debug, Clone)]
pub struct AdmissionRecipient {
    pub registration_id: String,
    pub silent: bool,
    /// `apns`, `fcm`, or empty when the caller did not say (an older facade).
    pub provider: Provider,
}

/// Which provider delivers to a batch's device: a scheduling hint for holding the work of a
/// provider that fails for everyone.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Provider {
    #[default]
    Unknown,
    Apns,
    Fcm,
}

impl Provider {
    /// Every provider a batch can be stored with: the claims read each one's due batches apart
    /// (`store::claims`), so a batch of a provider missing here would never be claimed.
    pub const ALL: [Self; 3] = [Self::Unknown, Self::Apns, Self::Fcm];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Unknown => "",
            Self::Apns => "apns",
            Self::Fcm => "fcm",
        }
    }

    pub fn parse(value: &str) -> Self {
        match value {
            "apns" => Self::Apns,
            "fcm" => Self::Fcm,
            _ => Self::Unknown,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AdmissionStatus {
    Queued,
    RateLimited,
    Error,
}

/// The contract's bounds, checked again here because internal teams call this service directly.
impl Admission {
    /// Bytes this event's routing adds to a summary it is the latest of: its content's routing
    /// fields and its epoch, which a summary names at the top level as well as in its members
    /// (an epoch of 128 control characters is 770 bytes escaped, more than the whole envelope
    /// reserve).
    pub fn routing_bytes(&self) -> i64 {
        self.content.routing_bytes() + json_str_len(&self.notification_epoch)
    }

    pub fn validate(&self) -> Result<(), QueueError> {
        let bad = QueueError::InvalidRequest;
        if self.host_fingerprint.is_empty() || self.host_fingerprint.len() > 64 {
            return Err(bad("host fingerprint"));
        }
        if !limits::is_opaque_id(&self.notification_epoch) {
            return Err(bad("notificationEpoch"));
        }
        if !(0..=MAX_SAFE_INTEGER).contains(&self.notification_seq) {
            return Err(bad("notificationSeq"));
        }
        let c = &self.content;
        if let Some(id) = &c.notification_id
            && !limits::is_notification_id(id)
        {
            return Err(bad("notificationId"));
        }
        if self.kind == Kind::Dismiss && c.notification_id.is_none() {
            return Err(bad("a dismissal needs a notificationId"));
        }
        if orca_push_api::Source::parse(&c.source).is_none() {
            return Err(bad("source"));
        }
        if let Some(state) = &c.agent_state
            && orca_push_api::AgentState::parse(state).is_none()
        {
            return Err(bad("agentState"));
        }
        if !limits::is_title(&c.title) || !limits::is_body(&c.body) {
            return Err(bad("title or body length"));
        }
        if c.worktree_id
            .as_ref()
            .is_some_and(|w| !limits::is_worktree_id(w))
        {
            return Err(bad("worktreeId"));
        }
        if self.recipients.is_empty() || self.recipients.len() > limits::MAX_REGISTRATION_IDS {
            return Err(bad("1 to 20 recipients"));
        }
        // Registration ids as the registry mints and the HTTP facade accepts them; a longer one
        // would also pass PostgreSQL's limit on an index entry and fail the whole group.
        if !self
            .recipients
            .iter()
            .all(|r| limits::is_opaque_id(&r.registration_id))
        {
            return Err(bad("registrationId: 1 to 128 characters"));
        }
        if self.least_json_len() > limits::MAX_NOTIFICATION_BYTES as i64 {
            return Err(bad("notification over 3000 bytes of JSON"));
        }
        // PostgreSQL refuses U+0000 in text (SQLite would store it): refused here, before any SQL,
        // so both backends answer INVALID_ARGUMENT alike.
        let texts = [
            Some(&self.host_fingerprint),
            Some(&self.notification_epoch),
            c.notification_id.as_ref(),
            Some(&c.source),
            c.agent_state.as_ref(),
            Some(&c.title),
            Some(&c.body),
            c.worktree_id.as_ref(),
            self.trace_parent.as_ref(),
        ];
        if texts.into_iter().flatten().any(|t| t.contains('\0')) {
            return Err(bad("NUL in a string"));
        }
        Ok(())
    }

    /// The fewest bytes of JSON this notification can have been sent as: the contract's
    /// 3000-byte cap less the fields a caller may leave out (`expiresAt`, `sound`). Whatever the
    /// HTTP facade admitted fits, since it measured the notification as sent; a direct caller's
    /// that could never have been sent does not, and neither would it fit the providers' 4 KB.
    fn least_json_len(&self) -> i64 {
        let c = &self.content;
        let (mut bytes, mut fields) = (2, 0);
        let mut field = |key: &str, value: i64| {
            // `"key":value`, and a comma before every field but the first.
            bytes += key.len() as i64 + 3 + value;
            fields += 1;
        };
        if let Some(id) = &c.notification_id {
            field("notificationId", json_str_len(id));
        }
        let digits = self.notification_seq.checked_ilog10().map_or(1, |d| d + 1);
        field("notificationSeq", i64::from(digits));
        field("notificationEpoch", json_str_len(&self.notification_epoch));
        field("source", json_str_len(&c.source));
        field(
            "agentState",
            c.agent_state.as_deref().map_or(4, json_str_len),
        );
        field("title", json_str_len(&c.title));
        field("body", json_str_len(&c.body));
        if let Some(worktree) = &c.worktree_id {
            field("worktreeId", json_str_len(worktree));
        }
        if self.kind == Kind::Dismiss {
            field("kind", json_str_len("dismiss"));
        }
        bytes + fields - 1
    }
}

/// JavaScript's `Number.MAX_SAFE_INTEGER`: sequences are JSON numbers on the wire.
pub const MAX_SAFE_INTEGER: i64 = limits::MAX_SAFE_INTEGER as i64;

pub use limits::utf16_len;

/// One member event of a claimed batch.
#[derive(Debug, Clone)]
pub struct Member {
    pub notification_epoch: String,
    pub notification_seq: i64,
    pub content: Content,
    pub trace_parent: Option<String>,
    /// The member event's own deadline: a summary is sent only with members still before theirs.
    pub deadline: i64,
}

/// What a lane delivers for one batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Delivery {
    pub title: String,
    pub body: String,
    pub notification_id: Option<String>,
    pub notification_seq: i64,
    pub notification_epoch: String,
    pub source: String,
    pub agent_state: Option<String>,
    pub worktree_id: Option<String>,
    pub coalesced_count: u32,
    /// (notificationId, epoch, seq) of every member of a summary; empty for one event.
    pub summary_members: Vec<(String, String, i64)>,
    pub collapse_id: String,
}

fn sha256_hex(parts: &[&[u8]]) -> String {
    let mut hasher = Sha256::new();
    for part in parts {
        hasher.update((part.len() as u32).to_be_bytes());
        hasher.update(part);
    }
    hex::encode(hasher.finalize())
}

/// A single alert's collapse id: sha256 of host and notification identity (64 hex characters, the
/// APNs maximum), or `host:<fingerprint>` for an event without a notification id.
pub fn single_collapse_id(host: &str, epoch: &str, notification_id: Option<&str>) -> String {
    match notification_id {
        Some(id) => sha256_hex(&[
            b"orca-push/alert",
            host.as_bytes(),
            epoch.as_bytes(),
            id.as_bytes(),
        ]),
        None => format!("host:{host}"),
    }
}

/// A summary's collapse id: sha256 of host and its complete, ordered membership.
pub fn summary_collapse_id(host: &str, members: &[(String, String, i64)]) -> String {
    let mut sorted: Vec<_> = members.iter().collect();
    sorted.sort();
    let mut parts: Vec<Vec<u8>> = vec![b"orca-push/summary".to_vec(), host.as_bytes().to_vec()];
    for (id, epoch, seq) in sorted {
        parts.push(epoch.as_bytes().to_vec());
        parts.push(id.as_bytes().to_vec());
        parts.push(seq.to_be_bytes().to_vec());
    }
    let refs: Vec<&[u8]> = parts.iter().map(Vec::as_slice).collect();
    sha256_hex(&refs)
}

/// One event goes out as itself; a burst becomes one summary with the latest event's routing.
/// `members` are in acceptance order, oldest first, and not empty.
pub fn delivery_of(host: &str, members: &[Member]) -> Option<Delivery> {
    let latest = members.last()?;
    if members.len() == 1 {
        return Some(Delivery {
            title: latest.content.title.clone(),
            body: latest.content.body.clone(),
            notification_id: latest.content.notification_id.clone(),
            notification_seq: latest.notification_seq,
            notification_epoch: latest.notification_epoch.clone(),
            source: latest.content.source.clone(),
            agent_state: latest.content.agent_state.clone(),
            worktree_id: latest.content.worktree_id.clone(),
            coalesced_count: 1,
            summary_members: Vec::new(),
            collapse_id: single_collapse_id(
                host,
                &latest.notification_epoch,
                latest.content.notification_id.as_deref(),
            ),
        });
    }
    let n = members.len();
    let needs_input = members
        .iter()
        .any(|m| m.content.agent_state.as_deref() == Some("needs-input"));
    let summary_members: Vec<(String, String, i64)> = members
        .iter()
        .map(|m| {
            (
                m.content.notification_id.clone().unwrap_or_default(),
                m.notification_epoch.clone(),
                m.notification_seq,
            )
        })
        .collect();
    Some(Delivery {
        title: "Orca".to_owned(),
        body: if needs_input {
            format!("{n} agents need attention")
        } else {
            format!("{n} updates")
        },
        notification_id: latest.content.notification_id.clone(),
        notification_seq: latest.notification_seq,
        notification_epoch: latest.notification_epoch.clone(),
        source: latest.content.source.clone(),
        agent_state: latest.content.agent_state.clone(),
        worktree_id: latest.content.worktree_id.clone(),
        coalesced_count: n as u32,
        collapse_id: summary_collapse_id(host, &summary_members),
        summary_members,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn member(id: &str, seq: i64, state: Option<&str>) -> Member {
        Member {
            notification_epoch: "epoch-1".into(),
            notification_seq: seq,
            content: Content {
                notification_id: Some(id.into()),
                source: "agent-task-complete".into(),
                agent_state: state.map(Into::into),
                title: format!("title {id}"),
                body: format!("body {id}"),
                worktree_id: Some(format!("wt-{id}")),
            },
            trace_parent: None,
            deadline: i64::MAX,
        }
    }

    /// Counted exactly as serde_json writes the string, every kind of escape included.
    #[test]
    fn json_lengths_are_serde_jsons() {
        for value in [
            "",
            "plain",
            "quote \" and backslash \\",
            "\u{8}\u{c}\n\r\t",
            "\u{0}\u{1}\u{1f}\u{7f}",
            "é, 漢字, 🦀",
        ] {
            assert_eq!(
                json_str_len(value),
                serde_json::to_string(value).unwrap().len() as i64,
                "{value:?}"
            );
        }
    }

    #[test]
    fn one_event_goes_out_as_itself() {
        let d = delivery_of("host", &[member("a", 1, Some("finished"))]).unwrap();
        assert_eq!((d.title.as_str(), d.body.as_str()), ("title a", "body a"));
        assert_eq!(d.coalesced_count, 1);
        assert!(d.summary_members.is_empty());
        assert_eq!(d.collapse_id.len(), 64);
        assert_eq!(
            d.collapse_id,
            single_collapse_id("host", "epoch-1", Some("a"))
        );
    }

    #[test]
    fn a_burst_is_one_summary_with_the_latest_routing() {
        let members = [member("a", 1, Some("finished")), member("b", 2, None)];
        let d = delivery_of("host", &members).unwrap();
        assert_eq!((d.title.as_str(), d.body.as_str()), ("Orca", "2 updates"));
        assert_eq!(d.notification_id.as_deref(), Some("b"));
        assert_eq!(d.worktree_id.as_deref(), Some("wt-b"));
        assert_eq!(d.coalesced_count, 2);
        assert_eq!(d.summary_members.len(), 2);
        let members = [
            member("a", 1, Some("needs-input")),
            member("b", 2, Some("finished")),
            member("c", 3, None),
        ];
        let d = delivery_of("host", &members).unwrap();
        assert_eq!(d.body, "3 agents need attention");
    }

    #[test]
    fn summary_collapse_ids_hash_the_whole_membership() {
        let ab = [member("a", 1, None), member("b", 2, None)];
        let abc = [
            member("a", 1, None),
            member("b", 2, None),
            member("c", 3, None),
        ];
        let x = delivery_of("host", &ab).unwrap().collapse_id;
        assert_eq!(x.len(), 64);
        assert_ne!(x, delivery_of("host", &abc).unwrap().collapse_id);
        assert_ne!(x, delivery_of("other", &ab).unwrap().collapse_id);
        assert_eq!(
            single_collapse_id("D20lU_8MD0R64gLt", "e", None),
            "host:D20lU_8MD0R64gLt"
        );
    }

    #[test]
    fn a_window_is_due_ahead_of_its_members_deadlines() {
        use super::window_due;
        // A deadline far off leaves the window's end as it was.
        assert_eq!(window_due(3_000, 300_000, 0), 3_000);
        // One inside the window brings it forward to a second before that deadline.
        assert_eq!(window_due(3_000, 2_500, 0), 1_500);
        // Never before now, however near the deadline.
        assert_eq!(window_due(3_000, 500, 100), 100);
        assert_eq!(window_due(3_000, i64::MIN, 100), 100);
    }

    #[test]
    fn member_bytes_count_double_escaping() {
        let plain = member_bytes("abc", "e");
        assert!((90..=110).contains(&plain), "{plain}");
        // Every quote costs 3 more bytes inside FCM's summaryMembers string (\\\").
        assert_eq!(member_bytes("a\"c", "e") - plain, 3);
    }

    #[test]
    fn content_hash_ignores_nothing_that_a_phone_sees() {
        let a = member("a", 1, None).content;
        let mut b = a.clone();
        b.body.push('!');
        assert_ne!(a.hash(), b.hash());
        assert_eq!(a.hash(), a.clone().hash());
    }

    fn valid() -> Admission {
        Admission {
            host_fingerprint: "hostAAAAAAAAAAAA".into(),
            kind: Kind::Alert,
            notification_epoch: "epoch-1".into(),
            notification_seq: 1,
            content: member("a", 1, Some("finished")).content,
            expires_at_ms: None,
            recipients: vec![AdmissionRecipient {
                registration_id: "reg-1".into(),
                silent: false,
                provider: Provider::Fcm,
            }],
            trace_parent: None,
        }
    }

    /// The same notification as the HTTP facade reads it, with only the fields it needs.
    fn as_sent(a: &Admission) -> orca_push_api::Notification {
        let c = &a.content;
        let mut v = serde_json::json!({
            "notificationSeq": a.notification_seq, "notificationEpoch": a.notification_epoch,
            "source": c.source, "agentState": c.agent_state, "title": c.title, "body": c.body,
        });
        if let Some(id) = &c.notification_id {
            v["notificationId"] = id.as_str().into();
        }
        if let Some(w) = &c.worktree_id {
            v["worktreeId"] = w.as_str().into();
        }
        if a.kind == Kind::Dismiss {
            v["kind"] = "dismiss".into();
        }
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn the_least_json_length_is_the_notifications_as_sent() {
        let cases: [fn(&mut Admission); 5] = [
            |_| {},
            |a| a.content.agent_state = None,
            |a| {
                a.content.notification_id = None;
                a.content.worktree_id = None;
                a.notification_seq = 0;
            },
            |a| {
                a.kind = Kind::Dismiss;
                a.notification_seq = MAX_SAFE_INTEGER;
                a.content.title = "quote \" \\ \u{1} é 🦀".into();
            },
            |a| a.content.body = "\n\t\u{1f}".repeat(30),
        ];
        for (i, mutate) in cases.iter().enumerate() {
            let mut a = valid();
            mutate(&mut a);
            assert_eq!(
                a.least_json_len(),
                as_sent(&a).json_len() as i64,
                "case {i}"
            );
        }
    }

    /// 3000 bytes of JSON pass and one more is refused, as over HTTP; so are registration ids the
    /// registry never mints.
    #[test]
    fn a_direct_caller_is_held_to_the_http_bounds() {
        let mut a = valid();
        a.content.notification_id = Some("n".repeat(2048));
        a.content.worktree_id = Some(String::new());
        let room = 3000 - a.least_json_len() as usize;
        a.content.worktree_id = Some("w".repeat(room));
        assert_eq!(as_sent(&a).json_len(), 3000);
        assert!(a.validate().is_ok());
        a.content.worktree_id = Some("w".repeat(room + 1));
        assert!(matches!(a.validate(), Err(QueueError::InvalidRequest(_))));
        for id in [String::new(), "r".repeat(129)] {
            let mut a = valid();
            a.recipients[0].registration_id = id;
            assert!(matches!(a.validate(), Err(QueueError::InvalidRequest(_))));
        }
    }

    #[test]
    fn an_admission_with_nul_in_any_string_is_invalid() {
        assert!(valid().validate().is_ok());
        type Mutation = fn(&mut Admission);
        let cases: [Mutation; 9] = [
            |a| a.host_fingerprint.push('\0'),
            |a| a.notification_epoch.push('\0'),
            |a| a.content.notification_id = Some("n\0".into()),
            |a| a.content.agent_state = Some("finished\0".into()),
            |a| a.content.title.push('\0'),
            |a| a.content.body.push('\0'),
            |a| a.content.worktree_id = Some("\0".into()),
            |a| a.recipients[0].registration_id.push('\0'),
            |a| a.trace_parent = Some("00-\0".into()),
        ];
        for (i, mutate) in cases.iter().enumerate() {
            let mut a = valid();
            mutate(&mut a);
            assert!(
                matches!(a.validate(), Err(QueueError::InvalidRequest(_))),
                "case {i}"
            );
        }
    }
}
