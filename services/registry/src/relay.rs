//! PostgreSQL: keeps a replica's resolve cache true to every replica's device writes. Each write
//! names its host with `pg_notify` on `DEVICES_CHANNEL` in its transaction, and this relay
//! (`orca_push_storage::notify_relay`) drops that host's entry on receipt. The heartbeats every
//! replica sends on the same channel prove the relay current, and the cache serves entries only
//! while they keep coming. A lost connection (announcements may be lost with it) makes the cache
//! serve nothing until the relay is connected and heard from again.

use std::sync::Arc;
use std::time::Duration;

use orca_push_storage::notify_relay::{self, Relayed};
use tokio_util::sync::CancellationToken;

use crate::resolve_cache::ResolveCache;
use crate::store::DEVICES_CHANNEL;

/// How often each replica proves its relay current.
pub const HEARTBEAT: Duration = Duration::from_millis(200);

/// SQLite: an exact cache's heartbeat for `WatchDevices` every [`HEARTBEAT`], until `shutdown`
/// (every write of this process is told as it commits, so a timer proves the watch current).
pub async fn exact_heartbeat(cache: Arc<ResolveCache>, shutdown: CancellationToken) {
    let mut ticks = tokio::time::interval(HEARTBEAT);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = shutdown.cancelled() => return,
            _ = ticks.tick() => cache.exact_heartbeat(),
        }
    }
}

pub async fn relay(pool: sqlx::PgPool, cache: Arc<ResolveCache>, shutdown: CancellationToken) {
    let on = move |relayed: Relayed<'_>| match relayed {
        Relayed::Connected => cache.relay_connected(),
        Relayed::Heartbeat => cache.relay_heard(),
        Relayed::Announced(host) => cache.invalidate(host),
        Relayed::Lost => {
            cache.relay_lost();
            tracing::debug!("device write relay lost; resolving from the database meanwhile");
        }
    };
    notify_relay::relay(pool, DEVICES_CHANNEL, HEARTBEAT, on, shutdown).await;
}
