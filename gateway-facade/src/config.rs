//! The environment, read once into a typed, validated config. A bad setting is an error naming its
//! variable; nothing else in the gateway reads the environment.

use std::net::SocketAddr;
use std::path::PathBuf;

use orca_push_storage::{DatabaseConfig, SqliteDurability};

pub use crate::connections::HttpLimits;
use exports::{Signal, otlp_export};
use readers::{http_limits, provider_settings, validate_origin};

mod exports;
mod readers;

/// The per-registration coalescing window when `ORCA_PUSH_COALESCE_MS` is not set.
pub const DEFAULT_COALESCE_MS: u64 = 3000;

/// A misconfiguration, reported as one line naming the variable.
#[derive(Debug, thiserror::Error)]
#[error("{variable}: {reason}")]
pub struct ConfigError {
    pub variable: &'static str,
    pub reason: String,
}

fn invalid(variable: &'static str, reason: impl Into<String>) -> ConfigError {
    ConfigError {
        variable,
        reason: reason.into(),
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Serve,
    /// Inert: migrates nothing, writes nothing, answers health and 503 `validation_only` on `/v1`.
    Validation,
}

impl Mode {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Serve => "serve",
            Self::Validation => "validation",
        }
    }
}

/// How the services of `orca-push serve` reach each other (`ORCA_PUSH_INTERNAL_TRANSPORT`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InternalTransport {
    /// Clients call the generated servers as tower services: no sockets, the same layers.
    InProcess,
    /// Each service on a kernel-chosen loopback port, over HTTP/2, as split mode runs them; for
    /// testing the network path in one process.
    Loopback,
}

/// The services a process can run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ServiceName {
    Facade,
    Auth,
    Registry,
    Queue,
    Sender,
}

impl ServiceName {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Facade => "facade",
            Self::Auth => "auth",
            Self::Registry => "registry",
            Self::Queue => "queue",
            Self::Sender => "sender",
        }
    }

    /// The port a split-mode service listens on when `ORCA_PUSH_GRPC_ADDR` is absent.
    pub fn default_grpc_port(self) -> u16 {
        match self {
            Self::Facade => 0,
            Self::Auth => 50051,
            Self::Registry => 50052,
            Self::Queue => 50053,
            Self::Sender => 50054,
        }
    }

    fn url_variable(self) -> &'static str {
        match self {
            Self::Facade => "ORCA_PUSH_FACADE_URL",
            Self::Auth => "ORCA_PUSH_AUTH_URL",
            Self::Registry => "ORCA_PUSH_REGISTRY_URL",
            Self::Queue => "ORCA_PUSH_QUEUE_URL",
            Self::Sender => "ORCA_PUSH_SENDER_URL",
        }
    }
}

/// Where split-mode callers reach each service; `None` means in this process.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ServiceUrls {
    pub auth: Option<String>,
    pub registry: Option<String>,
    pub queue: Option<String>,
    pub sender: Option<String>,
}

/// Provider settings, read with the rest (`ORCA_PUSH_APNS_*`, `ORCA_PUSH_FCM_*`, ...).
pub type ProviderSettings = orca_push_sender::ProviderConfig;

/// Every setting, grouped by the role that reads it: what every process needs, then the facade's,
/// auth's, the queue's and the sender's. A process reads only its own groups; [`Config::check_role`]
/// says what each role cannot start without.
#[derive(Debug, Clone)]
pub struct Config {
    pub common: CommonSettings,
    pub facade: FacadeSettings,
    pub auth: AuthSettings,
    pub queue: QueueSettings,
    pub sender: SenderRoleSettings,
}

/// What every process reads: storage, mode, how services reach each other, telemetry.
#[derive(Debug, Clone)]
pub struct CommonSettings {
    pub database: DatabaseConfig,
    pub mode: Mode,
    /// How the services of one process reach each other.
    pub internal_transport: InternalTransport,
    /// Where split-mode callers (the facade, auth, the sender) reach the others.
    pub service_urls: ServiceUrls,
    /// Listen address of a split-mode gRPC service, or of the all-in-one internal listener.
    pub grpc_addr: Option<SocketAddr>,
    /// Signs and checks internal gRPC tokens; required in split mode.
    pub internal_key: Option<orca_push_internal_auth::InternalKey>,
    /// Where `/metrics` is served.
    pub metrics_addr: SocketAddr,
    pub telemetry: TelemetrySettings,
}

