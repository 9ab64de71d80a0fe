//! Challenge, proof and session, as the contract's "Host authentication" describes them.

use std::sync::Arc;

use orca_push_host_proof as proof;
use orca_push_storage::Clock;
use rand::RngCore as _;
use rand::rngs::OsRng;
use sha2::{Digest as _, Sha256};
use subtle::ConstantTimeEq as _;

use crate::error::AuthError;
use crate::recent_challenges::RecentChallenges;
use crate::session_token::{SessionKey, SessionTagging, Tag};
use crate::store::{AuthStore, ChallengeRow, NewChallenge, NewSession};

/// Who still has registrations: the registry, asked over gRPC.
pub trait DeviceDirectory: Send + Sync {
    fn hosts_still_registered(
        &self,
        hosts: Vec<String>,
    ) -> impl std::future::Future<Output = Result<Vec<String>, tonic::Status>> + Send;
}

impl DeviceDirectory for crate::RegistryClient {
    async fn hosts_still_registered(
        &self,
        hosts: Vec<String>,
    ) -> Result<Vec<String>, tonic::Status> {
        let response = self
            .clone()
            .hosts_with_devices(orca_push_proto::registry::v1::HostsWithDevicesRequest {
                host_fingerprints: hosts,
            })
            .await?;
        Ok(response.into_inner().host_fingerprints)
    }
}

/// A session lives 24 hours.
pub const SESSION_TTL_MS: u64 = 24 * 60 * 60 * 1000;
/// Expired challenges are kept this long, so a slow proof reads as expired, not unknown.
pub const CHALLENGE_PRUNE_GRACE_MS: u64 = 30_000;
/// Expired sessions are kept a day, so a stale bearer still reads as `session_expired`.
pub const SESSION_PRUNE_GRACE_MS: u64 = 24 * 60 * 60 * 1000;
/// An authenticated call refreshes `last_seen_at` at most this often per host.
pub const LAST_SEEN_INTERVAL_MS: u64 = 60_000;
/// A host with no contact for an hour and no registrations is pruned.
pub const HOST_IDLE_MS: u64 = 60 * 60 * 1000;
const HOST_PRUNE_BATCH: i64 = 500;
/// Pages of stale hosts one prune pass reads at most.
const HOST_PRUNE_PAGES: usize = 20;
/// How long after the session key is created untagged tokens minted before it (or by a replica of
/// the previous version during the roll-out) may still be live: their TTL, plus an hour of roll-out.
pub const LEGACY_WINDOW_MS: u64 = SESSION_TTL_MS + 60 * 60 * 1000;
const CHALLENGE_ID_MAX: usize = 128;

/// The at-most-4-character prefix of a fingerprint that logs and spans may carry.
pub fn fingerprint_prefix(fingerprint: &str) -> &str {
    fingerprint.get(..4).unwrap_or("")
}

/// The `POST /v1/host/challenge` answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IssuedChallenge {
    pub challenge_id: String,
    pub gateway_ephemeral_public_key: [u8; proof::PUBLIC_KEY_LEN],
    pub nonce: [u8; proof::NONCE_LEN],
    pub ciphertext: Vec<u8>,
    pub expires_at_ms: u64,
}

/// A freshly minted session; the token leaves the service once, here.
#[derive(Clone, PartialEq, Eq)]
pub struct Session {
    pub token: String,
    pub expires_at_ms: u64,
    pub host_fingerprint: String,
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Session")
            .field("expires_at_ms", &self.expires_at_ms)
            .field("host", &fingerprint_prefix(&self.host_fingerprint))
            .finish_non_exhaustive()
    }
}

/// Who a valid bearer belongs to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Authenticated {
    pub host_fingerprint: String,
    pub expires_at_ms: u64,
}

fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

fn random<const N: usize>() -> [u8; N] {
    let mut out = [0u8; N];
    OsRng.fill_bytes(&mut out);
    out
}

/// Host authentication over a store.
pub struct HostAuth<S> {
    store: S,
    gateway_origin: String,
    clock: Arc<dyn Clock>,
    /// The fingerprint the host prune stopped after.
    prune_cursor: std::sync::Mutex<String>,
    /// Challenges issued here and not yet redeemed here, so their proofs need no read.
    recent: std::sync::Mutex<RecentChallenges>,
    /// Read (or created) once from the store, on first use.
    tagging: tokio::sync::OnceCell<SessionTagging>,
    /// What `WatchSessions` tells its watchers, when this auth can know every new session.
    news: Option<tokio::sync::broadcast::Sender<SessionNews>>,
    /// Whether `create_session` announces its own sessions (one process owns the store) or the
    /// store's commit does, to every replica (PostgreSQL, relayed by `relay_sessions`).
    announces: Announcer,
}

