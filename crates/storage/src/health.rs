//! A service's gRPC health follows its database: pinged on a beat, NOT_SERVING while it does not
//! answer. A periodic chore (pruning, cleanup) runs on a slower beat while it does.

use std::future::Future;
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tonic_health::ServingStatus;
use tonic_health::server::HealthReporter;

use crate::Pool;

/// How often the database is pinged.
pub const PING_EVERY: Duration = Duration::from_secs(5);
/// How long a ping may take before the database counts as not answering: a server that went
/// silent (a partition, a frozen host) would otherwise hold the ping on a pooled connection until
/// TCP gives up, some 15 minutes, all of it SERVING.
pub const PING_TIMEOUT: Duration = Duration::from_secs(5);

/// Runs until `shutdown`: reports `name`'s health from a database ping every 5 s, and runs `chore`
/// every `chore_every` while the database answers.
pub async fn follow_database<F, Fut>(
    pool: Pool,
    health: HealthReporter,
    name: &'static str,
    chore_every: Duration,
    chore: F,
    shutdown: CancellationToken,
) where
    F: Fn() -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    follow_database_unless(pool, health, name, chore_every, chore, || None, shutdown).await;
}

/// [`follow_database`], reporting NOT_SERVING also while `broken` names why the service cannot
/// serve though its database answers (the queue's SQLite WAL that could not be synced: every
/// admission is refused until a restart).
pub async fn follow_database_unless<F, Fut, B>(
    pool: Pool,
    health: HealthReporter,
    name: &'static str,
    chore_every: Duration,
    chore: F,
    broken: B,
    shutdown: CancellationToken,
) where
    F: Fn() -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
    B: Fn() -> Option<&'static str>,
{
    let mut ticker = tokio::time::interval(PING_EVERY);
    let mut last_chore = tokio::time::Instant::now();
    // The chore runs on a task of its own, beside the pings: between them, a pass over a backlog
    // (cleanup's steps have 10 s each) left health as it was for most of a minute; polled only
    // between pings, it held SQLite's one writer connection while a ping waited for it. One pass
    // at a time; one that panics is only a pass that ended.
    let mut chore_running: Option<tokio::task::JoinHandle<()>> = None;
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => {
                if let Some(running) = chore_running.take() {
                    running.abort();
                }
                return;
            }
            _ = ticker.tick() => {}
        }
        let ping = tokio::time::timeout(PING_TIMEOUT, pool.ping())
            .await
            .unwrap_or(Err(sqlx::Error::PoolTimedOut));
        let status = match ping {
            Ok(()) => match broken() {
                None => ServingStatus::Serving,
                Some(reason) => {
                    tracing::warn!(service = name, reason, "reporting not serving");
                    ServingStatus::NotServing
                }
            },
            Err(error) => {
                tracing::warn!(service = name, %error, "database unreachable; reporting not serving");
                ServingStatus::NotServing
            }
        };
        health.set_service_status(name, status).await;
        if chore_running
            .as_ref()
            .is_some_and(tokio::task::JoinHandle::is_finished)
        {
            chore_running = None;
        }
        if status == ServingStatus::Serving
            && chore_running.is_none()
            && last_chore.elapsed() >= chore_every
        {
            last_chore = tokio::time::Instant::now();
            chore_running = Some(tokio::spawn(chore()));
        }
    }
}

/// For a service with no chore.
pub async fn nothing() {}

#[cfg(test)]
mod tests {
    use tonic_health::pb::health_server::Health as _;
    use tonic_health::pb::{HealthCheckRequest, health_check_response};
    use tonic_health::server::HealthService;

    use super::*;

    async fn status(health: &HealthService, name: &str) -> health_check_response::ServingStatus {
        let request = tonic::Request::new(HealthCheckRequest {
            service: name.into(),
        });
        let answer = health.check(request).await.unwrap().into_inner();
        health_check_response::ServingStatus::try_from(answer.status).unwrap()
    }

