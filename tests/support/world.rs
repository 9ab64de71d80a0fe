//! A gateway with both provider mocks, one logged-in host, and helpers to register, send and read
//! outcomes: the world most delivery tests start from.

use std::time::Duration;

use orca_push_host::HostKey;
use orca_push_storage::Pool;
use serde_json::{Value, json};

use crate::mock_apns::MockApns;
use crate::mock_fcm::MockFcm;
use crate::{Backend, Gateway, Raw, bearer};

/// How long a test waits for an outcome.
pub const WAIT: Duration = Duration::from_secs(20);

pub struct World {
    pub apns: MockApns,
    pub fcm: MockFcm,
    pub gateway: Gateway,
    pub raw: Raw,
    pub auth: String,
}

impl World {
    pub async fn start(backend: Backend, coalesce_ms: &str) -> Self {
        Self::start_with(backend, coalesce_ms, &[]).await
    }

    /// With more environment for the gateway.
    pub async fn start_with(backend: Backend, coalesce_ms: &str, extra: &[(&str, &str)]) -> Self {
        let apns = MockApns::start().await;
        let fcm = MockFcm::start().await;
        Self::start_around(backend, coalesce_ms, extra, apns, fcm).await
    }

    /// The split topology (`Gateway::start_split`), each process given the mocks.
    pub async fn start_split(backend: Backend, coalesce_ms: &str) -> Self {
        let apns = MockApns::start().await;
        let fcm = MockFcm::start().await;
        Self::start_in(backend, coalesce_ms, &[], apns, fcm, true).await
    }

    /// Around mocks already started (e.g. with a fault proxy in front of one: `extra` comes last,
    /// so its `ORCA_PUSH_APNS_URL` wins).
    pub async fn start_around(
        backend: Backend,
        coalesce_ms: &str,
        extra: &[(&str, &str)],
        apns: MockApns,
        fcm: MockFcm,
    ) -> Self {
        Self::start_in(backend, coalesce_ms, extra, apns, fcm, false).await
    }

    async fn start_in(
        backend: Backend,
        coalesce_ms: &str,
        extra: &[(&str, &str)],
        apns: MockApns,
        fcm: MockFcm,
        split: bool,
    ) -> Self {
        let mut env = apns.env();
        env.extend(fcm.env());
        env.push(("ORCA_PUSH_COALESCE_MS".into(), coalesce_ms.into()));
        env.extend(
            extra
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned())),
        );
        let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        let gateway = if split {
            Gateway::start_split_with(backend, &env).await
        } else {
            Gateway::start_with(backend, &env).await
        };
        let raw = Raw::new(&gateway);
        let auth = bearer(&raw.login(&HostKey::from_secret([7u8; 32]), &[]).await);
        Self {
            apns,
            fcm,
            gateway,
            raw,
            auth,
        }
    }

    pub async fn register_ios(&self, device: &str, token: &str) -> String {
        self.register(json!({ "v": 1, "deviceId": device, "platform": "ios", "token": token, "apnsEnvironment": "production" }))
            .await
    }

    pub async fn register_android(&self, device: &str, token: &str) -> String {
        self.register(json!({ "v": 1, "deviceId": device, "platform": "android", "token": token }))
            .await
    }

    pub async fn register(&self, body: Value) -> String {
        let reply = self
            .raw
            .post("/v1/devices", &body, &[("authorization", &self.auth)])
            .await;
        assert_eq!(reply.status, 200, "{reply:?}");
        reply.body["registrationId"].as_str().unwrap().to_owned()
    }

    pub async fn send(&self, ids: &[&str], notification: Value) -> Vec<String> {
        let reply = self
            .raw
            .post(
                "/v1/send",
                &json!({ "v": 1, "registrationIds": ids, "notification": notification }),
                &[("authorization", &self.auth)],
            )
            .await;
        assert_eq!(reply.status, 200, "{reply:?}");
        reply.body["results"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r["status"].as_str().unwrap().to_owned())
            .collect()
    }

    /// The recipient's status in the queue's records.
    pub async fn outcome(&self, registration_id: &str) -> Vec<String> {
        let sql = "SELECT status FROM push_event_recipients WHERE registration_id = $1 ORDER BY created_at";
        match orca_push_storage::open(&self.gateway.database, &orca_push_queue::STORAGE)
            .await
            .unwrap()
        {
            Pool::Sqlite(p) => sqlx::query_scalar(sql)
                .bind(registration_id)
                .fetch_all(&p)
                .await
                .unwrap(),
            Pool::Postgres(p) => sqlx::query_scalar(sql)
                .bind(registration_id)
                .fetch_all(&p)
                .await
                .unwrap(),
        }
    }

    /// The registration's delivery batches as the queue keeps them, oldest first.
    pub async fn batches(&self, registration_id: &str) -> Vec<BatchRow> {
        let sql = "SELECT state, attempts, retries, available_at FROM push_delivery_batches \
                   WHERE registration_id = $1 ORDER BY created_at";
        let rows: Vec<(String, i32, i32, i64)> =
            match orca_push_storage::open(&self.gateway.database, &orca_push_queue::STORAGE)
                .await
                .unwrap()
            {
                Pool::Sqlite(p) => sqlx::query_as(sql)
                    .bind(registration_id)
                    .fetch_all(&p)
                    .await
                    .unwrap(),
                Pool::Postgres(p) => sqlx::query_as(sql)
                    .bind(registration_id)
                    .fetch_all(&p)
                    .await
                    .unwrap(),
            };
        rows.into_iter()
            .map(|(state, attempts, retries, available_at)| BatchRow {
                state,
                attempts,
                retries,
                available_at,
            })
            .collect()
    }

    /// Waits for `status` up to `within` (longer than [`WAIT`] where recovery takes a breaker's
    /// probe).
    pub async fn wait_outcome_within(&self, registration_id: &str, status: &str, within: Duration) {
        let deadline = std::time::Instant::now() + within;
        loop {
            let outcomes = self.outcome(registration_id).await;
            if outcomes.last().is_some_and(|s| s == status) {
                return;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "outcome {outcomes:?}, wanted {status}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    pub async fn wait_outcome(&self, registration_id: &str, status: &str) {
        self.wait_outcome_within(registration_id, status, WAIT)
            .await
    }
}

/// One row of `push_delivery_batches`: `attempts` counts provider answers, `retries` every retry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BatchRow {
    pub state: String,
    pub attempts: i32,
    pub retries: i32,
    /// Unix milliseconds when the batch may next be claimed.
    pub available_at: i64,
}

pub fn alert(seq: u64) -> Value {
    json!({
        "notificationId": format!("task-{seq}"), "notificationSeq": seq, "notificationEpoch": "epoch-1",
        "source": "agent-task-complete", "agentState": "finished",
        "title": "Agent finished", "body": "Refactor done", "worktreeId": "wt-1",
    })
}
