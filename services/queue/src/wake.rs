//! Wakes waiting claims when work may have become due, and says for which provider. A claim that
//! leaves a held provider's work alone sleeps through that provider's news: during an outage every
//! admission group is news for the failing provider only, and before this each one woke every lane
//! to read the next due time, a read that walks all of the held provider's batches (profiled: a
//! fifth of the gateway's CPU in the admission benchmark, growing with the backlog).
//!
//! An admission's work due later (a coalescing window) is news only to a claim that would sleep
//! past it: a claim asleep until the earliest due batch it read wakes by then anyway and reads
//! again. Before this, every admission group that opened a window woke every lane to read the same
//! next due time again (profiled: 2,000 such reads a second in the admission benchmark, until the
//! providers' breakers opened).

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;

use crate::model::{Admission, Provider};
use crate::store::{Enqueued, Skip};

/// News of due work, counted per provider.
#[derive(Debug, Default)]
pub struct Wake {
    notify: Notify,
    /// APNs, FCM, and work of no known provider (never skipped).
    news: [AtomicU64; 3],
    /// Of that news, work due at once ([`Wake::work_due`] at or before its `now`).
    due_now: [AtomicU64; 3],
    /// The claims looking for work or asleep (see [`Wake::claim`]).
    claims: Mutex<Vec<Claim>>,
    next_claim: AtomicU64,
    /// Notifications from other replicas acted on (see [`Wake::notified`]).
    replica_news: AtomicU64,
}

/// A claim among those [`Wake::work_due`] considers.
#[derive(Debug, Clone, Copy)]
struct Claim {
    id: u64,
    skip: Skip,
    /// When it wakes without news; None while it looks (it may not see work committed meanwhile).
    asleep_until: Option<Instant>,
}

/// What a claim had heard of when it last looked (see [`Wake::heard`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Heard(u64);

