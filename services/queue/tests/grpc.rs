//! The queue's gRPC surface as the sender and internal teams use it.

use std::sync::Arc;

use orca_push_proto::queue::v1 as pb;
use orca_push_proto::queue::v1::queue_service_client::QueueServiceClient;
use orca_push_storage::SystemClock;
use orca_push_storage::testing::{Backend, TestDbGuard, fresh};
use tokio_util::sync::CancellationToken;

/// A queue served on a fresh database of `backend`, its client, what stops it and the database's
/// guard.
async fn queue_over_grpc(
    backend: Backend,
) -> (
    QueueServiceClient<orca_push_internal_auth::InternalChannel>,
    CancellationToken,
    TestDbGuard,
) {
    let (config, guard) = fresh(backend).await;
    let pool = orca_push_queue::open_and_migrate(&config).await.unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let shutdown = CancellationToken::new();
    let key = orca_push_internal_auth::InternalKey::generate();
    tokio::spawn(orca_push_queue::serve(
        listener,
        pool,
        Arc::new(SystemClock),
        0,
        key.clone(),
        shutdown.clone(),
    ));
    let client = QueueServiceClient::new(
        orca_push_internal_auth::channel(&url, &key, "test", "queue").unwrap(),
    );
    (client, shutdown, guard)
}

