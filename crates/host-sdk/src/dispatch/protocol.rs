//! The gateway's `deliveryProtocol`, learned from `GET /health` and trusted for a while: an older
//! gateway strictly refuses the notification fields it does not know.

use std::time::Duration;

use tokio::sync::Mutex;
use tokio::time::Instant;

use super::failures::Tally;
use crate::Gateway;

/// What a gateway that says nothing (or cannot be asked) is assumed to speak.
const OLDEST_PROTOCOL: u32 = 1;

pub(super) struct ProtocolCache {
    ttl: Duration,
    /// Held across the health call, so concurrent dispatches ask the gateway once.
    learned: Mutex<Option<(u32, Instant)>>,
    /// The last protocol a gateway answered, kept through failed refreshes: a gateway that
    /// cannot answer /health right now has not been rolled back.
    last_known: std::sync::Mutex<Option<u32>>,
}

impl ProtocolCache {
    pub(super) fn new(ttl: Duration) -> Self {
        Self {
            ttl,
            learned: Mutex::new(None),
            last_known: std::sync::Mutex::new(None),
        }
    }

    /// The cached protocol, or the gateway's answer now. A failed health call keeps the last
    /// protocol a gateway answered (the oldest, when none ever did) for this dispatch only, and is
    /// asked again next time.
    pub(super) async fn get<G: Gateway>(&self, gateway: &G, failures: &mut Tally) -> u32 {
        let mut learned = self.learned.lock().await;
        if let Some((protocol, at)) = *learned
            && at.elapsed() < self.ttl
        {
            return protocol;
        }
        match gateway.health().await {
            Ok(health) => {
                *learned = Some((health.delivery_protocol, Instant::now()));
                *self.last_known.lock().unwrap_or_else(|p| p.into_inner()) =
                    Some(health.delivery_protocol);
                health.delivery_protocol
            }
            Err(error) => {
                *learned = None;
                failures.add(format!("health.{}", error.category()));
                self.last_known
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .unwrap_or(OLDEST_PROTOCOL)
            }
        }
    }

    /// The gateway refused a request as malformed: it may have been rolled back to an older
    /// protocol, so ask again next time.
    pub(super) async fn forget(&self) {
        *self.learned.lock().await = None;
        *self.last_known.lock().unwrap_or_else(|p| p.into_inner()) = None;
    }
}