/// A claim's place among those news of work due later is for; it leaves when dropped.
#[derive(Debug)]
pub struct Waiting<'a> {
    wake: &'a Wake,
    id: u64,
}

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

    /// Work of each provider becomes due at the time given (ms on the clock that reads `now`):
    /// news for the claims that take it and are looking, or asleep past that time. A claim asleep
    /// until then or earlier reads again by then, and sees it.
    pub fn work_due(&self, due: &[(Provider, i64)], now: i64) {
        if due.is_empty() {
            return;
        }
        let instant = Instant::now();
        // Counted before the wake, so a claim it wakes sees it ([`Wake::heard_due_now`]).
        for (provider, at) in due {
            if *at <= now {
                self.due_now[slot(*provider)].fetch_add(1, Ordering::SeqCst);
            }
        }
        let news: Vec<Provider> = {
            let claims = self.claims();
            due.iter()
                .filter(|(provider, at)| {
                    // A time from another replica's notification is the server's to carry:
                    // however far ahead it says (a day is as good as for ever to a claim that
                    // sleeps at most `MAX_WAIT_MS`), it must not overflow an `Instant`.
                    let after = u64::try_from(at.saturating_sub(now)).unwrap_or(0);
                    let at = instant + Duration::from_millis(after.min(86_400_000));
                    claims.iter().any(|claim| {
                        claim.skip.takes(*provider) && claim.asleep_until.is_none_or(|u| u > at)
                    })
                })
                .map(|(provider, _)| *provider)
                .collect()
        };
        self.work_for(news);
    }

    /// A PostgreSQL notification with `payload` arrived at `now` (ms on the clock of
    /// [`Wake::work_due`]): news for the claims its work is news to, unless this replica signed it
    /// (`origin`, see [`payload_from`]), having woken its own lanes as it committed.
    pub fn notified(&self, payload: &str, origin: &str, now: i64) {
        if sent_by(payload, origin) {
            return;
        }
        self.replica_news.fetch_add(1, Ordering::Relaxed);
        match news_named(payload) {
            (providers, Some(at)) => {
                let due: Vec<_> = providers.into_iter().map(|p| (p, at)).collect();
                self.work_due(&due, now);
            }
            (providers, None) => self.work_for(providers),
        }
    }

    /// Notifications of other replicas' work heard so far ([`Wake::notified`]).
    pub fn replica_news(&self) -> u64 {
        self.replica_news.load(Ordering::Relaxed)
    }

    /// Work of any provider may have become due (a retry, another replica, a lost connection).
    pub fn any(&self) {
        self.work_for([Provider::Apns, Provider::Fcm, Provider::Unknown]);
    }

    /// Counts a claim leaving `skip`'s work alone among those [`Wake::work_due`] is for, looking
    /// until it says when it sleeps until ([`Waiting::asleep_until`]).
    pub fn claim(&self, skip: Skip) -> Waiting<'_> {
        let id = self.next_claim.fetch_add(1, Ordering::Relaxed);
        self.claims().push(Claim {
            id,
            skip,
            asleep_until: None,
        });
        Waiting { wake: self, id }
    }

    fn claims(&self) -> std::sync::MutexGuard<'_, Vec<Claim>> {
        // A plain list: a panicking holder cannot leave it half written.
        self.claims
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn set_asleep_until(&self, id: u64, until: Option<Instant>) {
        if let Some(claim) = self.claims().iter_mut().find(|c| c.id == id) {
            claim.asleep_until = until;
        }
    }

    /// The news a claim leaving `skip`'s work alone cares about, so far. Taken before a claim
    /// reads, it tells [`Wake::news`] what the read may not have seen.
    pub fn heard(&self, skip: Skip) -> Heard {
        counted(&self.news, skip)
    }

    /// [`Wake::heard`] for news of work due at once alone: a claim that hears more of it than it
    /// had before it slept may claim without reading when work is due.
    pub fn heard_due_now(&self, skip: Skip) -> Heard {
        counted(&self.due_now, skip)
    }

    /// Waits until there is news `skip` cares about beyond `heard`, or until `until`.
    pub async fn news(&self, skip: Skip, heard: Heard, until: Instant) {
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

impl Waiting<'_> {
    /// About to look for work: news of any work due is for this claim until it sleeps.
    pub fn looking(&self) {
        self.wake.set_asleep_until(self.id, None);
    }

    /// Asleep until `until` unless woken: news of work due later is not for this claim.
    pub fn asleep_until(&self, until: Instant) {
        self.wake.set_asleep_until(self.id, Some(until));
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.wake.claims().retain(|c| c.id != self.id);
    }
}

/// For each provider of the recipients of an admission that made work due, the earliest time
/// such work is due.
pub fn earliest_due<'a>(
    admitted: impl IntoIterator<Item = (&'a Admission, &'a Enqueued)>,
) -> Vec<(Provider, i64)> {
    let mut due: Vec<(Provider, i64)> = Vec::with_capacity(3);
    for (admission, enqueued) in admitted {
        let Some(at) = enqueued.next_due_at else {
            continue;
        };
        for recipient in &admission.recipients {
            match due.iter_mut().find(|(p, _)| *p == recipient.provider) {
                Some((_, earliest)) => *earliest = (*earliest).min(at),
                None => due.push((recipient.provider, at)),
            }
        }
    }
    due
}

/// The news in `counters` of the providers `skip` takes, and of work of no known provider.
fn counted(counters: &[AtomicU64; 3], skip: Skip) -> Heard {
    let of = |provider: Provider| counters[slot(provider)].load(Ordering::SeqCst);
    let mut sum = of(Provider::Unknown);
    if !skip.apns {
        sum = sum.wrapping_add(of(Provider::Apns));
    }
    if !skip.fcm {
        sum = sum.wrapping_add(of(Provider::Fcm));
    }
    Heard(sum)
}

fn slot(provider: Provider) -> usize {
    match provider {
        Provider::Apns => 0,
        Provider::Fcm => 1,
        Provider::Unknown => 2,
    }
}

