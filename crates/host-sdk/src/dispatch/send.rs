//! Batching into `POST /v1/send` requests, the one retry per request, and reading the answers.

use std::collections::{HashMap, HashSet};

use orca_push_api::limits::MAX_REGISTRATION_IDS;
use orca_push_api::{ErrorCode, Notification, SendReply, SendRequest, SendStatus};
use tokio::time::Instant;

use super::failures::Tally;
use super::select::is_silent;
use super::{DispatchReport, Inner, Outcome, RequestReport};
use crate::{Gateway, GatewayError, Registration, RegistrationSource};

/// The registrations of one request.
pub(super) struct Batch {
    pub(super) registrations: Vec<Registration>,
    /// Sent with `sound: false`.
    pub(super) silent: bool,
}

/// Requests of at most the gateway's cap each (extra phones get more requests, never dropped);
/// with `split_silent`, phones that asked for silence in requests of their own.
pub(super) fn batches(recipients: Vec<Registration>, split_silent: bool) -> Vec<Batch> {
    let (silent, audible): (Vec<_>, Vec<_>) = recipients
        .into_iter()
        .partition(|r| split_silent && is_silent(r));
    let mut out = Vec::new();
    for (group, is_silent) in [(audible, false), (silent, true)] {
        let mut group = group.into_iter().peekable();
        while group.peek().is_some() {
            out.push(Batch {
                registrations: group.by_ref().take(MAX_REGISTRATION_IDS).collect(),
                silent: is_silent,
            });
        }
    }
    out
}

/// A retry waiting for its time.
struct Retry {
    due: Instant,
    index: usize,
    request: SendRequest,
}

impl<G: Gateway, R: RegistrationSource> Inner<G, R> {
    /// Sends every batch once, then retries the retryable failures, each at its own time.
    pub(super) async fn send_batches(
        &self,
        batches: &[Batch],
        audible: &Notification,
        silent: &Notification,
        expires_at: Option<i64>,
        report: &mut DispatchReport,
        failures: &mut Tally,
    ) {
        let mut retries = Vec::new();
        for (index, batch) in batches.iter().enumerate() {
            let ids: Vec<String> = batch
                .registrations
                .iter()
                .map(|r| r.registration_id.clone())
                .collect();
            let notification = if batch.silent { silent } else { audible };
            let request = SendRequest::new(ids.clone(), notification.clone());
            report.requests.push(RequestReport {
                registration_ids: ids,
                silent: batch.silent,
                attempts: 1,
                retry_skipped_expired: false,
            });
            // The event and every id were checked already; this is the contract's last word.
            if request.validate().is_err() {
                failures.add("invalid_event");
                fail(batch, "invalid_event", report);
                continue;
            }
            match self.gateway.send(&request).await {
                Ok(reply) => self.apply(batch, &reply, report, failures),
                Err(error) => {
                    self.count_error(&error, failures).await;
                    if !error.is_retryable() {
                        fail(batch, error.category(), report);
                        continue;
                    }
                    let wait = error
                        .retry_after()
                        // A Retry-After of 0 (or a date past) still waits the contract's 2 s.
                        .map_or(self.config.retry_delay, |after| {
                            after.max(self.config.retry_delay)
                        })
                        .min(self.config.max_retry_after);
                    let wait_ms = u64::try_from(wait.as_millis()).unwrap_or(u64::MAX);
                    let retry_at_ms = (self.clock)().saturating_add(wait_ms);
                    if expires_at
                        .is_some_and(|at| i64::try_from(retry_at_ms).unwrap_or(i64::MAX) >= at)
                    {
                        report.requests[index].retry_skipped_expired = true;
                        fail(batch, error.category(), report);
                        continue;
                    }
                    retries.push(Retry {
                        due: Instant::now() + wait,
                        index,
                        request,
                    });
                }
            }
        }
        // Earliest first, so one long Retry-After does not hold back another request's retry.
        retries.sort_by_key(|r| r.due);
        for retry in retries {
            // What is counted so far reaches the log before a wait that may be long.
            self.failures.record_tally(failures);
            tokio::time::sleep_until(retry.due).await;
            let batch = &batches[retry.index];
            report.requests[retry.index].attempts += 1;
            match self.gateway.send(&retry.request).await {
                Ok(reply) => self.apply(batch, &reply, report, failures),
                Err(error) => {
                    self.count_error(&error, failures).await;
                    fail(batch, error.category(), report);
                }
            }
        }
    }

    async fn count_error(&self, error: &GatewayError, failures: &mut Tally) {
        failures.add(format!("send.{}", error.category()));
        if error.code() == Some(ErrorCode::InvalidRequest) {
            self.protocol.forget().await;
        }
    }

    /// Reads the answers by registration id, never by position, and drops what the gateway
    /// reports dead (only if the stored record still matches what was sent).
    fn apply(
        &self,
        batch: &Batch,
        reply: &SendReply,
        report: &mut DispatchReport,
        failures: &mut Tally,
    ) {
        let mut answers: HashMap<&str, SendStatus> = HashMap::new();
        for result in &reply.results {
            answers
                .entry(result.registration_id.as_str())
                .or_insert(result.status);
        }
        let sent: HashSet<&str> = batch
            .registrations
            .iter()
            .map(|r| r.registration_id.as_str())
            .collect();
        let unexpected = answers.keys().filter(|id| !sent.contains(*id)).count();
        if unexpected > 0 {
            failures.add_n("result.unexpected", unexpected as u64);
        }
        for registration in &batch.registrations {
            let id = registration.registration_id.clone();
            let Some(&status) = answers.get(id.as_str()) else {
                failures.add("result.missing");
                report.outcomes.insert(id, Outcome::NoResult);
                continue;
            };
            if status != SendStatus::Queued {
                failures.add(format!("result.{}", status.as_str()));
            }
            if status == SendStatus::Dead && self.registrations.drop_dead(registration) {
                report.dropped_dead.push(id.clone());
            }
            report.outcomes.insert(id, Outcome::Status(status));
        }
    }
}

fn fail(batch: &Batch, category: &'static str, report: &mut DispatchReport) {
    for registration in &batch.registrations {
        report.outcomes.insert(
            registration.registration_id.clone(),
            Outcome::Failed(category),
        );
    }
}
