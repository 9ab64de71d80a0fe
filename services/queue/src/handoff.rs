//! Due-now work handed to waiting claims by the admission that creates it.
//!
//! A lane with nothing to do waits in a claim. Without a hand-off, a new send that is due at once
//! (no coalescing window) costs a second write transaction: its admission commits, wakes the lane,
//! and the lane's claim reads the batch back and leases it. Profiled at 100 end-to-end flows on
//! SQLite, those claims were a fifth of the one writer connection's time, and each waited some
//! 15 ms for it. Here the admission writes such a batch already leased to a waiting claim (the
//! same lease a claim would take: token, owner, expiry) and, once the group has committed, answers
//! the claim with it. Nothing is handed before the commit: an offer taken by a group that rolls
//! back is dropped, and its claim looks again.

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use tokio::sync::oneshot;

use crate::admission::{NewLease, Plan};
use crate::error::QueueError;
use crate::model::{Kind, Member, Provider};
use crate::store::{ClaimedBatch, Skip, random_id};
mod give_back;

pub use give_back::{give_back, hand_back};

/// The claims a group took, each with what to answer it once the group commits.
pub type Handed = Vec<(Offer, Vec<ClaimedBatch>)>;

/// Claims waiting for work, in the order they began to wait.
pub struct Handoff {
    waiting: Mutex<Vec<Offer>>,
    next_id: AtomicU64,
    /// Takes batches leased to a claim whose caller went away before it had them.
    orphans: Orphans,
    /// Batches given to `orphans` so far.
    given_back: AtomicU64,
}

/// What becomes of batches handed to a claim that is gone (see [`give_back`]).
pub type Orphans = Box<dyn Fn(Vec<ClaimedBatch>) + Send + Sync>;

impl std::fmt::Debug for Handoff {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Handoff")
            .field("waiting", &self.waiting())
            .finish_non_exhaustive()
    }
}

/// A waiting claim, as an admission may answer it.
#[derive(Debug)]
pub struct Offer {
    id: u64,
    pub lane: String,
    /// Batches it takes at most.
    pub max: usize,
    pub lease_ms: i64,
    pub skip: Skip,
    answer: oneshot::Sender<Vec<ClaimedBatch>>,
}

/// A claim's place among the waiting; it leaves when dropped.
#[derive(Debug)]
pub struct Ticket<'a> {
    handoff: &'a Handoff,
    id: u64,
    answer: oneshot::Receiver<Vec<ClaimedBatch>>,
}

impl Handoff {
    /// Claims waiting for work; `orphans` takes what was handed to a claim whose caller left.
    pub fn new(orphans: Orphans) -> Self {
        Self {
            waiting: Mutex::new(Vec::new()),
            next_id: AtomicU64::new(0),
            orphans,
            given_back: AtomicU64::new(0),
        }
    }

    /// Answers a claim taken by `take_for` with what its group committed. A claim that went away
    /// meanwhile gets nothing: its batches go to `orphans`.
    pub fn answer(&self, offer: Offer, batches: Vec<ClaimedBatch>) {
        if let Err(batches) = offer.answer.send(batches) {
            self.give(batches);
        }
    }

    /// Gives back batches leased to a claim whose caller went away before it had them, or that
    /// a failed commit may have leased to claims that never heard of them.
    pub fn orphan(&self, batches: Vec<ClaimedBatch>) {
        if !batches.is_empty() {
            self.give(batches);
        }
    }

    fn give(&self, batches: Vec<ClaimedBatch>) {
        self.given_back
            .fetch_add(batches.len() as u64, Ordering::Relaxed);
        (self.orphans)(batches);
    }

    /// Batches given to `orphans` so far.
    pub fn given_back(&self) -> u64 {
        self.given_back.load(Ordering::Relaxed)
    }

