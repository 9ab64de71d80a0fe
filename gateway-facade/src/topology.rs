//! Starting the gateway: all services in one process (the embedded default), or one service per
//! process (split mode). In both, the facade reaches the services over the same gRPC: in one
//! process its clients call the generated servers as tower services (no sockets, same layers);
//! split, over HTTP/2.

use std::net::SocketAddr;
use std::sync::Arc;

use anyhow::Context as _;
use orca_push_storage::{Clock, SystemClock};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::app::{AppState, router};
use crate::backends::{BackendTargets, Backends};
use crate::config::{Config, HttpLimits, InternalTransport, Mode, ServiceName};
use crate::connections;
use crate::limits::Limits;
use orca_push_internal_auth::{InternalKey, LocalServer, Target};

/// Applies every service's migrations.
pub async fn migrate(config: &Config) -> anyhow::Result<()> {
    orca_push_auth::open_and_migrate(&config.common.database)
        .await
        .context("auth migrations")?;
    orca_push_registry::open_and_migrate(&config.common.database)
        .await
        .context("registry migrations")?;
    orca_push_queue::open_and_migrate(&config.common.database)
        .await
        .context("queue migrations")?;
    Ok(())
}

/// `orca-push serve`: the facade and all four services in this process, on `listener`.
/// `drain` (SIGTERM) makes the facade refuse new work and the sender stop taking it; once the
/// sender's in-flight deliveries are done (or their grace is over) everything stops.
pub async fn serve_all_in_one(
    config: Arc<Config>,
    listener: TcpListener,
    drain: CancellationToken,
) -> anyhow::Result<()> {
    if config.common.mode == Mode::Validation {
        let state = AppState::validation();
        return serve_facade(listener, state, config.facade.http, drain.clone(), drain).await;
    }
    // Stopped by the sender once it has drained: services stay up for its last reports.
    let stop = CancellationToken::new();
    let shutdown = stop.clone();
    let clock: Arc<dyn Clock> = Arc::new(SystemClock);
    // One process talking to itself: a fresh key unless one is configured (for internal teams).
    // The internal listener is for callers outside the process: they need tokens from a known key,
    // and the address must bind, both checked before anything migrates.
    let internal_listener = match config.common.grpc_addr {
        Some(addr) => {
            config.require_internal_key().context(
                "ORCA_PUSH_GRPC_ADDR: internal callers need tokens signed with a known key",
            )?;
            Some(bind(addr)?)
        }
        None => None,
    };
    let key = config
        .common
        .internal_key
        .clone()
        .unwrap_or_else(InternalKey::generate);
    let mut tasks = tokio::task::JoinSet::new();
    let mut expose = Exposer {
        transport: config.common.internal_transport,
        key: key.clone(),
        shutdown: shutdown.clone(),
        tasks: &mut tasks,
        for_listener: internal_listener.as_ref().map(|_| Vec::new()),
    };

    // Before anything in the folder is opened or migrated.
    orca_push_queue::own_sqlite_queue(&config.common.database)?;
    let auth_pool = orca_push_auth::open_and_migrate(&config.common.database)
        .await
        .context("auth database")?;
    let registry_pool = orca_push_registry::open_and_migrate(&config.common.database)
        .await
        .context("registry database")?;
    let registry = orca_push_registry::routes(registry_pool, clock.clone(), shutdown.clone()).await;
    let registry = expose
        .service(orca_push_registry::AUDIENCE, registry)
        .await?;
    let origin = config.gateway_origin(listener.local_addr()?.port());
    let auth = orca_push_auth::routes(
        auth_pool,
        origin,
        clock.clone(),
        orca_push_auth::registry_client(&registry, &key).context("registry channel")?,
        shutdown.clone(),
    )
    .await;
    let auth = expose.service(orca_push_auth::AUDIENCE, auth).await?;
    let queue_pool = orca_push_queue::open_and_migrate(&config.common.database)
        .await
        .context("queue database")?;
    let queue = orca_push_queue::routes(
        queue_pool,
        clock.clone(),
        config.queue.coalesce_ms,
        shutdown.clone(),
    )
    .await;
    let queue = expose.service(orca_push_queue::AUDIENCE, queue).await?;
    let providers = orca_push_sender::Providers::new(&config.sender.providers)
        .await
        .context("providers")?;
    let (sender, lanes) = orca_push_sender::start(
        providers,
        &queue,
        &registry,
        clock.clone(),
        config.sender_settings(),
        &key,
        drain.clone(),
        stop.clone(),
    )
    .context("sender channels")?;
    let sender = expose.service(orca_push_sender::AUDIENCE, sender).await?;
    if let (Some(listener), Some(services)) = (internal_listener, expose.for_listener.take()) {
        tracing::info!(addr = %listener.local_addr()?, "internal gRPC listening (all services)");
        tasks.spawn(orca_push_internal_auth::serve_services(
            listener,
            key.clone(),
            services,
            &INTERNAL_HEALTH_NAMES,
            shutdown.clone(),
        ));
    }
    tasks.spawn(async move {
        match lanes.await {
            Err(error) if error.is_panic() => std::panic::resume_unwind(error.into_panic()),
            _ => Ok(()),
        }
    });

    let backends = Backends::connect(
        &BackendTargets {
            auth,
            registry,
            queue,
            sender,
        },
        &key,
    )
    .context("service channels")?;
    let state = AppState::serving(backends, Limits::new(config.facade.trusted_proxy_hops));
    let facade = serve_facade(
        listener,
        state,
        config.facade.http,
        drain.clone(),
        stop.clone(),
    );
    tokio::pin!(facade);
    let result = loop {
        tokio::select! {
            result = &mut facade => break result,
            Some(joined) = tasks.join_next() => match joined {
                // Stopping as asked (the sender drained): the facade finishes its own stop.
                Ok(Ok(())) if stop.is_cancelled() => continue,
                // A service stopping on its own is fatal for the whole process.
                Ok(Ok(())) => break Err(anyhow::anyhow!("a service stopped unexpectedly")),
                Ok(Err(error)) => break Err(anyhow::Error::new(error).context("a service failed")),
                Err(error) => break Err(anyhow::Error::new(error).context("a service panicked")),
            },
        }
    };
    stop.cancel();
    while tasks.join_next().await.is_some() {}
    result
}