/// Session news a watcher may fall behind by before it is cut off (it then trusts nothing it
/// cached under that stream).
pub const WATCH_BACKLOG: usize = 4096;

/// What a session watcher hears.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SessionNews {
    /// The host was given a new session: its older ones no longer authenticate.
    Replaced(String),
    /// Every session minted before this was announced.
    Heard,
    /// Announcements may have been lost: nothing trusted under the watch may be trusted still.
    Lost,
}

/// Who announces a new session to the watchers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Announcer {
    /// `create_session`, as it returns: this process alone mints the store's sessions.
    ThisProcess,
    /// The store, in the transaction that mints it (replicas sharing PostgreSQL).
    TheStore,
}

impl<S: AuthStore> HostAuth<S> {
    pub fn new(store: S, gateway_origin: String, clock: Arc<dyn Clock>) -> Self {
        Self {
            store,
            gateway_origin,
            clock,
            prune_cursor: std::sync::Mutex::new(String::new()),
            recent: std::sync::Mutex::default(),
            tagging: tokio::sync::OnceCell::new(),
            news: None,
            announces: Announcer::ThisProcess,
        }
    }

    /// Offers `WatchSessions`, with new sessions announced by `announces`. Someone must also send
    /// [`SessionNews::Heard`] on [`HostAuth::session_news`] regularly: a watcher trusts the watch
    /// only while it hears from it.
    pub fn with_session_watch(mut self, announces: Announcer) -> Self {
        self.news = Some(tokio::sync::broadcast::channel(WATCH_BACKLOG).0);
        self.announces = announces;
        self
    }

    /// The challenges issued here (a poisoned lock still holds a consistent map: no method of it
    /// panics midway).
    fn recent(&self) -> std::sync::MutexGuard<'_, RecentChallenges> {
        self.recent
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Where session news is published, if the watch is offered.
    pub fn session_news(&self) -> Option<tokio::sync::broadcast::Sender<SessionNews>> {
        self.news.clone()
    }

    /// Session news from now on, or `None` if this auth offers no watch.
    pub fn watch_sessions(&self) -> Option<tokio::sync::broadcast::Receiver<SessionNews>> {
        self.news
            .as_ref()
            .map(tokio::sync::broadcast::Sender::subscribe)
    }

    /// The session key and legacy window, created in the store the first time any replica asks
    /// and the same for every replica and restart after that.
    pub async fn session_tagging(&self) -> Result<&SessionTagging, AuthError> {
        self.tagging
            .get_or_try_init(|| async {
                let now = self.clock.now_ms();
                let (key, legacy_until_ms) = self
                    .store
                    .session_key(
                        SessionKey::generate().as_bytes(),
                        now.saturating_add(LEGACY_WINDOW_MS),
                        now,
                    )
                    .await?;
                let key = SessionKey::from_bytes(&key).ok_or(AuthError::CorruptSessionKey)?;
                Ok(SessionTagging {
                    key,
                    legacy_until_ms,
                })
            })
            .await
    }

    pub fn store(&self) -> &S {
        &self.store
    }