/// The providers a PostgreSQL notification names (`apns,fcm`); an empty or unknown payload names
/// them all. An `@` element (`apns,@1800000003000`) is the earliest due time, not a provider: see
/// [`news_named`].
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

/// The providers a notification names, and the earliest time their new work is due if it says
/// (absent: due now, as from a replica that does not say).
pub fn news_named(payload: &str) -> (Vec<Provider>, Option<i64>) {
    let due = payload
        .split(',')
        .find_map(|element| element.strip_prefix('@')?.parse().ok());
    (providers_named(payload), due)
}

/// The payload naming `due`'s providers for [`providers_named`], then the earliest due time for
/// [`news_named`]. A replica that reads only the names sees the time as no provider.
pub fn payload_naming(due: &[(Provider, i64)]) -> String {
    let mut apns = false;
    let mut fcm = false;
    let mut other = false;
    for (provider, _) in due {
        match provider {
            Provider::Apns => apns = true,
            Provider::Fcm => fcm = true,
            Provider::Unknown => other = true,
        }
    }
    let mut elements: Vec<String> = if other {
        // Work of no known provider: every claim cares.
        Vec::new()
    } else {
        [(apns, "apns"), (fcm, "fcm")]
            .into_iter()
            .filter(|(named, _)| *named)
            .map(|(_, name)| name.to_owned())
            .collect()
    };
    if let Some(earliest) = due.iter().map(|(_, at)| *at).min() {
        elements.push(format!("@{earliest}"));
    }
    elements.join(",")
}

/// `payload_naming(due)` signed with the replica that sent it (`#origin`): that replica woke its own
/// lanes when it committed, so its listener skips the echo ([`sent_by`]). Hearing its own
/// notifications, every admission round woke the lanes a second time, a few milliseconds after the
/// first wake's claim had taken the work: on PostgreSQL at 100 end-to-end flows, about half the
/// claims came back empty. Other replicas read the element as no provider.
pub fn payload_from(due: &[(Provider, i64)], origin: &str) -> String {
    let mut payload = payload_naming(due);
    if !origin.is_empty() {
        if !payload.is_empty() {
            payload.push(',');
        }
        payload.push('#');
        payload.push_str(origin);
    }
    payload
}

/// Whether `payload` was signed by `origin` ([`payload_from`]).
pub fn sent_by(payload: &str, origin: &str) -> bool {
    !origin.is_empty()
        && payload
            .split(',')
            .any(|element| element.strip_prefix('#') == Some(origin))
}

/// The times this replica has told other replicas that work will be due, per provider, so that it
/// need not tell them again of work due later.
///
/// Every replica's claims sleep at most until the earliest due time they read or were told, and
/// read again then ([`Wake::work_due`]). So once this replica has told them of work due at a time
/// still to come, work it makes due at that time or later is news to none of them: each is awake
/// by then, and reads it. Under a steady load every admission round opens or joins a window that
/// ends seconds later, and each round's notification was one more commit holding the server's one
/// notification lock through its flush, and one more signal to every listening session: told only
/// when news, PostgreSQL admission went 13-15% higher at 32 and 64 connections (docs/benchmarks.md,
/// round 36). Work due at once, or earlier than what was told, is always told.
///
/// A time told counts as still to come only while it is more than `TOLD_AHEAD_MS` away: a
/// round's `now` is read before its transaction, which commits a little later, and replicas'
/// clocks differ a little. (Claims that leave the provider alone are not woken by news anyway.)
///
/// What was told may be gone before its time: its members dismissed, or its batch made due at
/// once by another replica's admissions (full) and claimed. A claim that reads then sleeps until
/// the next work it finds, so another replica may take the later work only when its claim next
/// looks (the lanes wait 10 s, at most `MAX_WAIT_MS`); this replica's own claims are woken in
/// process, as they always are. So is a round whose commit came more than `TOLD_AHEAD_MS` after
/// its `now` (a lost connection, the writer's retries).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Told([Option<i64>; 3]);