/// Logs, spans and metrics beyond Prometheus.
#[derive(Debug, Clone)]
pub struct TelemetrySettings {
    /// Where spans are exported, from the standard `OTEL_*` variables; None: no export.
    pub otlp: Option<orca_push_telemetry::OtlpExport>,
    /// Where metrics are also exported (`OTEL_METRICS_EXPORTER=otlp`); Prometheus always serves.
    pub otlp_metrics: Option<orca_push_telemetry::OtlpExport>,
    /// `OTEL_SERVICE_NAME`, if set, names the service in exported spans.
    pub otel_service_name: Option<String>,
    /// `ORCA_PUSH_LOG_FORMAT`: `text` (default) or `json` (one object per line, with trace ids).
    pub log_format: orca_push_telemetry::LogFormat,
}

/// The public HTTP API's.
#[derive(Debug, Clone)]
pub struct FacadeSettings {
    pub port: u16,
    pub trusted_proxy_hops: usize,
    /// Header and idle timeouts and the connection cap of the public listener.
    pub http: HttpLimits,
}

/// The auth service's.
#[derive(Debug, Clone)]
pub struct AuthSettings {
    /// The bare origin bound into challenge transcripts; `None` means `http://127.0.0.1:<port>` of
    /// the port actually bound (so `PORT=0` works).
    pub public_url: Option<String>,
}

/// The queue's.
#[derive(Debug, Clone)]
pub struct QueueSettings {
    pub coalesce_ms: u64,
}

/// The sender's.
#[derive(Debug, Clone)]
pub struct SenderRoleSettings {
    pub providers: ProviderSettings,
    /// Lease on a batch (`ORCA_PUSH_LEASE_MS`).
    pub lease_ms: u32,
    /// The first retry's backoff (`ORCA_PUSH_RETRY_BASE_MS`); it doubles up to 30 s.
    pub retry_base_ms: u32,
}

impl Config {
    /// What a sender instance of this process is told.
    pub fn sender_settings(&self) -> orca_push_sender::SenderSettings {
        orca_push_sender::SenderSettings {
            instance: crate::topology::instance_name("sender"),
            lease_ms: self.sender.lease_ms,
            backoff: orca_push_sender::verdict::Backoff {
                base: std::time::Duration::from_millis(u64::from(self.sender.retry_base_ms)),
                cap: orca_push_sender::verdict::BACKOFF_CAP,
            },
        }
    }

    pub fn from_env() -> Result<Self, ConfigError> {
        Self::from_lookup(|name| std::env::var(name).ok())
    }

