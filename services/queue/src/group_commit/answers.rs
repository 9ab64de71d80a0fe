//! A round's answers: each claim's batches at the commit, each admission's and report's once
//! the round is synced, and the refusals counted.

use tokio::sync::oneshot;

use super::ClaimAnswer;
use crate::error::QueueError;
use crate::handoff::Handoff;
use crate::model::{Admission, Kind};
use crate::store::{ClaimedBatch, Enqueued};

/// Each claim's batches (or the round's error for it). A lapsed lease taken over is counted here,
/// by the writer, whether or not its caller is still there to hear of it; what a caller that went
/// away was answered goes to the hand-off's orphans, due again at once.
pub(super) fn answer_claims(
    handoff: &Handoff,
    answers: Vec<ClaimAnswer>,
    claimed: Vec<Result<Vec<ClaimedBatch>, QueueError>>,
) {
    for (answer, result) in answers.into_iter().zip(claimed) {
        if let Ok(batches) = &result {
            crate::handoff::record_lapsed_leases(batches);
        }
        if let Err(Ok(batches)) = answer.send(result) {
            handoff.orphan(batches);
        }
    }
}

/// A round's answers, held until its commit is on disk.
pub(super) struct Answers {
    pub(super) admissions: Vec<oneshot::Sender<Result<Enqueued, QueueError>>>,
    pub(super) admitted: Vec<Result<Enqueued, QueueError>>,
    pub(super) reports: Vec<(ReportAnswer, usize)>,
    pub(super) reported: Result<Vec<bool>, QueueError>,
    pub(super) refused: Refused,
}

impl Answers {
    /// Each caller's own answer once the round is synced; if it could not be, what it committed
    /// is answered as unavailable (it may or may not survive a power loss), never as done.
    /// Refusals are counted here, by the writer: a caller may have gone (an HTTP client that hung
    /// up ends its `Enqueue` call) and the refusal still happened.
    pub(super) fn send(self, synced: Result<(), orca_push_storage::SyncFailed>) {
        let (admitted, reported) = match synced {
            Ok(()) => {
                self.refused.count();
                (self.admitted, self.reported)
            }
            Err(failed) => {
                let failed = std::sync::Arc::new(QueueError::NotDurable(failed));
                let admitted = self
                    .admitted
                    .into_iter()
                    .map(|r| r.and(Err(QueueError::Round(failed.clone()))))
                    .collect();
                (admitted, Err(QueueError::Round(failed)))
            }
        };
        for (answer, result) in self.admissions.into_iter().zip(admitted) {
            // A caller that went away misses its answer; the admission stands.
            let _ = answer.send(result);
        }
        answer_reports(self.reports, reported);
    }
}

/// A round's admissions answered `rate_limited` (any recipient refused by the quota), by kind.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(super) struct Refused {
    pub(super) alerts: u64,
    pub(super) dismissals: u64,
}

impl Refused {
    pub(super) fn of(admissions: &[&Admission], admitted: &[Result<Enqueued, QueueError>]) -> Self {
        let mut refused = Self::default();
        for (admission, result) in admissions.iter().zip(admitted) {
            let Ok(enqueued) = result else { continue };
            if enqueued
                .statuses
                .iter()
                .any(|(_, s)| *s == crate::model::AdmissionStatus::RateLimited)
            {
                match admission.kind {
                    Kind::Alert => refused.alerts += 1,
                    Kind::Dismiss => refused.dismissals += 1,
                }
            }
        }
        refused
    }

    /// Into `orca_push_quota_refusals_total`.
    pub(super) fn count(self) {
        for (kind, refused) in [(Kind::Alert, self.alerts), (Kind::Dismiss, self.dismissals)] {
            if refused > 0 {
                metrics::counter!("orca_push_quota_refusals_total", "kind" => kind.as_str())
                    .increment(refused);
            }
        }
    }
}

/// Where a report's flags go.
pub(super) type ReportAnswer = oneshot::Sender<Result<Vec<bool>, QueueError>>;

/// Gives each report (its answer, its row count) its own flags out of the round's, in order; or
/// the round's error to all.
fn answer_reports(reports: Vec<(ReportAnswer, usize)>, reported: Result<Vec<bool>, QueueError>) {
    match reported {
        Ok(flags) => {
            let mut flags = flags.into_iter();
            for (answer, rows) in reports {
                let own: Vec<bool> = flags.by_ref().take(rows).collect();
                let _ = answer.send(Ok(own));
            }
        }
        Err(error) => {
            let shared = std::sync::Arc::new(error);
            for (answer, _) in reports {
                let _ = answer.send(Err(QueueError::Round(shared.clone())));
            }
        }
    }
}
