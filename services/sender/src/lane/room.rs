//! A lane's room for each provider: how many of its deliveries may be in flight at each.

use std::sync::Arc;

use orca_push_proto::queue::v1 as queue_pb;
use orca_push_proto::registry::v1 as registry_pb;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::{CLAIM_BATCHES, IN_FLIGHT_PER_PROVIDER};

/// A lane's room for each provider (see [`IN_FLIGHT_PER_PROVIDER`]).
#[derive(Clone)]
pub(super) struct ProviderRoom {
    apns: Arc<Semaphore>,
    fcm: Arc<Semaphore>,
}

impl ProviderRoom {
    pub(super) fn new() -> Self {
        Self {
            apns: Arc::new(Semaphore::new(IN_FLIGHT_PER_PROVIDER)),
            fcm: Arc::new(Semaphore::new(IN_FLIGHT_PER_PROVIDER)),
        }
    }

    fn each(&self) -> [(queue_pb::Provider, &Arc<Semaphore>); 2] {
        [
            (queue_pb::Provider::Apns, &self.apns),
            (queue_pb::Provider::Fcm, &self.fcm),
        ]
    }

    /// A place in the share of the provider of a device of `platform`, if one is free.
    pub(super) fn try_take(&self, platform: i32) -> Option<OwnedSemaphorePermit> {
        let room = if platform == registry_pb::Platform::Ios as i32 {
            &self.apns
        } else {
            &self.fcm
        };
        room.clone().try_acquire_owned().ok()
    }

    /// Whether this lane has a place free for `provider`'s work (a probe claimed without one
    /// would reach its gate, find no place and be handed back, and another lane would claim the
    /// next probe at once).
    pub(super) fn has_room(&self, provider: queue_pb::Provider) -> bool {
        self.each()
            .iter()
            .any(|(p, room)| *p == provider && room.available_permits() > 0)
    }

    /// What the lane's next claim may take: the providers to leave alone (`held` ones and those
    /// with fewer than `CLAIM_BATCHES` places free) and the fewest places free among the rest,
    /// so that no batch it brings back finds its provider's share full. None when every provider
    /// is left alone.
    pub(super) fn claimable(&self, held: &[i32]) -> (Vec<i32>, Option<usize>) {
        let mut skip = held.to_vec();
        let mut least: Option<usize> = None;
        for (provider, room) in self.each() {
            let provider = provider as i32;
            if skip.contains(&provider) {
                continue;
            }
            let free = room.available_permits();
            if free < CLAIM_BATCHES {
                skip.push(provider);
            } else {
                least = Some(least.map_or(free, |l| l.min(free)));
            }
        }
        (skip, least)
    }

    /// Resolves once one of the `saturated` providers has `CLAIM_BATCHES` places free again (at
    /// once if one has; never if none is named). The places are only looked at, not kept: the
    /// claim that follows counts them again.
    pub(super) async fn freed(&self, saturated: &[i32]) {
        let freed = |provider: queue_pb::Provider, room: &Arc<Semaphore>| {
            let room = room.clone();
            let named = saturated.contains(&(provider as i32));
            async move {
                if !named {
                    std::future::pending::<()>().await;
                }
                let _ = room.acquire_many(CLAIM_BATCHES as u32).await;
            }
        };
        tokio::select! {
            _ = freed(queue_pb::Provider::Apns, &self.apns) => {}
            _ = freed(queue_pb::Provider::Fcm, &self.fcm) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    const IOS: i32 = registry_pb::Platform::Ios as i32;
    const ANDROID: i32 = registry_pb::Platform::Android as i32;
    const APNS: i32 = queue_pb::Provider::Apns as i32;
    const FCM: i32 = queue_pb::Provider::Fcm as i32;

    #[test]
    fn a_claim_takes_no_more_than_the_fullest_providers_share_has_room_for() {
        let room = ProviderRoom::new();
        assert_eq!(room.claimable(&[]), (vec![], Some(IN_FLIGHT_PER_PROVIDER)));
        let apns: Vec<_> = (0..IN_FLIGHT_PER_PROVIDER - 20)
            .map(|_| room.try_take(IOS).unwrap())
            .collect();
        assert_eq!(
            room.claimable(&[]),
            (vec![], Some(20)),
            "20 places left for APNs"
        );
        let fcm = room.try_take(ANDROID).unwrap();
        assert_eq!(room.claimable(&[]), (vec![], Some(20)));
        drop(fcm);
        // Under CLAIM_BATCHES places: APNs work is left to other lanes, FCM's still taken.
        let more: Vec<_> = (0..5).map(|_| room.try_take(IOS).unwrap()).collect();
        assert_eq!(
            room.claimable(&[]),
            (vec![APNS], Some(IN_FLIGHT_PER_PROVIDER))
        );
        // A held provider is skipped as before, and counts for nothing.
        assert_eq!(room.claimable(&[FCM]), (vec![FCM, APNS], None));
        drop(more);
        assert_eq!(room.claimable(&[FCM]), (vec![FCM], Some(20)));
        drop(apns);
    }

    /// A lane claims a provider's probe only with a place for it: without one, the probe would
    /// be handed back at its gate and another lane would claim the next at once.
    #[test]
    fn a_lane_has_room_for_a_probe_while_one_place_is_free() {
        let room = ProviderRoom::new();
        let mut taken: Vec<_> = (0..IN_FLIGHT_PER_PROVIDER - 1)
            .map(|_| room.try_take(ANDROID).unwrap())
            .collect();
        assert!(room.has_room(queue_pb::Provider::Fcm), "one place left");
        taken.push(room.try_take(ANDROID).unwrap());
        assert!(!room.has_room(queue_pb::Provider::Fcm));
        assert!(room.has_room(queue_pb::Provider::Apns));
        drop(taken);
        assert!(room.has_room(queue_pb::Provider::Fcm));
    }

    #[test]
    fn a_full_share_has_no_place_to_give() {
        let room = ProviderRoom::new();
        let taken: Vec<_> = (0..IN_FLIGHT_PER_PROVIDER)
            .map(|_| room.try_take(IOS).unwrap())
            .collect();
        assert!(room.try_take(IOS).is_none());
        assert!(
            room.try_take(ANDROID).is_some(),
            "the other provider's share is apart"
        );
        drop(taken);
        assert!(room.try_take(IOS).is_some());
    }

    #[tokio::test]
    async fn a_saturated_lane_wakes_when_its_share_has_room_again() {
        let room = ProviderRoom::new();
        let mut apns: Vec<_> = (0..IN_FLIGHT_PER_PROVIDER)
            .map(|_| room.try_take(IOS).unwrap())
            .collect();
        let soon = Duration::from_millis(50);
        // FCM's share is empty, but the lane waits for APNs places, not for FCM's.
        assert!(
            tokio::time::timeout(soon, room.freed(&[APNS]))
                .await
                .is_err(),
            "APNs full"
        );
        apns.truncate(apns.len() - (CLAIM_BATCHES - 1));
        assert!(
            tokio::time::timeout(soon, room.freed(&[APNS]))
                .await
                .is_err(),
            "one place short of a claim"
        );
        apns.pop();
        tokio::time::timeout(soon, room.freed(&[APNS]))
            .await
            .expect("a claim's worth of places");
        assert!(
            tokio::time::timeout(soon, room.freed(&[])).await.is_err(),
            "nothing to wait for: only the lane's timer ends the wait"
        );
        assert_eq!(
            room.claimable(&[]),
            (vec![], Some(CLAIM_BATCHES)),
            "the places looked at were given back"
        );
    }
}