    /// Reads every setting through `lookup`, so tests never touch the process environment.
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<Self, ConfigError> {
        let get = |name: &str| lookup(name).filter(|v| !v.is_empty());
        let port = match get("PORT") {
            Some(v) => v
                .parse::<u16>()
                .map_err(|_| invalid("PORT", "must be a port number 0-65535"))?,
            None => 8080,
        };
        let public_url = match get("ORCA_PUSH_PUBLIC_URL") {
            Some(v) => Some(validate_origin(&v).map_err(|r| invalid("ORCA_PUSH_PUBLIC_URL", r))?),
            None => None,
        };
        let database = match get("ORCA_PUSH_DATABASE_URL") {
            Some(url) => {
                if !(url.starts_with("postgres://") || url.starts_with("postgresql://")) {
                    return Err(invalid(
                        "ORCA_PUSH_DATABASE_URL",
                        "must be a postgres:// URL (leave it unset for SQLite)",
                    ));
                }
                orca_push_storage::check_postgres_url(&url).map_err(|reason| {
                    invalid(
                        "ORCA_PUSH_DATABASE_URL",
                        format!("cannot be read as a PostgreSQL URL: {reason}"),
                    )
                })?;
                DatabaseConfig::Postgres { url: url.into() }
            }
            None => DatabaseConfig::Sqlite {
                data_dir: PathBuf::from(
                    get("ORCA_PUSH_DATA_DIR").unwrap_or_else(|| "./data".into()),
                ),
                durability: match get("ORCA_PUSH_SQLITE_SYNCHRONOUS").as_deref() {
                    None | Some("full") => SqliteDurability::Full,
                    Some("normal") => SqliteDurability::Normal,
                    Some(_) => {
                        return Err(invalid(
                            "ORCA_PUSH_SQLITE_SYNCHRONOUS",
                            "must be `full` or `normal`",
                        ));
                    }
                },
            },
        };
        let mode = match get("ORCA_PUSH_MODE").as_deref() {
            None | Some("serve") => Mode::Serve,
            Some("validation") => Mode::Validation,
            Some(_) => return Err(invalid("ORCA_PUSH_MODE", "must be `serve` or `validation`")),
        };
        let trusted_proxy_hops = match get("ORCA_PUSH_TRUSTED_PROXY_HOPS") {
            Some(v) => v
                .parse::<usize>()
                .ok()
                .filter(|n| *n <= 16)
                .ok_or_else(|| {
                    invalid(
                        "ORCA_PUSH_TRUSTED_PROXY_HOPS",
                        "must be a whole number 0-16",
                    )
                })?,
            None => 0,
        };
        let coalesce_ms = match get("ORCA_PUSH_COALESCE_MS") {
            Some(v) => v
                .parse::<u64>()
                .ok()
                .filter(|n| *n <= 60_000)
                .ok_or_else(|| invalid("ORCA_PUSH_COALESCE_MS", "must be milliseconds 0-60000"))?,
            None => DEFAULT_COALESCE_MS,
        };
        let internal_transport = match get("ORCA_PUSH_INTERNAL_TRANSPORT").as_deref() {
            None | Some("in-process") => InternalTransport::InProcess,
            Some("loopback") => InternalTransport::Loopback,
            Some(_) => {
                return Err(invalid(
                    "ORCA_PUSH_INTERNAL_TRANSPORT",
                    "must be `in-process` or `loopback`",
                ));
            }
        };
        let service_url = |service: ServiceName| -> Result<Option<String>, ConfigError> {
            let variable = service.url_variable();
            get(variable)
                .map(|v| {
                    // The services speak gRPC in the clear (TLS between them is a mesh's job): an
                    // https:// URL would be accepted here and then fail at every call.
                    if v.starts_with("http://") {
                        Ok(v.trim_end_matches('/').to_owned())
                    } else {
                        Err(invalid(
                            variable,
                            "must be an http:// URL (services speak gRPC without TLS)",
                        ))
                    }
                })
                .transpose()
        };
        let service_urls = ServiceUrls {
            auth: service_url(ServiceName::Auth)?,
            registry: service_url(ServiceName::Registry)?,
            queue: service_url(ServiceName::Queue)?,
            sender: service_url(ServiceName::Sender)?,
        };
        let grpc_addr = get("ORCA_PUSH_GRPC_ADDR")
            .map(|v| {
                v.parse::<SocketAddr>().map_err(|_| {
                    invalid(
                        "ORCA_PUSH_GRPC_ADDR",
                        "must be an address like 0.0.0.0:50051",
                    )
                })
            })
            .transpose()?;
        let providers = provider_settings(&get)?;
        let metrics_addr = match get("ORCA_PUSH_METRICS_ADDR") {
            Some(v) => v.parse::<SocketAddr>().map_err(|_| {
                invalid(
                    "ORCA_PUSH_METRICS_ADDR",
                    "must be an address like 127.0.0.1:9464",
                )
            })?,
            None => SocketAddr::from(([127, 0, 0, 1], 9464)),
        };
        let otlp = otlp_export(&get, Signal::Traces)?;
        let otlp_metrics = otlp_export(&get, Signal::Metrics)?;
        let otel_service_name = get("OTEL_SERVICE_NAME");
        let log_format = match get("ORCA_PUSH_LOG_FORMAT").as_deref() {
            None | Some("text") => orca_push_telemetry::LogFormat::Text,
            Some("json") => orca_push_telemetry::LogFormat::Json,
            Some(_) => return Err(invalid("ORCA_PUSH_LOG_FORMAT", "must be `text` or `json`")),
        };
        let internal_key = get("ORCA_PUSH_INTERNAL_KEY")
            .map(|secret| {
                orca_push_internal_auth::InternalKey::from_secret(&secret)
                    .map_err(|e| invalid("ORCA_PUSH_INTERNAL_KEY", e.to_string()))
            })
            .transpose()?;
        let lease_ms = match get("ORCA_PUSH_LEASE_MS") {
            Some(v) => v
                .parse::<u32>()
                .ok()
                .filter(|n| (1_000..=300_000).contains(n))
                .ok_or_else(|| invalid("ORCA_PUSH_LEASE_MS", "must be milliseconds 1000-300000"))?,
            None => orca_push_sender::lane::DEFAULT_LEASE_MS,
        };
        let retry_base_ms = match get("ORCA_PUSH_RETRY_BASE_MS") {
            Some(v) => v
                .parse::<u32>()
                .ok()
                .filter(|n| (10..=30_000).contains(n))
                .ok_or_else(|| {
                    invalid("ORCA_PUSH_RETRY_BASE_MS", "must be milliseconds 10-30000")
                })?,
            None => 1_000,
        };
        let http = http_limits(&get)?;
        Ok(Self {
            common: CommonSettings {
                database,
                mode,
                internal_transport,
                service_urls,
                grpc_addr,
                internal_key,
                metrics_addr,
                telemetry: TelemetrySettings {
                    otlp,
                    otlp_metrics,
                    otel_service_name,
                    log_format,
                },
            },
            facade: FacadeSettings {
                port,
                trusted_proxy_hops,
                http,
            },
            auth: AuthSettings { public_url },
            queue: QueueSettings { coalesce_ms },
            sender: SenderRoleSettings {
                providers,
                lease_ms,
                retry_base_ms,
            },
        })
    }

