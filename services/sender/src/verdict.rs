//! What a provider's answer means for the work: sent, dead token, retry (when, and whether it
//! counts), or give up; and the retry policy.
//!
//! Transient failures (throttling, server errors, a stale provider token, no answer at all) retry
//! until the event's deadline: the contract expires work at its deadline, not after a number of
//! tries. Only answers that look permanent but might not be (an unexpected status, a credentials
//! refusal an operator may be fixing) keep a small cap of [`MAX_ATTEMPTS`] provider answers.

use std::time::Duration;

/// Provider answers a batch gets at most for a failure that looks permanent, the first included.
pub const MAX_ATTEMPTS: u32 = 5;
/// The first retry's backoff by default (`ORCA_PUSH_RETRY_BASE_MS`); it doubles per retry.
pub const DEFAULT_BACKOFF_BASE: Duration = Duration::from_secs(1);
/// The longest backoff: with a five-minute deadline, a batch still gets about a dozen tries.
pub const BACKOFF_CAP: Duration = Duration::from_secs(30);
/// A provider's Retry-After beyond this is taken as this: every deadline is at most five minutes
/// away, so the work expires either way, and no arithmetic on it can overflow.
pub const MAX_RETRY_AFTER: Duration = Duration::from_secs(3600);

/// How a retry is charged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RetryClass {
    /// Throttling, a server error, a stale token, or no answer: retried until the deadline.
    Transient,
    /// An answer that looks permanent: capped at [`MAX_ATTEMPTS`] provider answers.
    Suspect,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    Sent,
    /// The token is dead for good: mark it in the registry.
    Dead(String),
    /// Try again, not before `not_before` (the provider's Retry-After or minimum delay).
    Retry {
        reason: String,
        not_before: Duration,
        class: RetryClass,
        /// The provider answered (an attempt that counts); false when it was never reached.
        answered: bool,
    },
    /// Permanent: retrying would fail the same way.
    Failed(String),
}

impl Verdict {
    /// A provider's answer asking for another try.
    pub fn answered_retry(
        reason: impl Into<String>,
        not_before: Duration,
        class: RetryClass,
    ) -> Self {
        Self::Retry {
            reason: reason.into(),
            not_before: not_before.min(MAX_RETRY_AFTER),
            class,
            answered: true,
        }
    }

    /// The provider was not reached (connection, TLS, timeout, OAuth token, registry): retried
    /// until the deadline, and not counted as an attempt.
    pub fn unanswered(reason: impl Into<String>) -> Self {
        Self::Retry {
            reason: reason.into(),
            not_before: Duration::ZERO,
            class: RetryClass::Transient,
            answered: false,
        }
    }

    /// Whether the provider gave an answer (every verdict but an unanswered retry).
    pub fn answered(&self) -> bool {
        !matches!(
            self,
            Self::Retry {
                answered: false,
                ..
            }
        )
    }
}

/// The retry policy of one sender.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backoff {
    pub base: Duration,
    pub cap: Duration,
}

impl Default for Backoff {
    fn default() -> Self {
        Self {
            base: DEFAULT_BACKOFF_BASE,
            cap: BACKOFF_CAP,
        }
    }
}

impl Backoff {
    /// The un-jittered backoff before retry `retry` (1-based): base, 2 base, 4 base, ... capped.
    pub fn ceiling(&self, retry: u32) -> Duration {
        let factor = 1u32 << retry.saturating_sub(1).min(20);
        self.base
            .saturating_mul(factor)
            .min(self.cap.max(self.base))
    }

    /// When to try again: an "equal jitter" backoff (between half and all of the ceiling, so many
    /// batches failing together do not come back together), never sooner than what the provider
    /// asked.
    pub fn delay(&self, retry: u32, not_before: Duration, rng: &mut impl rand::Rng) -> Duration {
        let ceiling = self.ceiling(retry);
        let half = ceiling / 2;
        let jitter = rng.gen_range(0..=half.as_millis().min(u128::from(u32::MAX)) as u64);
        (half + Duration::from_millis(jitter)).max(not_before.min(MAX_RETRY_AFTER))
    }
}

