//! Per-device serialization and the per-device register throttle.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::OwnedMutexGuard;
use tokio::time::Instant;

type LockMap = HashMap<String, Arc<tokio::sync::Mutex<()>>>;

/// One async mutex per device id, created on demand and forgotten when nobody holds or awaits it,
/// so the map stays as small as the set of devices being worked on.
#[derive(Debug, Default)]
pub(super) struct DeviceLocks {
    map: Mutex<LockMap>,
}

/// Holds one device's lock; dropping it releases the lock.
pub(super) struct DeviceGuard<'a> {
    locks: &'a DeviceLocks,
    device_id: String,
    guard: Option<OwnedMutexGuard<()>>,
}

impl DeviceLocks {
    fn map(&self) -> std::sync::MutexGuard<'_, LockMap> {
        self.map.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(super) async fn lock(&self, device_id: &str) -> DeviceGuard<'_> {
        let mutex = self.map().entry(device_id.to_owned()).or_default().clone();
        // A wait cancelled here leaves an idle entry behind; the device's next release drops it.
        let guard = mutex.lock_owned().await;
        DeviceGuard {
            locks: self,
            device_id: device_id.to_owned(),
            guard: Some(guard),
        }
    }

    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.map().len()
    }
}

impl Drop for DeviceGuard<'_> {
    fn drop(&mut self) {
        // Release first; then the map's own reference is the only one left unless another task
        // holds or awaits this device. Clones are only made under the map lock, so this is exact.
        drop(self.guard.take());
        let mut map = self.locks.map();
        if map
            .get(&self.device_id)
            .is_some_and(|m| Arc::strong_count(m) == 1)
        {
            map.remove(&self.device_id);
        }
    }
}

/// A sliding-window limit per device: at most `limit` admitted calls in any `window`. Refused
/// calls are not counted, so a phone that keeps looping gets in again as soon as its oldest
/// admitted call is a window old.
#[derive(Debug)]
pub(super) struct Throttle {
    limit: usize,
    window: Duration,
    calls: Mutex<HashMap<String, VecDeque<Instant>>>,
}

impl Throttle {
    pub(super) fn new(limit: usize, window: Duration) -> Self {
        Self {
            limit,
            window,
            calls: Mutex::new(HashMap::new()),
        }
    }

    /// Admits and counts a call, or refuses it.
    pub(super) fn admit(&self, device_id: &str) -> bool {
        let now = Instant::now();
        let window = self.window;
        let fresh = |at: &Instant| now.saturating_duration_since(*at) < window;
        let mut calls = self.calls.lock().unwrap_or_else(|e| e.into_inner());
        // Forget devices whose calls have all aged out.
        calls.retain(|_, times| times.back().is_some_and(fresh));
        let times = calls.entry(device_id.to_owned()).or_default();
        while times.front().is_some_and(|at| !fresh(at)) {
            times.pop_front();
        }
        if times.len() >= self.limit {
            return false;
        }
        times.push_back(now);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn the_window_slides() {
        let throttle = Throttle::new(3, Duration::from_secs(60));
        assert!(throttle.admit("a"));
        tokio::time::advance(Duration::from_secs(20)).await;
        assert!(throttle.admit("a") && throttle.admit("a"));
        assert!(!throttle.admit("a"));
        assert!(throttle.admit("b"), "devices have their own budgets");
        tokio::time::advance(Duration::from_secs(39)).await;
        assert!(!throttle.admit("a"));
        tokio::time::advance(Duration::from_secs(1)).await;
        // Only the call made at 0 s has aged out; refused calls never counted.
        assert!(throttle.admit("a"));
        assert!(!throttle.admit("a"));
        tokio::time::advance(Duration::from_secs(20)).await;
        assert!(throttle.admit("a") && throttle.admit("a"));
        assert!(!throttle.admit("a"));
    }

    #[tokio::test(start_paused = true)]
    async fn device_locks_exclude_and_are_forgotten_when_free() {
        let locks = Arc::new(DeviceLocks::default());
        let held = locks.lock("a").await;
        let other = locks.lock("b").await;
        assert_eq!(locks.len(), 2);
        drop(other);
        assert_eq!(locks.len(), 1);

        let waiter = tokio::spawn({
            let locks = locks.clone();
            async move {
                let _second = locks.lock("a").await;
            }
        });
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert!(
            !waiter.is_finished(),
            "the second holder waits for the first"
        );
        drop(held);
        waiter.await.unwrap();
        assert_eq!(locks.len(), 0);
    }
}