    /// The origin challenges are bound to, given the facade's bound port.
    pub fn gateway_origin(&self, bound_port: u16) -> String {
        self.auth
            .public_url
            .clone()
            .unwrap_or_else(|| format!("http://127.0.0.1:{bound_port}"))
    }

    /// Everything a process of `role` (`None`: all in one) needs beyond valid values, checked
    /// before it binds or migrates anything: a misconfiguration costs one line, not a half-started
    /// service.
    pub fn check_role(&self, role: Option<ServiceName>) -> Result<(), ConfigError> {
        let Some(service) = role else {
            // The internal listener is for callers outside the process: they need a known key.
            if self.common.grpc_addr.is_some()
                && self.common.mode == Mode::Serve
                && self.common.internal_key.is_none()
            {
                return Err(invalid(
                    "ORCA_PUSH_INTERNAL_KEY",
                    "required with ORCA_PUSH_GRPC_ADDR: internal callers need tokens signed with a known key",
                ));
            }
            return Ok(());
        };
        self.require_internal_key()?;
        if self.common.mode == Mode::Validation && service != ServiceName::Facade {
            return Err(invalid(
                "ORCA_PUSH_MODE",
                "validation runs the facade only (use --service facade)",
            ));
        }
        let needs: &[ServiceName] = match service {
            ServiceName::Facade if self.common.mode == Mode::Validation => &[],
            ServiceName::Facade => &[
                ServiceName::Auth,
                ServiceName::Registry,
                ServiceName::Queue,
                ServiceName::Sender,
            ],
            ServiceName::Auth => {
                self.require_public_url()?;
                &[ServiceName::Registry]
            }
            ServiceName::Sender => &[ServiceName::Queue, ServiceName::Registry],
            ServiceName::Registry | ServiceName::Queue => &[],
        };
        for needed in needs {
            self.require_url(*needed)?;
        }
        Ok(())
    }

