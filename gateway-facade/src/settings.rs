//! Every setting the gateway reads, as clap arguments backed by their environment variables, so
//! `orca-push serve --help` lists them all (with a flag of the same name for each). The values
//! reach [`crate::Config::from_lookup`], which validates them; nothing else reads the environment.

use clap::Args;

macro_rules! settings {
    ($( $(#[$secret:ident])? $field:ident = $var:literal : $help:literal; )+) => {
        /// The gateway's settings (environment variables, or flags of the same name).
        #[derive(Args, Default, Clone)]
        #[command(next_help_heading = "Settings (each an environment variable; README.md, Environment)")]
        pub struct Settings {
            $(
                #[arg(
                    long,
                    env = $var,
                    value_name = "VALUE",
                    help = $help,
                    hide_env_values = settings!(@secret $($secret)?),
                )]
                $field: Option<String>,
            )+
        }

        impl Settings {
            /// Every variable, in help order.
            pub const VARIABLES: &'static [&'static str] = &[$($var),+];

            /// The value of `variable`, if set (by its environment variable or its flag).
            pub fn get(&self, variable: &str) -> Option<String> {
                match variable {
                    $($var => self.$field.clone(),)+
                    _ => None,
                }
            }
        }
    };
    (@secret secret) => { true };
    (@secret) => { false };
}

settings! {
    port = "PORT": "Port of the public HTTP API [default: 8080]";
    public_url = "ORCA_PUSH_PUBLIC_URL": "Bare origin bound into challenge transcripts (required by split auth)";
    #[secret]
    database_url = "ORCA_PUSH_DATABASE_URL": "postgres:// URL; absent: SQLite files under ORCA_PUSH_DATA_DIR";
    data_dir = "ORCA_PUSH_DATA_DIR": "Folder of the SQLite files [default: ./data]";
    sqlite_synchronous = "ORCA_PUSH_SQLITE_SYNCHRONOUS": "SQLite durability: full or normal [default: full]";
    mode = "ORCA_PUSH_MODE": "serve or validation [default: serve]";
    trusted_proxy_hops = "ORCA_PUSH_TRUSTED_PROXY_HOPS": "Proxies appending to x-forwarded-for after the client [default: 0]";
    coalesce_ms = "ORCA_PUSH_COALESCE_MS": "Per-registration coalescing window in ms [default: 3000]";
    internal_transport = "ORCA_PUSH_INTERNAL_TRANSPORT": "in-process or loopback (all in one) [default: in-process]";
    grpc_addr = "ORCA_PUSH_GRPC_ADDR": "Listen address of a split service, or of the all-in-one internal listener";
    auth_url = "ORCA_PUSH_AUTH_URL": "Where split callers reach auth (comma-separated replicas)";
    registry_url = "ORCA_PUSH_REGISTRY_URL": "Where split callers reach the registry";
    queue_url = "ORCA_PUSH_QUEUE_URL": "Where split callers reach the queue";
    sender_url = "ORCA_PUSH_SENDER_URL": "Where split callers reach the sender";
    #[secret]
    internal_key = "ORCA_PUSH_INTERNAL_KEY": "Secret (32+ bytes) signing internal gRPC tokens; required in split mode";
    #[secret]
    apns_key = "ORCA_PUSH_APNS_KEY": "APNs token key (PEM text of the .p8)";
    apns_key_id = "ORCA_PUSH_APNS_KEY_ID": "APNs key id";
    apple_team_id = "ORCA_PUSH_APPLE_TEAM_ID": "Apple team id";
    apns_topic = "ORCA_PUSH_APNS_TOPIC": "apns-topic [default: com.stably.orca.mobile]";
    apns_url = "ORCA_PUSH_APNS_URL": "Replaces both APNs hosts";
    fcm_project_id = "ORCA_PUSH_FCM_PROJECT_ID": "FCM project [default: onorca-cloud]";
    fcm_url = "ORCA_PUSH_FCM_URL": "Replaces https://fcm.googleapis.com";
    ca_file = "ORCA_PUSH_CA_FILE": "Extra PEM roots for providers, token endpoints and an https OTLP collector";
    google_application_credentials = "GOOGLE_APPLICATION_CREDENTIALS": "FCM service-account JSON; absent: the GCE metadata server";
    gce_metadata_host = "GCE_METADATA_HOST": "Host of the GCE metadata server";
    lease_ms = "ORCA_PUSH_LEASE_MS": "Sender lease on a delivery batch in ms";
    retry_base_ms = "ORCA_PUSH_RETRY_BASE_MS": "First retry backoff in ms (doubles up to 30 s)";
    metrics_addr = "ORCA_PUSH_METRICS_ADDR": "Prometheus /metrics listener [default: 127.0.0.1:9464]";
    http_header_timeout_ms = "ORCA_PUSH_HTTP_HEADER_TIMEOUT_MS": "Time a client has to send request headers, in ms";
    http_idle_timeout_ms = "ORCA_PUSH_HTTP_IDLE_TIMEOUT_MS": "Idle keep-alive connection lifetime, in ms";
    http_max_connections = "ORCA_PUSH_HTTP_MAX_CONNECTIONS": "Open connections the public listener accepts";
    log_format = "ORCA_PUSH_LOG_FORMAT": "text or json [default: text]";
    otel_exporter_otlp_endpoint = "OTEL_EXPORTER_OTLP_ENDPOINT": "OTLP collector (base URL for http/protobuf)";
    otel_exporter_otlp_traces_endpoint = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "OTLP traces endpoint, used as given";
    otel_exporter_otlp_protocol = "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc or http/protobuf [default: grpc]";
    otel_exporter_otlp_traces_protocol = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc or http/protobuf, for traces";
    otel_exporter_otlp_metrics_endpoint = "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": "OTLP metrics endpoint, used as given";
    otel_exporter_otlp_metrics_protocol = "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL": "grpc or http/protobuf, for metrics";
    otel_metrics_exporter = "OTEL_METRICS_EXPORTER": "otlp: also export metrics by OTLP (Prometheus always serves) [default: prometheus]";
    otel_sdk_disabled = "OTEL_SDK_DISABLED": "true: export nothing by OTLP";
    otel_traces_exporter = "OTEL_TRACES_EXPORTER": "otlp or none [default: otlp]";
    otel_service_name = "OTEL_SERVICE_NAME": "service.name of exported spans";
}

