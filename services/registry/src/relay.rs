//! PostgreSQL: keeps a replica's resolve cache true to every replica's device writes. Each write
//! names its host with `pg_notify` on `DEVICES_CHANNEL` in its transaction; this relay drops that
//! host's entry on receipt. Each replica also sends an empty notification every [`HEARTBEAT`]:
//! PostgreSQL delivers notifications in commit order, so hearing one proves every write committed
//! before it was relayed first, and the cache serves entries only while heartbeats keep coming. A
//! lost connection (announcements may be lost with it) empties the cache, and it serves nothing
//! until the relay is connected and heard from again.

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::resolve_cache::ResolveCache;
use crate::store::DEVICES_CHANNEL;

/// How often each replica proves its relay current.
pub const HEARTBEAT: Duration = Duration::from_millis(200);
/// How long to wait before listening again after the listener failed.
const RELISTEN_AFTER: Duration = Duration::from_secs(1);

pub async fn relay(pool: sqlx::PgPool, cache: Arc<ResolveCache>, shutdown: CancellationToken) {
    tokio::spawn(send_heartbeats(pool.clone(), shutdown.clone()));
    loop {
        let listened = tokio::select! {
            () = shutdown.cancelled() => return,
            result = listen(&pool, &cache) => result,
        };
        cache.relay_lost();
        if let Err(error) = listened {
            tracing::warn!(%error, "device write listener failed; resolving from the database meanwhile");
        }
        tokio::select! {
            () = shutdown.cancelled() => return,
            () = tokio::time::sleep(RELISTEN_AFTER) => {}
        }
    }
}

async fn send_heartbeats(pool: sqlx::PgPool, shutdown: CancellationToken) {
    let mut ticks = tokio::time::interval(HEARTBEAT);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = shutdown.cancelled() => return,
            _ = ticks.tick() => {
                // A missed heartbeat only sends resolves to the database for a while.
                if let Err(error) = sqlx::query("SELECT pg_notify($1, '')")
                    .bind(DEVICES_CHANNEL)
                    .execute(&pool)
                    .await
                {
                    tracing::debug!(%error, "device relay heartbeat not sent");
                }
            }
        }
    }
}

/// Relays until the connection is lost (`Ok`) or fails to open.
async fn listen(pool: &sqlx::PgPool, cache: &ResolveCache) -> Result<(), sqlx::Error> {
    let mut listener = sqlx::postgres::PgListener::connect_with(pool).await?;
    listener.listen(DEVICES_CHANNEL).await?;
    cache.relay_connected();
    // `try_recv` answers `None` when the connection was lost: what was sent meanwhile is gone.
    while let Some(notification) = listener.try_recv().await? {
        let host = notification.payload();
        if host.is_empty() {
            cache.relay_heard();
        } else {
            cache.invalidate(host);
        }
    }
    Ok(())
}
