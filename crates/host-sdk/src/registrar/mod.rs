//! The desktop's `notifications.registerPush` / `notifications.unregisterPush` duties: the durable
//! registration store, the unregister outbox, and the [`Registrar`] that keeps them and the
//! gateway in step.
//!
//! Invariants: every registration the gateway accepted is either stored locally or has its delete
//! queued (tried at once if even the outbox cannot be written), so none leaks; a queued delete
//! leaves the outbox only when the gateway confirmed it, when it can never succeed, or when a new
//! registration made its id live again; and for one device, registering, unregistering and outbox
//! deletes never interleave.

#[cfg(test)]
mod fake;
mod json_file;
mod locks;
mod outbox;
mod store;
#[cfg(test)]
mod tests;
mod worker;
#[cfg(test)]
mod worker_tests;

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use orca_push_api::{ApnsEnvironment, ErrorCode, Platform, RegisterRequest, V1};
use tokio::sync::Notify;

pub use outbox::{OUTBOX_FILE, PendingDelete, UnregisterOutbox};
pub use store::{REGISTRATIONS_FILE, RegistrationStore};

use crate::registration::{HostFilter, Registration};
use crate::{Gateway, GatewayError};
use locks::{DeviceLocks, Throttle};

/// Wall-clock Unix milliseconds, injectable for tests.
pub type Clock = Arc<dyn Fn() -> u64 + Send + Sync>;

/// Limits from the contract; tests shrink them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegistrarConfig {
    /// Register calls admitted per device in any `register_window` (sliding window).
    pub register_limit: usize,
    pub register_window: Duration,
    /// The outbox worker's first retry delay after a pass that left deletes queued; it doubles
    /// after each such pass up to `retry_max`, and starts over once a pass empties the outbox.
    pub retry_initial: Duration,
    pub retry_max: Duration,
}

impl Default for RegistrarConfig {
    fn default() -> Self {
        Self {
            register_limit: 10,
            register_window: Duration::from_secs(60),
            retry_initial: Duration::from_secs(30),
            retry_max: Duration::from_secs(600),
        }
    }
}

/// What `notifications.registerPush` answers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RegisterOutcome {
    Registered { registration_id: String },
    NotRegistered(NotRegistered),
}

/// Why a registration did not happen. Phones treat every one as "retry later".
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NotRegistered {
    /// Over the per-device register limit; the earlier registration is untouched.
    Throttled,
    /// The network, a 5xx, or a busy, rate-limiting or draining gateway.
    GatewayUnreachable,
    /// The gateway refused the request (a 4xx, including a 401 that re-proving did not cure).
    GatewayRejected(ErrorCode),
    /// The request breaks the contract; nothing was sent.
    InvalidRequest,
    /// The gateway accepted it but the host could not store it; its delete is queued.
    StorageFailed,
}

impl NotRegistered {
    /// The RPC's `reason` string.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Throttled => "throttled",
            Self::GatewayUnreachable => "gateway_unreachable",
            Self::GatewayRejected(_) => "gateway_rejected",
            Self::InvalidRequest => "invalid_request",
            Self::StorageFailed => "registration_storage_failed",
        }
    }

    fn from_error(error: &GatewayError) -> Self {
        match error {
            _ if error.is_retryable() => Self::GatewayUnreachable,
            GatewayError::Api { code, .. } => Self::GatewayRejected(*code),
            GatewayError::Invalid(_) => Self::InvalidRequest,
            // A refused challenge, an unusable key or session file, a malformed reply: the host
            // could not complete a call, and the phone retries later either way.
            _ => Self::GatewayUnreachable,
        }
    }
}

/// What one pass over the outbox did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DrainReport {
    /// Confirmed gone: deleted now, or answered `not_found` (already gone).
    pub deleted: usize,
    /// Answered `invalid_request`, which no retry can cure: dropped from the outbox.
    pub dropped: usize,
    /// Failed and kept for a later pass (outages, 5xx, authentication failures).
    pub failed: usize,
    /// Deletes still queued when the pass ended.
    pub remaining: usize,
}

enum Attempt {
    Deleted,
    Dropped,
    Failed,
}

