//! The queue's test harness: a queue on a fresh database (SQLite or PostgreSQL) with a manual
//! clock, admissions to build, and a macro that runs a test on both backends.
#![allow(dead_code)]

use std::sync::Arc;

use orca_push_queue::model::{
    Admission, AdmissionRecipient, AdmissionStatus, Content, Kind, Provider,
};
use orca_push_queue::{AnyQueueStore, DeliveryQueue, open_and_migrate};
use orca_push_storage::testing::{Backend, TestDbGuard, fresh};
use orca_push_storage::{DatabaseConfig, ManualClock};

pub const T0: u64 = 1_800_000_000_000;
pub const HOST: &str = "hostAAAAAAAAAAAA";
pub const WINDOW: u64 = 3000;
pub const LEASE: i64 = 30_000;

pub struct Harness {
    pub queue: Arc<DeliveryQueue<AnyQueueStore>>,
    pub clock: ManualClock,
    pub config: DatabaseConfig,
    /// The queue's waker, for a test that wakes its lanes itself.
    pub wake: Arc<orca_push_queue::Wake>,
    _db: TestDbGuard,
}

pub async fn harness(backend: Backend) -> Harness {
    harness_with(backend, WINDOW).await
}

pub async fn harness_with(backend: Backend, window: u64) -> Harness {
    let (config, guard) = fresh(backend).await;
    harness_on(config, guard, window).await
}

/// A harness on a database of the caller's (for example one reached through a proxy).
pub async fn harness_on(config: DatabaseConfig, guard: TestDbGuard, window: u64) -> Harness {
    let pool = open_and_migrate(&config).await.expect("open and migrate");
    let clock = ManualClock::new(T0);
    let wake = Arc::new(orca_push_queue::Wake::new());
    let queue = DeliveryQueue::new(
        AnyQueueStore::new(pool),
        Arc::new(clock.clone()),
        window,
        wake.clone(),
    );
    Harness {
        queue: Arc::new(queue),
        clock,
        config,
        wake,
        _db: guard,
    }
}

pub fn alert(seq: i64, recipients: &[&str]) -> Admission {
    Admission {
        host_fingerprint: HOST.into(),
        kind: Kind::Alert,
        notification_epoch: "epoch-1".into(),
        notification_seq: seq,
        content: Content {
            notification_id: Some(format!("n-{seq}")),
            source: "agent-task-complete".into(),
            agent_state: Some("finished".into()),
            title: format!("Task {seq} done"),
            body: "All good".into(),
            worktree_id: Some("wt-1".into()),
        },
        expires_at_ms: None,
        recipients: recipients
            .iter()
            .map(|r| AdmissionRecipient {
                registration_id: (*r).into(),
                silent: false,
                provider: Provider::Apns,
            })
            .collect(),
        trace_parent: None,
    }
}

pub fn dismiss(of: &Admission, seq: i64, recipients: &[&str]) -> Admission {
    let mut d = alert(seq, recipients);
    d.kind = Kind::Dismiss;
    d.content.notification_id = of.content.notification_id.clone();
    d
}

impl Harness {
    /// The queue as a restarted process finds it: a new store on the same database, sharing the
    /// clock. The harness keeps the database.
    pub async fn reopened(&self) -> Harness {
        let pool = open_and_migrate(&self.config)
            .await
            .expect("open and migrate");
        let wake = Arc::new(orca_push_queue::Wake::new());
        let queue = DeliveryQueue::new(
            AnyQueueStore::new(pool),
            Arc::new(self.clock.clone()),
            WINDOW,
            wake.clone(),
        );
        Harness {
            queue: Arc::new(queue),
            clock: self.clock.clone(),
            config: self.config.clone(),
            wake,
            _db: TestDbGuard::default(),
        }
    }

    pub async fn admit(&self, a: &Admission) -> Vec<AdmissionStatus> {
        self.queue
            .enqueue(a)
            .await
            .expect("enqueue")
            .statuses
            .into_iter()
            .map(|(_, s)| s)
            .collect()
    }

    /// The reads of the earliest due time once waiting lanes have all made their first and gone
    /// to sleep (no read for 200 ms): a lane that starts late reads on its own, which under a
    /// loaded suite once took longer than a fixed 200 ms.
    pub async fn settled_due_reads(&self) -> u64 {
        let mut before = self.queue.due_reads();
        for _ in 0..50 {
            tokio::time::sleep(std::time::Duration::from_millis(200)).await;
            let now = self.queue.due_reads();
            if now == before && now > 0 {
                return now;
            }
            before = now;
        }
        panic!("the lanes' first reads never settled");
    }

    pub async fn claim_all(&self) -> Vec<orca_push_queue::store::ClaimedBatch> {
        self.queue
            .claim("lane-test", 64, LEASE, 0)
            .await
            .expect("claim")
    }
}

#[macro_export]
macro_rules! on_both_backends {
    ($($name:ident),* $(,)?) => {$(
        mod $name {
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn sqlite() {
                super::$name(orca_push_storage::testing::Backend::Sqlite).await;
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn postgres() {
                super::$name(orca_push_storage::testing::Backend::Postgres).await;
            }
        }
    )*};
}