/// `<service>-<host>-<pid>`: who holds a lease, for operators.
pub fn instance_name(service: &str) -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_owned())
        .unwrap_or_else(|_| "localhost".to_owned());
    format!("{service}-{host}-{}", std::process::id())
}

/// `orca-push serve --service NAME`: one service in this process.
pub async fn serve_split(
    config: Arc<Config>,
    service: ServiceName,
    drain: CancellationToken,
) -> anyhow::Result<()> {
    let shutdown = drain.clone();
    let key = config.require_internal_key()?;
    if service == ServiceName::Facade {
        let listener = bind(SocketAddr::from(([0, 0, 0, 0], config.facade.port)))?;
        let state = match config.common.mode {
            Mode::Validation => AppState::validation(),
            Mode::Serve => AppState::serving(
                Backends::connect(
                    &BackendTargets {
                        auth: config.require_url(ServiceName::Auth)?.into(),
                        registry: config.require_url(ServiceName::Registry)?.into(),
                        queue: config.require_url(ServiceName::Queue)?.into(),
                        sender: config.require_url(ServiceName::Sender)?.into(),
                    },
                    &key,
                )
                .context("service channels")?,
                Limits::new(config.facade.trusted_proxy_hops),
            ),
        };
        return serve_facade(listener, state, config.facade.http, drain.clone(), drain).await;
    }
    if config.common.mode == Mode::Validation {
        anyhow::bail!("ORCA_PUSH_MODE: validation runs the facade only (use --service facade)");
    }
    let addr = config
        .common
        .grpc_addr
        .unwrap_or_else(|| SocketAddr::from(([0, 0, 0, 0], service.default_grpc_port())));
    let listener = bind(addr)?;
    let bound = listener.local_addr()?;
    tracing::info!(service = service.as_str(), addr = %bound, "gRPC service listening");
    match service {
        ServiceName::Auth => {
            let pool = orca_push_auth::open_and_migrate(&config.common.database)
                .await
                .context("auth database")?;
            orca_push_auth::serve(
                listener,
                pool,
                config.require_public_url()?,
                Arc::new(SystemClock),
                orca_push_auth::registry_client(
                    &config.require_url(ServiceName::Registry)?.into(),
                    &key,
                )
                .context("registry channel")?,
                key,
                shutdown,
            )
            .await?
        }
        ServiceName::Registry => {
            let pool = orca_push_registry::open_and_migrate(&config.common.database)
                .await
                .context("registry database")?;
            orca_push_registry::serve(listener, pool, Arc::new(SystemClock), key, shutdown).await?
        }
        ServiceName::Queue => {
            orca_push_queue::own_sqlite_queue(&config.common.database)?;
            let pool = orca_push_queue::open_and_migrate(&config.common.database)
                .await
                .context("queue database")?;
            orca_push_queue::serve(
                listener,
                pool,
                Arc::new(SystemClock),
                config.queue.coalesce_ms,
                key,
                shutdown,
            )
            .await?
        }
        ServiceName::Sender => {
            let providers = orca_push_sender::Providers::new(&config.sender.providers)
                .await
                .context("providers")?;
            // The process ends when the lanes have drained, not at the signal itself.
            let stop = CancellationToken::new();
            orca_push_sender::serve(
                listener,
                providers,
                config.require_url(ServiceName::Queue)?.into(),
                config.require_url(ServiceName::Registry)?.into(),
                Arc::new(SystemClock),
                config.sender_settings(),
                key,
                drain,
                stop,
            )
            .await?
        }
        ServiceName::Facade => unreachable!("handled above"),
    }
    Ok(())
}