    fn offers(&self) -> std::sync::MutexGuard<'_, Vec<Offer>> {
        // The list holds no invariant a panicking holder could break halfway.
        self.waiting
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Waits among the claims admissions may answer, until the ticket is dropped or answered.
    pub fn wait(&self, lane: &str, max: usize, lease_ms: i64, skip: Skip) -> Ticket<'_> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (answer, answered) = oneshot::channel();
        self.offers().push(Offer {
            id,
            lane: lane.to_owned(),
            max,
            lease_ms,
            skip,
            answer,
        });
        Ticket {
            handoff: self,
            id,
            answer: answered,
        }
    }

    /// Claims waiting now.
    pub fn waiting(&self) -> usize {
        self.offers().len()
    }

    /// A claim that rides in a writer's round (`QueueStore::claims_in_rounds`): an offer the
    /// round's admissions may lease new work to, never among the waiting, answered on the
    /// receiver once the round commits (dropped unanswered if it rolls back).
    pub fn round_offer(
        &self,
        lane: &str,
        max: usize,
        lease_ms: i64,
        skip: Skip,
    ) -> (Offer, oneshot::Receiver<Vec<ClaimedBatch>>) {
        let (answer, answered) = oneshot::channel();
        let offer = Offer {
            id: self.next_id.fetch_add(1, Ordering::Relaxed),
            lane: lane.to_owned(),
            max,
            lease_ms,
            skip,
            answer,
        };
        (offer, answered)
    }

    /// For batches of `providers` (in order), the claims that take them: the round's own
    /// (`round`, first: their lanes asked in this round), then the waiting ones. Each batch goes
    /// to the first claim (a round's in order, then the longest waiting) that takes its provider
    /// and has room. The claims given any leave `round` or the waiting; the second list says
    /// which of them each batch went to.
    pub fn take_for(
        &self,
        round: &mut Vec<Offer>,
        providers: &[Provider],
    ) -> (Vec<Offer>, Vec<Option<usize>>) {
        let mut offers = self.offers();
        offers.retain(|o| !o.answer.is_closed());
        let wanted: Vec<(usize, Skip)> = round
            .iter()
            .chain(offers.iter())
            .map(|o| (o.max, o.skip))
            .collect();
        let assigned = assign(&wanted, providers);
        let mut given = vec![false; wanted.len()];
        for &claim in assigned.iter().flatten() {
            given[claim] = true;
        }
        // The offers given any leave their list; the assignment is renumbered to their new
        // places.
        let mut place = vec![None; wanted.len()];
        let mut taken = Vec::new();
        let from_round = round.len();
        let mut kept_round = Vec::with_capacity(from_round);
        let mut kept = Vec::with_capacity(offers.len());
        for (i, offer) in round.drain(..).chain(offers.drain(..)).enumerate() {
            if given[i] {
                place[i] = Some(taken.len());
                taken.push(offer);
            } else if i < from_round {
                kept_round.push(offer);
            } else {
                kept.push(offer);
            }
        }
        *round = kept_round;
        *offers = kept;
        let assigned = assigned
            .into_iter()
            .map(|claim| claim.and_then(|i| place[i]))
            .collect();
        (taken, assigned)
    }
}

/// Leases the plan's new batches that are due at once (not coalescing windows) to the round's
/// claims and the waiting ones (`Handoff::take_for`), so that their inserts write them leased, and
/// says what to answer each claim taken. An admission whose work all went to claims leaves none
/// due for any other (`Plan::leave_handed_undue`).
pub fn lease_due_now(
    plan: &mut Plan<'_>,
    handoff: &Handoff,
    round: &mut Vec<Offer>,
    now: i64,
) -> Handed {
    let due: Vec<usize> = (0..plan.batches.len())
        .filter(|&i| !plan.batches[i].coalescible && plan.batches[i].window_ends_at <= now)
        .collect();
    if due.is_empty() {
        return Vec::new();
    }
    let providers: Vec<Provider> = due.iter().map(|&i| plan.batches[i].provider).collect();
    let (offers, assigned) = handoff.take_for(round, &providers);
    if offers.is_empty() {
        return Vec::new();
    }
    let tokens: Vec<String> = offers.iter().map(|_| random_id()).collect();
    let mut handed: Vec<Vec<ClaimedBatch>> = offers.iter().map(|_| Vec::new()).collect();
    // Where each handed batch sits: its claim, and its place in that claim's answer.
    let mut place: HashMap<String, (usize, usize)> = HashMap::with_capacity(due.len());
    for (&i, claim) in due.iter().zip(assigned) {
        let Some(claim) = claim else { continue };
        let batch = &mut plan.batches[i];
        let until = now + offers[claim].lease_ms;
        batch.lease = Some(NewLease {
            token: tokens[claim].clone(),
            owner: offers[claim].lane.clone(),
            until,
        });
        place.insert(batch.batch_id.clone(), (claim, handed[claim].len()));
        handed[claim].push(ClaimedBatch {
            batch_id: batch.batch_id.clone(),
            lease_token: tokens[claim].clone(),
            lease_expires_at: until,
            registration_id: batch.registration_id.to_owned(),
            host_fingerprint: batch.host_fingerprint.to_owned(),
            kind: Kind::Alert,
            attempt: 1,
            retries: 0,
            deadline: batch.deadline,
            silent: batch.silent,
            provider: batch.provider,
            recovered: false,
            members: Vec::new(),
        });
    }
    for recipient in &plan.recipients {
        let Some(&(claim, at)) = recipient.batch_id.as_ref().and_then(|id| place.get(id)) else {
            continue;
        };
        let event = &plan.events[recipient.event];
        let a = event.admission;
        handed[claim][at].members.push(Member {
            notification_epoch: a.notification_epoch.clone(),
            notification_seq: a.notification_seq,
            content: a.content.clone(),
            trace_parent: a.trace_parent.clone(),
            deadline: event.deadline,
        });
    }
    plan.leave_handed_undue();
    offers.into_iter().zip(handed).collect()
}