    /// A database that accepts connections and never answers is not serving, within a ping's
    /// time: the ping does not wait for the connection to give up.
    #[tokio::test]
    async fn a_database_that_never_answers_is_not_serving() {
        let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = silent.local_addr().unwrap().port();
        let held = tokio::spawn(async move {
            let mut kept = Vec::new();
            while let Ok((socket, _)) = silent.accept().await {
                kept.push(socket);
            }
        });
        let pool = sqlx::postgres::PgPoolOptions::new()
            .acquire_timeout(Duration::from_secs(600))
            .connect_lazy(&format!("postgres://u@127.0.0.1:{port}/db"))
            .unwrap();
        let reporter = HealthReporter::new();
        reporter
            .set_service_status("svc", ServingStatus::Serving)
            .await;
        let health = HealthService::from_health_reporter(reporter.clone());
        let shutdown = CancellationToken::new();
        let following = tokio::spawn(follow_database(
            Pool::Postgres(pool),
            reporter,
            "svc",
            Duration::from_secs(60),
            nothing,
            shutdown.clone(),
        ));
        let deadline = tokio::time::Instant::now() + PING_TIMEOUT + Duration::from_secs(3);
        while status(&health, "svc").await != health_check_response::ServingStatus::NotServing {
            assert!(tokio::time::Instant::now() < deadline, "still serving");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        shutdown.cancel();
        following.abort();
        held.abort();
    }

    /// A SQLite writer in `dir`, and a reporter whose `svc` is UNKNOWN until followed.
    async fn writer_and_health(
        dir: &std::path::Path,
    ) -> (sqlx::SqlitePool, HealthReporter, HealthService) {
        let writer = crate::open_sqlite(&dir.join("h.db"), crate::SqliteDurability::Full)
            .await
            .unwrap();
        let reporter = HealthReporter::new();
        reporter
            .set_service_status("svc", ServingStatus::Unknown)
            .await;
        let health = HealthService::from_health_reporter(reporter.clone());
        (writer, reporter, health)
    }

    /// A chore that takes long (cleanup over a backlog) does not hold health where it was.
    #[tokio::test]
    async fn health_is_followed_while_a_chore_runs() {
        let dir = tempfile::tempdir().unwrap();
        let (writer, reporter, health) = writer_and_health(dir.path()).await;
        let broken = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let shutdown = CancellationToken::new();
        let flag = broken.clone();
        let following = tokio::spawn(follow_database_unless(
            Pool::Sqlite(writer),
            reporter,
            "svc",
            Duration::ZERO,
            std::future::pending::<()>,
            move || {
                flag.load(std::sync::atomic::Ordering::SeqCst)
                    .then_some("broken meanwhile")
            },
            shutdown.clone(),
        ));
        let wait_for = |want| {
            let health = &health;
            async move {
                let deadline = tokio::time::Instant::now() + PING_EVERY + Duration::from_secs(3);
                while status(health, "svc").await != want {
                    assert!(tokio::time::Instant::now() < deadline, "never {want:?}");
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
        };
        wait_for(health_check_response::ServingStatus::Serving).await;
        // The chore started with that first check and never ends.
        broken.store(true, std::sync::atomic::Ordering::SeqCst);
        wait_for(health_check_response::ServingStatus::NotServing).await;
        shutdown.cancel();
        following.await.unwrap();
    }

    /// A chore that keeps SQLite's one writer connection busy, transaction after transaction (a
    /// cleanup pass over a backlog), goes on while a ping waits for that connection: health stays
    /// SERVING through two pings. Polled only between pings, the chore held the connection the
    /// ping waited for, until the ping timed out and said NOT_SERVING.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_chore_holding_the_writer_does_not_starve_the_ping() {
        let dir = tempfile::tempdir().unwrap();
        let (writer, reporter, health) = writer_and_health(dir.path()).await;
        let shutdown = CancellationToken::new();
        let busy = writer.clone();
        let following = tokio::spawn(follow_database(
            Pool::Sqlite(writer),
            reporter,
            "svc",
            Duration::ZERO,
            move || {
                let busy = busy.clone();
                async move {
                    let until =
                        tokio::time::Instant::now() + 2 * PING_EVERY + Duration::from_secs(1);
                    while tokio::time::Instant::now() < until {
                        let tx = busy.begin().await.unwrap();
                        tokio::time::sleep(Duration::from_millis(200)).await;
                        tx.commit().await.unwrap();
                    }
                }
            },
            shutdown.clone(),
        ));
        let started = tokio::time::Instant::now();
        // The first ping makes it serving (it starts unknown)...
        while status(&health, "svc").await != health_check_response::ServingStatus::Serving {
            assert!(started.elapsed() < PING_EVERY, "never serving");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        // ...and it stays so while the chore holds the writer, through two more pings.
        while started.elapsed() < 2 * PING_EVERY + Duration::from_millis(500) {
            assert_eq!(
                status(&health, "svc").await,
                health_check_response::ServingStatus::Serving,
                "after {:?}",
                started.elapsed()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        shutdown.cancel();
        following.await.unwrap();
    }

    /// A database that answers does not make a broken service serving.
    #[tokio::test]
    async fn a_broken_service_is_not_serving_while_its_database_answers() {
        let dir = tempfile::tempdir().unwrap();
        let writer = crate::open_sqlite(&dir.path().join("h.db"), crate::SqliteDurability::Full)
            .await
            .unwrap();
        let pool = Pool::Sqlite(writer);
        for (broken, want) in [
            (None, health_check_response::ServingStatus::Serving),
            (
                Some("the WAL could not be synced"),
                health_check_response::ServingStatus::NotServing,
            ),
        ] {
            let reporter = HealthReporter::new();
            reporter
                .set_service_status("svc", ServingStatus::Unknown)
                .await;
            let health = HealthService::from_health_reporter(reporter.clone());
            let shutdown = CancellationToken::new();
            let following = tokio::spawn(follow_database_unless(
                pool.clone(),
                reporter,
                "svc",
                Duration::from_secs(60),
                nothing,
                move || broken,
                shutdown.clone(),
            ));
            let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
            while status(&health, "svc").await != want {
                assert!(tokio::time::Instant::now() < deadline, "{broken:?}");
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            shutdown.cancel();
            following.await.unwrap();
        }
    }
}
