//! The tonic face of [`DeliveryQueue`].

use std::sync::Arc;

use orca_push_proto::queue::v1 as pb;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};
use tracing::Instrument as _;

use crate::error::QueueError;
use crate::model::{Admission, AdmissionRecipient, AdmissionStatus, Content, Kind, Provider};
use crate::queue::DeliveryQueue;
use crate::store::{AnyQueueStore, Completion, Outcome, Retry, RetryResult};

pub struct QueueGrpc {
    queue: Arc<DeliveryQueue<AnyQueueStore>>,
    /// Fired as the server stops: a claim still waiting for work ends then, empty, so the server
    /// can finish its calls (a lane's claim waits up to 10 s) and its lanes ask another replica.
    stopping: CancellationToken,
}

impl QueueGrpc {
    pub fn new(queue: Arc<DeliveryQueue<AnyQueueStore>>, stopping: CancellationToken) -> Self {
        Self { queue, stopping }
    }
}

fn kind_from_wire(value: i32) -> Result<Kind, QueueError> {
    match pb::Kind::try_from(value) {
        Ok(pb::Kind::Alert | pb::Kind::Unspecified) => Ok(Kind::Alert),
        Ok(pb::Kind::Dismiss) => Ok(Kind::Dismiss),
        Err(_) => Err(QueueError::InvalidRequest("kind")),
    }
}

fn kind_to_wire(kind: Kind) -> i32 {
    match kind {
        Kind::Alert => pb::Kind::Alert as i32,
        Kind::Dismiss => pb::Kind::Dismiss as i32,
    }
}

/// An unknown value is a provider this queue does not know yet: no hint, not an error.
fn provider_from_wire(value: i32) -> Provider {
    match pb::Provider::try_from(value) {
        Ok(pb::Provider::Apns) => Provider::Apns,
        Ok(pb::Provider::Fcm) => Provider::Fcm,
        _ => Provider::Unknown,
    }
}

fn provider_to_wire(provider: Provider) -> i32 {
    match provider {
        Provider::Unknown => pb::Provider::Unspecified as i32,
        Provider::Apns => pb::Provider::Apns as i32,
        Provider::Fcm => pb::Provider::Fcm as i32,
    }
}

fn outcome_from_wire(value: i32) -> Result<Outcome, QueueError> {
    match pb::Outcome::try_from(value) {
        Ok(pb::Outcome::Sent) => Ok(Outcome::Sent),
        Ok(pb::Outcome::Dead) => Ok(Outcome::Dead),
        Ok(pb::Outcome::Failed) => Ok(Outcome::Failed),
        Ok(pb::Outcome::Expired) => Ok(Outcome::Expired),
        _ => Err(QueueError::InvalidRequest("outcome")),
    }
}

fn seq_from_wire(seq: u64) -> Result<i64, QueueError> {
    i64::try_from(seq).map_err(|_| QueueError::InvalidRequest("notification_seq"))
}

/// Admissions one `EnqueueMany` call may carry. As many of the largest sends the contract allows
/// stay under tonic's 4 MiB message limit (a test checks).
pub const MAX_ENQUEUE_MANY: usize = 256;

/// An `Enqueue` request as the queue admits it.
fn admission_from_wire(
    r: pb::EnqueueRequest,
    trace_parent: Option<String>,
) -> Result<Admission, QueueError> {
    let n = r
        .notification
        .ok_or(QueueError::InvalidRequest("notification"))?;
    Ok(Admission {
        host_fingerprint: r.host_fingerprint,
        kind: kind_from_wire(n.kind)?,
        notification_epoch: n.notification_epoch,
        notification_seq: seq_from_wire(n.notification_seq)?,
        content: Content {
            notification_id: n.notification_id,
            source: n.source,
            agent_state: n.agent_state,
            title: n.title,
            body: n.body,
            worktree_id: n.worktree_id,
        },
        expires_at_ms: n.expires_at_ms,
        recipients: r
            .recipients
            .into_iter()
            .map(|p| AdmissionRecipient {
                registration_id: p.registration_id,
                silent: p.silent,
                provider: provider_from_wire(p.provider),
            })
            .collect(),
        trace_parent,
    })
}

