//! OTLP export of traces and metrics, from the standard `OTEL_*` variables.

use super::{ConfigError, invalid};

/// What OTLP carries: each signal has its own exporter switch, endpoint and protocol variables.
#[derive(Clone, Copy)]
pub(super) enum Signal {
    Traces,
    Metrics,
}

impl Signal {
    /// `OTEL_TRACES_EXPORTER` / `OTEL_METRICS_EXPORTER`.
    fn exporter_variable(self) -> &'static str {
        match self {
            Self::Traces => "OTEL_TRACES_EXPORTER",
            Self::Metrics => "OTEL_METRICS_EXPORTER",
        }
    }

    fn endpoint_variable(self) -> &'static str {
        match self {
            Self::Traces => "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
            Self::Metrics => "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT",
        }
    }

    fn protocol_variable(self) -> &'static str {
        match self {
            Self::Traces => "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
            Self::Metrics => "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL",
        }
    }

    /// What OTLP/HTTP appends to the general endpoint.
    fn http_path(self) -> &'static str {
        match self {
            Self::Traces => "/v1/traces",
            Self::Metrics => "/v1/metrics",
        }
    }
}

/// Export of one signal from the standard variables: `OTEL_SDK_DISABLED`, the signal's exporter
/// switch, the endpoint and protocol (the signal's own variable first), and `ORCA_PUSH_CA_FILE` as
/// extra roots for an `https://` collector. Spans are exported whenever an endpoint is set
/// (`OTEL_TRACES_EXPORTER=none` turns that off); metrics only with `OTEL_METRICS_EXPORTER=otlp`,
/// since Prometheus is how they are read by default.
pub(super) fn otlp_export(
    get: &impl Fn(&str) -> Option<String>,
    signal: Signal,
) -> Result<Option<orca_push_telemetry::OtlpExport>, ConfigError> {
    use orca_push_telemetry::{OtlpExport, OtlpProtocol};
    match get("OTEL_SDK_DISABLED")
        .map(|v| v.trim().to_ascii_lowercase())
        .as_deref()
    {
        None | Some("false") | Some("") => {}
        Some("true") => return Ok(None),
        Some(_) => return Err(invalid("OTEL_SDK_DISABLED", "must be `true` or `false`")),
    }
    let (protocol_var, protocol) = match get(signal.protocol_variable()) {
        Some(value) => (signal.protocol_variable(), Some(value)),
        None => (
            "OTEL_EXPORTER_OTLP_PROTOCOL",
            get("OTEL_EXPORTER_OTLP_PROTOCOL"),
        ),
    };
    let protocol = match protocol.as_deref() {
        None | Some("grpc") => OtlpProtocol::Grpc,
        Some("http/protobuf") => OtlpProtocol::HttpProtobuf,
        Some(_) => {
            return Err(invalid(
                protocol_var,
                "must be `grpc` or `http/protobuf` (`http/json` is not supported)",
            ));
        }
    };
    let exporter = get(signal.exporter_variable()).map(|v| v.trim().to_ascii_lowercase());
    match (signal, exporter.as_deref()) {
        (_, Some("none")) => return Ok(None),
        (_, Some("otlp")) | (Signal::Traces, None) => {}
        (Signal::Metrics, None | Some("prometheus")) => return Ok(None),
        (Signal::Traces, Some(_)) => {
            return Err(invalid(
                "OTEL_TRACES_EXPORTER",
                "only `otlp` or `none` are supported",
            ));
        }
        (Signal::Metrics, Some(_)) => {
            return Err(invalid(
                "OTEL_METRICS_EXPORTER",
                "only `otlp`, `prometheus` or `none` are supported (Prometheus is always served)",
            ));
        }
    }
    // The signal's endpoint is used as given; the general one is a base URL, to which OTLP/HTTP
    // appends the signal's path.
    let (endpoint_var, endpoint) = match get(signal.endpoint_variable()) {
        Some(endpoint) => (signal.endpoint_variable(), endpoint),
        None => match get("OTEL_EXPORTER_OTLP_ENDPOINT") {
            Some(base) if protocol == OtlpProtocol::HttpProtobuf => (
                "OTEL_EXPORTER_OTLP_ENDPOINT",
                format!("{}{}", base.trim_end_matches('/'), signal.http_path()),
            ),
            Some(base) => ("OTEL_EXPORTER_OTLP_ENDPOINT", base),
            None if exporter.is_some() => {
                return Err(invalid(
                    "OTEL_EXPORTER_OTLP_ENDPOINT",
                    "required when an exporter variable asks for OTLP",
                ));
            }
            None => return Ok(None),
        },
    };
    if !(endpoint.starts_with("http://") || endpoint.starts_with("https://")) {
        return Err(invalid(endpoint_var, "must be an http:// or https:// URL"));
    }
    let extra_roots_pem = match get("ORCA_PUSH_CA_FILE") {
        Some(path) if endpoint.starts_with("https://") => Some(
            std::fs::read(&path)
                .map_err(|_| invalid("ORCA_PUSH_CA_FILE", "is not a readable file"))?,
        ),
        _ => None,
    };
    Ok(Some(OtlpExport {
        endpoint,
        protocol,
        extra_roots_pem,
    }))
}