    /// Seals a fresh secret and transcript to the host's key. Stores the sha256 of the proof the
    /// host must return, never the secret; writes no `push_hosts` row.
    pub async fn issue_challenge(
        &self,
        host_public_key: &[u8],
    ) -> Result<IssuedChallenge, AuthError> {
        let host_public_key: [u8; proof::PUBLIC_KEY_LEN] = host_public_key
            .try_into()
            .map_err(|_| AuthError::InvalidRequest("host public key must be 32 bytes"))?;
        // A box sealed to a key of small order opens with an all-zero secret: anyone could prove
        // it, and all who did would share one host and its phones.
        if proof::is_small_order(&host_public_key) {
            return Err(AuthError::InvalidRequest("host public key has small order"));
        }
        let ephemeral_secret = random::<{ proof::SECRET_LEN }>();
        let nonce = random::<{ proof::NONCE_LEN }>();
        let secret = random::<{ proof::SECRET_LEN }>();
        let issued_at_ms = self.clock.now_ms();
        let transcript = proof::Transcript {
            gateway_origin: self.gateway_origin.clone(),
            gateway_ephemeral_public_key: proof::public_key(&ephemeral_secret),
            challenge_nonce: nonce,
            challenge_id: uuid::Uuid::new_v4().to_string(),
            issued_at_ms,
            expires_at_ms: issued_at_ms + proof::CHALLENGE_TTL_MS,
            host_fingerprint: proof::host_fingerprint(&host_public_key),
            host_public_key,
        };
        let encoded = transcript.encode();
        let ciphertext = proof::seal(
            &proof::challenge_plaintext(&encoded, &secret),
            &nonce,
            &host_public_key,
            &ephemeral_secret,
        );
        let expected_proof = proof::proof(&secret, &encoded);
        let secret_hash = sha256_hex(&expected_proof);
        self.store
            .insert_challenge(&NewChallenge {
                challenge_id: &transcript.challenge_id,
                host_fingerprint: &transcript.host_fingerprint,
                host_public_key: &host_public_key,
                secret_hash: &secret_hash,
                transcript: &encoded,
                issued_at_ms,
                expires_at_ms: transcript.expires_at_ms,
            })
            .await?;
        self.recent().insert(
            transcript.challenge_id.clone(),
            ChallengeRow {
                host_fingerprint: transcript.host_fingerprint.clone(),
                host_public_key: host_public_key.to_vec(),
                secret_hash,
                expires_at_ms: transcript.expires_at_ms,
                consumed_at_ms: None,
            },
            issued_at_ms,
        );
        tracing::debug!(
            host = fingerprint_prefix(&transcript.host_fingerprint),
            "challenge issued"
        );
        Ok(IssuedChallenge {
            challenge_id: transcript.challenge_id,
            gateway_ephemeral_public_key: transcript.gateway_ephemeral_public_key,
            nonce,
            ciphertext,
            expires_at_ms: transcript.expires_at_ms,
        })
    }

    /// Verifies the proof and consumes the challenge, exactly once even under racing proofs. A wrong
    /// proof leaves the challenge usable. Upserts the host and replaces its one session.
    pub async fn create_session(
        &self,
        challenge_id: &str,
        presented: &[u8],
    ) -> Result<Session, AuthError> {
        // NUL too: PostgreSQL refuses it in text, SQLite would look it up; both must say the same.
        if challenge_id.is_empty()
            || challenge_id.len() > CHALLENGE_ID_MAX
            || challenge_id.contains('\0')
        {
            return Err(AuthError::InvalidRequest(
                "challenge id must be 1 to 128 characters, no NUL",
            ));
        }
        if presented.len() != proof::PROOF_LEN {
            return Err(AuthError::InvalidRequest("proof must be 32 bytes"));
        }
        let now = self.clock.now_ms();
        let issued_here = self.recent().get(challenge_id, now);
        let challenge = match issued_here {
            Some(challenge) => challenge,
            None => self
                .store
                .find_challenge(challenge_id)
                .await?
                .ok_or(AuthError::InvalidChallenge)?,
        };
        if challenge.consumed_at_ms.is_some() {
            return Err(AuthError::InvalidProof("challenge already used"));
        }
        // The TTL is the whole window: not a millisecond of skew on the gateway's side.
        if now >= challenge.expires_at_ms {
            return Err(AuthError::InvalidProof("challenge expired"));
        }
        let presented_hash = sha256_hex(presented);
        if !bool::from(
            presented_hash
                .as_bytes()
                .ct_eq(challenge.secret_hash.as_bytes()),
        ) {
            return Err(AuthError::InvalidProof("proof does not match"));
        }
        let token = self
            .session_tagging()
            .await?
            .key
            .mint()
            .ok_or(AuthError::CorruptSessionKey)?;
        let expires_at_ms = now + SESSION_TTL_MS;
        // The redemption and its announcement run to their end on a task of their own, even if
        // this call is dropped while the group writer commits (its caller gone): a session that
        // replaced the host's must be announced, or the facades would keep trusting the replaced
        // bearer for as long as they trust a watched verdict.
        let news = match (&self.news, self.announces) {
            (Some(news), Announcer::ThisProcess) => Some(news.clone()),
            _ => None,
        };
        let redeem = {
            let store = self.store.clone();
            let challenge_id = challenge_id.to_owned();
            let host = challenge.host_fingerprint.clone();
            let host_public_key = challenge.host_public_key.clone();
            let token_hash = sha256_hex(token.as_bytes());
            async move {
                let redeemed = store
                    .redeem_challenge(&NewSession {
                        challenge_id: &challenge_id,
                        host_fingerprint: &host,
                        host_public_key: &host_public_key,
                        token_hash: &token_hash,
                        now_ms: now,
                        expires_at_ms,
                    })
                    .await?;
                if redeemed && let Some(news) = news {
                    // No watcher is not an error: the facade may not have subscribed yet.
                    let _ = news.send(SessionNews::Replaced(host));
                }
                Ok::<_, AuthError>(redeemed)
            }
        };
        let redeemed = tokio::spawn(tracing::Instrument::in_current_span(redeem))
            .await
            .map_err(|_| AuthError::CommitTask)??;
        // Consumed now, by this proof or another: later proofs read the store.
        self.recent().remove(challenge_id);
        if !redeemed {
            return Err(AuthError::InvalidProof(
                "challenge consumed by a concurrent proof",
            ));
        }
        tracing::info!(
            host = fingerprint_prefix(&challenge.host_fingerprint),
            "session created"
        );
        Ok(Session {
            token,
            expires_at_ms,
            host_fingerprint: challenge.host_fingerprint,
        })
    }