/// Up to four due batches, under a 30 s lease, waiting up to a second for them.
async fn claim_due(
    client: &mut QueueServiceClient<orca_push_internal_auth::InternalChannel>,
) -> Vec<pb::ClaimedBatch> {
    client
        .claim(pb::ClaimRequest {
            lane: "test".into(),
            max_batches: 4,
            lease_ms: 30_000,
            wait_ms: 1_000,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .batches
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn enqueue_claim_complete_and_read_outcomes_over_grpc() {
    // As in every process without a collector: spans exist, so an admission has a trace context
    // to keep.
    let _telemetry = orca_push_telemetry::init(
        opentelemetry_sdk::trace::SdkTracerProvider::builder().build(),
        orca_push_telemetry::LogFormat::Text,
        orca_push_telemetry::SpanDetail::ContextOnly,
    )
    .unwrap();
    let (mut client, shutdown, _guard) = queue_over_grpc(Backend::Sqlite).await;

    let notification = pb::Notification {
        notification_id: Some("n-1".into()),
        notification_seq: 9,
        notification_epoch: "epoch".into(),
        source: "agent-task-complete".into(),
        agent_state: Some("needs-input".into()),
        title: "Needs input".into(),
        body: "Approve the plan?".into(),
        worktree_id: Some("wt".into()),
        kind: pb::Kind::Alert as i32,
        expires_at_ms: None,
    };
    let results = client
        .enqueue(pb::EnqueueRequest {
            host_fingerprint: "hostAAAAAAAAAAAA".into(),
            notification: Some(notification.clone()),
            recipients: vec![pb::Recipient {
                registration_id: "r1".into(),
                silent: true,
                provider: pb::Provider::Apns as i32,
            }],
        })
        .await
        .unwrap()
        .into_inner()
        .results;
    assert_eq!(results[0].status, pb::EnqueueStatus::Queued as i32);

    let depth = client
        .get_queue_depth(pb::GetQueueDepthRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(depth.due, 1);

    let claimed = claim_due(&mut client).await;
    assert_eq!(claimed.len(), 1);
    let batch = &claimed[0];
    assert_eq!(batch.registration_id, "r1");
    assert_eq!(batch.kind, pb::Kind::Alert as i32);
    assert_eq!(batch.attempt, 1);
    assert!(batch.silent);
    assert_eq!(batch.collapse_id.len(), 64);
    assert_eq!(
        batch.member_traceparents.len(),
        1,
        "the admission's trace context is kept"
    );
    let content = batch.content.as_ref().unwrap();
    assert_eq!(
        (content.title.as_str(), content.body.as_str()),
        ("Needs input", "Approve the plan?")
    );
    assert_eq!(content.notification_seq, 9);
    assert_eq!(content.coalesced_count, 1);
    assert!(content.summary_members.is_empty());

    let renewed = client
        .renew_lease(pb::RenewLeaseRequest {
            batch_id: batch.batch_id.clone(),
            lease_token: batch.lease_token.clone(),
            lease_ms: 30_000,
        })
        .await
        .unwrap()
        .into_inner();
    assert!(renewed.renewed);
    let done = client
        .complete(pb::CompleteRequest {
            batch_id: batch.batch_id.clone(),
            lease_token: batch.lease_token.clone(),
            outcome: pb::Outcome::Sent as i32,
            reason: "200".into(),
            provider_answered: true,
        })
        .await
        .unwrap()
        .into_inner();
    assert!(done.recorded);

    let outcomes = client
        .get_event_outcomes(pb::GetEventOutcomesRequest {
            host_fingerprint: "hostAAAAAAAAAAAA".into(),
            kind: pb::Kind::Alert as i32,
            notification_epoch: "epoch".into(),
            notification_seq: 9,
        })
        .await
        .unwrap()
        .into_inner();
    assert!(outcomes.found);
    assert_eq!(outcomes.recipients[0].status, "sent");
    assert_eq!(outcomes.recipients[0].attempts, 1);

    // Bad input is a proper status, never a panic.
    let report = |outcome: i32| pb::CompleteRequest {
        batch_id: batch.batch_id.clone(),
        lease_token: batch.lease_token.clone(),
        outcome,
        reason: "200".into(),
        provider_answered: true,
    };
    let err = client
        .complete_many(pb::CompleteManyRequest {
            reports: vec![report(pb::Outcome::Sent as i32), report(99)],
        })
        .await
        .unwrap_err();
    assert_eq!(
        err.code(),
        tonic::Code::InvalidArgument,
        "one bad report fails the call"
    );
    let again = client
        .complete_many(pb::CompleteManyRequest {
            reports: vec![report(pb::Outcome::Sent as i32)],
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(again.recorded, [false], "the batch was already finished");
    let err = client
        .claim(pb::ClaimRequest {
            lane: "test".into(),
            max_batches: 0,
            lease_ms: 30_000,
            wait_ms: 0,
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument);
    let mut bad = notification.clone();
    bad.title = String::new();
    let err = client
        .enqueue(pb::EnqueueRequest {
            host_fingerprint: "hostAAAAAAAAAAAA".into(),
            notification: Some(bad),
            recipients: vec![pb::Recipient {
                registration_id: "r1".into(),
                silent: false,
                provider: pb::Provider::Fcm as i32,
            }],
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument);

    // A send batched by the facade continues its own trace: the admission's kept context is the
    // send's trace, under the queue's span for it.
    let send_trace = "4bf92f3577b34da6a3ce929d0e0e4736";
    let mut batched = notification;
    batched.notification_seq = 10;
    let outcomes = client
        .enqueue_many(pb::EnqueueManyRequest {
            requests: vec![pb::BatchedEnqueue {
                request: Some(pb::EnqueueRequest {
                    host_fingerprint: "hostAAAAAAAAAAAA".into(),
                    notification: Some(batched),
                    recipients: vec![pb::Recipient {
                        registration_id: "r9".into(),
                        silent: false,
                        provider: pb::Provider::Apns as i32,
                    }],
                }),
                traceparent: Some(format!("00-{send_trace}-00f067aa0ba902b7-01")),
            }],
        })
        .await
        .unwrap()
        .into_inner()
        .outcomes;
    assert!(matches!(
        outcomes[0].outcome,
        Some(pb::enqueue_outcome::Outcome::Admitted(_))
    ));
    let claimed = claim_due(&mut client).await;
    assert_eq!(claimed.len(), 1);
    let kept = &claimed[0].member_traceparents;
    assert_eq!(kept.len(), 1);
    assert!(
        kept[0].starts_with(&format!("00-{send_trace}-")),
        "{kept:?}"
    );
    assert!(
        !kept[0].contains("00f067aa0ba902b7"),
        "the queue's own span"
    );
    shutdown.cancel();
}

/// `EnqueueMany` answers each send as `Enqueue` would have, in order: a bad one is refused with
/// its contract code and fails none of the others, the same identity twice is admitted once, and
/// more than 256 sends are refused whole.
async fn enqueue_many_admits_each_send_on_its_own(backend: Backend) {
    let (mut client, shutdown, _guard) = queue_over_grpc(backend).await;
    let send = |host: &str, seq: u64, registration: &str| pb::BatchedEnqueue {
        request: Some(pb::EnqueueRequest {
            host_fingerprint: host.into(),
            notification: Some(pb::Notification {
                notification_id: Some("n-1".into()),
                notification_seq: seq,
                notification_epoch: "epoch".into(),
                source: "terminal-bell".into(),
                title: "Done".into(),
                kind: pb::Kind::Alert as i32,
                ..Default::default()
            }),
            recipients: vec![pb::Recipient {
                registration_id: registration.into(),
                silent: false,
                provider: pb::Provider::Fcm as i32,
            }],
        }),
        traceparent: None,
    };
    let mut no_notification = send("hostBBBBBBBBBBBB", 1, "rb");
    no_notification.request.as_mut().unwrap().notification = None;
    let requests = vec![
        send("hostAAAAAAAAAAAA", 1, "ra"),
        no_notification,
        send("hostCCCCCCCCCCCC", 1, "rc"),
        send("hostDDDDDDDDDDDD", u64::MAX, "rd"),
        send("hostAAAAAAAAAAAA", 1, "ra"),
    ];
    let outcomes = client
        .enqueue_many(pb::EnqueueManyRequest { requests })
        .await
        .unwrap()
        .into_inner()
        .outcomes;
    let answered: Vec<_> = outcomes
        .into_iter()
        .map(|o| match o.outcome.unwrap() {
            pb::enqueue_outcome::Outcome::Admitted(admitted) => {
                let statuses: Vec<_> = admitted
                    .results
                    .iter()
                    .map(|r| (r.registration_id.clone(), r.status))
                    .collect();
                Ok(statuses)
            }
            pb::enqueue_outcome::Outcome::Refused(refused) => {
                let status = orca_push_proto::refused_status(refused);
                Err((
                    status.code(),
                    orca_push_proto::error_code(&status).map(str::to_owned),
                ))
            }
        })
        .collect();
    let queued = |id: &str| Ok(vec![(id.to_owned(), pb::EnqueueStatus::Queued as i32)]);
    let invalid = Err((
        tonic::Code::InvalidArgument,
        Some("invalid_request".to_owned()),
    ));
    assert_eq!(
        answered,
        [
            queued("ra"),
            invalid.clone(),
            queued("rc"),
            invalid,
            queued("ra")
        ]
    );
    let depth = client
        .get_queue_depth(pb::GetQueueDepthRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(depth.due, 2, "one event per identity");

    let too_many = (0..257)
        .map(|i| send("hostEEEEEEEEEEEE", i + 1, "re"))
        .collect();
    let err = client
        .enqueue_many(pb::EnqueueManyRequest { requests: too_many })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument);
    shutdown.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn enqueue_many_admits_each_send_on_its_own_on_sqlite() {
    enqueue_many_admits_each_send_on_its_own(Backend::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn enqueue_many_admits_each_send_on_its_own_on_postgresql() {
    enqueue_many_admits_each_send_on_its_own(Backend::Postgres).await;
}

/// A direct caller is held to the bounds the HTTP facade enforces: registration ids of 1 to 128
/// characters (a longer one overflowed PostgreSQL's index entries and came back UNAVAILABLE) and
/// a notification that fits 3000 bytes of JSON; and a retry time before 1970, which no claim
/// would ever find due, is refused rather than strand the batch until its deadline.
async fn direct_callers_are_held_to_the_http_bounds(backend: Backend) {
    let (mut client, shutdown, _guard) = queue_over_grpc(backend).await;
    let enqueue = |registration: String, worktree: usize| pb::EnqueueRequest {
        host_fingerprint: "hostAAAAAAAAAAAA".into(),
        notification: Some(pb::Notification {
            notification_id: Some("n".repeat(2048)),
            notification_seq: 1,
            notification_epoch: "epoch".into(),
            source: "terminal-bell".into(),
            title: "Done".into(),
            worktree_id: Some("w".repeat(worktree)),
            kind: pb::Kind::Alert as i32,
            ..Default::default()
        }),
        recipients: vec![pb::Recipient {
            registration_id: registration,
            silent: false,
            provider: pb::Provider::Fcm as i32,
        }],
    };
    let random_id: String = (0..3000)
        .map(|i| char::from(b'a' + ((i * 7919 + i / 3) % 26) as u8))
        .collect();
    for (what, request) in [
        ("an empty id", enqueue(String::new(), 10)),
        ("a 3000-character id", enqueue(random_id, 10)),
        ("2048 + 2048 characters", enqueue("r1".into(), 2048)),
    ] {
        let refused = client.enqueue(request).await.unwrap_err();
        assert_eq!(refused.code(), tonic::Code::InvalidArgument, "{what}");
    }
    let depth = client
        .get_queue_depth(pb::GetQueueDepthRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(depth.due, 0, "nothing was stored");

    let queued = client
        .enqueue(enqueue("r1".into(), 10))
        .await
        .unwrap()
        .into_inner()
        .results;
    assert_eq!(queued[0].status, pb::EnqueueStatus::Queued as i32);
    let claimed = claim_due(&mut client).await;
    let retry = |at: i64| pb::RetryRequest {
        batch_id: claimed[0].batch_id.clone(),
        lease_token: claimed[0].lease_token.clone(),
        retry_at_ms: at,
        reason: "test".into(),
        ..Default::default()
    };
    let refused = client.retry(retry(-1)).await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::InvalidArgument);
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64;
    client.retry(retry(now)).await.unwrap();
    assert_eq!(claim_due(&mut client).await.len(), 1, "due again at once");
    shutdown.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn direct_callers_are_held_to_the_http_bounds_on_sqlite() {
    direct_callers_are_held_to_the_http_bounds(Backend::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn direct_callers_are_held_to_the_http_bounds_on_postgresql() {
    direct_callers_are_held_to_the_http_bounds(Backend::Postgres).await;
}
