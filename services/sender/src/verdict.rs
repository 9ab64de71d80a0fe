//! What a provider's answer means for the work: sent, dead token, retry (when), or give up.

use std::time::Duration;

/// Attempts per batch, the first included.
pub const MAX_ATTEMPTS: u32 = 5;
const BACKOFF_BASE: Duration = Duration::from_secs(1);
const BACKOFF_CAP: Duration = Duration::from_secs(60);

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    Sent,
    /// The token is dead for good: mark it in the registry.
    Dead(String),
    /// Try again, not before `not_before` (the provider's Retry-After or minimum delay).
    Retry {
        reason: String,
        not_before: Duration,
    },
    /// Permanent: retrying would fail the same way.
    Failed(String),
}

/// Exponential backoff after attempt `attempt` (1-based): 1 s, 2 s, 4 s, ... capped at 60 s.
pub fn backoff(attempt: u32) -> Duration {
    let factor = 1u32 << attempt.saturating_sub(1).min(16);
    (BACKOFF_BASE * factor).min(BACKOFF_CAP)
}

/// When to try again: never sooner than the backoff, nor than what the provider asked.
pub fn retry_delay(attempt: u32, not_before: Duration) -> Duration {
    backoff(attempt).max(not_before)
}

/// Parses a `Retry-After` header: delay-seconds or an HTTP date.
pub fn parse_retry_after(value: &str, now: std::time::SystemTime) -> Option<Duration> {
    let value = value.trim();
    if let Ok(seconds) = value.parse::<u64>() {
        return Some(Duration::from_secs(seconds));
    }
    let at = httpdate::parse_http_date(value).ok()?;
    Some(at.duration_since(now).unwrap_or(Duration::ZERO))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_and_caps() {
        assert_eq!(backoff(1), Duration::from_secs(1));
        assert_eq!(backoff(2), Duration::from_secs(2));
        assert_eq!(backoff(4), Duration::from_secs(8));
        assert_eq!(backoff(30), Duration::from_secs(60));
    }

    #[test]
    fn retry_after_is_never_shortened() {
        assert_eq!(
            retry_delay(1, Duration::from_secs(30)),
            Duration::from_secs(30)
        );
        assert_eq!(
            retry_delay(3, Duration::from_secs(1)),
            Duration::from_secs(4)
        );
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
}
