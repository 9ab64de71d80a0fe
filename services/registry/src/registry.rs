//! Registrations as the contract describes them, over a store.

use std::sync::Arc;

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use orca_push_storage::Clock;
use rand::RngCore as _;

use crate::device::{
    ApnsEnvironment, MAX_IDS_PER_CALL, Platform, Registration, has_nul, is_host_fingerprint,
    is_opaque_id,
};
use crate::error::RegistryError;
use crate::store::{DeliveryRow, DeviceRow, RegistryStore, ResolvedRow};

pub struct DeviceRegistry<S> {
    store: S,
    clock: Arc<dyn Clock>,
}

fn now(clock: &dyn Clock) -> i64 {
    i64::try_from(clock.now_ms()).unwrap_or(i64::MAX)
}

/// An opaque, unguessable registration id: 18 random bytes, base64url (24 characters).
fn new_registration_id() -> String {
    let mut bytes = [0u8; 18];
    rand::rngs::OsRng.fill_bytes(&mut bytes);
    URL_SAFE_NO_PAD.encode(bytes)
}

fn check_host(host: &str) -> Result<(), RegistryError> {
    if !is_host_fingerprint(host) {
        return Err(RegistryError::InvalidRequest("host fingerprint"));
    }
    Ok(())
}

fn check_ids(ids: &[String]) -> Result<(), RegistryError> {
    if ids.len() > MAX_IDS_PER_CALL {
        return Err(RegistryError::InvalidRequest("too many ids in one call"));
    }
    if ids.iter().any(|id| has_nul(id)) {
        return Err(RegistryError::InvalidRequest("NUL in an id"));
    }
    Ok(())
}

impl<S: RegistryStore> DeviceRegistry<S> {
    pub fn new(store: S, clock: Arc<dyn Clock>) -> Self {
        Self { store, clock }
    }

    pub async fn register(&self, registration: &Registration) -> Result<String, RegistryError> {
        registration.validate()?;
        self.store
            .register(registration, &new_registration_id(), now(&*self.clock))
            .await
    }

    pub async fn list(&self, host: &str) -> Result<Vec<DeviceRow>, RegistryError> {
        check_host(host)?;
        self.store.list(host).await
    }

    pub async fn delete(&self, host: &str, registration_id: &str) -> Result<(), RegistryError> {
        check_host(host)?;
        if has_nul(registration_id) {
            return Err(RegistryError::InvalidRequest("NUL in the registration id"));
        }
        if !is_opaque_id(registration_id) {
            return Err(RegistryError::NotFound);
        }
        if self.store.delete(host, registration_id).await? {
            Ok(())
        } else {
            Err(RegistryError::NotFound)
        }
    }

    pub async fn resolve(
        &self,
        host: &str,
        ids: &[String],
    ) -> Result<Vec<ResolvedRow>, RegistryError> {
        check_host(host)?;
        check_ids(ids)?;
        self.store.resolve(host, ids).await
    }

    pub async fn for_delivery(&self, ids: &[String]) -> Result<Vec<DeliveryRow>, RegistryError> {
        check_ids(ids)?;
        self.store.for_delivery(ids).await
    }

    pub async fn mark_dead(
        &self,
        registration_id: &str,
        token: &str,
        platform: Platform,
        apns_environment: Option<ApnsEnvironment>,
    ) -> Result<bool, RegistryError> {
        if has_nul(registration_id) || has_nul(token) {
            return Err(RegistryError::InvalidRequest("NUL in an id or token"));
        }
        let marked = self
            .store
            .mark_dead(
                registration_id,
                token,
                platform,
                apns_environment,
                now(&*self.clock),
            )
            .await?;
        if marked {
            tracing::info!(platform = platform.as_str(), "registration marked dead");
        }
        Ok(marked)
    }

    pub async fn hosts_with_devices(&self, hosts: &[String]) -> Result<Vec<String>, RegistryError> {
        check_ids(hosts)?;
        self.store.hosts_with_devices(hosts).await
    }
}
