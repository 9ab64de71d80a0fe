//! What keeps `WatchSessions` talking: a heartbeat, so a watcher knows it has heard every session
//! minted up to about then, and on PostgreSQL the relay of every replica's new sessions.
//!
//! On SQLite this process mints every session and announces each as it does (`HostAuth`), so a
//! timer's heartbeat is enough. Replicas sharing PostgreSQL announce a new session with
//! `pg_notify` in the transaction that mints it, and send their heartbeats the same way: PostgreSQL
//! delivers notifications in commit order, so a heartbeat relayed here proves every session
//! committed before it was relayed first. A listener that lost its connection (and with it,
//! perhaps, announcements) tells the watchers so, and they stop trusting what they cached.

use std::time::Duration;

use tokio::sync::broadcast::Sender;
use tokio_util::sync::CancellationToken;

use crate::host_auth::SessionNews;
use crate::store::{PgAuthStore, SESSIONS_CHANNEL};

/// How often watchers hear from auth when no session is minted.
pub const HEARTBEAT: Duration = Duration::from_millis(200);

/// How long to wait before listening again after the listener failed.
const RELISTEN_AFTER: Duration = Duration::from_secs(1);

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
    tokio::spawn(send_heartbeats(store.clone(), shutdown.clone()));
    loop {
        let listened = tokio::select! {
            () = shutdown.cancelled() => return,
            result = listen(&store, &news) => result,
        };
        if let Err(error) = listened {
            tracing::warn!(%error, "session announcement listener failed; listening again");
        }
        let _ = news.send(SessionNews::Lost);
        tokio::select! {
            () = shutdown.cancelled() => return,
            () = tokio::time::sleep(RELISTEN_AFTER) => {}
        }
    }
}

async fn send_heartbeats(store: PgAuthStore, shutdown: CancellationToken) {
    let mut ticks = tokio::time::interval(HEARTBEAT);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = shutdown.cancelled() => return,
            _ = ticks.tick() => {
                // A missed heartbeat only makes watchers fall back to re-checking each second.
                if let Err(error) = store.announce_heartbeat().await {
                    tracing::debug!(%error, "session heartbeat not sent");
                }
            }
        }
    }
}

/// Relays until the connection is lost (`Ok`: the caller reports the loss) or fails to open.
async fn listen(store: &PgAuthStore, news: &Sender<SessionNews>) -> Result<(), sqlx::Error> {
    let mut listener = sqlx::postgres::PgListener::connect_with(store.pool()).await?;
    listener.listen(SESSIONS_CHANNEL).await?;
    // `try_recv` answers `None` when the connection was lost: what was sent meanwhile is gone.
    while let Some(notification) = listener.try_recv().await? {
        let host = notification.payload();
        let _ = news.send(if host.is_empty() {
            SessionNews::Heard
        } else {
            SessionNews::Replaced(host.to_owned())
        });
    }
    Ok(())
}