fn enqueue_response(enqueued: crate::store::Enqueued) -> pb::EnqueueResponse {
    let results = enqueued
        .statuses
        .into_iter()
        .map(|(registration_id, status)| pb::RecipientResult {
            registration_id,
            status: match status {
                AdmissionStatus::Queued => pb::EnqueueStatus::Queued,
                AdmissionStatus::RateLimited => pb::EnqueueStatus::RateLimited,
                AdmissionStatus::Error => pb::EnqueueStatus::Error,
            } as i32,
        })
        .collect();
    pb::EnqueueResponse { results }
}

/// The caller's trace context, so the delivery can link back to the admission.
fn current_traceparent() -> Option<String> {
    orca_push_telemetry::traceparent_of(&tracing::Span::current())
}

#[tonic::async_trait]
impl pb::queue_service_server::QueueService for QueueGrpc {
    async fn enqueue(
        &self,
        request: Request<pb::EnqueueRequest>,
    ) -> Result<Response<pb::EnqueueResponse>, Status> {
        let admission = admission_from_wire(request.into_inner(), current_traceparent())?;
        let enqueued = self.queue.enqueue(&admission).await?;
        Ok(Response::new(enqueue_response(enqueued)))
    }

    async fn enqueue_many(
        &self,
        request: Request<pb::EnqueueManyRequest>,
    ) -> Result<Response<pb::EnqueueManyResponse>, Status> {
        let requests = request.into_inner().requests;
        if requests.len() > MAX_ENQUEUE_MANY {
            return Err(QueueError::InvalidRequest("requests").into());
        }
        // Each admission on its own, all at once, so they reach the writer together (a round takes
        // up to `MAX_GROUP` of them; the facade sends no more in one call).
        let admissions = requests.into_iter().map(|batched| {
            let span = tracing::info_span!("queue.admission");
            if let Some(traceparent) = &batched.traceparent {
                orca_push_telemetry::set_parent_from_traceparent(&span, traceparent);
            }
            let queue = &self.queue;
            async move {
                let admitted = async {
                    let request = batched.request.unwrap_or_default();
                    let admission = admission_from_wire(request, current_traceparent())?;
                    Ok::<_, QueueError>(enqueue_response(queue.enqueue(&admission).await?))
                }
                .await;
                let outcome = match admitted {
                    Ok(response) => pb::enqueue_outcome::Outcome::Admitted(response),
                    Err(error) => pb::enqueue_outcome::Outcome::Refused(
                        orca_push_proto::refused_call(&Status::from(error)),
                    ),
                };
                pb::EnqueueOutcome {
                    outcome: Some(outcome),
                }
            }
            .instrument(span)
        });
        let outcomes = futures::future::join_all(admissions).await;
        Ok(Response::new(pb::EnqueueManyResponse { outcomes }))
    }

