//! What keeps `WatchSessions` talking: a heartbeat, so a watcher knows it has heard every session
//! minted up to about then, and on PostgreSQL the relay of every replica's new sessions.
//!
//! On SQLite this process mints every session and announces each as it does (`HostAuth`), so a
//! timer's heartbeat is enough. Replicas sharing PostgreSQL announce a new session with
//! `pg_notify` in the transaction that mints it, and send their heartbeats the same way
//! (`orca_push_storage::notify_relay`): a heartbeat relayed here follows every session committed
//! before it. A listener that lost its connection (and with it, perhaps, announcements) tells the
//! watchers so, and they stop trusting what they cached.

use std::time::Duration;

use orca_push_storage::notify_relay::{self, Relayed};
use tokio::sync::broadcast::Sender;
use tokio_util::sync::CancellationToken;

use crate::host_auth::SessionNews;
use crate::store::{PgAuthStore, SESSIONS_CHANNEL};

/// How often watchers hear from auth when no session is minted.
pub const HEARTBEAT: Duration = Duration::from_millis(200);

/// SQLite: a heartbeat every [`HEARTBEAT`], until `shutdown`.
pub async fn heartbeat(news: Sender<SessionNews>, shutdown: CancellationToken) {
    let mut ticks = tokio::time::interval(HEARTBEAT);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = shutdown.cancelled() => return,
            _ = ticks.tick() => {
                // No watcher is not an error.
                let _ = news.send(SessionNews::Heard);
            }
        }
    }
}

/// PostgreSQL: sends this replica's heartbeat through the database every [`HEARTBEAT`] and relays
/// every replica's announcements and heartbeats to this replica's watchers, until `shutdown`.
pub async fn relay(store: PgAuthStore, news: Sender<SessionNews>, shutdown: CancellationToken) {
    let on = move |relayed: Relayed<'_>| {
        // No watcher is not an error.
        let _ = match relayed {
            Relayed::Connected => return,
            Relayed::Heartbeat => news.send(SessionNews::Heard),
            Relayed::Announced(host) => news.send(SessionNews::Replaced(host.to_owned())),
            Relayed::Lost => news.send(SessionNews::Lost),
        };
    };
    notify_relay::relay(
        store.pool().clone(),
        SESSIONS_CHANNEL,
        HEARTBEAT,
        on,
        shutdown,
    )
    .await;
}