    /// Split-mode processes must share the key that signs their calls to each other.
    pub fn require_internal_key(
        &self,
    ) -> Result<orca_push_internal_auth::InternalKey, ConfigError> {
        self.common.internal_key.clone().ok_or_else(|| {
            invalid(
                "ORCA_PUSH_INTERNAL_KEY",
                "required in split mode: the secret (32+ bytes) every service signs its gRPC calls with",
            )
        })
    }

    /// A split-mode auth service cannot know the facade's port: the origin must be configured.
    pub fn require_public_url(&self) -> Result<String, ConfigError> {
        self.auth.public_url.clone().ok_or_else(|| {
            invalid(
                "ORCA_PUSH_PUBLIC_URL",
                "required by the auth service in split mode: the facade's public origin",
            )
        })
    }

    /// The URL a split-mode caller uses for `service`, or an error naming the variable to set.
    pub fn require_url(&self, service: ServiceName) -> Result<String, ConfigError> {
        let url = match service {
            ServiceName::Auth => &self.common.service_urls.auth,
            ServiceName::Registry => &self.common.service_urls.registry,
            ServiceName::Queue => &self.common.service_urls.queue,
            ServiceName::Sender => &self.common.service_urls.sender,
            ServiceName::Facade => &None,
        };
        url.clone().ok_or_else(|| {
            invalid(
                service.url_variable(),
                "required in split mode: where this process reaches the service",
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A throwaway P-256 PKCS#8 key, as Apple's .p8 files are.
    const TEST_P256_KEY: &str = "-----BEGIN PRIVATE KEY-----\nMIGHAgEAMBMGByqGSM49AgEGCCqGSM49AwEHBG0wawIBAQQg6dNQ8X84qPo1BxlK\ngFH0Z34kOxwVikgR4NUgpwAV//KhRANCAARQA2m7JDnBr47v9BnUH9fkzLtBpAfd\nioa+4Tfn7lMVaSaiftdkd9n91vEKQZDVXCcOLn4hCEvXtW3j9td0r8lf\n-----END PRIVATE KEY-----";

    fn config(vars: &[(&str, &str)]) -> Result<Config, ConfigError> {
        let vars: Vec<(String, String)> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Config::from_lookup(move |name| {
            vars.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone())
        })
    }

    #[test]
    fn defaults_are_the_embedded_sqlite_gateway() {
        let c = config(&[]).unwrap();
        assert_eq!(c.facade.port, 8080);
        assert_eq!(c.auth.public_url, None);
        assert_eq!(c.gateway_origin(8080), "http://127.0.0.1:8080");
        assert!(matches!(
            &c.common.database,
            DatabaseConfig::Sqlite {
                data_dir,
                durability: SqliteDurability::Full,
            } if data_dir == std::path::Path::new("./data")
        ));
        assert_eq!(c.common.mode, Mode::Serve);
        assert_eq!(c.facade.trusted_proxy_hops, 0);
        assert_eq!(c.queue.coalesce_ms, 3000);
        assert_eq!(c.common.internal_transport, InternalTransport::InProcess);
        assert_eq!(c.common.service_urls, ServiceUrls::default());
        assert_eq!(
            c.facade.http,
            HttpLimits {
                header_read_timeout: std::time::Duration::from_secs(10),
                idle_timeout: std::time::Duration::from_secs(30),
                max_connections: 1024,
            }
        );
    }

    #[test]
    fn http_limits_are_read_and_bounded() {
        let c = config(&[
            ("ORCA_PUSH_HTTP_HEADER_TIMEOUT_MS", "500"),
            ("ORCA_PUSH_HTTP_IDLE_TIMEOUT_MS", "750"),
            ("ORCA_PUSH_HTTP_MAX_CONNECTIONS", "2"),
        ])
        .unwrap();
        assert_eq!(
            c.facade.http,
            HttpLimits {
                header_read_timeout: std::time::Duration::from_millis(500),
                idle_timeout: std::time::Duration::from_millis(750),
                max_connections: 2,
            }
        );
    }

    #[test]
    fn a_database_url_sqlx_cannot_read_stops_start_up_naming_its_variable() {
        // Credentials with an empty host (a Unix socket given only as `?host=`): URLs cannot
        // have them, and before this check the gateway started and failed at its first connect.
        let error = config(&[(
            "ORCA_PUSH_DATABASE_URL",
            "postgres://orca:hunter2@/orca?host=/cloudsql/project:region:db",
        )])
        .unwrap_err();
        assert_eq!(error.variable, "ORCA_PUSH_DATABASE_URL");
        assert!(!error.reason.contains("hunter2"), "{}", error.reason);
        for url in [
            "postgres://orca:hunter2@localhost/orca?host=/cloudsql/project:region:db",
            "postgres://orca@%2Fvar%2Frun%2Fpostgresql/orca",
        ] {
            config(&[("ORCA_PUSH_DATABASE_URL", url)]).unwrap();
        }
    }

    #[test]
    fn debug_output_never_shows_a_secret() {
        let c = config(&[
            ("ORCA_PUSH_DATABASE_URL", "postgres://orca:hunter2@db/orca"),
            (
                "ORCA_PUSH_INTERNAL_KEY",
                "a-key-of-at-least-32-bytes-SECRETSECRET",
            ),
        ])
        .unwrap();
        let shown = format!("{c:?}");
        assert!(!shown.contains("hunter2"), "{shown}");
        assert!(!shown.contains("SECRETSECRET"), "{shown}");
    }

    #[test]
    fn sqlite_durability_and_the_internal_transport_can_be_chosen() {
        let c = config(&[
            ("ORCA_PUSH_SQLITE_SYNCHRONOUS", "normal"),
            ("ORCA_PUSH_INTERNAL_TRANSPORT", "loopback"),
        ])
        .unwrap();
        assert!(matches!(
            c.common.database,
            DatabaseConfig::Sqlite {
                durability: SqliteDurability::Normal,
                ..
            }
        ));
        assert_eq!(c.common.internal_transport, InternalTransport::Loopback);
    }

    #[test]
    fn span_export_follows_the_standard_variables() {
        use orca_push_telemetry::OtlpProtocol;
        let export = |vars: &[(&str, &str)]| config(vars).unwrap().common.telemetry.otlp;
        assert!(export(&[]).is_none());
        let grpc = export(&[("OTEL_EXPORTER_OTLP_ENDPOINT", "https://collector:4317")]).unwrap();
        assert_eq!(grpc.protocol, OtlpProtocol::Grpc);
        assert_eq!(grpc.endpoint, "https://collector:4317");
        let http = export(&[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318/"),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"),
        ])
        .unwrap();
        assert_eq!(http.protocol, OtlpProtocol::HttpProtobuf);
        assert_eq!(http.endpoint, "http://collector:4318/v1/traces");
        let traces = export(&[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://ignored:4318"),
            (
                "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
                "http://collector:4318/custom",
            ),
            ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf"),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"),
        ])
        .unwrap();
        assert_eq!(traces.endpoint, "http://collector:4318/custom");
        assert_eq!(traces.protocol, OtlpProtocol::HttpProtobuf);
        for off in [
            ("OTEL_SDK_DISABLED", "TRUE"),
            ("OTEL_TRACES_EXPORTER", "none"),
        ] {
            assert!(export(&[("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4317"), off]).is_none());
        }
    }

    #[test]
    fn each_role_needs_its_own_settings_before_it_starts() {
        let key = (
            "ORCA_PUSH_INTERNAL_KEY",
            "a-key-of-at-least-32-bytes-0123456789",
        );
        let missing = |vars: &[(&str, &str)], role| {
            config(vars)
                .unwrap()
                .check_role(role)
                .err()
                .map(|e| e.variable)
        };
        assert_eq!(missing(&[], None), None);
        assert_eq!(
            missing(&[("ORCA_PUSH_GRPC_ADDR", "127.0.0.1:50051")], None),
            Some("ORCA_PUSH_INTERNAL_KEY")
        );
        for role in [ServiceName::Registry, ServiceName::Queue] {
            assert_eq!(missing(&[], Some(role)), Some("ORCA_PUSH_INTERNAL_KEY"));
            assert_eq!(missing(&[key], Some(role)), None);
        }
        assert_eq!(
            missing(&[key], Some(ServiceName::Auth)),
            Some("ORCA_PUSH_PUBLIC_URL")
        );
        assert_eq!(
            missing(
                &[key, ("ORCA_PUSH_PUBLIC_URL", "https://push.example.com")],
                Some(ServiceName::Auth)
            ),
            Some("ORCA_PUSH_REGISTRY_URL")
        );
        assert_eq!(
            missing(
                &[key, ("ORCA_PUSH_QUEUE_URL", "http://q")],
                Some(ServiceName::Sender)
            ),
            Some("ORCA_PUSH_REGISTRY_URL")
        );
        let facade = [
            key,
            ("ORCA_PUSH_AUTH_URL", "http://a"),
            ("ORCA_PUSH_REGISTRY_URL", "http://r"),
            ("ORCA_PUSH_QUEUE_URL", "http://q"),
        ];
        assert_eq!(
            missing(&facade, Some(ServiceName::Facade)),
            Some("ORCA_PUSH_SENDER_URL")
        );
        assert_eq!(
            missing(
                &[key, ("ORCA_PUSH_MODE", "validation")],
                Some(ServiceName::Facade)
            ),
            None
        );
        assert_eq!(
            missing(
                &[key, ("ORCA_PUSH_MODE", "validation")],
                Some(ServiceName::Queue)
            ),
            Some("ORCA_PUSH_MODE")
        );
    }

    #[test]
    fn every_bad_setting_names_its_variable() {
        for (var, value) in [
            ("PORT", "http"),
            ("ORCA_PUSH_PUBLIC_URL", "https://push.example.com/"),
            ("ORCA_PUSH_PUBLIC_URL", "https://push.example.com/v1"),
            ("ORCA_PUSH_PUBLIC_URL", "http://push.example.com"),
            ("ORCA_PUSH_PUBLIC_URL", "push.example.com"),
            ("ORCA_PUSH_PUBLIC_URL", "https://push.example.com:99999"),
            // Not as hosts write an origin into their check of the transcript: every login
            // would be refused.
            ("ORCA_PUSH_PUBLIC_URL", "https://push.example.com:443"),
            ("ORCA_PUSH_PUBLIC_URL", "https://Push.Example.com"),
            ("ORCA_PUSH_PUBLIC_URL", "http://[0:0::1]:8080"),
            (
                "ORCA_PUSH_DATABASE_URL",
                "postgres://orca:pw@/orca?host=/run/db",
            ),
            ("ORCA_PUSH_DATABASE_URL", "mysql://x"),
            ("ORCA_PUSH_MODE", "staging"),
            ("ORCA_PUSH_TRUSTED_PROXY_HOPS", "-1"),
            ("ORCA_PUSH_COALESCE_MS", "soon"),
            ("ORCA_PUSH_AUTH_URL", "auth:50051"),
            ("ORCA_PUSH_QUEUE_URL", "https://queue.example.com"),
            ("ORCA_PUSH_GRPC_ADDR", "everywhere"),
            ("ORCA_PUSH_APNS_URL", "api.push.apple.com"),
            ("ORCA_PUSH_CA_FILE", "/no/such/file.pem"),
            ("GOOGLE_APPLICATION_CREDENTIALS", "/no/such/sa.json"),
            ("ORCA_PUSH_INTERNAL_KEY", "too-short"),
            ("ORCA_PUSH_METRICS_ADDR", "everywhere"),
            ("ORCA_PUSH_HTTP_HEADER_TIMEOUT_MS", "0"),
            ("ORCA_PUSH_HTTP_HEADER_TIMEOUT_MS", "soon"),
            ("ORCA_PUSH_HTTP_IDLE_TIMEOUT_MS", "3600001"),
            ("ORCA_PUSH_HTTP_MAX_CONNECTIONS", "0"),
            ("ORCA_PUSH_HTTP_MAX_CONNECTIONS", "-5"),
            ("ORCA_PUSH_SQLITE_SYNCHRONOUS", "off"),
            ("ORCA_PUSH_INTERNAL_TRANSPORT", "tcp"),
            ("ORCA_PUSH_LOG_FORMAT", "xml"),
            ("OTEL_SDK_DISABLED", "maybe"),
            ("OTEL_METRICS_EXPORTER", "statsd"),
            ("OTEL_EXPORTER_OTLP_METRICS_PROTOCOL", "http/json"),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json"),
            ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "thrift"),
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "collector:4317"),
        ] {
            let err = config(&[(var, value)]).expect_err(value);
            assert_eq!(err.variable, var, "{value}");
            assert!(err.to_string().starts_with(var));
        }
    }

    #[test]
    fn apns_credentials_come_as_three_or_not_at_all() {
        assert_eq!(
            config(&[("ORCA_PUSH_APNS_KEY_ID", "K")])
                .unwrap_err()
                .variable,
            "ORCA_PUSH_APNS_KEY"
        );
        let partial = config(&[("ORCA_PUSH_APNS_KEY", "x"), ("ORCA_PUSH_APNS_KEY_ID", "K")]);
        assert_eq!(partial.unwrap_err().variable, "ORCA_PUSH_APPLE_TEAM_ID");
        let not_pem = config(&[
            ("ORCA_PUSH_APNS_KEY", "x"),
            ("ORCA_PUSH_APNS_KEY_ID", "K"),
            ("ORCA_PUSH_APPLE_TEAM_ID", "T"),
        ]);
        assert_eq!(not_pem.unwrap_err().variable, "ORCA_PUSH_APNS_KEY");
        let escaped = TEST_P256_KEY.replace('\n', "\\n");
        let c = config(&[
            ("ORCA_PUSH_APNS_KEY", escaped.as_str()),
            ("ORCA_PUSH_APNS_KEY_ID", "K"),
            ("ORCA_PUSH_APPLE_TEAM_ID", "T"),
        ])
        .unwrap();
        let apns = c.sender.providers.apns.unwrap();
        assert_eq!(
            secrecy::ExposeSecret::expose_secret(&apns.key_pem),
            TEST_P256_KEY
        );
        assert!(!format!("{apns:?}").contains("MIGH"), "Debug hides the key");
        // A PEM that is no signing key stops start-up, naming the variable.
        let broken = config(&[
            (
                "ORCA_PUSH_APNS_KEY",
                "-----BEGIN PRIVATE KEY-----\nabc\n-----END PRIVATE KEY-----",
            ),
            ("ORCA_PUSH_APNS_KEY_ID", "K"),
            ("ORCA_PUSH_APPLE_TEAM_ID", "T"),
        ]);
        assert_eq!(broken.unwrap_err().variable, "ORCA_PUSH_APNS_KEY");
        assert!(config(&[]).unwrap().sender.providers.apns.is_none());
    }

    #[test]
    fn origins_on_loopback_may_be_http() {
        for ok in [
            "https://push.onorca.dev",
            "https://push.onorca.dev:8443",
            "http://127.0.0.1:8080",
            "http://localhost:3000",
            "http://[::1]:8080",
        ] {
            assert_eq!(
                config(&[("ORCA_PUSH_PUBLIC_URL", ok)])
                    .unwrap()
                    .gateway_origin(1),
                ok
            );
        }
    }

    #[test]
    fn split_mode_names_the_missing_service_url() {
        let c = config(&[]).unwrap();
        assert_eq!(
            c.require_url(ServiceName::Auth).unwrap_err().variable,
            "ORCA_PUSH_AUTH_URL"
        );
        let c = config(&[("ORCA_PUSH_AUTH_URL", "http://auth:50051/")]).unwrap();
        assert_eq!(
            c.require_url(ServiceName::Auth).unwrap(),
            "http://auth:50051"
        );
    }
}