/// Which claim each batch goes to: the first, in order, that takes the batch's provider (not in
/// its `Skip`) and has room left under its maximum.
pub fn assign(claims: &[(usize, Skip)], providers: &[Provider]) -> Vec<Option<usize>> {
    let mut room: Vec<usize> = claims.iter().map(|(max, _)| *max).collect();
    providers
        .iter()
        .map(|&provider| {
            let claim = claims
                .iter()
                .enumerate()
                .position(|(i, (_, skip))| room[i] > 0 && skip.takes(provider))?;
            room[claim] -= 1;
            Some(claim)
        })
        .collect()
}

impl Ticket<'_> {
    /// The batches an admission handed this claim, once it has. Never resolves otherwise while
    /// the ticket waits; an offer dropped unanswered (its group rolled back) resolves empty.
    pub async fn answered(&mut self) -> Vec<ClaimedBatch> {
        (&mut self.answer).await.unwrap_or_default()
    }

    /// Stops waiting. If an admission took the offer first, its answer is awaited (it comes
    /// once that group's transaction ends).
    pub async fn withdraw(mut self) -> Vec<ClaimedBatch> {
        let still_waiting = {
            let mut offers = self.handoff.offers();
            let before = offers.len();
            offers.retain(|o| o.id != self.id);
            offers.len() != before
        };
        if still_waiting {
            return Vec::new();
        }
        self.answered().await
    }
}

impl Drop for Ticket<'_> {
    /// Leaves the waiting claims. An answer that came but was never read goes to `orphans`; one
    /// still to come will find the ticket gone and go there too.
    fn drop(&mut self) {
        let mut offers = self.handoff.offers();
        let before = offers.len();
        offers.retain(|o| o.id != self.id);
        if offers.len() != before {
            return;
        }
        drop(offers);
        self.answer.close();
        if let Ok(batches) = self.answer.try_recv()
            && !batches.is_empty()
        {
            self.handoff.give(batches);
        }
    }
}

/// The answer of a claim transaction run on a task of its own (`DeliveryQueue::claim_once`).
/// Dropped unread (its caller went away after the transaction ended, before reading it), what the
/// claim leased goes to the orphans at once instead of staying leased to nobody until the lease
/// lapses. An answer sent after the drop fails, and the claim's task gives it back itself.
pub struct ClaimAnswer<'h> {
    answer: oneshot::Receiver<Result<Vec<ClaimedBatch>, QueueError>>,
    handoff: &'h Handoff,
}

impl Handoff {
    /// Waits for `answer` (see [`ClaimAnswer`]).
    pub fn claim_answer(
        &self,
        answer: oneshot::Receiver<Result<Vec<ClaimedBatch>, QueueError>>,
    ) -> ClaimAnswer<'_> {
        ClaimAnswer {
            answer,
            handoff: self,
        }
    }
}

impl ClaimAnswer<'_> {
    /// The claim's batches; `ClaimTask` if its task ended without answering.
    pub async fn read(mut self) -> Result<Vec<ClaimedBatch>, QueueError> {
        (&mut self.answer)
            .await
            .map_err(|_| QueueError::ClaimTask)?
    }
}