/// See [`Told`].
pub const TOLD_AHEAD_MS: i64 = 1_000;

impl Told {
    /// What of `due` is news to other replicas at `now`.
    pub fn news(&self, due: &[(Provider, i64)], now: i64) -> Vec<(Provider, i64)> {
        due.iter()
            .copied()
            .filter(|&(provider, at)| match self.0[slot(provider)] {
                Some(told) if told > now.saturating_add(TOLD_AHEAD_MS) => at < told,
                _ => true,
            })
            .collect()
    }

    /// `told` was committed and sent.
    pub fn heard(&mut self, told: &[(Provider, i64)]) {
        for &(provider, at) in told {
            self.0[slot(provider)] = Some(at);
        }
    }
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

    #[tokio::test(start_paused = true)]
    async fn work_due_later_is_news_only_to_a_claim_that_would_sleep_past_it() {
        const NOW: i64 = 1_000_000;
        let wake = Wake::new();
        wake.work_due(&[(Provider::Apns, NOW)], NOW);
        assert_eq!(
            wake.heard(Skip::default()),
            Heard(0),
            "no claim waits: no news"
        );
        let claim = wake.claim(Skip::default());
        let heard = wake.heard(Skip::default());
        wake.work_due(&[(Provider::Apns, NOW + 60_000)], NOW);
        assert_ne!(
            wake.heard(Skip::default()),
            heard,
            "a claim looking may not see work committed meanwhile, whenever it is due"
        );
        claim.asleep_until(soon(1_000));
        let heard = wake.heard(Skip::default());
        wake.work_due(&[(Provider::Apns, NOW + 1_500)], NOW);
        assert_eq!(
            wake.heard(Skip::default()),
            heard,
            "due after it wakes anyway"
        );
        wake.work_due(&[(Provider::Fcm, NOW + 500)], NOW);
        assert_ne!(wake.heard(Skip::default()), heard, "due before it wakes");
        drop(claim);
        let held = wake.claim(FCM_HELD);
        held.asleep_until(soon(1_000));
        let heard = wake.heard(FCM_HELD);
        wake.work_due(&[(Provider::Fcm, NOW)], NOW);
        assert_eq!(wake.heard(FCM_HELD), heard, "a held provider's work");
        held.looking();
        wake.work_due(&[(Provider::Unknown, NOW + 60_000)], NOW);
        assert_ne!(
            wake.heard(FCM_HELD),
            heard,
            "no known provider: never skipped"
        );
        // Times from another replica's notification, however far off, are only times.
        let heard = wake.heard(FCM_HELD);
        wake.work_due(
            &[(Provider::Unknown, i64::MAX), (Provider::Unknown, i64::MIN)],
            NOW,
        );
        assert_ne!(wake.heard(FCM_HELD), heard);
    }

    #[test]
    fn the_earliest_due_time_is_named_per_provider() {
        use crate::model::{AdmissionRecipient, Content, Kind};
        let to = |providers: &[Provider]| Admission {
            host_fingerprint: "h".into(),
            kind: Kind::Alert,
            notification_epoch: "e".into(),
            notification_seq: 1,
            content: Content {
                notification_id: None,
                source: "s".into(),
                agent_state: None,
                title: String::new(),
                body: String::new(),
                worktree_id: None,
            },
            expires_at_ms: None,
            recipients: providers
                .iter()
                .map(|p| AdmissionRecipient {
                    registration_id: "r".into(),
                    silent: false,
                    provider: *p,
                })
                .collect(),
            trace_parent: None,
        };
        let due = |at: Option<i64>| Enqueued {
            statuses: Vec::new(),
            next_due_at: at,
        };
        let (a, b, c) = (
            to(&[Provider::Apns]),
            to(&[Provider::Apns, Provider::Fcm]),
            to(&[Provider::Fcm]),
        );
        let (late, early, none) = (due(Some(300)), due(Some(100)), due(None));
        assert_eq!(
            earliest_due([(&a, &late), (&b, &early), (&c, &none)]),
            vec![(Provider::Apns, 100), (Provider::Fcm, 100)]
        );
        assert_eq!(
            earliest_due([(&c, &none), (&a, &late)]),
            vec![(Provider::Apns, 300)]
        );
    }

