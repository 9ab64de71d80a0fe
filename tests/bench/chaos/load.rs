//! The chaos load: alerts from simulated hosts to their iOS and Android phones, each a new event
//! identity, sent until answered. A failed request (broken connection, timeout, 5xx, 429) is
//! retried with the very same body, which the contract makes idempotent, after a backoff of
//! 250 ms doubling to 2 s, until the event's retry deadline.

use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::Rng as _;
use reqwest::Method;

use super::ledger::{Attempt, Ledger, Outcome};
use crate::population::{Host, Pool};
use crate::scenarios::{self, alert};

/// How long a host keeps retrying one event before it gives up on it.
pub const RETRY_FOR: Duration = Duration::from_secs(90);

const FIRST_PAUSE: Duration = Duration::from_millis(250);
const LONGEST_PAUSE: Duration = Duration::from_secs(2);

/// Sends one new alert from `host` to all its phones until it is answered or `RETRY_FOR` passes.
async fn send_event(host: Arc<Host>, ledger: Arc<Ledger>) {
    let notification_id = format!("c-{}", uuid::Uuid::new_v4().simple());
    let body = alert(&host, host.registration_ids(None), &notification_id);
    ledger.event_sent();
    let give_up_at = Instant::now() + RETRY_FOR;
    let mut pause = FIRST_PAUSE;
    loop {
        let started = Instant::now();
        let reply = host
            .client
            .call(Method::POST, "/v1/send", Some(&body))
            .await;
        let ended = Instant::now();
        let outcome = match reply {
            Ok(reply) => {
                let results = reply["results"].as_array().cloned().unwrap_or_default();
                let mut refused = None;
                for result in &results {
                    let status = result["status"].as_str().unwrap_or("missing");
                    let token = host
                        .devices
                        .iter()
                        .find(|d| result["registrationId"] == d.registration_id.as_str())
                        .map(|d| d.token.as_str());
                    match (status, token) {
                        ("queued", Some(token)) => ledger.accepted(&notification_id, token, ended),
                        ("queued", None) => refused = Some("queued for an unknown id".to_owned()),
                        (other, _) => refused = Some(format!("status {other}")),
                    }
                }
                match refused {
                    None if results.len() == host.devices.len() => Outcome::Queued,
                    None => Outcome::Refused("results missing".into()),
                    Some(kind) => Outcome::Refused(kind),
                }
            }
            Err(e) => Outcome::Failed(scenarios::error_kind(&e)),
        };
        let answered = !matches!(outcome, Outcome::Failed(_));
        ledger.attempt(Attempt {
            started,
            ended,
            outcome,
        });
        if answered {
            return;
        }
        if Instant::now() + pause > give_up_at {
            ledger.gave_up();
            return;
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(LONGEST_PAUSE);
    }
}

/// An open loop at `rate` operations per second until `stop` resolves (or `deadline`, whichever
/// first): 80% one alert from the next host, 20% a burst of five alerts from one host at once.
/// Returns once every event is answered or given up.
pub async fn run(
    pool: &Arc<Pool>,
    ledger: &Arc<Ledger>,
    rate: f64,
    deadline: Instant,
    stop: impl std::future::Future<Output = ()>,
) {
    let started = Instant::now();
    let mut running = tokio::task::JoinSet::new();
    let mut issued: u64 = 0;
    let mut tick = tokio::time::interval(Duration::from_millis(5));
    tokio::pin!(stop);
    while Instant::now() < deadline {
        tokio::select! {
            _ = &mut stop => break,
            _ = tick.tick() => {}
        }
        // Operation i is due at i / rate: the first at once.
        let due = (started.elapsed().as_secs_f64() * rate) as u64 + 1;
        while issued < due {
            issued += 1;
            running.spawn(operation(pool.clone(), ledger.clone()));
        }
        while running.try_join_next().is_some() {}
    }
    while running.join_next().await.is_some() {}
}

async fn operation(pool: Arc<Pool>, ledger: Arc<Ledger>) {
    let burst = rand::thread_rng().gen_range(0..100) >= 80;
    let Some(host) = pool.take(false) else {
        ledger.attempt(Attempt {
            started: Instant::now(),
            ended: Instant::now(),
            outcome: Outcome::Refused("hosts' quota budget spent".into()),
        });
        return;
    };
    if burst {
        for _ in 0..4 {
            host.spend(false);
        }
        let sends = (0..5).map(|_| send_event(host.clone(), ledger.clone()));
        futures::future::join_all(sends).await;
    } else {
        send_event(host, ledger).await;
    }
}
