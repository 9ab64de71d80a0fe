//! Giving back batches leased to no lane that will send them: a claim whose caller went away,
//! or a round whose commit failed (`Handoff::orphan`).

use std::sync::Arc;

use orca_push_storage::Clock;

use super::Orphans;
use crate::store::{ClaimedBatch, QueueStore, Retry};
use crate::wake::Wake;

/// `Orphans` that give the batches back to `store`, due again at once, on the runtime this is
/// called on (the queue's): they are handed to it from wherever a group commits, which on
/// PostgreSQL and SQLite is the writer's own thread, whose runtime serves its rounds and nothing
/// else. Called where no runtime runs, the batches' leases lapse instead.
pub fn give_back<S: QueueStore>(store: S, clock: Arc<dyn Clock>, wake: Arc<Wake>) -> Orphans {
    let runtime = tokio::runtime::Handle::try_current().ok();
    if runtime.is_none() {
        tracing::warn!(
            "queue built outside a runtime: orphans go back on the runtime that gives them"
        );
    }
    Box::new(move |batches| {
        let store = store.clone();
        let wake = wake.clone();
        let now = i64::try_from(clock.now_ms()).unwrap_or(i64::MAX);
        let give = async move { hand_back(&store, &wake, &batches, now).await };
        match runtime
            .clone()
            .or_else(|| tokio::runtime::Handle::try_current().ok())
        {
            Some(runtime) => drop(runtime.spawn(give)),
            None => tracing::warn!("no runtime to hand batches back on; their leases will lapse"),
        }
    })
}

/// Gives back batches leased to no lane that will send them (a claim whose caller went away, or a
/// round whose commit failed): untried, so neither an attempt nor a retry, due again at once; the
/// waiting claims hear of them (they last saw them leased). First it waits for their hosts' and
/// their rows' locks (`QueueStore::settle`): a round or a claim whose commit was still under way
/// on the server when its connection failed holds them until its rows are there to be given back
/// (a look before would find the rows as they were, and pass them by). A batch whose lease is
/// not the one given (never committed, or taken since) is left as it is. What the database
/// refuses is tried again, `HAND_BACK_ATTEMPTS` times in all; the last try gives back even if it
/// could not wait for the locks.
pub async fn hand_back<S: QueueStore>(store: &S, wake: &Wake, batches: &[ClaimedBatch], now: i64) {
    if batches.is_empty() {
        return;
    }
    let _woken = Woken(wake);
    tracing::info!(
        batches = batches.len(),
        "handing back batches leased to no lane"
    );
    let mut hosts: Vec<&str> = batches
        .iter()
        .map(|b| b.host_fingerprint.as_str())
        .collect();
    hosts.sort_unstable();
    hosts.dedup();
    let mut settled = false;
    let mut left: Vec<&ClaimedBatch> = batches.iter().collect();
    let mut pause = HAND_BACK_FIRST_PAUSE;
    for attempt in 1..=HAND_BACK_ATTEMPTS {
        let mut failure = None;
        if !settled {
            // A transaction the server keeps open for a client it has not yet found gone could
            // hold the locks for long: past a lease's length, there is nothing left to save.
            let ids: Vec<&str> = left.iter().map(|b| b.batch_id.as_str()).collect();
            match tokio::time::timeout(SETTLE_AT_MOST, store.settle(&hosts, &ids)).await {
                Ok(Ok(())) => settled = true,
                Err(_) => {
                    // A commit that ends after this hand-back found no row leaves its batches to
                    // their leases (`orca_push_lease_expiries_total` counts them then).
                    tracing::warn!(
                        batches = left.len(),
                        waited_s = SETTLE_AT_MOST.as_secs(),
                        "hosts' locks still held; handing batches back regardless"
                    );
                    settled = true;
                }
                Ok(Err(error)) if attempt == HAND_BACK_ATTEMPTS => {
                    // The last try gives back regardless: a commit still under way hides its rows
                    // from it (nothing changes, they wait for their leases as they would have),
                    // and a finished one's batches are due again.
                    tracing::warn!(
                        %error,
                        batches = left.len(),
                        "could not wait for the hosts' locks; handing batches back regardless"
                    );
                    settled = true;
                }
                Ok(Err(error)) => failure = Some(error),
            }
        }
        if settled {
            let mut refused = Vec::new();
            for batch in left {
                let given = store
                    .retry(
                        &batch.batch_id,
                        &batch.lease_token,
                        now,
                        "caller_gone",
                        Retry::HandBack,
                        now,
                    )
                    .await;
                if let Err(error) = given {
                    failure = Some(error);
                    refused.push(batch);
                }
            }
            left = refused;
        }
        let Some(error) = failure.filter(|_| !left.is_empty()) else {
            return;
        };
        if attempt == HAND_BACK_ATTEMPTS {
            tracing::warn!(
                %error,
                batches = left.len(),
                "could not hand batches back; their leases will lapse"
            );
            return;
        }
        // The database may be coming back (a restart that also failed the commit whose batches
        // these are): a short wait costs less than a lease's. What went back meanwhile is due now.
        tracing::debug!(
            %error,
            attempt,
            batches = left.len(),
            "could not hand batches back yet; trying again"
        );
        wake.any();
        tokio::time::sleep(pause).await;
        pause *= 2;
    }
}

/// A hand-back the database refuses is tried this many times in all, the pause between two tries
/// doubling from `HAND_BACK_FIRST_PAUSE`: some 7 s, then the leases lapse.
const HAND_BACK_ATTEMPTS: u32 = 4;
const HAND_BACK_FIRST_PAUSE: std::time::Duration = std::time::Duration::from_secs(1);
/// How long a hand-back waits for its hosts' and batches' locks (`QueueStore::settle`) before it goes on
/// regardless: the lanes' default lease.
const SETTLE_AT_MOST: std::time::Duration = std::time::Duration::from_secs(30);

/// Wakes every waiting claim when dropped: after a hand-back, however it ended.
struct Woken<'a>(&'a Wake);

impl Drop for Woken<'_> {
    fn drop(&mut self) {
        self.0.any();
    }
}
