//! The `orca-push` command line: the gateway (all in one, or one service), its migrations, and the
//! host CLI. `main.rs` only calls [`main`]; the end-to-end tests build the same entry point.

use std::process::ExitCode;
use std::sync::Arc;

use crate::config::{Config, ServiceName};
use crate::host_cli::HostCommand;
use crate::settings::Settings;
use crate::topology;
use anyhow::Context as _;
use clap::{Parser, Subcommand};
use tokio_util::sync::CancellationToken;

/// SIGTERM to exit, at most (the platform kills at 10 s).
const HARD_DEADLINE: std::time::Duration = std::time::Duration::from_secs(9);

/// `--version`: the package's version, and the commit it was built from when the build set
/// `ORCA_PUSH_BUILD_REVISION` (`scripts/bench` does, so a benchmark's JSON names the build it
/// measured; other builds leave it out rather than pay a rebuild on every commit).
pub const BUILD_REVISION: &str = match option_env!("ORCA_PUSH_BUILD_REVISION") {
    Some(revision) => revision,
    None => "",
};

static VERSION_LINE: std::sync::LazyLock<String> =
    std::sync::LazyLock::new(|| version_line(env!("CARGO_PKG_VERSION"), BUILD_REVISION));

/// What `--version` prints after the name (the bench reads the revision back from it).
fn version_line(package: &str, revision: &str) -> String {
    if revision.is_empty() {
        package.to_owned()
    } else {
        format!("{package} (revision {revision})")
    }
}

#[derive(Parser)]
#[command(
    name = "orca-push",
    version = VERSION_LINE.as_str(),
    about = "The orca-push gateway: desktop hosts to their phones through APNs and FCM"
)]
pub struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the gateway. Without --service: the facade and all four services in this process.
    #[command(after_long_help = crate::settings::LIBRARY_VARIABLES)]
    Serve {
        /// Run only this service (split mode).
        #[arg(long, value_enum)]
        service: Option<ServiceName>,
        #[command(flatten)]
        settings: Settings,
    },
    /// Apply every service's database migrations, then exit.
    Migrate {
        #[command(flatten)]
        settings: Settings,
    },
    /// Print a token an internal team (or grpcurl) can call a service with. Reads
    /// ORCA_PUSH_INTERNAL_KEY, the key the services check tokens with. Read-only unless
    /// --scope full.
    InternalToken {
        /// The service to call: auth, registry, queue or sender.
        #[arg(long, value_parser = ["auth", "registry", "queue", "sender"])]
        audience: String,
        /// Who is calling (a team or tool name: 1-64 letters, digits, `.`, `_`, `-`, `@`);
        /// services trace it, never the token.
        #[arg(long, value_parser = subject)]
        subject: String,
        /// What the token may call: `read` (look-ups such as event outcomes, queue depth and a
        /// host's device list; never push tokens) or `full` (every method, as services call each
        /// other).
        #[arg(long, value_enum, default_value_t = TokenScope::Read)]
        scope: TokenScope,
        /// Lifetime in seconds: at most 28800 (8 h) for a read token, 3600 (1 h) for a full one.
        #[arg(long, default_value_t = 300, value_parser = clap::value_parser!(u64).range(1..))]
        ttl: u64,
        #[command(flatten)]
        settings: Settings,
    },
    /// Container health check: exits 0 when this host's process answers. With ORCA_PUSH_GRPC_ADDR
    /// set (a split-mode service, or the all-in-one internal listener) it asks gRPC health;
    /// otherwise GET /healthz on PORT.
    Healthcheck {
        #[command(flatten)]
        settings: Settings,
    },
    /// Deployment check: an FCM `validate_only` send with the configured credentials. Exits 0 when
    /// FCM accepted the credentials (the token itself may be unknown to it).
    ProbeFcm {
        /// An FCM registration token to validate against (any well-formed one).
        #[arg(long)]
        token: String,
        #[command(flatten)]
        settings: Settings,
    },
    /// The desktop host's side: keys, login, phones, notifications (built on the host SDK).
    Host {
        #[command(subcommand)]
        command: HostCommand,
    },
}