    #[test]
    fn notification_payloads_name_providers_and_when_their_work_is_due() {
        let fcm_apns = [(Provider::Fcm, 300), (Provider::Apns, 100)];
        assert_eq!(payload_naming(&fcm_apns), "apns,fcm,@100");
        assert_eq!(
            payload_naming(&[(Provider::Fcm, 5), (Provider::Fcm, 7)]),
            "fcm,@5"
        );
        assert_eq!(
            payload_naming(&[(Provider::Apns, 9), (Provider::Unknown, 8)]),
            "@8"
        );
        assert_eq!(
            news_named("apns,fcm,@100"),
            (vec![Provider::Apns, Provider::Fcm], Some(100))
        );
        assert_eq!(news_named("fcm"), (vec![Provider::Fcm], None));
        assert_eq!(providers_named("fcm,@5"), vec![Provider::Fcm]);
        assert_eq!(providers_named("@8").len(), 3, "only a time names all");
        assert_eq!(news_named("@8").1, Some(8));
        let signed = payload_from(&fcm_apns, "r1");
        assert_eq!(signed, "apns,fcm,@100,#r1");
        assert_eq!(news_named(&signed), news_named("apns,fcm,@100"));
        assert_eq!(
            news_named(&payload_from(&[(Provider::Unknown, 8)], "r1"))
                .0
                .len(),
            3
        );
        assert!(sent_by(&signed, "r1"));
        assert!(!sent_by(&signed, "r"), "another replica's echo is news");
        assert!(!sent_by("apns,fcm,@100", "r1"));
        assert!(
            !sent_by("apns,#", ""),
            "a replica that signs nothing hears everything"
        );
        assert_eq!(providers_named("").len(), 3, "an empty payload names all");
        assert_eq!(providers_named("x").len(), 3);
        assert_eq!(
            news_named("apns,@soon").1,
            None,
            "a time it cannot read: due now"
        );
    }

    #[test]
    fn work_due_at_or_after_a_time_told_and_still_to_come_is_not_told_again() {
        let now = 1_000;
        let mut told = Told::default();
        let first = [(Provider::Fcm, 4_000)];
        assert_eq!(told.news(&first, now), first, "nothing told yet");
        told.heard(&first);
        assert!(told.news(&[(Provider::Fcm, 4_000)], now).is_empty());
        assert!(told.news(&[(Provider::Fcm, 4_500)], now).is_empty());
        assert_eq!(
            told.news(&[(Provider::Fcm, 3_000), (Provider::Apns, 5_000)], now),
            [(Provider::Fcm, 3_000), (Provider::Apns, 5_000)],
            "earlier, or another provider's"
        );
        assert_eq!(
            told.news(&[(Provider::Fcm, now)], now),
            [(Provider::Fcm, now)],
            "due at once"
        );
        assert_eq!(
            told.news(&[(Provider::Fcm, 7_000)], 4_000 - TOLD_AHEAD_MS),
            [(Provider::Fcm, 7_000)],
            "as the time told comes near, later work is news again"
        );
        assert!(
            told.news(&[(Provider::Fcm, 7_000)], 4_000 - TOLD_AHEAD_MS - 1)
                .is_empty(),
            "until then it is not"
        );
        told.heard(&[(Provider::Fcm, now)]);
        assert_eq!(
            told.news(&[(Provider::Fcm, 4_500)], now + 1),
            [(Provider::Fcm, 4_500)]
        );
    }
}
