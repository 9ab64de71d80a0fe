//! Per-phone burst suppression: at most one alert per window, measured on the events' `emittedAt`
//! (not on when they reach the dispatcher, which a slow desktop can bunch up or spread out).

use std::collections::{HashMap, HashSet};
use std::time::Duration;

pub(super) struct BurstWindows {
    window_ms: u64,
    /// device id → `emittedAt` of the alert that opened its current window.
    starts: HashMap<String, u64>,
}

impl BurstWindows {
    pub(super) fn new(window: Duration) -> Self {
        Self {
            window_ms: u64::try_from(window.as_millis()).unwrap_or(u64::MAX),
            starts: HashMap::new(),
        }
    }

    /// Which of `devices` may take an alert emitted at `emitted_at`; those that may open a new
    /// window there. Decided for all of them against the windows as they were, so a device listed
    /// twice (two registrations) is not suppressed by itself. A suppressed alert does not extend
    /// the window, so a steady stream still gets one alert per window.
    ///
    /// The distance is measured both ways: an alert emitted shortly before the window's opener is
    /// part of the same burst, and a desktop clock set back by an hour does not silence a phone
    /// for an hour.
    pub(super) fn admit(&mut self, devices: &[&str], emitted_at: u64) -> Vec<bool> {
        let admitted: Vec<bool> = devices
            .iter()
            .map(|device| {
                self.starts
                    .get(*device)
                    .is_none_or(|start| start.abs_diff(emitted_at) >= self.window_ms)
            })
            .collect();
        for (device, ok) in devices.iter().zip(&admitted) {
            if *ok {
                self.starts.insert((*device).to_owned(), emitted_at);
            }
        }
        admitted
    }

    /// Forgets devices no longer registered, so the map stays as small as the registrations.
    pub(super) fn retain(&mut self, devices: &HashSet<&str>) {
        self.starts
            .retain(|device, _| devices.contains(device.as_str()));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dispatch_burst_window_is_one_alert_per_window_per_device() {
        let mut w = BurstWindows::new(Duration::from_secs(5));
        assert_eq!(w.admit(&["a", "a"], 10_000), [true, true]);
        assert_eq!(w.admit(&["a", "b"], 14_999), [false, true]);
        // The suppressed alert at 14_999 did not move the window.
        assert_eq!(w.admit(&["a"], 15_000), [true]);
        // Shortly before the opener is the same burst; far before is a clock set back.
        assert_eq!(w.admit(&["a"], 11_000), [false]);
        assert_eq!(w.admit(&["a"], 1_000), [true]);
        w.retain(&HashSet::from(["b"]));
        assert_eq!(w.admit(&["a"], 1_001), [true]);
    }
}
