//! Settings read from several variables at once: the HTTP limits, the providers' credentials,
//! the public origin.

use std::path::PathBuf;

use super::{ConfigError, HttpLimits, ProviderSettings, invalid};

pub(super) fn http_limits(
    get: &impl Fn(&str) -> Option<String>,
) -> Result<HttpLimits, ConfigError> {
    let defaults = HttpLimits::default();
    let number = |variable: &'static str, range: std::ops::RangeInclusive<u64>, unit: &str| {
        get(variable)
            .map(|v| {
                v.parse::<u64>()
                    .ok()
                    .filter(|n| range.contains(n))
                    .ok_or_else(|| {
                        invalid(
                            variable,
                            format!("must be {unit} {}-{}", range.start(), range.end()),
                        )
                    })
            })
            .transpose()
    };
    let ms = |n: u64| std::time::Duration::from_millis(n);
    Ok(HttpLimits {
        header_read_timeout: number(
            "ORCA_PUSH_HTTP_HEADER_TIMEOUT_MS",
            100..=300_000,
            "milliseconds",
        )?
        .map_or(defaults.header_read_timeout, ms),
        idle_timeout: number(
            "ORCA_PUSH_HTTP_IDLE_TIMEOUT_MS",
            100..=3_600_000,
            "milliseconds",
        )?
        .map_or(defaults.idle_timeout, ms),
        max_connections: number(
            "ORCA_PUSH_HTTP_MAX_CONNECTIONS",
            1..=1_000_000,
            "a whole number",
        )?
        .map_or(defaults.max_connections, |n| n as usize),
    })
}

pub(super) fn provider_settings(
    get: &impl Fn(&str) -> Option<String>,
) -> Result<ProviderSettings, ConfigError> {
    use orca_push_sender::fcm::TokenSource;
    let source = match get("GOOGLE_APPLICATION_CREDENTIALS") {
        Some(path) => {
            let path = PathBuf::from(path);
            if !path.is_file() {
                return Err(invalid(
                    "GOOGLE_APPLICATION_CREDENTIALS",
                    "is not a readable file",
                ));
            }
            TokenSource::ServiceAccountFile(path)
        }
        None => TokenSource::Metadata {
            host: get("GCE_METADATA_HOST").unwrap_or_else(|| "metadata.google.internal".into()),
        },
    };
    let mut settings = ProviderSettings::new(source);
    let apns = [
        ("ORCA_PUSH_APNS_KEY", get("ORCA_PUSH_APNS_KEY")),
        ("ORCA_PUSH_APNS_KEY_ID", get("ORCA_PUSH_APNS_KEY_ID")),
        ("ORCA_PUSH_APPLE_TEAM_ID", get("ORCA_PUSH_APPLE_TEAM_ID")),
    ];
    if apns.iter().any(|(_, v)| v.is_some()) {
        if let Some((missing, _)) = apns.iter().find(|(_, v)| v.is_none()) {
            return Err(invalid(
                missing,
                "APNs needs the key, its key id and the team id together",
            ));
        }
        let [key, key_id, team_id] = apns.map(|(_, v)| v.unwrap_or_default());
        // Secret managers sometimes hand a PEM over with escaped newlines.
        let key_pem = if key.contains('\n') {
            key
        } else {
            key.replace("\\n", "\n")
        };
        if !key_pem.contains("-----BEGIN PRIVATE KEY-----") {
            return Err(invalid(
                "ORCA_PUSH_APNS_KEY",
                "must be the .p8 key's PEM text (BEGIN PRIVATE KEY)",
            ));
        }
        orca_push_sender::apns::check_key(&key_pem)
            .map_err(|reason| invalid("ORCA_PUSH_APNS_KEY", reason))?;
        settings.apns = Some(orca_push_sender::ApnsCredentials {
            key_pem: key_pem.into(),
            key_id,
            team_id,
        });
    }
    if let Some(topic) = get("ORCA_PUSH_APNS_TOPIC") {
        settings.apns_topic = topic;
    }
    if let Some(project) = get("ORCA_PUSH_FCM_PROJECT_ID") {
        settings.fcm_project_id = project;
    }
    for (variable, target) in [
        ("ORCA_PUSH_APNS_URL", &mut settings.apns_url),
        ("ORCA_PUSH_FCM_URL", &mut settings.fcm_url),
    ] {
        if let Some(url) = get(variable) {
            if !(url.starts_with("https://") || url.starts_with("http://")) {
                return Err(invalid(
                    variable,
                    "must be an https:// (or http:// for tests) URL",
                ));
            }
            *target = Some(url.trim_end_matches('/').to_owned());
        }
    }
    if let Some(path) = get("ORCA_PUSH_CA_FILE") {
        let path = PathBuf::from(path);
        if !path.is_file() {
            return Err(invalid("ORCA_PUSH_CA_FILE", "is not a readable file"));
        }
        settings.ca_file = Some(path);
    }
    Ok(settings)
}

/// A bare origin: scheme, host, optional port; no path, query or trailing slash; https unless the
/// host is loopback.
pub(super) fn validate_origin(value: &str) -> Result<String, String> {
    let (scheme, rest) = value
        .split_once("://")
        .ok_or("must be an origin like https://push.example.com")?;
    if scheme != "https" && scheme != "http" {
        return Err("scheme must be https (or http on loopback)".into());
    }
    if rest.is_empty() || rest.contains(['/', '?', '#', '@', ' ']) {
        return Err("must be a bare origin: no path, query, credentials or trailing slash".into());
    }
    let host = match rest.strip_prefix('[') {
        Some(v6) => v6
            .split_once(']')
            .map(|(h, _)| h)
            .ok_or("unterminated IPv6 host")?,
        None => rest.split(':').next().unwrap_or(""),
    };
    if host.is_empty() {
        return Err("has no host".into());
    }
    let port = rest
        .rsplit_once(':')
        .filter(|_| !rest.ends_with(']'))
        .map(|(_, p)| p);
    if let Some(p) = port.filter(|p| !p.contains(']')) {
        p.parse::<u16>().map_err(|_| "has an invalid port")?;
    }
    let loopback = host == "localhost"
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback());
    if scheme == "http" && !loopback {
        return Err("must use https unless the host is loopback".into());
    }
    // Auth writes this text into every transcript, and hosts compare it with the origin of the
    // URL they called as a URL library writes it (lower case, no default port, IPv6 shortened).
    let canonical = orca_push_host::origin_of(value)
        .map_err(|_| "must be an origin like https://push.example.com")?;
    if canonical != value {
        return Err(format!(
            "must be written as hosts write the origin ({canonical}), or every login is refused"
        ));
    }
    Ok(value.to_owned())
}
