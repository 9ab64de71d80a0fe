//! How far this process's clock is from PostgreSQL's: `orca_push_clock_offset_seconds{service}`
//! (the server's clock minus this process's, sampled every minute), and a warning past 1 s.
//!
//! Replicas compare times that each wrote from its own clock: a lease's end, a coalescing
//! window's, a challenge's expiry, the quota's fifteen minutes. A replica whose clock trails the
//! others' by Δ writes leases that the others see lapse Δ early (past the lease, they send the
//! batch again), windows that close Δ early, challenges that expire Δ early. So the replicas'
//! clocks must agree (NTP keeps them within milliseconds); the database's is the one clock they
//! all see, and the offset from it says which replica has drifted.

use std::sync::Arc;
use std::time::Duration;

use sqlx::postgres::PgPool;
use tokio_util::sync::CancellationToken;

use crate::Clock;

/// How often the offset is sampled.
pub const SAMPLE_EVERY: Duration = Duration::from_secs(60);
/// An offset beyond this, in either direction, is logged as a warning.
pub const WARN_PAST_MS: i64 = 1_000;
/// A reading whose round trip took longer than this says too little: left out.
const MAX_ROUND_TRIP_MS: i64 = 200;

/// The server's clock, in Unix milliseconds.
const SERVER_NOW_SQL: &str = "SELECT (extract(epoch FROM clock_timestamp()) * 1000)::bigint";

/// The server's clock minus this process's, from the server's reading `server` taken between
/// `before` and `after` on this process's clock (Unix ms): the server read it about halfway.
/// None when the round trip was too long (or the clock stepped back) to place it.
pub fn offset_ms(before: i64, server: i64, after: i64) -> Option<i64> {
    let round_trip = after.checked_sub(before)?;
    if !(0..=MAX_ROUND_TRIP_MS).contains(&round_trip) {
        return None;
    }
    server.checked_sub(before + round_trip / 2)
}

/// One reading of the offset (see [`offset_ms`]).
pub async fn sample(pool: &PgPool, clock: &dyn Clock) -> Result<Option<i64>, sqlx::Error> {
    let now = || i64::try_from(clock.now_ms()).unwrap_or(i64::MAX);
    let mut conn = pool.acquire().await?;
    let before = now();
    let server: i64 = sqlx::query_scalar(SERVER_NOW_SQL)
        .fetch_one(&mut *conn)
        .await?;
    let after = now();
    Ok(offset_ms(before, server, after))
}

/// Samples the offset every [`SAMPLE_EVERY`] (the first at once) into the gauge, labelled with
/// `service`, until `shutdown`.
pub async fn watch_until(
    service: &'static str,
    pool: PgPool,
    clock: Arc<dyn Clock>,
    shutdown: CancellationToken,
) {
    let mut ticker = tokio::time::interval(SAMPLE_EVERY);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = ticker.tick() => {}
        }
        match sample(&pool, &*clock).await {
            Ok(Some(offset)) => {
                #[allow(clippy::cast_precision_loss)] // milliseconds well within f64's integers
                let seconds = offset as f64 / 1000.0;
                metrics::gauge!("orca_push_clock_offset_seconds", "service" => service)
                    .set(seconds);
                if offset.abs() > WARN_PAST_MS {
                    tracing::warn!(
                        service,
                        offset_ms = offset,
                        "this process's clock is off the database's by more than a second: \
                         replicas compare each other's times (leases, windows, expiries); \
                         check NTP on this host"
                    );
                }
            }
            Ok(None) => {}
            Err(error) => tracing::debug!(%error, "could not read the database's clock"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_offset_is_taken_from_the_middle_of_the_round_trip() {
        assert_eq!(offset_ms(1_000, 1_010, 1_020), Some(0));
        assert_eq!(offset_ms(1_000, 3_010, 1_020), Some(2_000));
        assert_eq!(offset_ms(1_000, 10, 1_020), Some(-1_000));
        assert_eq!(offset_ms(1_000, 1_000, 1_000), Some(0));
        // Too slow a round trip, or a clock stepped back, places nothing.
        assert_eq!(offset_ms(1_000, 1_100, 1_201), None);
        assert_eq!(offset_ms(1_000, 1_000, 999), None);
        assert_eq!(offset_ms(i64::MIN + 1, i64::MAX, i64::MIN + 2), None);
    }

    /// On the test cluster (this host's clock), the offset reads as about nothing, and a clock
    /// set an hour ahead reads as an hour behind the server.
    #[tokio::test]
    async fn the_offset_from_the_database_is_read_on_postgresql() {
        let url = std::env::var("ORCA_PUSH_TEST_POSTGRES_URL")
            .expect("ORCA_PUSH_TEST_POSTGRES_URL: scripts/test starts a throwaway PostgreSQL");
        let pool = crate::postgres_pool_options()
            .max_connections(1)
            .connect(&url)
            .await
            .unwrap();
        let mut readings = Vec::new();
        for _ in 0..5 {
            if let Some(offset) = sample(&pool, &crate::SystemClock).await.unwrap() {
                readings.push(offset);
            }
        }
        assert!(!readings.is_empty(), "no reading within the round trip");
        assert!(readings.iter().all(|o| o.abs() < 100), "{readings:?}");
        let ahead = crate::ManualClock::new(crate::SystemClock.now_ms() + 3_600_000);
        let offset = loop {
            if let Some(offset) = sample(&pool, &ahead).await.unwrap() {
                break offset;
            }
        };
        assert!((offset + 3_600_000).abs() < 5_000, "{offset}");
        pool.close().await;
    }
}
