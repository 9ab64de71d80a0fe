//! The tonic face of [`DeviceRegistry`]: wire enums to domain types and back.

use std::sync::Arc;

use orca_push_internal_auth::news::{NewsStream, Told, news_stream};
use orca_push_proto::convert;
use orca_push_proto::registry::v1 as pb;
use tonic::{Request, Response, Status};

use crate::device::{ApnsEnvironment, DeviceFilter, Platform, Registration};
use crate::error::RegistryError;
use crate::registry::DeviceRegistry;
use crate::resolve_cache::{DeviceNews, ResolveCache};
use crate::store::AnyRegistryStore;
use tokio_util::sync::CancellationToken;

pub struct RegistryGrpc {
    registry: Arc<DeviceRegistry<AnyRegistryStore>>,
    /// Whose news `WatchDevices` passes on.
    resolves: Arc<ResolveCache>,
    /// Ends device watches, so a draining server is not held open by them.
    shutdown: CancellationToken,
}

impl RegistryGrpc {
    pub fn new(
        registry: Arc<DeviceRegistry<AnyRegistryStore>>,
        resolves: Arc<ResolveCache>,
        shutdown: CancellationToken,
    ) -> Self {
        Self {
            registry,
            resolves,
            shutdown,
        }
    }
}

type EventStream = NewsStream<pb::DeviceEvent>;

/// What a `WatchDevices` watcher is told of each piece of device news.
fn tell(news: DeviceNews) -> Told<pb::DeviceEvent> {
    match news {
        DeviceNews::Changed(host) => Told::Event(pb::DeviceEvent {
            changed_host_fingerprint: host,
        }),
        DeviceNews::Heard => Told::Event(pb::DeviceEvent::default()),
        DeviceNews::Lost => Told::Lost,
    }
}

fn platform_from_wire(value: i32) -> Result<Platform, RegistryError> {
    convert::platform_from_wire(value).map_err(|e| RegistryError::InvalidRequest(e.0))
}

fn platform_to_wire(platform: Platform) -> i32 {
    pb::Platform::from(platform) as i32
}

fn environment_from_wire(value: i32) -> Result<Option<ApnsEnvironment>, RegistryError> {
    convert::environment_from_wire(value).map_err(|e| RegistryError::InvalidRequest(e.0))
}

use convert::environment_to_wire;

fn filter_to_wire(filter: DeviceFilter) -> pb::DeviceFilter {
    pb::DeviceFilter {
        sources: filter.sources,
        agent_states: filter.agent_states,
    }
}

/// A `RegisterDevice` request as the registry reads it, before [`Registration::validate`].
pub fn registration_from_wire(r: pb::RegisterDeviceRequest) -> Result<Registration, RegistryError> {
    Ok(Registration {
        host_fingerprint: r.host_fingerprint,
        device_id: r.device_id,
        platform: platform_from_wire(r.platform)?,
        token: r.token,
        apns_environment: environment_from_wire(r.apns_environment)?,
        filter: r.filter.map(|f| DeviceFilter {
            sources: f.sources,
            agent_states: f.agent_states,
        }),
    })
}

#[tonic::async_trait]
impl pb::registry_service_server::RegistryService for RegistryGrpc {
    type WatchDevicesStream = EventStream;

    async fn watch_devices(
        &self,
        _request: Request<pb::WatchDevicesRequest>,
    ) -> Result<Response<Self::WatchDevicesStream>, Status> {
        Ok(Response::new(news_stream(
            self.resolves.watch(),
            self.shutdown.clone(),
            "device",
            tell,
        )))
    }

    async fn register_device(
        &self,
        request: Request<pb::RegisterDeviceRequest>,
    ) -> Result<Response<pb::RegisterDeviceResponse>, Status> {
        let registration = registration_from_wire(request.into_inner())?;
        let registration_id = self.registry.register(&registration).await?;
        Ok(Response::new(pb::RegisterDeviceResponse {
            registration_id,
        }))
    }

    async fn list_devices(
        &self,
        request: Request<pb::ListDevicesRequest>,
    ) -> Result<Response<pb::ListDevicesResponse>, Status> {
        let rows = self
            .registry
            .list(&request.into_inner().host_fingerprint)
            .await?;
        let devices = rows
            .into_iter()
            .map(|d| pb::Device {
                registration_id: d.registration_id,
                device_id: d.device_id,
                platform: platform_to_wire(d.platform),
                dead: d.dead,
                filter: d.filter.map(filter_to_wire),
            })
            .collect();
        Ok(Response::new(pb::ListDevicesResponse { devices }))
    }

    async fn delete_device(
        &self,
        request: Request<pb::DeleteDeviceRequest>,
    ) -> Result<Response<pb::DeleteDeviceResponse>, Status> {
        let r = request.into_inner();
        self.registry
            .delete(&r.host_fingerprint, &r.registration_id)
            .await?;
        Ok(Response::new(pb::DeleteDeviceResponse {}))
    }

    async fn resolve_registrations(
        &self,
        request: Request<pb::ResolveRegistrationsRequest>,
    ) -> Result<Response<pb::ResolveRegistrationsResponse>, Status> {
        let r = request.into_inner();
        let rows = self
            .registry
            .resolve(&r.host_fingerprint, &r.registration_ids)
            .await?;
        let registrations = rows
            .into_iter()
            .map(|row| pb::ResolvedRegistration {
                registration_id: row.registration_id,
                platform: platform_to_wire(row.platform),
                dead: row.dead,
            })
            .collect();
        Ok(Response::new(pb::ResolveRegistrationsResponse {
            registrations,
        }))
    }

    async fn get_devices_for_delivery(
        &self,
        request: Request<pb::GetDevicesForDeliveryRequest>,
    ) -> Result<Response<pb::GetDevicesForDeliveryResponse>, Status> {
        let rows = self
            .registry
            .for_delivery(&request.into_inner().registration_ids)
            .await?;
        let devices = rows
            .into_iter()
            .map(|row| pb::DeliveryDevice {
                registration_id: row.registration_id,
                host_fingerprint: row.host_fingerprint,
                platform: platform_to_wire(row.platform),
                token: row.token,
                apns_environment: environment_to_wire(row.apns_environment),
                dead: row.dead,
            })
            .collect();
        Ok(Response::new(pb::GetDevicesForDeliveryResponse { devices }))
    }

    async fn mark_dead(
        &self,
        request: Request<pb::MarkDeadRequest>,
    ) -> Result<Response<pb::MarkDeadResponse>, Status> {
        let r = request.into_inner();
        let marked = self
            .registry
            .mark_dead(
                &r.registration_id,
                &r.token,
                platform_from_wire(r.platform)?,
                environment_from_wire(r.apns_environment)?,
            )
            .await?;
        Ok(Response::new(pb::MarkDeadResponse { marked }))
    }

    async fn hosts_with_devices(
        &self,
        request: Request<pb::HostsWithDevicesRequest>,
    ) -> Result<Response<pb::HostsWithDevicesResponse>, Status> {
        let hosts = self
            .registry
            .hosts_with_devices(&request.into_inner().host_fingerprints)
            .await?;
        Ok(Response::new(pb::HostsWithDevicesResponse {
            host_fingerprints: hosts,
        }))
    }
}
