//! PostgreSQL: a channel that replicas announce their writes on with `pg_notify` (in the writing
//! transaction), relayed to this process, with heartbeats that prove the relay current. Every
//! replica sends an empty notification on the channel every `heartbeat`; PostgreSQL delivers
//! notifications in commit order, so hearing one proves every announcement committed before it
//! was relayed first. A lost connection may have lost announcements with it: the caller hears
//! [`Relayed::Lost`] and must stop trusting what it kept until it hears a heartbeat again.
//!
//! Used by auth (new sessions, for the facade's session watch) and the registry (device writes,
//! for its resolve cache).

use std::time::Duration;

use tokio_util::sync::CancellationToken;

/// What the relay tells its caller.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Relayed<'a> {
    /// Listening on a new connection: nothing is proven until the next heartbeat.
    Connected,
    /// A heartbeat: every announcement committed before it was sent has been relayed.
    Heartbeat,
    /// An announcement's payload (never empty).
    Announced(&'a str),
    /// The connection was lost or could not be opened: announcements may be missing.
    Lost,
}

/// How long to wait before listening again after the listener failed.
const RELISTEN_AFTER: Duration = Duration::from_secs(1);

/// Sends this process's heartbeat on `channel` every `heartbeat` and relays everything heard on it
/// to `on`, until `shutdown`.
pub async fn relay(
    pool: sqlx::PgPool,
    channel: &'static str,
    heartbeat: Duration,
    mut on: impl FnMut(Relayed<'_>) + Send,
    shutdown: CancellationToken,
) {
    tokio::spawn(send_heartbeats(
        pool.clone(),
        channel,
        heartbeat,
        shutdown.clone(),
    ));
    loop {
        let listened = tokio::select! {
            () = shutdown.cancelled() => return,
            result = listen(&pool, channel, &mut on) => result,
        };
        on(Relayed::Lost);
        if let Err(error) = listened {
            tracing::warn!(%error, channel, "notification listener failed; listening again");
        }
        tokio::select! {
            () = shutdown.cancelled() => return,
            () = tokio::time::sleep(RELISTEN_AFTER) => {}
        }
    }
}

async fn send_heartbeats(
    pool: sqlx::PgPool,
    channel: &'static str,
    heartbeat: Duration,
    shutdown: CancellationToken,
) {
    let mut ticks = tokio::time::interval(heartbeat);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = shutdown.cancelled() => return,
            _ = ticks.tick() => {
                // A missed heartbeat only makes the listeners distrust what they kept for a while.
                if let Err(error) = sqlx::query("SELECT pg_notify($1, '')")
                    .bind(channel)
                    .execute(&pool)
                    .await
                {
                    tracing::debug!(%error, channel, "heartbeat not sent");
                }
            }
        }
    }
}

/// Relays until the connection is lost (`Ok`) or fails to open.
async fn listen(
    pool: &sqlx::PgPool,
    channel: &'static str,
    on: &mut (impl FnMut(Relayed<'_>) + Send),
) -> Result<(), sqlx::Error> {
    let mut listener = sqlx::postgres::PgListener::connect_with(pool).await?;
    listener.listen(channel).await?;
    on(Relayed::Connected);
    // `try_recv` answers `None` when the connection was lost: what was sent meanwhile is gone.
    while let Some(notification) = listener.try_recv().await? {
        on(match notification.payload() {
            "" => Relayed::Heartbeat,
            payload => Relayed::Announced(payload),
        });
    }
    Ok(())
}