/// Registers and unregisters paired phones with the gateway, keeping the local store and the
/// unregister outbox consistent with it.
pub struct Registrar<G: Gateway> {
    gateway: Arc<G>,
    store: Arc<RegistrationStore>,
    outbox: Arc<UnregisterOutbox>,
    config: RegistrarConfig,
    clock: Clock,
    devices: DeviceLocks,
    throttle: Throttle,
    /// Wakes the outbox worker; a wake while it is busy is kept for after the pass.
    kick: Notify,
    /// One drain pass at a time.
    pass: tokio::sync::Mutex<()>,
}

fn system_clock() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// The first four characters of an id: enough to correlate logs, too little to identify.
pub(crate) fn short(id: &str) -> &str {
    id.char_indices().nth(4).map_or(id, |(end, _)| &id[..end])
}

impl<G: Gateway> Registrar<G> {
    pub fn new(
        gateway: Arc<G>,
        store: Arc<RegistrationStore>,
        outbox: Arc<UnregisterOutbox>,
        config: RegistrarConfig,
    ) -> Self {
        let throttle = Throttle::new(config.register_limit, config.register_window);
        Self {
            gateway,
            store,
            outbox,
            config,
            clock: Arc::new(system_clock),
            devices: DeviceLocks::default(),
            throttle,
            kick: Notify::new(),
            pass: tokio::sync::Mutex::new(()),
        }
    }

    /// Replaces the wall clock that stamps `registeredAt` and `queuedAt`.
    pub fn with_clock(mut self, clock: Clock) -> Self {
        self.clock = clock;
        self
    }

    pub fn store(&self) -> &Arc<RegistrationStore> {
        &self.store
    }

    pub fn outbox(&self) -> &Arc<UnregisterOutbox> {
        &self.outbox
    }

    /// Asks the outbox worker for a pass now (after an unregister, or when the network returns).
    pub fn kick_outbox(&self) {
        self.kick.notify_one();
    }

    /// `notifications.registerPush` for `device_id` (the paired phone the RPC came from). Only
    /// the filter's gateway part is sent; `followDesktop` and `sound` stay on this host.
    pub async fn register(
        &self,
        device_id: &str,
        platform: Platform,
        token: &str,
        apns_environment: Option<ApnsEnvironment>,
        filter: HostFilter,
    ) -> RegisterOutcome {
        use RegisterOutcome::NotRegistered as No;
        let request = RegisterRequest {
            v: V1,
            device_id: device_id.to_owned(),
            platform,
            token: token.to_owned(),
            apns_environment,
            filter: Some(filter.gateway_part()),
        };
        if request.validate().is_err() {
            return No(NotRegistered::InvalidRequest);
        }
        if !self.throttle.admit(device_id) {
            return No(NotRegistered::Throttled);
        }
        let _device = self.devices.lock(device_id).await;
        // Earlier deletes of this phone go first: sent after the new registration, a delete of
        // the id the gateway keeps for this device would remove the registration just made.
        for entry in self.outbox.pending_for(device_id) {
            self.attempt(&entry).await;
        }
        let registration_id = match self.gateway.register(&request).await {
            Ok(reply) => reply.registration_id,
            Err(error) => {
                tracing::info!(
                    device = short(device_id),
                    error = error.category(),
                    "push registration failed"
                );
                return No(NotRegistered::from_error(&error));
            }
        };
        let previous = self.store.get(device_id);
        let registration = Registration {
            device_id: device_id.to_owned(),
            registration_id: registration_id.clone(),
            platform,
            token: request.token,
            apns_environment,
            filter,
            registered_at: (self.clock)(),
        };
        // The registration is live again, so a delete of its id still queued (it failed above)
        // must not run after it is stored.
        let stored = self
            .outbox
            .remove(&registration_id)
            .and_then(|_| self.store.put(registration));
        if let Err(error) = stored {
            tracing::warn!(
                device = short(device_id),
                %error,
                "could not store an accepted push registration"
            );
            // The unchanged local record may still name this id (the gateway keeps a device's id
            // across re-registrations); then it is still pushed to and deleting it would only
            // cut the phone off. Otherwise nothing would ever push to it: delete it.
            if previous.is_none_or(|p| p.registration_id != registration_id) {
                self.queue_delete(device_id, &registration_id).await;
            }
            return No(NotRegistered::StorageFailed);
        }
        if let Some(previous) = previous.filter(|p| p.registration_id != registration_id) {
            self.queue_delete(device_id, &previous.registration_id)
                .await;
        }
        RegisterOutcome::Registered { registration_id }
    }

