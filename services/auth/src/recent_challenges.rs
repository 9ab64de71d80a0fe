//! The challenges this process issued and that no proof has redeemed yet, until they expire: a
//! proof usually comes back to the replica that issued its challenge, which then checks it
//! without reading the challenge back from the database.
//!
//! Only what the store holds is kept, and only while the store would answer the same: an entry
//! is dropped once its challenge is redeemed here or expires (an expired challenge is read from
//! the store, which tells expired from pruned). A challenge redeemed by another replica is still
//! held here; its proof then fails at the redemption, whose conditional update consumes a
//! challenge once.

use std::collections::{HashMap, VecDeque};

use crate::store::ChallengeRow;

/// Entries at most; the oldest goes first. Challenges live 10 s, so this holds 10 s of issuing
/// at 1,600 per second (a few MB at most).
pub const CAPACITY: usize = 16_384;

#[derive(Debug, Default)]
pub struct RecentChallenges {
    rows: HashMap<String, ChallengeRow>,
    /// Ids in issuing order (so in expiry order: every challenge lives as long).
    order: VecDeque<String>,
}

impl RecentChallenges {
    /// Holds `row` for `challenge_id`, dropping what has expired by `now_ms` and, if still full,
    /// the oldest entry.
    pub fn insert(&mut self, challenge_id: String, row: ChallengeRow, now_ms: u64) {
        while let Some(oldest) = self.order.front() {
            let expired = self
                .rows
                .get(oldest)
                .is_none_or(|row| row.expires_at_ms <= now_ms);
            if !expired && self.order.len() < CAPACITY {
                break;
            }
            let oldest = self.order.pop_front().expect("front was Some");
            self.rows.remove(&oldest);
        }
        self.order.push_back(challenge_id.clone());
        self.rows.insert(challenge_id, row);
    }

    /// The challenge, if issued here, not redeemed here and not expired at `now_ms`.
    pub fn get(&self, challenge_id: &str, now_ms: u64) -> Option<ChallengeRow> {
        self.rows
            .get(challenge_id)
            .filter(|row| now_ms < row.expires_at_ms)
            .cloned()
    }

    /// Forgets a redeemed challenge.
    pub fn remove(&mut self, challenge_id: &str) {
        self.rows.remove(challenge_id);
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.rows.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(expires_at_ms: u64) -> ChallengeRow {
        ChallengeRow {
            host_fingerprint: "host".to_owned(),
            host_public_key: vec![7; 32],
            secret_hash: "hash".to_owned(),
            expires_at_ms,
            consumed_at_ms: None,
        }
    }

    #[test]
    fn a_challenge_is_held_until_it_expires_or_is_redeemed() {
        let mut recent = RecentChallenges::default();
        recent.insert("a".to_owned(), row(10_000), 0);
        recent.insert("b".to_owned(), row(10_000), 0);
        assert!(recent.get("a", 9_999).is_some());
        assert!(recent.get("a", 10_000).is_none(), "expired: ask the store");
        recent.remove("b");
        assert!(recent.get("b", 1).is_none());
        assert!(recent.get("never-issued", 1).is_none());
    }

    #[test]
    fn expired_entries_go_as_new_ones_come() {
        let mut recent = RecentChallenges::default();
        recent.insert("a".to_owned(), row(10_000), 0);
        recent.insert("b".to_owned(), row(15_000), 5_000);
        recent.insert("c".to_owned(), row(20_000), 10_000);
        assert_eq!(recent.len(), 2, "a expired at 10,000");
        recent.insert("d".to_owned(), row(99_000), 30_000);
        assert_eq!(recent.len(), 1);
    }

    #[test]
    fn a_full_cache_drops_its_oldest_entry() {
        let mut recent = RecentChallenges::default();
        for i in 0..CAPACITY + 10 {
            recent.insert(i.to_string(), row(u64::MAX), 0);
        }
        assert_eq!(recent.len(), CAPACITY);
        assert!(recent.get("9", 0).is_none());
        assert!(recent.get("10", 0).is_some());
        assert!(recent.get(&(CAPACITY + 9).to_string(), 0).is_some());
    }
}