/// Serves the public HTTP API under `http`'s timeouts and connection cap: from `drain` on it
/// refuses new `/v1` work with `shutting_down`; at `shutdown` it stops, letting requests in flight
/// finish.
pub async fn serve_facade(
    listener: TcpListener,
    state: AppState,
    http: HttpLimits,
    drain: CancellationToken,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let state = state.draining_at(drain);
    let addr = listener.local_addr()?;
    tracing::info!(%addr, mode = state.mode.as_str(), "facade listening");
    tokio::spawn(sweep_limits(state.limits.clone(), shutdown.clone()));
    if let Some(backends) = &state.backends {
        let auth = backends.auth.clone();
        tokio::spawn(state.sessions.clone().keep_fresh(auth, shutdown.clone()));
        let resolves = backends.resolves.clone();
        tokio::spawn(resolves.follow(backends.registry.clone(), shutdown.clone()));
    }
    connections::serve(listener, router(state), http, shutdown).await;
    Ok(())
}

fn bind(addr: SocketAddr) -> anyhow::Result<TcpListener> {
    crate::connections::listen(addr).with_context(|| format!("cannot listen on {addr}"))
}

/// What gRPC health answers for on the all-in-one internal listener: the process (liveness, as
/// `/health`; whether the services reach their database is `/ready`'s to say).
const INTERNAL_HEALTH_NAMES: [&str; 1] = [""];

/// How the services of one process are reached by each other and by the facade.
struct Exposer<'a> {
    transport: InternalTransport,
    key: InternalKey,
    shutdown: CancellationToken,
    tasks: &'a mut tokio::task::JoinSet<Result<(), tonic::transport::Error>>,
    /// With `ORCA_PUSH_GRPC_ADDR`: each service's in-process server, for the internal listener.
    for_listener: Option<Vec<(&'static str, LocalServer)>>,
}

impl Exposer<'_> {
    /// `routes` as a server in this process, or (`loopback`) served on a kernel-chosen loopback
    /// port until shutdown.
    async fn service(
        &mut self,
        audience: &'static str,
        routes: tonic::service::Routes,
    ) -> anyhow::Result<Target> {
        if let Some(servers) = &mut self.for_listener {
            servers.push((
                audience,
                LocalServer::new(self.key.clone(), audience, routes.clone()),
            ));
        }
        match self.transport {
            InternalTransport::InProcess => Ok(Target::Local(LocalServer::new(
                self.key.clone(),
                audience,
                routes,
            ))),
            InternalTransport::Loopback => {
                let listener = bind(SocketAddr::from(([127, 0, 0, 1], 0)))?;
                let url = format!("http://{}", listener.local_addr()?);
                self.tasks.spawn(orca_push_internal_auth::serve_routes(
                    listener,
                    self.key.clone(),
                    audience,
                    routes,
                    self.shutdown.clone(),
                ));
                Ok(Target::Url(url))
            }
        }
    }
}

/// Drops limiter state for clients that went quiet, so memory follows the live client set.
async fn sweep_limits(limits: Arc<Limits>, shutdown: CancellationToken) {
    let mut ticker = tokio::time::interval(std::time::Duration::from_secs(10));
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = ticker.tick() => limits.sweep(),
        }
    }
}