    /// `notifications.unregisterPush` (and unpairing): forgets the phone's registration and
    /// queues its gateway delete, which the outbox worker then sends. Returns whether a local
    /// registration existed. Not throttled: it can only find something once per registration.
    pub async fn unregister(&self, device_id: &str) -> bool {
        let _device = self.devices.lock(device_id).await;
        let Some(existing) = self.store.get(device_id) else {
            return false;
        };
        // Queued before the record goes: a crash in between then leaves a delete to send, never
        // a gateway registration nothing remembers.
        self.queue_delete(device_id, &existing.registration_id)
            .await;
        if let Err(error) = self.store.remove(device_id) {
            tracing::warn!(
                device = short(device_id),
                %error,
                "could not remove a push registration; its gateway delete is queued"
            );
        }
        true
    }

    /// Queues a gateway delete and wakes the worker. If even the outbox cannot be written, the
    /// delete is tried once now, since it cannot wait durably. The caller holds the device lock.
    async fn queue_delete(&self, device_id: &str, registration_id: &str) {
        match self.outbox.push(registration_id, device_id, (self.clock)()) {
            Ok(()) => self.kick_outbox(),
            Err(error) => {
                tracing::warn!(
                    device = short(device_id),
                    %error,
                    "could not queue a push unregister; trying it once now"
                );
                if let Err(error) = self.gateway.unregister(registration_id).await
                    && error.code() != Some(ErrorCode::NotFound)
                {
                    tracing::warn!(
                        device = short(device_id),
                        error = error.category(),
                        "an unqueued push unregister failed"
                    );
                }
            }
        }
    }

    /// Sends one queued delete and settles its entry. The caller holds the device's lock.
    async fn attempt(&self, entry: &PendingDelete) -> Attempt {
        let id = entry.registration_id.as_str();
        let (attempt, settled) = match self.gateway.unregister(id).await {
            Ok(()) => (Attempt::Deleted, self.outbox.remove(id).map(drop)),
            Err(error) if error.code() == Some(ErrorCode::NotFound) => {
                (Attempt::Deleted, self.outbox.remove(id).map(drop))
            }
            // Authentication failures are the host's problem, not the delete's: keep it.
            Err(error) if !error.is_auth() && is_permanent(&error) => {
                tracing::warn!(
                    registration = short(id),
                    error = error.category(),
                    "dropping a push unregister the gateway can never accept"
                );
                (Attempt::Dropped, self.outbox.remove(id).map(drop))
            }
            Err(error) => {
                tracing::debug!(
                    registration = short(id),
                    error = error.category(),
                    attempts = entry.attempts.saturating_add(1),
                    "push unregister failed; kept for retry"
                );
                (Attempt::Failed, self.outbox.record_failure(id))
            }
        };
        if let Err(error) = settled {
            tracing::warn!(
                registration = short(id),
                %error,
                "could not update the push unregister outbox"
            );
        }
        attempt
    }

    /// One pass over the outbox. The queue is re-read before each delete, so one queued during
    /// the pass is sent in it; each id is tried at most once per pass.
    pub async fn drain(&self) -> DrainReport {
        let _pass = self.pass.lock().await;
        let mut report = DrainReport::default();
        let mut tried = HashSet::new();
        while let Some(entry) = self
            .outbox
            .pending()
            .into_iter()
            .find(|e| !tried.contains(&e.registration_id))
        {
            tried.insert(entry.registration_id.clone());
            let _device = self.devices.lock(&entry.device_id).await;
            // A register of this phone may have settled it while this pass waited.
            let Some(entry) = self
                .outbox
                .pending_for(&entry.device_id)
                .into_iter()
                .find(|e| e.registration_id == entry.registration_id)
            else {
                continue;
            };
            match self.attempt(&entry).await {
                Attempt::Deleted => report.deleted += 1,
                Attempt::Dropped => report.dropped += 1,
                Attempt::Failed => report.failed += 1,
            }
        }
        report.remaining = self.outbox.len();
        report
    }
}

/// Only a request the gateway calls malformed can never succeed.
fn is_permanent(error: &GatewayError) -> bool {
    matches!(error, GatewayError::Invalid(_)) || error.code() == Some(ErrorCode::InvalidRequest)
}