    async fn claim(
        &self,
        request: Request<pb::ClaimRequest>,
    ) -> Result<Response<pb::ClaimResponse>, Status> {
        let r = request.into_inner();
        let skip = crate::store::Skip::of(r.skip_providers.iter().copied().map(provider_from_wire));
        let claim = self.queue.claim_skipping(
            &r.lane,
            i64::from(r.max_batches),
            i64::from(r.lease_ms),
            u64::from(r.wait_ms),
            skip,
        );
        // Ended unanswered, a claim gives back whatever it had leased (see `claim_once`), as when
        // its caller goes away.
        let claimed = tokio::select! {
            claimed = claim => claimed?,
            () = self.stopping.cancelled() => Vec::new(),
        };
        let batches = claimed
            .into_iter()
            .filter_map(|batch| {
                let delivery = crate::model::delivery_of(&batch.host_fingerprint, &batch.members)?;
                Some(pb::ClaimedBatch {
                    batch_id: batch.batch_id,
                    lease_token: batch.lease_token,
                    lease_expires_at_ms: batch.lease_expires_at,
                    registration_id: batch.registration_id,
                    host_fingerprint: batch.host_fingerprint,
                    kind: kind_to_wire(batch.kind),
                    attempt: batch.attempt,
                    retries: batch.retries,
                    provider: provider_to_wire(batch.provider),
                    deadline_ms: batch.deadline,
                    collapse_id: delivery.collapse_id,
                    silent: batch.silent,
                    member_traceparents: batch
                        .members
                        .iter()
                        .filter_map(|m| m.trace_parent.clone())
                        .collect(),
                    content: Some(pb::DeliveryContent {
                        title: delivery.title,
                        body: delivery.body,
                        notification_id: delivery.notification_id,
                        notification_seq: u64::try_from(delivery.notification_seq).unwrap_or(0),
                        notification_epoch: delivery.notification_epoch,
                        source: delivery.source,
                        agent_state: delivery.agent_state,
                        worktree_id: delivery.worktree_id,
                        coalesced_count: delivery.coalesced_count,
                        summary_members: delivery
                            .summary_members
                            .into_iter()
                            .map(
                                |(notification_id, notification_epoch, seq)| pb::SummaryMember {
                                    notification_id,
                                    notification_epoch,
                                    notification_seq: u64::try_from(seq).unwrap_or(0),
                                },
                            )
                            .collect(),
                    }),
                })
            })
            .collect();
        Ok(Response::new(pb::ClaimResponse { batches }))
    }

    async fn renew_lease(
        &self,
        request: Request<pb::RenewLeaseRequest>,
    ) -> Result<Response<pb::RenewLeaseResponse>, Status> {
        let r = request.into_inner();
        let until = self
            .queue
            .renew(&r.batch_id, &r.lease_token, i64::from(r.lease_ms))
            .await?;
        Ok(Response::new(pb::RenewLeaseResponse {
            renewed: until.is_some(),
            lease_expires_at_ms: until.unwrap_or(0),
        }))
    }

    async fn complete(
        &self,
        request: Request<pb::CompleteRequest>,
    ) -> Result<Response<pb::CompleteResponse>, Status> {
        let r = request.into_inner();
        let recorded = self
            .queue
            .complete(
                &r.batch_id,
                &r.lease_token,
                outcome_from_wire(r.outcome)?,
                &r.reason,
                r.provider_answered,
            )
            .await?;
        Ok(Response::new(pb::CompleteResponse { recorded }))
    }

    async fn complete_many(
        &self,
        request: Request<pb::CompleteManyRequest>,
    ) -> Result<Response<pb::CompleteManyResponse>, Status> {
        // Every report is checked before anything is written: one bad report fails the call.
        let completions = request
            .into_inner()
            .reports
            .into_iter()
            .map(|r| {
                Ok(Completion {
                    outcome: outcome_from_wire(r.outcome)?,
                    batch_id: r.batch_id,
                    lease_token: r.lease_token,
                    reason: r.reason,
                    answered: r.provider_answered,
                })
            })
            .collect::<Result<Vec<_>, QueueError>>()?;
        let recorded = self.queue.complete_many(completions).await?;
        Ok(Response::new(pb::CompleteManyResponse { recorded }))
    }

    async fn retry(
        &self,
        request: Request<pb::RetryRequest>,
    ) -> Result<Response<pb::RetryResponse>, Status> {
        let r = request.into_inner();
        let how = match (r.hand_back, r.provider_answered) {
            (true, _) => Retry::HandBack,
            (false, true) => Retry::Answered,
            (false, false) => Retry::Unanswered,
        };
        let result = self
            .queue
            .retry(&r.batch_id, &r.lease_token, r.retry_at_ms, &r.reason, how)
            .await?;
        Ok(Response::new(pb::RetryResponse {
            scheduled: result == RetryResult::Scheduled,
            expired: result == RetryResult::Expired,
        }))
    }