/// What an `internal-token` may call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum TokenScope {
    Read,
    Full,
}

impl From<TokenScope> for orca_push_internal_auth::Scope {
    fn from(scope: TokenScope) -> Self {
        match scope {
            TokenScope::Read => Self::Read,
            TokenScope::Full => Self::Full,
        }
    }
}

/// `--subject`: a name the services accept as a caller.
fn subject(value: &str) -> Result<String, String> {
    if orca_push_internal_auth::valid_subject(value) {
        Ok(value.to_owned())
    } else {
        Err("1 to 64 ASCII letters, digits, `.`, `_`, `-` or `@`".to_owned())
    }
}

/// Parses the command line and runs it; errors print as one line.
pub fn main() -> ExitCode {
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("orca-push: cannot start the async runtime: {error}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            // One line: the chain of causes, never a panic trace.
            eprintln!("orca-push: {error:#}");
            ExitCode::FAILURE
        }
    }
}

async fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Serve { service, settings } => {
            let config = Arc::new(settings.config()?);
            // Everything this role needs is checked before anything binds or migrates, so a
            // misconfiguration is one line and nothing else.
            config.check_role(service)?;
            let name = service.map_or("orca-push", |s| match s {
                ServiceName::Facade => "orca-push-facade",
                ServiceName::Auth => "orca-push-auth",
                ServiceName::Registry => "orca-push-registry",
                ServiceName::Queue => "orca-push-queue",
                ServiceName::Sender => "orca-push-sender",
            });
            let _telemetry = init_telemetry(&config, name)?;
            let shutdown = CancellationToken::new();
            tokio::spawn(cancel_on_signal(shutdown.clone()));
            let metrics = crate::metrics::install(
                config
                    .common
                    .telemetry
                    .otlp_metrics
                    .as_ref()
                    .map(|export| (export, telemetry_resource(&config, name))),
                &shutdown,
            )?;
            // Dropped last, at exit: flushes the OTLP metrics.
            let _otlp_metrics = metrics.otlp;
            crate::metrics::serve(
                config.common.metrics_addr,
                metrics.prometheus,
                shutdown.clone(),
            )
            .await?;
            match service {
                None => {
                    let addr = std::net::SocketAddr::from(([0, 0, 0, 0], config.facade.port));
                    let listener = crate::connections::listen(addr)
                        .with_context(|| format!("PORT: cannot listen on {addr}"))?;
                    topology::serve_all_in_one(config, listener, shutdown).await
                }
                Some(service) => topology::serve_split(config, service, shutdown).await,
            }
        }
        Command::Migrate { settings } => {
            let config = settings.config()?;
            let _telemetry = init_telemetry(&config, "orca-push-migrate")?;
            topology::migrate(&config).await?;
            tracing::info!("migrations applied");
            Ok(())
        }
        Command::InternalToken {
            audience,
            subject,
            scope,
            ttl,
            settings,
        } => {
            let scope = orca_push_internal_auth::Scope::from(scope);
            let max = scope.max_ttl().as_secs();
            anyhow::ensure!(
                ttl <= max,
                "--ttl: a {} token lives at most {max} seconds",
                scope.as_str()
            );
            let key = settings.config()?.require_internal_key()?;
            println!(
                "{}",
                orca_push_internal_auth::mint(
                    &key,
                    &subject,
                    &audience,
                    scope,
                    std::time::Duration::from_secs(ttl)
                )
            );
            Ok(())
        }
        Command::Healthcheck { settings } => {
            let config = settings.config()?;
            match config.common.grpc_addr {
                Some(addr) => grpc_health(addr.port()).await,
                None => {
                    let services = [
                        ServiceName::Auth,
                        ServiceName::Registry,
                        ServiceName::Queue,
                        ServiceName::Sender,
                    ];
                    health_without_grpc_addr(
                        config.facade.port,
                        &services.map(ServiceName::default_grpc_port),
                    )
                    .await
                }
            }
        }
        Command::ProbeFcm { token, settings } => {
            let config = settings.config()?;
            let _telemetry = init_telemetry(&config, "orca-push-probe")?;
            let providers = orca_push_sender::Providers::new(&config.sender.providers)
                .await
                .context("providers")?;
            let verdict = providers
                .probe_fcm(&token)
                .await
                .ok_or_else(|| anyhow::anyhow!("FCM is not configured"))?;
            use orca_push_sender::verdict::Verdict;
            match verdict {
                Verdict::Sent => println!("fcm: ok (validate_only accepted)"),
                Verdict::Dead(reason) => {
                    println!("fcm: ok (credentials accepted; probe token refused: {reason})")
                }
                Verdict::Retry { reason, .. } | Verdict::Failed(reason) => {
                    anyhow::bail!("fcm probe failed: {reason}")
                }
            }
            Ok(())
        }
        Command::Host { command } => crate::host_cli::run(command).await,
    }
}

