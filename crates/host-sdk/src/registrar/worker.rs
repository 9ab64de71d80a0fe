//! The outbox worker: drains at start, when kicked, and with a doubling backoff while deletes
//! remain.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;

use super::Registrar;
use crate::Gateway;

impl<G: Gateway> Registrar<G> {
    /// Runs the outbox: a pass at start, one after each [`Registrar::kick_outbox`] (every
    /// unregister kicks), and while deletes remain, retries after `retry_initial` doubling up to
    /// `retry_max`. Stops when `shutdown` turns true or its sender is dropped; a pass cut short
    /// loses nothing, since every entry is on disk.
    pub fn spawn_outbox_worker(
        self: &Arc<Self>,
        shutdown: watch::Receiver<bool>,
    ) -> JoinHandle<()> {
        let registrar = Arc::clone(self);
        tokio::spawn(async move { registrar.run_worker(shutdown).await })
    }

    async fn run_worker(&self, mut shutdown: watch::Receiver<bool>) {
        let mut backoff = Backoff::new(self.config.retry_initial, self.config.retry_max);
        loop {
            // Listen before the pass so a kick during it brings another pass; a kick from before
            // it (a stored permit, consumed here) is covered by this pass.
            let mut kicked = std::pin::pin!(self.kick.notified());
            while kicked.as_mut().enable() {
                kicked.set(self.kick.notified());
            }
            let report = tokio::select! {
                biased;
                () = stopped(&mut shutdown) => return,
                report = self.drain() => report,
            };
            let retry = if report.remaining == 0 {
                backoff.reset();
                None
            } else {
                Some(backoff.next_delay())
            };
            tokio::select! {
                biased;
                () = stopped(&mut shutdown) => return,
                () = kicked => {}
                () = sleep_or_wait(retry) => {}
            }
        }
    }
}

async fn stopped(shutdown: &mut watch::Receiver<bool>) {
    // An error means the sender is gone, which also means stop.
    let _ = shutdown.wait_for(|stop| *stop).await;
}

async fn sleep_or_wait(delay: Option<Duration>) {
    match delay {
        Some(delay) => tokio::time::sleep(delay).await,
        None => std::future::pending().await,
    }
}

/// Doubling delays with a cap.
#[derive(Debug)]
struct Backoff {
    initial: Duration,
    max: Duration,
    next: Duration,
}

impl Backoff {
    fn new(initial: Duration, max: Duration) -> Self {
        Self {
            initial,
            max,
            next: initial.min(max),
        }
    }

    fn next_delay(&mut self) -> Duration {
        let delay = self.next;
        self.next = delay.saturating_mul(2).min(self.max);
        delay
    }

    fn reset(&mut self) {
        self.next = self.initial.min(self.max);
    }
}