/// Read by libraries themselves, not by the gateway's settings: named in `--help` after the list.
pub const LIBRARY_VARIABLES: &str = "Also read by libraries: RUST_LOG (log filter, default info), \
OTEL_EXPORTER_OTLP_HEADERS, OTEL_EXPORTER_OTLP_TIMEOUT, OTEL_EXPORTER_OTLP_COMPRESSION (gzip) and \
OTEL_METRIC_EXPORT_INTERVAL (ms between OTLP metric exports, default 60000).";

impl Settings {
    /// The validated config these settings make.
    pub fn config(&self) -> Result<crate::Config, crate::config::ConfigError> {
        crate::Config::from_lookup(|variable| self.get(variable))
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use super::*;

    /// The quoted variable names in the config's sources, as `Config::from_lookup` asks for them.
    fn read_by_config() -> BTreeSet<String> {
        const NOT_SETTINGS: [&str; 1] = ["ORCA_PUSH_FACADE_URL"];
        let sources = [
            include_str!("config.rs"),
            include_str!("config/exports.rs"),
            include_str!("config/readers.rs"),
            include_str!("connections.rs"),
        ]
        .join("\n");
        sources
            .split('"')
            .skip(1)
            .step_by(2)
            .filter(|s| {
                (s.starts_with("ORCA_PUSH_")
                    || s.starts_with("OTEL_")
                    || s.starts_with("GOOGLE_")
                    || s.starts_with("GCE_")
                    || *s == "PORT")
                    && s.chars()
                        .all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_')
            })
            .filter(|s| !NOT_SETTINGS.contains(s))
            .map(str::to_owned)
            .collect()
    }

    #[test]
    fn every_variable_the_config_reads_is_a_setting() {
        let settings: BTreeSet<String> =
            Settings::VARIABLES.iter().map(|v| v.to_string()).collect();
        assert_eq!(read_by_config(), settings);
    }

    #[test]
    fn serve_help_lists_every_variable_and_hides_secret_values() {
        use clap::CommandFactory as _;
        let mut cli = crate::cli::Cli::command();
        cli.build();
        let serve = cli.find_subcommand_mut("serve").expect("serve");
        let help = serve.render_long_help().to_string();
        for variable in Settings::VARIABLES {
            assert!(
                help.contains(&format!("[env: {variable}")),
                "{variable} in {help}"
            );
        }
        assert!(help.contains("RUST_LOG"));
        let hidden: Vec<&str> = serve
            .get_arguments()
            .filter(|a| a.is_hide_env_values_set())
            .filter_map(|a| a.get_env().and_then(|e| e.to_str()))
            .collect();
        assert_eq!(
            hidden,
            [
                "ORCA_PUSH_DATABASE_URL",
                "ORCA_PUSH_INTERNAL_KEY",
                "ORCA_PUSH_APNS_KEY"
            ]
        );
    }

    #[test]
    fn flags_and_variables_reach_the_config_alike() {
        use clap::Parser as _;
        #[derive(clap::Parser)]
        struct Probe {
            #[command(flatten)]
            settings: Settings,
        }
        let probe =
            Probe::try_parse_from(["probe", "--coalesce-ms", "250", "--log-format", "json"])
                .unwrap();
        let config = probe.settings.config().unwrap();
        assert_eq!(config.queue.coalesce_ms, 250);
        assert_eq!(
            config.common.telemetry.log_format,
            orca_push_telemetry::LogFormat::Json
        );
    }
}
