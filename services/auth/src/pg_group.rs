//! PostgreSQL: a group of handshake writes in one transaction of at most five statements, whatever
//! its size: the challenges in one multi-row insert, the redemptions' challenges consumed in one
//! update, their hosts and sessions upserted in one insert each, and one notification per host.
//! Each statement takes its rows as arrays (`UNNEST`), so its text never changes and stays
//! prepared.
//!
//! The outcome is the one the writes would have had one after another in arrival order:
//! - of several proofs for one challenge, only the first can redeem it (the later ones answer
//!   `false`, as they would once the first had consumed it);
//! - of several sessions minted for one host, the last replaces the others (an upsert may not touch
//!   a row twice, so only the last of each host is written: the earlier ones would have been
//!   replaced within the same transaction).
//!
//! Challenges are consumed in id order and hosts written in fingerprint order, so two groups
//! written side by side (two replicas) lock the rows they share in the same order. A deadlock
//! with another writer (the prune's delete of long-expired sessions) is still possible: PostgreSQL
//! aborts one side after `deadlock_timeout`, and the group is then written one write at a time.

use std::collections::{BTreeMap, HashSet};

use crate::group_writer::{Done, GroupStore, Redemption, Write};
use crate::store::{PgAuthStore, SESSIONS_CHANNEL, db_time};

const INSERT_CHALLENGES_SQL: &str = "INSERT INTO push_challenges \
     (challenge_id, host_fingerprint, host_public_key, secret_hash, transcript, issued_at, expires_at) \
     SELECT * FROM UNNEST($1::text[], $2::text[], $3::bytea[], $4::text[], $5::bytea[], \
     $6::int8[], $7::int8[])";
const CONSUME_CHALLENGES_SQL: &str = "UPDATE push_challenges AS c SET consumed_at = v.now \
     FROM UNNEST($1::text[], $2::int8[]) AS v(challenge_id, now) \
     WHERE c.challenge_id = v.challenge_id AND c.consumed_at IS NULL AND c.expires_at > v.now \
     RETURNING c.challenge_id";
const UPSERT_HOSTS_SQL: &str = "INSERT INTO push_hosts \
     (host_fingerprint, host_public_key, created_at, last_seen_at) \
     SELECT fp, key, now, now FROM UNNEST($1::text[], $2::bytea[], $3::int8[]) AS v(fp, key, now) \
     ON CONFLICT (host_fingerprint) DO UPDATE SET \
     host_public_key = excluded.host_public_key, last_seen_at = excluded.last_seen_at";
const UPSERT_SESSIONS_SQL: &str = "INSERT INTO push_sessions \
     (token_hash, host_fingerprint, expires_at, created_at) \
     SELECT * FROM UNNEST($1::text[], $2::text[], $3::int8[], $4::int8[]) \
     ON CONFLICT (host_fingerprint) DO UPDATE SET \
     token_hash = excluded.token_hash, expires_at = excluded.expires_at, \
     created_at = excluded.created_at";
/// Delivered to every replica's watchers once (and only if) the group commits.
const ANNOUNCE_ALL_SQL: &str = "SELECT pg_notify($1, fp) FROM UNNEST($2::text[]) AS fp";

/// PostgreSQL's group writes, on the store's pool.
pub(crate) struct PgGroups(pub(crate) PgAuthStore);

impl GroupStore for PgGroups {
    async fn write_together(&self, group: &[Write]) -> Result<Vec<Done>, sqlx::Error> {
        let mut tx = self.0.pool().begin().await?;
        insert_challenges(&mut tx, group).await?;
        let done = redeem_all(&mut tx, group).await?;
        tx.commit().await?;
        Ok(done)
    }

    async fn write_alone(&self, write: &Write) -> Result<Done, sqlx::Error> {
        match write {
            Write::Challenge(c, _) => {
                let mut conn = self.0.pool().acquire().await?;
                PgAuthStore::insert_challenge_on(&mut conn, &c.borrowed()).await?;
                Ok(Done::Challenge)
            }
            Write::Redemption(r, _) => {
                let mut tx = self.0.pool().begin().await?;
                let redeemed = PgAuthStore::redeem_on(&mut tx, &r.borrowed()).await?;
                if redeemed {
                    tx.commit().await?;
                } else {
                    tx.rollback().await?;
                }
                Ok(Done::Redemption(redeemed))
            }
        }
    }
}

async fn insert_challenges(conn: &mut sqlx::PgConnection, group: &[Write]) -> sqlx::Result<()> {
    let challenges: Vec<_> = group
        .iter()
        .filter_map(|write| match write {
            Write::Challenge(c, _) => Some(c),
            Write::Redemption(..) => None,
        })
        .collect();
    if challenges.is_empty() {
        return Ok(());
    }
    let ids: Vec<&str> = challenges.iter().map(|c| c.challenge_id.as_str()).collect();
    let hosts: Vec<&str> = challenges
        .iter()
        .map(|c| c.host_fingerprint.as_str())
        .collect();
    let keys: Vec<&[u8]> = challenges
        .iter()
        .map(|c| c.host_public_key.as_slice())
        .collect();
    let hashes: Vec<&str> = challenges.iter().map(|c| c.secret_hash.as_str()).collect();
    let transcripts: Vec<&[u8]> = challenges.iter().map(|c| c.transcript.as_slice()).collect();
    let issued: Vec<i64> = challenges.iter().map(|c| db_time(c.issued_at_ms)).collect();
    let expires: Vec<i64> = challenges
        .iter()
        .map(|c| db_time(c.expires_at_ms))
        .collect();
    sqlx::query(INSERT_CHALLENGES_SQL)
        .bind(ids)
        .bind(hosts)
        .bind(keys)
        .bind(hashes)
        .bind(transcripts)
        .bind(issued)
        .bind(expires)
        .execute(&mut *conn)
        .await?;
    Ok(())
}