/// Whether a retry of this class, after `attempt` provider answers (this one included), gives up.
pub fn gives_up(class: RetryClass, answered: bool, attempt: u32) -> bool {
    class == RetryClass::Suspect && answered && attempt >= MAX_ATTEMPTS
}

/// Parses a `Retry-After` header: delay-seconds or an HTTP date, at most [`MAX_RETRY_AFTER`]. A
/// number too large for any integer is the maximum, not an unparsable header (which would mean no
/// wait at all).
pub fn parse_retry_after(value: &str, now: std::time::SystemTime) -> Option<Duration> {
    let value = value.trim();
    if !value.is_empty() && value.bytes().all(|b| b.is_ascii_digit()) {
        let seconds = value.parse::<u64>().unwrap_or(u64::MAX);
        return Some(Duration::from_secs(seconds).min(MAX_RETRY_AFTER));
    }
    let at = httpdate::parse_http_date(value).ok()?;
    Some(
        at.duration_since(now)
            .unwrap_or(Duration::ZERO)
            .min(MAX_RETRY_AFTER),
    )
}

/// `now + delay` in milliseconds, saturating.
pub fn at_ms(now_ms: i64, delay: Duration) -> i64 {
    now_ms.saturating_add(i64::try_from(delay.as_millis()).unwrap_or(i64::MAX))
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng as _;

    #[test]
    fn backoff_doubles_and_caps() {
        let b = Backoff::default();
        assert_eq!(b.ceiling(1), Duration::from_secs(1));
        assert_eq!(b.ceiling(2), Duration::from_secs(2));
        assert_eq!(b.ceiling(4), Duration::from_secs(8));
        assert_eq!(b.ceiling(30), BACKOFF_CAP);
        assert_eq!(b.ceiling(u32::MAX), BACKOFF_CAP);
    }

    #[test]
    fn jitter_stays_between_half_and_the_ceiling() {
        let b = Backoff::default();
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        let mut seen = std::collections::HashSet::new();
        for _ in 0..200 {
            let d = b.delay(4, Duration::ZERO, &mut rng);
            assert!(
                d >= Duration::from_secs(4) && d <= Duration::from_secs(8),
                "{d:?}"
            );
            seen.insert(d);
        }
        assert!(seen.len() > 50, "the delays are spread out");
    }

    #[test]
    fn retry_after_is_never_shortened() {
        let b = Backoff::default();
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        for _ in 0..50 {
            assert_eq!(
                b.delay(1, Duration::from_secs(30), &mut rng),
                Duration::from_secs(30)
            );
        }
    }

    #[test]
    fn only_suspect_answers_are_capped() {
        assert!(!gives_up(RetryClass::Transient, true, 1000));
        assert!(!gives_up(RetryClass::Suspect, false, 1000));
        assert!(!gives_up(RetryClass::Suspect, true, MAX_ATTEMPTS - 1));
        assert!(gives_up(RetryClass::Suspect, true, MAX_ATTEMPTS));
    }

    #[test]
    fn retry_after_parses_seconds_and_dates() {
        let now = std::time::UNIX_EPOCH + Duration::from_secs(1_800_000_000);
        assert_eq!(
            parse_retry_after("120", now),
            Some(Duration::from_secs(120))
        );
        let date = httpdate::fmt_http_date(now + Duration::from_secs(90));
        assert_eq!(parse_retry_after(&date, now), Some(Duration::from_secs(90)));
        assert_eq!(parse_retry_after("soon", now), None);
    }

    #[test]
    fn a_huge_retry_after_is_clamped_not_wrapped() {
        let now = std::time::UNIX_EPOCH + Duration::from_secs(1_800_000_000);
        for huge in ["99999999999999999999999999", "18446744073709551615"] {
            assert_eq!(
                parse_retry_after(huge, now),
                Some(MAX_RETRY_AFTER),
                "{huge}"
            );
        }
        let b = Backoff::default();
        let delay = b.delay(3, Duration::MAX, &mut rand::rngs::StdRng::seed_from_u64(2));
        assert_eq!(delay, MAX_RETRY_AFTER);
        assert!(at_ms(i64::MAX - 5, Duration::MAX) == i64::MAX);
        assert!(at_ms(1_000, MAX_RETRY_AFTER) > 1_000);
    }
}
