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

/// Heartbeats the relay may miss in a row before it takes its connection for dead and listens on a
/// new one: a connection the network dropped without a word (a fail-over, a NAT or load balancer
/// forgetting an idle flow) is never closed, and a listener only reads, so nothing else finds out.
const SILENT_FOR_HEARTBEATS: u32 = 50;

/// The next notification `listener` hears (`Some(Ok(None))` when its connection was lost and made
/// again), or `None` when it heard nothing at all for `silence`: its connection may be dead
/// without a word, and the caller drops the listener (a read cut off part way leaves nothing to
/// reuse) and listens on a new one.
pub async fn next_within(
    listener: &mut sqlx::postgres::PgListener,
    silence: Duration,
) -> Option<Result<Option<sqlx::postgres::PgNotification>, sqlx::Error>> {
    tokio::time::timeout(silence, listener.try_recv())
        .await
        .ok()
}

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
            result = listen(&pool, channel, heartbeat * SILENT_FOR_HEARTBEATS, &mut on) => result,
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
                // One the server never answers (its connection dropped without a word) is given
                // up, so that the next goes on another connection.
                let sent = tokio::time::timeout(
                    heartbeat * 5,
                    sqlx::query("SELECT pg_notify($1, '')").bind(channel).execute(&pool),
                )
                .await;
                match sent {
                    Ok(Ok(_)) => {}
                    Ok(Err(error)) => tracing::debug!(%error, channel, "heartbeat not sent"),
                    Err(_) => tracing::debug!(channel, "heartbeat unanswered; given up"),
                }
            }
        }
    }
}

/// Relays until the connection is lost (`Ok`), fails to open, or is silent for `silence` (not
/// even this process's own heartbeat heard).
async fn listen(
    pool: &sqlx::PgPool,
    channel: &'static str,
    silence: Duration,
    on: &mut (impl FnMut(Relayed<'_>) + Send),
) -> Result<(), sqlx::Error> {
    let mut listener = sqlx::postgres::PgListener::connect_with(pool).await?;
    listener.listen(channel).await?;
    on(Relayed::Connected);
    loop {
        // `try_recv` answers `None` when the connection was lost: what was sent meanwhile is gone.
        let Some(notification) = next_within(&mut listener, silence).await.transpose()? else {
            return Err(sqlx::Error::Io(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "no heartbeat heard on the notification connection",
            )));
        };
        let Some(notification) = notification else {
            return Ok(());
        };
        on(match notification.payload() {
            "" => Relayed::Heartbeat,
            payload => Relayed::Announced(payload),
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What the relay told, by name.
    fn told(relayed: Relayed<'_>) -> &'static str {
        match relayed {
            Relayed::Connected => "connected",
            Relayed::Heartbeat => "heartbeat",
            Relayed::Announced(_) => "announced",
            Relayed::Lost => "lost",
        }
    }

    async fn hear(told: &mut tokio::sync::mpsc::UnboundedReceiver<&'static str>, what: &str) {
        let heard = tokio::time::timeout(Duration::from_secs(10), async {
            while let Some(next) = told.recv().await {
                if next == what {
                    return;
                }
            }
        })
        .await;
        assert!(heard.is_ok(), "the relay never told {what}");
    }

    fn signal(name: &str, pid: i32) -> bool {
        std::process::Command::new("kill")
            .args([name, &pid.to_string()])
            .status()
            .is_ok_and(|status| status.success())
    }

    /// Lets a stopped server process go on when dropped.
    struct Resume(i32);

    impl Drop for Resume {
        fn drop(&mut self) {
            signal("-CONT", self.0);
        }
    }

    /// A listener whose connection stays open but says nothing (its server process stopped, as a
    /// connection the network dropped without a word looks) is given up once the heartbeats are
    /// missed, and the relay listens on a new connection.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_listener_heard_from_no_more_is_replaced() {
        let url = std::env::var("ORCA_PUSH_TEST_POSTGRES_URL")
            .expect("ORCA_PUSH_TEST_POSTGRES_URL: scripts/test starts a throwaway PostgreSQL");
        let pool = crate::postgres_pool_options()
            .max_connections(4)
            .connect(&url)
            .await
            .unwrap();
        let channel = "orca_push_relay_silence_test";
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let shutdown = CancellationToken::new();
        let relaying = tokio::spawn(relay(
            pool.clone(),
            channel,
            Duration::from_millis(20),
            move |relayed| {
                let _ = tx.send(told(relayed));
            },
            shutdown.clone(),
        ));
        hear(&mut rx, "heartbeat").await;
        let pid: i32 = sqlx::query_scalar(
            "SELECT pid FROM pg_stat_activity WHERE query LIKE 'LISTEN%' \
             AND query LIKE '%orca_push_relay_silence_test%' AND pid <> pg_backend_pid()",
        )
        .fetch_one(&pool)
        .await
        .unwrap();
        assert!(signal("-STOP", pid), "kill -STOP {pid}");
        // The server process goes on again however the test ends.
        let _resume = Resume(pid);
        // Silent from now on, yet open: no `Lost` from sqlx, only from the missed heartbeats.
        while rx.try_recv().is_ok() {}
        hear(&mut rx, "lost").await;
        hear(&mut rx, "connected").await;
        hear(&mut rx, "heartbeat").await;
        shutdown.cancel();
        relaying.await.unwrap();
    }
}