    /// Resolves a bearer token. A token without a valid tag is refused without a look-up (outside
    /// the legacy window). Refreshes the host's `last_seen_at` at most once a minute.
    pub async fn authenticate(&self, token: &str) -> Result<Authenticated, AuthError> {
        let now = self.clock.now_ms();
        if self.session_tagging().await?.check(token, now) == Tag::Invalid {
            return Err(AuthError::InvalidToken);
        }
        let session = self
            .store
            .find_session(&sha256_hex(token.as_bytes()))
            .await?
            .ok_or(AuthError::InvalidToken)?;
        if now >= session.expires_at_ms {
            return Err(AuthError::SessionExpired);
        }
        let stale = session
            .last_seen_at_ms
            .is_none_or(|seen| now.saturating_sub(seen) >= LAST_SEEN_INTERVAL_MS);
        if stale {
            // Best effort: a failed refresh must not fail the caller's request.
            if let Err(error) = self
                .store
                .touch_host(
                    &session.host_fingerprint,
                    now,
                    now.saturating_sub(LAST_SEEN_INTERVAL_MS),
                )
                .await
            {
                tracing::warn!(%error, "could not refresh host last_seen_at");
            }
        }
        Ok(Authenticated {
            host_fingerprint: session.host_fingerprint,
            expires_at_ms: session.expires_at_ms,
        })
    }

    /// Deletes hosts idle for an hour that no registration names. The registry owns
    /// `push_devices`, so it is asked over gRPC; this service never reads that table.
    pub async fn prune_hosts(&self, directory: &impl DeviceDirectory) -> Result<u64, AuthError> {
        let cutoff = self.clock.now_ms().saturating_sub(HOST_IDLE_MS);
        let mut pruned = 0;
        // Resume where the last pass stopped; a pass reads a bounded number of pages.
        let mut after = self
            .prune_cursor
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        for _ in 0..HOST_PRUNE_PAGES {
            let stale = self
                .store
                .stale_hosts(cutoff, &after, HOST_PRUNE_BATCH)
                .await?;
            let Some(last) = stale.last().cloned() else {
                after.clear();
                break;
            };
            let keep = directory
                .hosts_still_registered(stale.clone())
                .await
                .map_err(|_| AuthError::DirectoryUnavailable)?;
            let doomed: Vec<String> = stale
                .iter()
                .filter(|h| !keep.contains(h))
                .cloned()
                .collect();
            pruned += self.store.delete_stale_hosts(&doomed, cutoff).await?;
            if (stale.len() as i64) < HOST_PRUNE_BATCH {
                after.clear();
                break;
            }
            after = last;
        }
        *self.prune_cursor.lock().unwrap_or_else(|p| p.into_inner()) = after;
        if pruned > 0 {
            tracing::info!(pruned, "pruned idle hosts without devices");
        }
        Ok(pruned)
    }

    /// Deletes challenges expired more than 30 s ago and sessions expired more than a day ago.
    pub async fn prune(&self) -> Result<(), AuthError> {
        let now = self.clock.now_ms();
        let pruned = self
            .store
            .prune(
                now.saturating_sub(CHALLENGE_PRUNE_GRACE_MS),
                now.saturating_sub(SESSION_PRUNE_GRACE_MS),
            )
            .await?;
        if pruned.challenges + pruned.sessions > 0 {
            tracing::debug!(
                challenges = pruned.challenges,
                sessions = pruned.sessions,
                "pruned auth rows"
            );
        }
        Ok(())
    }
}