fn init_telemetry(
    config: &Config,
    service_name: &str,
) -> anyhow::Result<orca_push_telemetry::TelemetryGuard> {
    let export = config.common.telemetry.otlp.as_ref();
    let provider =
        orca_push_telemetry::tracer_provider(telemetry_resource(config, service_name), export)
            .context("OTLP span export")?;
    orca_push_telemetry::init(
        provider,
        config.common.telemetry.log_format,
        orca_push_telemetry::SpanDetail::exporting(export.is_some()),
    )
    .context("telemetry")
}

/// The OpenTelemetry resource of this process: `OTEL_SERVICE_NAME` or the role's name, and the
/// host and pid as the instance.
fn telemetry_resource(config: &Config, service_name: &str) -> opentelemetry_sdk::Resource {
    let instance = format!("{}-{}", hostname(), std::process::id());
    let name = config
        .common
        .telemetry
        .otel_service_name
        .as_deref()
        .unwrap_or(service_name);
    orca_push_telemetry::resource(name, &instance)
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_owned())
        .unwrap_or_else(|_| "localhost".to_owned())
}

/// SIGTERM (the platform's stop) or Ctrl-C starts a graceful shutdown.
async fn cancel_on_signal(shutdown: CancellationToken) {
    #[cfg(unix)]
    {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(signal) => signal,
                Err(error) => {
                    tracing::error!(%error, "cannot listen for SIGTERM");
                    return;
                }
            };
        tokio::select! {
            _ = term.recv() => {}
            _ = tokio::signal::ctrl_c() => {}
        }
    }
    #[cfg(not(unix))]
    let _ = tokio::signal::ctrl_c().await;
    tracing::info!("shutdown requested");
    shutdown.cancel();
    // The platform's hard deadline: whatever has not finished by then is left to lease expiry.
    tokio::time::sleep(HARD_DEADLINE).await;
    eprintln!("orca-push: shutdown did not finish within {HARD_DEADLINE:?}; exiting");
    std::process::exit(1);
}

/// How long a health check waits for each answer.
const HEALTH_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(3);

/// A health check's connection was refused: nothing listens on that port.
#[derive(Debug, thiserror::Error)]
#[error("nothing listens on 127.0.0.1:{0}")]
struct NotListening(u16);

enum HttpHealth {
    NotListening(reqwest::Error),
    Failed(anyhow::Error),
}

