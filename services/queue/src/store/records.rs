//! What the store's operations take and answer: admissions done, claims and their batches,
//! reports, retries, and the reads that watch the queue.

use crate::error::QueueError;
use crate::model::{AdmissionStatus, Kind, Member, Provider};

/// What an admission did.
#[derive(Debug, Clone)]
pub struct Enqueued {
    /// One status per requested recipient, in request order.
    pub statuses: Vec<(String, AdmissionStatus)>,
    /// The earliest time a batch this admission touched becomes claimable; `None` if it made
    /// nothing claimable (refused, fenced, or all its work handed to waiting claims, which have
    /// it at the commit).
    pub next_due_at: Option<i64>,
}

/// What a writer's round did: one result per admission, in order, the reports' flags, and one
/// answer per claim, in order.
#[derive(Debug)]
pub struct Round {
    pub admitted: Vec<Result<Enqueued, QueueError>>,
    pub reported: Result<Vec<bool>, QueueError>,
    pub claimed: Vec<Result<Vec<ClaimedBatch>, QueueError>>,
    /// A transaction of the round failed: one whose commit's answer was lost may have committed
    /// work that no result says is due, so the writer wakes its lanes to look.
    pub uncertain: bool,
}

/// A lane's claim riding in a writer's round (`QueueStore::claims_in_rounds`): what `claim` takes.
#[derive(Debug, Clone)]
pub struct ClaimAsk {
    pub lane: String,
    pub max: i64,
    pub lease_ms: i64,
    pub skip: Skip,
}

/// A batch handed to a lane under a lease.
#[derive(Debug, Clone)]
pub struct ClaimedBatch {
    pub batch_id: String,
    pub lease_token: String,
    pub lease_expires_at: i64,
    pub registration_id: String,
    pub host_fingerprint: String,
    pub kind: Kind,
    /// Provider answers so far, plus one.
    pub attempt: u32,
    /// Retries scheduled so far: the backoff grows with it.
    pub retries: u32,
    /// The earliest deadline of the members being sent: none is sent past its own.
    pub deadline: i64,
    pub silent: bool,
    pub provider: Provider,
    /// The lease of a lane that stopped answering had lapsed: this is a recovery.
    pub recovered: bool,
    pub members: Vec<Member>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Sent,
    Dead,
    Failed,
    Expired,
}

impl Outcome {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Sent => "sent",
            Self::Dead => "dead",
            Self::Failed => "failed",
            Self::Expired => "expired",
        }
    }
}

/// A lane's final answer for one batch it holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Completion {
    pub batch_id: String,
    pub lease_token: String,
    pub outcome: Outcome,
    pub reason: String,
    /// The provider answered this attempt: it counts as one.
    pub answered: bool,
}

/// How a lane gives a batch back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Retry {
    /// The provider answered: an attempt, and a retry.
    Answered,
    /// The provider was not reached (connection, registry, token endpoint): a retry only.
    Unanswered,
    /// Untried (a stopping lane, a provider on hold): neither.
    HandBack,
}

impl Retry {
    pub(super) fn counts(self) -> (i32, i32) {
        match self {
            Self::Answered => (1, 1),
            Self::Unanswered => (0, 1),
            Self::HandBack => (0, 0),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RetryResult {
    Scheduled,
    /// The retry would land past the deadline: the batch expired instead.
    Expired,
    LeaseLost,
}

#[derive(Debug, Clone)]
pub struct RecipientRecord {
    pub registration_id: String,
    pub status: String,
    pub updated_at: i64,
    pub attempts: u32,
}

#[derive(Debug, Clone)]
pub struct EventRecord {
    pub accepted_at: i64,
    pub deadline: i64,
    pub recipients: Vec<RecipientRecord>,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Depth {
    pub waiting: u64,
    pub due: u64,
    pub leased: u64,
    pub oldest_due_age_ms: i64,
}

#[derive(Debug, Clone, Copy, Default)]
pub struct Cleaned {
    pub expired_batches: u64,
    pub cleared_payloads: u64,
    pub deleted_events: u64,
    pub deleted_batches: u64,
    pub deleted_fences: u64,
    /// Rows of `push_quota_use` too old to be read again (PostgreSQL).
    pub deleted_quota_rows: u64,
    /// How far past retention the oldest row still kept is (0 when cleanup is keeping up).
    pub past_retention_ms: i64,
}

/// Providers whose work a claim leaves alone: their sender's breaker is holding it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Skip {
    pub apns: bool,
    pub fcm: bool,
}

impl Skip {
    pub fn of(providers: impl IntoIterator<Item = Provider>) -> Self {
        providers
            .into_iter()
            .fold(Self::default(), |skip, provider| match provider {
                Provider::Apns => Self { apns: true, ..skip },
                Provider::Fcm => Self { fcm: true, ..skip },
                Provider::Unknown => skip,
            })
    }

    /// Whether a claim skipping `self` takes `provider`'s work (work of no known provider is
    /// never skipped).
    pub fn takes(self, provider: Provider) -> bool {
        match provider {
            Provider::Apns => !self.apns,
            Provider::Fcm => !self.fcm,
            Provider::Unknown => true,
        }
    }
}
