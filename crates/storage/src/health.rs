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
    Fut: Future<Output = ()>,
{
    let mut ticker = tokio::time::interval(PING_EVERY);
    let mut last_chore = tokio::time::Instant::now();
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = ticker.tick() => {}
        }
        let status = match pool.ping().await {
            Ok(()) => ServingStatus::Serving,
            Err(error) => {
                tracing::warn!(service = name, %error, "database unreachable; reporting not serving");
                ServingStatus::NotServing
            }
        };
        health.set_service_status(name, status).await;
        if status == ServingStatus::Serving && last_chore.elapsed() >= chore_every {
            last_chore = tokio::time::Instant::now();
            chore().await;
        }
    }
}

/// For a service with no chore.
pub async fn nothing() {}