/// Health of a process started without ORCA_PUSH_GRPC_ADDR: `GET /healthz` on `http_port`, or, if
/// nothing listens there, gRPC health on the first of `service_ports` that something listens on:
/// a split service on its default port (`serve --service queue`), whose container runs this check
/// without knowing which service it holds. One process per container, so the port that answers is
/// its own.
async fn health_without_grpc_addr(http_port: u16, service_ports: &[u16]) -> anyhow::Result<()> {
    let error = match http_health(http_port).await {
        Ok(()) => return Ok(()),
        Err(HttpHealth::Failed(error)) => return Err(error),
        Err(HttpHealth::NotListening(error)) => error,
    };
    for &port in service_ports {
        match grpc_health(port).await {
            Err(e) if e.is::<NotListening>() => {}
            answer => return answer,
        }
    }
    Err(anyhow::Error::new(error)
        .context("GET /healthz: nothing listens on PORT, nor on a service's default gRPC port"))
}

/// gRPC health of the process listening on `port` of this host.
async fn grpc_health(port: u16) -> anyhow::Result<()> {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://127.0.0.1:{port}"))?
        .connect_timeout(HEALTH_TIMEOUT)
        .timeout(HEALTH_TIMEOUT)
        .connect()
        .await
        .map_err(|error| {
            if refused(&error) {
                anyhow::Error::new(NotListening(port))
            } else {
                anyhow::Error::new(error).context("gRPC health: cannot connect")
            }
        })?;
    let answer = tonic_health::pb::health_client::HealthClient::new(channel)
        .check(tonic_health::pb::HealthCheckRequest {
            service: String::new(),
        })
        .await
        .context("gRPC health")?;
    anyhow::ensure!(answer.into_inner().status == 1, "gRPC health: not serving");
    Ok(())
}

/// `GET /healthz` on `port` of this host.
async fn http_health(port: u16) -> Result<(), HttpHealth> {
    let client = reqwest::Client::builder()
        .timeout(HEALTH_TIMEOUT)
        .build()
        .map_err(|e| HttpHealth::Failed(e.into()))?;
    let answer = client
        .get(format!("http://127.0.0.1:{port}/healthz"))
        .send()
        .await
        .map_err(|error| {
            if refused(&error) {
                HttpHealth::NotListening(error)
            } else {
                HttpHealth::Failed(anyhow::Error::new(error).context("GET /healthz"))
            }
        })?;
    if !answer.status().is_success() {
        return Err(HttpHealth::Failed(anyhow::anyhow!(
            "GET /healthz answered {}",
            answer.status()
        )));
    }
    Ok(())
}

/// Whether `error` is, at its root, a refused connection.
fn refused(error: &(dyn std::error::Error + 'static)) -> bool {
    let mut cause = Some(error);
    while let Some(e) = cause {
        if e.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::ConnectionRefused)
        {
            return true;
        }
        cause = e.source();
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A port nothing listens on (bound, then let go).
    fn closed_port() -> u16 {
        std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
    }

    #[tokio::test]
    async fn a_healthcheck_without_a_grpc_addr_finds_a_service_on_its_default_port() {
        let (reporter, service) = tonic_health::server::health_reporter();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(service)
                .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
        );
        let (http, other) = (closed_port(), closed_port());
        health_without_grpc_addr(http, &[other, port])
            .await
            .expect("the service on the second default port answers");
        reporter
            .set_service_status("", tonic_health::ServingStatus::NotServing)
            .await;
        assert!(
            health_without_grpc_addr(http, &[other, port])
                .await
                .is_err(),
            "a service not serving fails it"
        );
        assert!(
            health_without_grpc_addr(http, &[other]).await.is_err(),
            "nothing anywhere fails it"
        );
    }

    #[test]
    fn the_version_names_the_build_revision_when_the_build_set_one() {
        assert_eq!(version_line("0.1.0", ""), "0.1.0");
        assert_eq!(
            version_line("0.1.0", "7246985-dirty"),
            "0.1.0 (revision 7246985-dirty)"
        );
        use clap::CommandFactory as _;
        let shown = Cli::command().render_version();
        let expected = format!("orca-push {}", env!("CARGO_PKG_VERSION"));
        assert!(shown.starts_with(&expected), "{shown}");
    }
}