/// Consumes the redemptions' challenges and mints their sessions; answers every write of `group`
/// (challenges as written, redemptions as redeemed or not).
async fn redeem_all(conn: &mut sqlx::PgConnection, group: &[Write]) -> sqlx::Result<Vec<Done>> {
    let redemptions: Vec<(usize, &Redemption)> = group
        .iter()
        .enumerate()
        .filter_map(|(i, write)| match write {
            Write::Redemption(r, _) => Some((i, r)),
            Write::Challenge(..) => None,
        })
        .collect();
    let mut done: Vec<Done> = group
        .iter()
        .map(|write| match write {
            Write::Challenge(..) => Done::Challenge,
            Write::Redemption(..) => Done::Redemption(false),
        })
        .collect();
    let mut tries = first_per_challenge(&redemptions);
    // Challenges are locked in id order, as hosts are in fingerprint order below.
    tries.sort_unstable_by(|(_, a), (_, b)| a.challenge_id.cmp(&b.challenge_id));
    if tries.is_empty() {
        return Ok(done);
    }
    let consumed: HashSet<String> = sqlx::query_scalar(CONSUME_CHALLENGES_SQL)
        .bind(
            tries
                .iter()
                .map(|(_, r)| r.challenge_id.as_str())
                .collect::<Vec<_>>(),
        )
        .bind(
            tries
                .iter()
                .map(|(_, r)| db_time(r.now_ms))
                .collect::<Vec<_>>(),
        )
        .fetch_all(&mut *conn)
        .await?
        .into_iter()
        .collect();
    let redeemed: Vec<(usize, &Redemption)> = tries
        .into_iter()
        .filter(|(_, r)| consumed.contains(&r.challenge_id))
        .collect();
    if redeemed.is_empty() {
        return Ok(done);
    }
    for (i, _) in &redeemed {
        done[*i] = Done::Redemption(true);
    }
    let sessions = last_per_host(&redeemed);
    let hosts: Vec<&str> = sessions.keys().copied().collect();
    let keys: Vec<&[u8]> = sessions
        .values()
        .map(|r| r.host_public_key.as_slice())
        .collect();
    let now: Vec<i64> = sessions.values().map(|r| db_time(r.now_ms)).collect();
    let tokens: Vec<&str> = sessions.values().map(|r| r.token_hash.as_str()).collect();
    let expires: Vec<i64> = sessions
        .values()
        .map(|r| db_time(r.expires_at_ms))
        .collect();
    sqlx::query(UPSERT_HOSTS_SQL)
        .bind(&hosts)
        .bind(keys)
        .bind(&now)
        .execute(&mut *conn)
        .await?;
    sqlx::query(UPSERT_SESSIONS_SQL)
        .bind(tokens)
        .bind(&hosts)
        .bind(expires)
        .bind(&now)
        .execute(&mut *conn)
        .await?;
    sqlx::query(ANNOUNCE_ALL_SQL)
        .bind(SESSIONS_CHANNEL)
        .bind(&hosts)
        .execute(&mut *conn)
        .await?;
    Ok(done)
}

/// The redemptions that may consume their challenge: the first for each challenge, in arrival
/// order. A later proof for the same challenge would find it consumed (or, if the first could not
/// consume it, expired or spent just the same).
fn first_per_challenge<'a>(
    redemptions: &[(usize, &'a Redemption)],
) -> Vec<(usize, &'a Redemption)> {
    let mut seen: HashSet<&str> = HashSet::with_capacity(redemptions.len());
    redemptions
        .iter()
        .filter(|(_, r)| seen.insert(r.challenge_id.as_str()))
        .copied()
        .collect()
}

/// The session each host keeps: its last redemption in arrival order, keyed (and so ordered) by
/// fingerprint.
fn last_per_host<'a>(redeemed: &[(usize, &'a Redemption)]) -> BTreeMap<&'a str, &'a Redemption> {
    redeemed
        .iter()
        .map(|(_, r)| (r.host_fingerprint.as_str(), *r))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn redemption(challenge: &str, host: &str, token: &str) -> Redemption {
        Redemption {
            challenge_id: challenge.to_owned(),
            host_fingerprint: host.to_owned(),
            host_public_key: vec![7; 32],
            token_hash: token.to_owned(),
            now_ms: 2_000,
            expires_at_ms: 90_000,
        }
    }

    #[test]
    fn only_the_first_proof_of_a_challenge_tries_to_consume_it() {
        let (a, b, c) = (
            redemption("c1", "h1", "ta"),
            redemption("c1", "h1", "tb"),
            redemption("c2", "h2", "tc"),
        );
        let all = [(0, &a), (3, &b), (5, &c)];
        let tries: Vec<usize> = first_per_challenge(&all).iter().map(|(i, _)| *i).collect();
        assert_eq!(tries, [0, 5]);
    }

    #[test]
    fn a_host_keeps_its_last_session_and_hosts_come_in_fingerprint_order() {
        let (a, b, c) = (
            redemption("c1", "hz", "first"),
            redemption("c2", "ha", "other"),
            redemption("c3", "hz", "last"),
        );
        let kept = last_per_host(&[(0, &a), (1, &b), (2, &c)]);
        let kept: Vec<(&str, &str)> = kept
            .iter()
            .map(|(host, r)| (*host, r.token_hash.as_str()))
            .collect();
        assert_eq!(kept, [("ha", "other"), ("hz", "last")]);
    }
}
