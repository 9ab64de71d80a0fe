//! How full each service's connection pools are, as gauges sampled every 5 s:
//! `orca_push_db_pool_connections{service, backend, pool, state}` (`idle` or `in_use`; their sum
//! is the pool's size) and `orca_push_db_pool_max_connections{service, backend, pool}`. `pool` is
//! SQLite's `writer` (one connection) or `readers`, or PostgreSQL's `read_write` pool (and the
//! queue's `rounds`, its admission writer's own connection).

use std::time::Duration;

use sqlx::postgres::PgPool;
use sqlx::sqlite::SqlitePool;
use tokio_util::sync::CancellationToken;

use crate::Pool;

/// How often the pools are sampled.
pub const SAMPLE_EVERY: Duration = Duration::from_secs(5);

/// A store's pools by role.
#[derive(Debug, Clone)]
pub struct StorePools(Vec<(&'static str, Pool)>);

impl StorePools {
    /// SQLite: the one writer, and the readers beside it.
    pub fn sqlite(writer: &SqlitePool, readers: &SqlitePool) -> Self {
        Self(vec![
            ("writer", Pool::Sqlite(writer.clone())),
            ("readers", Pool::Sqlite(readers.clone())),
        ])
    }

    /// PostgreSQL: one pool serves reads and writes.
    pub fn postgres(pool: &PgPool) -> Self {
        Self(vec![("read_write", Pool::Postgres(pool.clone()))])
    }

    /// These and a PostgreSQL pool of its own for `role` (the queue's admission `rounds`).
    pub fn with_postgres(mut self, role: &'static str, pool: &PgPool) -> Self {
        self.0.push((role, Pool::Postgres(pool.clone())));
        self
    }

    /// Records every pool's use now, labelled with `service` (`auth`, `registry`, `queue`).
    pub fn record(&self, service: &'static str) {
        for (role, pool) in &self.0 {
            let (size, idle, max) = match pool {
                Pool::Sqlite(p) => (p.size(), p.num_idle(), p.options().get_max_connections()),
                Pool::Postgres(p) => (p.size(), p.num_idle(), p.options().get_max_connections()),
            };
            let idle = u32::try_from(idle).unwrap_or(u32::MAX).min(size);
            let backend = pool.backend();
            metrics::gauge!("orca_push_db_pool_connections", "service" => service, "backend" => backend, "pool" => *role, "state" => "idle")
                .set(f64::from(idle));
            metrics::gauge!("orca_push_db_pool_connections", "service" => service, "backend" => backend, "pool" => *role, "state" => "in_use")
                .set(f64::from(size - idle));
            metrics::gauge!("orca_push_db_pool_max_connections", "service" => service, "backend" => backend, "pool" => *role)
                .set(f64::from(max));
        }
    }
}

/// Samples `pools` every [`SAMPLE_EVERY`] (the first at once) until `shutdown`.
pub async fn record_until(service: &'static str, pools: StorePools, shutdown: CancellationToken) {
    let mut ticker = tokio::time::interval(SAMPLE_EVERY);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = ticker.tick() => pools.record(service),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn value(text: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
        text.lines()
            .filter(|l| l.starts_with(name) && l[name.len()..].starts_with('{'))
            .find(|l| {
                labels
                    .iter()
                    .all(|(k, v)| l.contains(&format!("{k}=\"{v}\"")))
            })
            .and_then(|l| l.rsplit(' ').next()?.parse().ok())
    }

    #[tokio::test]
    async fn a_held_connection_is_in_use_and_a_returned_one_idle() {
        let dir = tempfile::tempdir().unwrap();
        let writer = crate::open_sqlite(&dir.path().join("t.sqlite"), Default::default())
            .await
            .unwrap();
        let readers = crate::sqlite_readers(&writer, 4);
        let pools = StorePools::sqlite(&writer, &readers);
        let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
        let sample = || {
            metrics::with_local_recorder(&recorder, || pools.record("queue"));
            recorder.handle().render()
        };
        let writer_in = |text: &str, state| {
            value(
                text,
                "orca_push_db_pool_connections",
                &[
                    ("service", "queue"),
                    ("backend", "sqlite"),
                    ("pool", "writer"),
                    ("state", state),
                ],
            )
        };

        let held = writer.acquire().await.unwrap();
        let text = sample();
        assert_eq!(writer_in(&text, "in_use"), Some(1.0), "{text}");
        assert_eq!(writer_in(&text, "idle"), Some(0.0));
        let max = |pool| {
            value(
                &text,
                "orca_push_db_pool_max_connections",
                &[("service", "queue"), ("pool", pool)],
            )
        };
        assert_eq!(max("writer"), Some(1.0));
        assert_eq!(max("readers"), Some(4.0));
        // The readers connect lazily: none open yet.
        assert_eq!(
            value(
                &text,
                "orca_push_db_pool_connections",
                &[("pool", "readers"), ("state", "idle")]
            ),
            Some(0.0)
        );

        // sqlx hands a dropped connection back to its pool on a task of its own.
        drop(held);
        let mut text = sample();
        for _ in 0..100 {
            if writer_in(&text, "in_use") == Some(0.0) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
            text = sample();
        }
        assert_eq!(writer_in(&text, "in_use"), Some(0.0), "{text}");
        assert_eq!(writer_in(&text, "idle"), Some(1.0));
    }
}