impl Drop for ClaimAnswer<'_> {
    fn drop(&mut self) {
        self.answer.close();
        if let Ok(Ok(batches)) = self.answer.try_recv()
            && !batches.is_empty()
        {
            self.handoff.give(batches);
        }
    }
}

/// Logs and counts each lapsed lease a claim took over (`orca_push_lease_expiries_total`). Called
/// by whatever ran the claim, not by its caller, which may be gone by then: a lapsed lease handed
/// back unread would be `pending` at the next claim, not recovered.
pub fn record_lapsed_leases(batches: &[ClaimedBatch]) {
    for batch in batches.iter().filter(|b| b.recovered) {
        tracing::warn!(batch = %batch.batch_id, "reclaimed a batch whose lease lapsed");
        metrics::counter!("orca_push_lease_expiries_total").increment(1);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::admission::{Seen, plan};
    use crate::model::{Admission, AdmissionRecipient, Content};

    const NOW: i64 = 1_800_000_000_000;

    fn recording() -> (Handoff, Arc<Mutex<Vec<String>>>) {
        let orphaned = Arc::new(Mutex::new(Vec::new()));
        let sink = orphaned.clone();
        let handoff = Handoff::new(Box::new(move |batches: Vec<ClaimedBatch>| {
            let mut sink = sink.lock().unwrap();
            sink.extend(batches.into_iter().map(|b| b.batch_id));
        }));
        (handoff, orphaned)
    }

    #[tokio::test]
    async fn a_claims_answer_dropped_unread_goes_to_the_orphans() {
        let (handoff, orphaned) = recording();
        // Answered, then dropped before it was read: its caller went away in between.
        let (answer, answered) = oneshot::channel();
        let unread = handoff.claim_answer(answered);
        answer.send(Ok(vec![batch("a"), batch("b")])).unwrap();
        drop(unread);
        assert_eq!(*orphaned.lock().unwrap(), ["a", "b"]);
        // Dropped before the claim answered: the answer cannot be sent, and the claim's task
        // gives the batches back itself.
        let (answer, answered) = oneshot::channel();
        drop(handoff.claim_answer(answered));
        assert!(answer.send(Ok(vec![batch("c")])).is_err());
        // Read: nothing more to give back.
        let (answer, answered) = oneshot::channel();
        answer.send(Ok(vec![batch("d")])).unwrap();
        let read = handoff.claim_answer(answered).read().await.unwrap();
        assert_eq!(read.len(), 1);
        assert_eq!(*orphaned.lock().unwrap(), ["a", "b"]);
        // A task that ended without answering.
        let (answer, answered) = oneshot::channel::<Result<Vec<ClaimedBatch>, QueueError>>();
        drop(answer);
        assert!(matches!(
            handoff.claim_answer(answered).read().await,
            Err(QueueError::ClaimTask)
        ));
    }

    fn batch(id: &str) -> ClaimedBatch {
        ClaimedBatch {
            batch_id: id.into(),
            lease_token: "token".into(),
            lease_expires_at: NOW + 30_000,
            registration_id: "phone".into(),
            host_fingerprint: "host".into(),
            kind: Kind::Alert,
            attempt: 1,
            retries: 0,
            deadline: NOW + 60_000,
            silent: false,
            provider: Provider::Apns,
            recovered: false,
            members: Vec::new(),
        }
    }

    fn alert(
        seq: i64,
        phone: &str,
        provider: Provider,
        notification_id: Option<&str>,
    ) -> Admission {
        Admission {
            host_fingerprint: "host".into(),
            kind: Kind::Alert,
            notification_epoch: "e".into(),
            notification_seq: seq,
            content: Content {
                notification_id: notification_id.map(str::to_owned),
                source: "agent".into(),
                agent_state: None,
                title: "t".into(),
                body: format!("b-{seq}"),
                worktree_id: None,
            },
            expires_at_ms: None,
            recipients: vec![AdmissionRecipient {
                registration_id: phone.into(),
                silent: false,
                provider,
            }],
            trace_parent: Some(format!("00-{seq:032}-{seq:016}-01")),
        }
    }

    const APNS_HELD: Skip = Skip {
        apns: true,
        fcm: false,
    };

    #[test]
    fn each_batch_goes_to_the_first_claim_that_takes_its_provider_and_has_room() {
        let claims = [(1, Skip::default()), (2, APNS_HELD), (5, Skip::default())];
        let providers = [
            Provider::Apns,
            Provider::Fcm,
            Provider::Apns,
            Provider::Fcm,
            Provider::Fcm,
        ];
        assert_eq!(
            assign(&claims, &providers),
            vec![Some(0), Some(1), Some(2), Some(1), Some(2)]
        );
        assert_eq!(
            assign(&[(3, APNS_HELD)], &[Provider::Apns, Provider::Fcm]),
            vec![None, Some(0)],
            "a held provider's batch goes to no claim that skips it"
        );
        assert_eq!(assign(&[], &[Provider::Apns]), vec![None]);
    }

    #[test]
    fn claims_given_work_leave_the_waiting_the_others_stay() {
        let (handoff, _) = recording();
        let _apns_held = handoff.wait("lane-0", 4, 30_000, APNS_HELD);
        let _any = handoff.wait("lane-1", 4, 30_000, Skip::default());
        let (taken, assigned) =
            handoff.take_for(&mut Vec::new(), &[Provider::Apns, Provider::Apns]);
        assert_eq!(taken.len(), 1);
        assert_eq!(taken[0].lane, "lane-1");
        assert_eq!(
            assigned,
            vec![Some(0), Some(0)],
            "renumbered to the taken list"
        );
        assert_eq!(
            handoff.waiting(),
            1,
            "the claim that skips APNs still waits"
        );
    }

    #[tokio::test]
    async fn a_ticket_is_answered_withdrawn_or_leaves_when_dropped() {
        let (handoff, orphaned) = recording();
        let mut answered = handoff.wait("lane-0", 4, 30_000, Skip::default());
        let (mut taken, _) = handoff.take_for(&mut Vec::new(), &[Provider::Fcm]);
        handoff.answer(taken.remove(0), vec![batch("b-1")]);
        assert_eq!(answered.answered().await.len(), 1);
        drop(answered);

        let withdrawn = handoff.wait("lane-0", 4, 30_000, Skip::default());
        assert!(withdrawn.withdraw().await.is_empty());
        assert_eq!(handoff.waiting(), 0);

        // Taken, then withdrawn before the group committed: the answer is awaited, not lost.
        let late = handoff.wait("lane-0", 4, 30_000, Skip::default());
        let (mut taken, _) = handoff.take_for(&mut Vec::new(), &[Provider::Fcm]);
        let offer = taken.remove(0);
        let (got, ()) = tokio::join!(late.withdraw(), async {
            tokio::task::yield_now().await;
            handoff.answer(offer, vec![batch("b-2")]);
        });
        assert_eq!(got.len(), 1);

        drop(handoff.wait("lane-0", 4, 30_000, Skip::default()));
        assert_eq!(handoff.waiting(), 0, "a dropped ticket stops waiting");
        assert!(orphaned.lock().unwrap().is_empty());
    }

    #[test]
    fn work_handed_to_a_claim_that_left_is_given_back() {
        let (handoff, orphaned) = recording();
        // Gone before the group answered it.
        let gone = handoff.wait("lane-0", 4, 30_000, Skip::default());
        let (mut taken, _) = handoff.take_for(&mut Vec::new(), &[Provider::Fcm]);
        drop(gone);
        handoff.answer(taken.remove(0), vec![batch("b-1")]);
        // Answered, then gone without reading the answer.
        let unread = handoff.wait("lane-1", 4, 30_000, Skip::default());
        let (mut taken, _) = handoff.take_for(&mut Vec::new(), &[Provider::Fcm]);
        handoff.answer(taken.remove(0), vec![batch("b-2")]);
        drop(unread);
        assert_eq!(*orphaned.lock().unwrap(), vec!["b-1", "b-2"]);
    }

    #[test]
    fn an_admission_whose_work_was_all_handed_leaves_nothing_due() {
        let (handoff, _) = recording();
        let group = [
            // Handed to the waiting claim.
            alert(1, "phone-a", Provider::Fcm, None),
            // A coalescing window, due later.
            alert(2, "phone-b", Provider::Fcm, Some("n-2")),
            // Its provider is held by the only waiting claim: left in the table.
            alert(3, "phone-c", Provider::Apns, None),
        ];
        let refs: Vec<&Admission> = group.iter().collect();
        let fresh = || plan(&refs, &[Seen::default(); 3], Vec::new(), NOW, 3000).unwrap();
        let due =
            |plan: &Plan<'_>| crate::wake::earliest_due(refs.iter().copied().zip(&plan.results));
        let unhanded = fresh();
        assert_eq!(
            due(&unhanded),
            [(Provider::Fcm, NOW), (Provider::Apns, NOW)],
            "nothing handed: all of it"
        );
        let _claim = handoff.wait("lane-7", 4, 30_000, APNS_HELD);
        let mut plan = fresh();
        assert_eq!(
            lease_due_now(&mut plan, &handoff, &mut Vec::new(), NOW).len(),
            1
        );
        let next: Vec<Option<i64>> = plan.results.iter().map(|r| r.next_due_at).collect();
        assert_eq!(next, [None, Some(NOW + 3000), Some(NOW)]);
        assert_eq!(
            due(&plan),
            [(Provider::Fcm, NOW + 3000), (Provider::Apns, NOW)]
        );
    }

    #[test]
    fn an_admission_partly_handed_keeps_its_due_time() {
        let (handoff, _) = recording();
        // Two phones, one claim with room for one: the second phone's batch stays in the table.
        let mut both = alert(1, "phone-a", Provider::Fcm, None);
        let mut second = both.recipients[0].clone();
        second.registration_id = "phone-b".into();
        both.recipients.push(second);
        let refs = [&both];
        let _claim = handoff.wait("lane-1", 1, 30_000, Skip::default());
        let mut plan = plan(&refs, &[Seen::default()], Vec::new(), NOW, 3000).unwrap();
        let handed = lease_due_now(&mut plan, &handoff, &mut Vec::new(), NOW);
        assert_eq!(handed[0].1.len(), 1);
        assert_eq!(plan.results[0].next_due_at, Some(NOW));
    }

    #[test]
    fn only_new_batches_due_at_once_are_leased_to_waiting_claims() {
        let (handoff, _) = recording();
        let _claim = handoff.wait("lane-7", 2, 30_000, APNS_HELD);
        let group = [
            alert(1, "phone-a", Provider::Fcm, None),
            // Opens a coalescing window: due later, not handed.
            alert(2, "phone-b", Provider::Fcm, Some("n-2")),
            // Its provider is held by the only waiting claim.
            alert(3, "phone-c", Provider::Apns, None),
            alert(4, "phone-d", Provider::Fcm, None),
            // The claim is full.
            alert(5, "phone-e", Provider::Fcm, None),
        ];
        let refs: Vec<&Admission> = group.iter().collect();
        let mut plan = plan(&refs, &[Seen::default(); 5], Vec::new(), NOW, 3000).unwrap();
        let handed = lease_due_now(&mut plan, &handoff, &mut Vec::new(), NOW);
        assert_eq!(handed.len(), 1);
        let (offer, batches) = &handed[0];
        assert_eq!(offer.lane, "lane-7");
        let phones: Vec<&str> = batches.iter().map(|b| b.registration_id.as_str()).collect();
        assert_eq!(phones, vec!["phone-a", "phone-d"]);
        let first = &batches[0];
        assert_eq!(first.lease_expires_at, NOW + 30_000);
        assert_eq!(
            (first.attempt, first.retries, first.recovered),
            (1, 0, false)
        );
        assert_eq!(first.members.len(), 1);
        assert_eq!(first.members[0].notification_seq, 1);
        assert_eq!(first.members[0].content.body, "b-1");
        assert_eq!(first.members[0].trace_parent, group[0].trace_parent);
        let states: Vec<&str> = plan.batches.iter().map(|b| b.state().0).collect();
        assert_eq!(
            states,
            vec!["leased", "open", "pending", "leased", "pending"]
        );
        let leased = plan.batches[0].lease.as_ref().unwrap();
        assert_eq!(
            (leased.token.as_str(), leased.owner.as_str(), leased.until),
            (first.lease_token.as_str(), "lane-7", NOW + 30_000)
        );
        assert_eq!(
            plan.batches[0].state().1,
            NOW + 30_000,
            "available when the lease ends"
        );
    }
}