    async fn hold_provider(
        &self,
        request: Request<pb::HoldProviderRequest>,
    ) -> Result<Response<pb::HoldProviderResponse>, Status> {
        let r = request.into_inner();
        let provider = provider_from_wire(r.provider);
        let held = if r.release {
            let limit = (r.release_limit > 0).then_some(u64::from(r.release_limit));
            self.queue.release(provider, limit).await?
        } else {
            let due_before = (r.due_before_ms > 0).then_some(r.due_before_ms);
            self.queue.hold(provider, r.until_ms, due_before).await?
        };
        Ok(Response::new(pb::HoldProviderResponse { held }))
    }

    async fn get_event_outcomes(
        &self,
        request: Request<pb::GetEventOutcomesRequest>,
    ) -> Result<Response<pb::GetEventOutcomesResponse>, Status> {
        let r = request.into_inner();
        let record = self
            .queue
            .event_record(
                &r.host_fingerprint,
                kind_from_wire(r.kind)?,
                &r.notification_epoch,
                seq_from_wire(r.notification_seq)?,
            )
            .await?;
        let Some(record) = record else {
            return Ok(Response::new(pb::GetEventOutcomesResponse::default()));
        };
        Ok(Response::new(pb::GetEventOutcomesResponse {
            found: true,
            accepted_at_ms: record.accepted_at,
            deadline_ms: record.deadline,
            recipients: record
                .recipients
                .into_iter()
                .map(|r| pb::RecipientOutcome {
                    registration_id: r.registration_id,
                    status: r.status,
                    updated_at_ms: r.updated_at,
                    attempts: r.attempts,
                })
                .collect(),
        }))
    }

    async fn get_queue_depth(
        &self,
        _request: Request<pb::GetQueueDepthRequest>,
    ) -> Result<Response<pb::GetQueueDepthResponse>, Status> {
        let depth = self.queue.depth().await?;
        Ok(Response::new(pb::GetQueueDepthResponse {
            waiting: depth.waiting,
            due: depth.due,
            leased: depth.leased,
            oldest_due_age_ms: depth.oldest_due_age_ms,
        }))
    }
}

#[cfg(test)]
mod tests {
    use orca_push_api::limits::{MAX_NOTIFICATION_BYTES, MAX_OPAQUE_ID, MAX_REGISTRATION_IDS};
    use prost::Message as _;

    use super::*;

    #[test]
    fn the_largest_enqueue_many_fits_in_one_grpc_message() {
        // A notification is at most MAX_NOTIFICATION_BYTES of JSON, so its strings are fewer.
        let request = pb::EnqueueRequest {
            host_fingerprint: "h".repeat(64),
            notification: Some(pb::Notification {
                notification_id: Some("n".repeat(MAX_NOTIFICATION_BYTES)),
                notification_seq: u64::MAX,
                notification_epoch: "e".repeat(64),
                expires_at_ms: Some(i64::MAX),
                ..Default::default()
            }),
            recipients: vec![
                pb::Recipient {
                    registration_id: "r".repeat(MAX_OPAQUE_ID),
                    silent: true,
                    provider: pb::Provider::Apns as i32,
                };
                MAX_REGISTRATION_IDS
            ],
        };
        let batched = pb::BatchedEnqueue {
            request: Some(request),
            traceparent: Some(format!("00-{}-{}-01", "a".repeat(32), "b".repeat(16))),
        };
        let largest = pb::EnqueueManyRequest {
            requests: vec![batched; MAX_ENQUEUE_MANY],
        };
        assert!(largest.encoded_len() < 4 << 20, "{}", largest.encoded_len());
    }
}
