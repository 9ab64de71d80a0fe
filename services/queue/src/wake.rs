//! Wakes waiting claims when work may have become due, and says for which provider. A claim that
//! leaves a held provider's work alone sleeps through that provider's news: during an outage every
//! admission group is news for the failing provider only, and before this each one woke every lane
//! to read the next due time, a read that walks all of the held provider's batches (profiled: a
//! fifth of the gateway's CPU in the admission benchmark, growing with the backlog).

use std::sync::atomic::{AtomicU64, Ordering};

use tokio::sync::Notify;

use crate::model::{Admission, Provider};
use crate::store::{Enqueued, Skip};

/// News of due work, counted per provider.
#[derive(Debug, Default)]
pub struct Wake {
    notify: Notify,
    /// APNs, FCM, and work of no known provider (never skipped).
    news: [AtomicU64; 3],
}

/// What a claim had heard of when it last looked (see [`Wake::heard`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Heard(u64);

impl Wake {
    pub fn new() -> Self {
        Self::default()
    }

    /// Work of `providers` may have become due.
    pub fn work_for(&self, providers: impl IntoIterator<Item = Provider>) {
        let mut any = false;
        for provider in providers {
            self.news[slot(provider)].fetch_add(1, Ordering::SeqCst);
            any = true;
        }
        if any {
            self.notify.notify_waiters();
        }
    }

    /// Work of any provider may have become due (a retry, another replica, a lost connection).
    pub fn any(&self) {
        self.work_for([Provider::Apns, Provider::Fcm, Provider::Unknown]);
    }

    /// The news a claim leaving `skip`'s work alone cares about, so far. Taken before a claim
    /// reads, it tells [`Wake::news`] what the read may not have seen.
    pub fn heard(&self, skip: Skip) -> Heard {
        let counted = |provider: Provider| self.news[slot(provider)].load(Ordering::SeqCst);
        let mut sum = counted(Provider::Unknown);
        if !skip.apns {
            sum = sum.wrapping_add(counted(Provider::Apns));
        }
        if !skip.fcm {
            sum = sum.wrapping_add(counted(Provider::Fcm));
        }
        Heard(sum)
    }

    /// Waits until there is news `skip` cares about beyond `heard`, or until `until`.
    pub async fn news(&self, skip: Skip, heard: Heard, until: tokio::time::Instant) {
        loop {
            // Listen before looking, so news between the look and the wait is not missed.
            let woken = self.notify.notified();
            tokio::pin!(woken);
            woken.as_mut().enable();
            if self.heard(skip) != heard {
                return;
            }
            tokio::select! {
                _ = woken => {}
                _ = tokio::time::sleep_until(until) => return,
            }
        }
    }
}

/// The providers of the recipients of every admission that made work due, each once.
pub fn providers_due<'a>(
    admitted: impl IntoIterator<Item = (&'a Admission, &'a Enqueued)>,
) -> Vec<Provider> {
    let mut providers = Vec::with_capacity(3);
    for (admission, enqueued) in admitted {
        if enqueued.next_due_at.is_none() {
            continue;
        }
        for recipient in &admission.recipients {
            if !providers.contains(&recipient.provider) {
                providers.push(recipient.provider);
            }
        }
    }
    providers
}

fn slot(provider: Provider) -> usize {
    match provider {
        Provider::Apns => 0,
        Provider::Fcm => 1,
        Provider::Unknown => 2,
    }
}

/// The providers a PostgreSQL notification names (`apns,fcm`); an empty or unknown payload names
/// them all.
pub fn providers_named(payload: &str) -> Vec<Provider> {
    let named: Vec<Provider> = payload
        .split(',')
        .map(Provider::parse)
        .filter(|p| *p != Provider::Unknown)
        .collect();
    if named.is_empty() {
        vec![Provider::Apns, Provider::Fcm, Provider::Unknown]
    } else {
        named
    }
}

/// The payload naming `providers` for [`providers_named`].
pub fn payload_naming(providers: impl IntoIterator<Item = Provider>) -> String {
    let mut apns = false;
    let mut fcm = false;
    let mut other = false;
    for provider in providers {
        match provider {
            Provider::Apns => apns = true,
            Provider::Fcm => fcm = true,
            Provider::Unknown => other = true,
        }
    }
    if other {
        // Work of no known provider: every claim cares.
        return String::new();
    }
    [(apns, "apns"), (fcm, "fcm")]
        .into_iter()
        .filter_map(|(named, name)| named.then_some(name))
        .collect::<Vec<_>>()
        .join(",")
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use super::*;

    const FCM_HELD: Skip = Skip {
        apns: false,
        fcm: true,
    };

    fn soon(ms: u64) -> tokio::time::Instant {
        tokio::time::Instant::now() + Duration::from_millis(ms)
    }

    /// How long a claim leaving FCM alone sleeps (at most 1 s) when `news` comes 10 ms in.
    async fn slept_through(news: Provider) -> Duration {
        let wake = Arc::new(Wake::new());
        let heard = wake.heard(FCM_HELD);
        let waiting = tokio::spawn({
            let wake = wake.clone();
            async move {
                let began = tokio::time::Instant::now();
                wake.news(FCM_HELD, heard, soon(1_000)).await;
                began.elapsed()
            }
        });
        tokio::time::sleep(Duration::from_millis(10)).await;
        wake.work_for([news]);
        waiting.await.expect("waiter")
    }

    #[tokio::test(start_paused = true)]
    async fn a_claim_skipping_a_provider_sleeps_through_its_news() {
        let slept = slept_through(Provider::Fcm).await;
        assert!(
            slept >= Duration::from_millis(1_000),
            "woken after {slept:?}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn news_it_cares_about_wakes_a_claim_at_once() {
        for news in [Provider::Apns, Provider::Unknown] {
            let slept = slept_through(news).await;
            assert!(slept < Duration::from_millis(100), "{news:?}: {slept:?}");
        }
        let wake = Wake::new();
        let heard = wake.heard(FCM_HELD);
        wake.any();
        assert_ne!(wake.heard(FCM_HELD), heard, "any names every provider");
    }

    #[tokio::test(start_paused = true)]
    async fn news_before_the_wait_began_is_not_missed() {
        let wake = Wake::new();
        let heard = wake.heard(Skip::default());
        wake.work_for([Provider::Fcm]);
        let began = tokio::time::Instant::now();
        wake.news(Skip::default(), heard, soon(1_000)).await;
        assert!(began.elapsed() < Duration::from_millis(1));
    }

    #[test]
    fn notification_payloads_name_providers() {
        assert_eq!(payload_naming([Provider::Fcm, Provider::Apns]), "apns,fcm");
        assert_eq!(payload_naming([Provider::Fcm, Provider::Fcm]), "fcm");
        assert_eq!(payload_naming([Provider::Apns, Provider::Unknown]), "");
        assert_eq!(providers_named("fcm"), vec![Provider::Fcm]);
        assert_eq!(
            providers_named("apns,fcm"),
            vec![Provider::Apns, Provider::Fcm]
        );
        assert_eq!(providers_named("").len(), 3, "an empty payload names all");
        assert_eq!(providers_named("x").len(), 3);
    }
}
