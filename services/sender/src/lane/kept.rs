//! The phones of a claim's batches: those of hosts kept in memory while the registry's device
//! watch vouches for them, the rest asked of the registry in one call and kept for the next.

use std::collections::HashMap;
use std::time::Duration;

use orca_push_proto::queue::v1 as queue_pb;
use orca_push_proto::registry::v1 as registry_pb;
use orca_push_registry::watched::Read;
use tracing::Instrument as _;

use super::{Devices, Sender};

/// What a kept phone takes besides its strings (an estimate; it only bounds the copy).
const DEVICE_OVERHEAD: usize = 160;

impl Sender {
    /// The devices of a claim's batches, by registration id: those of hosts kept while the
    /// registry's device watch vouches for them ([`Devices`]), the rest in one registry call. The
    /// registry is the truth: a device deleted, marked dead or given a new token since admission
    /// is seen here, just before the attempts, once the watch has told of it (within
    /// milliseconds; on PostgreSQL a registry replica's copy follows another replica's write by
    /// the time its relay takes to hear of it; a token the provider then refuses is marked dead
    /// only while it is still the registration's).
    pub(super) async fn look_up(
        &self,
        batches: &[queue_pb::ClaimedBatch],
    ) -> Result<HashMap<String, registry_pb::DeliveryDevice>, tonic::Code> {
        if batches.is_empty() {
            return Ok(HashMap::new());
        }
        let kept = self.devices.as_deref();
        let began = kept.and_then(Devices::begin);
        let kept = kept.zip(began.as_ref());
        let (mut found, registration_ids) = from_kept(kept, batches);
        let source = |kept: bool| if kept { "memory" } else { "registry" };
        metrics::counter!("orca_push_sender_device_lookups_total", "source" => source(true))
            .increment(found.len() as u64);
        metrics::counter!("orca_push_sender_device_lookups_total", "source" => source(false))
            .increment(registration_ids.len() as u64);
        if registration_ids.is_empty() {
            return Ok(found);
        }
        let span = tracing::info_span!(
            "look up devices",
            otel.kind = "client",
            orca.devices = registration_ids.len(),
        );
        // Nothing renews the claim's leases yet: a slow registry becomes a retry well before
        // they could lapse.
        let within = Duration::from_millis(u64::from(self.lease_ms) / 3);
        let devices = tokio::time::timeout(
            within,
            self.registry.clone().get_devices_for_delivery(
                registry_pb::GetDevicesForDeliveryRequest { registration_ids },
            ),
        )
        .instrument(span)
        .await
        .map_err(|_| tonic::Code::DeadlineExceeded)?
        .map_err(|status| status.code())?
        .into_inner()
        .devices;
        if let Some((kept, read)) = kept {
            keep_answered(kept, read, &devices);
        }
        found.extend(devices.into_iter().map(|d| (d.registration_id.clone(), d)));
        Ok(found)
    }
}

/// The phones of `batches` that `kept` answers under its read, by registration id, and the ids
/// left to ask the registry (sorted, each once). A host's phones come from memory only if every
/// one its batches name is kept.
pub(super) fn from_kept(
    kept: Option<(&Devices, &Read)>,
    batches: &[queue_pb::ClaimedBatch],
) -> (HashMap<String, registry_pb::DeliveryDevice>, Vec<String>) {
    let Some((kept, read)) = kept else {
        // No copy (one process): every id is asked for, with nothing grouped.
        let mut ids: Vec<String> = batches.iter().map(|b| b.registration_id.clone()).collect();
        ids.sort_unstable();
        ids.dedup();
        return (HashMap::new(), ids);
    };
    let mut by_host: HashMap<&str, Vec<&str>> = HashMap::new();
    for batch in batches {
        let ids = by_host.entry(batch.host_fingerprint.as_str()).or_default();
        if !ids.contains(&batch.registration_id.as_str()) {
            ids.push(batch.registration_id.as_str());
        }
    }
    let mut found = HashMap::with_capacity(batches.len());
    let mut missing = Vec::new();
    for (host, ids) in by_host {
        match kept.answer(host, &ids, read) {
            Some(devices) => {
                found.extend(devices.into_iter().map(|d| (d.registration_id.clone(), d)));
            }
            None => missing.extend(ids.into_iter().map(str::to_owned)),
        }
    }
    missing.sort_unstable();
    missing.dedup();
    (found, missing)
}

/// Keeps what the registry answered a read that began at `read`, each phone under its own host
/// (the one the registry's watch names when it changes).
pub(super) fn keep_answered(kept: &Devices, read: &Read, devices: &[registry_pb::DeliveryDevice]) {
    let mut by_host: HashMap<&str, Vec<(String, registry_pb::DeliveryDevice, usize)>> =
        HashMap::new();
    for d in devices {
        let bytes = d.host_fingerprint.len() + d.token.len() + DEVICE_OVERHEAD;
        by_host
            .entry(d.host_fingerprint.as_str())
            .or_default()
            .push((d.registration_id.clone(), d.clone(), bytes));
    }
    for (host, devices) in by_host {
        kept.keep(host, read, devices);
    }
}
