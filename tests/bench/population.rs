//! Simulated hosts: each its own X25519 key and client IP (x-forwarded-for, with the gateway told
//! to trust one proxy hop), a session from the real handshake, and M registered phones.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};

use futures::StreamExt as _;
use orca_push_host::{GatewayClient, GatewayError, HostKey};
use reqwest::Method;
use reqwest::header::{HeaderMap, HeaderValue};
use serde_json::{Value, json};

/// Alerts (and separately dismissals) a host may spend in the bench: under the contract's 300 per
/// 15 minutes, so quota never binds unless a scenario is about quota.
pub const QUOTA_BUDGET: u32 = 280;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Platform {
    Ios,
    Android,
}

#[derive(Debug, Clone)]
pub struct Device {
    pub device_id: String,
    pub registration_id: String,
    pub platform: Platform,
    /// The native token registered at set-up (a re-registration in `mixed` replaces it).
    pub token: String,
}

pub struct Host {
    pub client: GatewayClient,
    /// `x-forwarded-for` as the host SDK sends it (`client`), for the load generator's own sends.
    pub forwarded: HeaderValue,
    /// `Bearer <session token>`, for the same.
    bearer: std::sync::Mutex<HeaderValue>,
    pub devices: Vec<Device>,
    /// notificationEpoch of this host's counter.
    pub epoch: String,
    seq: AtomicU64,
    alerts: AtomicU32,
    dismissals: AtomicU32,
}

impl Host {
    pub fn next_seq(&self) -> u64 {
        self.seq.fetch_add(1, Ordering::Relaxed) + 1
    }

    pub fn registration_ids(&self, platform: Option<Platform>) -> Vec<String> {
        self.devices
            .iter()
            .filter(|d| platform.is_none_or(|p| d.platform == p))
            .map(|d| d.registration_id.clone())
            .collect()
    }

    pub fn bearer(&self) -> HeaderValue {
        self.bearer.lock().expect("bearer").clone()
    }

    /// Takes the session the host SDK holds now, after it renewed one the gateway refused.
    pub async fn renewed(&self) {
        if let Ok(session) = self.client.session().await
            && let Ok(bearer) = bearer_of(&session.session_token)
        {
            *self.bearer.lock().expect("bearer") = bearer;
        }
    }

    /// Alerts this host may still spend (`QUOTA_BUDGET`).
    pub fn alerts_left(&self) -> u32 {
        QUOTA_BUDGET.saturating_sub(self.alerts.load(Ordering::Relaxed))
    }

    /// Counts `n` alerts sent as this host outside `spend` (a wrk run, `crate::wrk`).
    pub fn spent_alerts(&self, n: u32) {
        self.alerts.fetch_add(n, Ordering::Relaxed);
    }

    /// Takes one alert (or dismissal) from the host's budget; false when it is spent.
    pub fn spend(&self, dismissal: bool) -> bool {
        let counter = if dismissal {
            &self.dismissals
        } else {
            &self.alerts
        };
        counter.fetch_add(1, Ordering::Relaxed) < QUOTA_BUDGET
    }
}

/// The client IP of simulated client `n` in address block `block` (10 for hosts, 11 and up for
/// one-off handshakes), unique for up to 16 million clients.
pub fn client_ip(block: u8, n: usize) -> String {
    format!("{block}.{}.{}.{}", (n >> 16) & 255, (n >> 8) & 255, n & 255)
}

pub fn client(base: &str, http: &reqwest::Client, ip: &str) -> Result<GatewayClient, GatewayError> {
    let mut headers = HeaderMap::new();
    headers.insert("x-forwarded-for", forwarded_for(ip)?);
    Ok(GatewayClient::new(base, HostKey::generate())?
        .with_http_client(http.clone())
        .with_headers(headers))
}

/// `x-forwarded-for` as a load balancer would pass it on: the client, then the balancer itself
/// (the one hop ORCA_PUSH_TRUSTED_PROXY_HOPS=1 tells the gateway to skip).
fn forwarded_for(ip: &str) -> Result<HeaderValue, GatewayError> {
    HeaderValue::from_str(&format!("{ip}, 192.0.2.1")).map_err(|_| GatewayError::BadUrl)
}

fn bearer_of(token: &str) -> Result<HeaderValue, GatewayError> {
    HeaderValue::from_str(&format!("Bearer {token}"))
        .map_err(|_| GatewayError::Malformed("session token"))
}

/// A new native token of the right shape: 64 hex digits for APNs, an FCM-looking string else.
pub fn fresh_token(platform: Platform) -> String {
    let (a, b) = (uuid::Uuid::new_v4().simple(), uuid::Uuid::new_v4().simple());
    match platform {
        Platform::Ios => format!("{a}{b}"),
        Platform::Android => format!("fcm-bench:{a}"),
    }
}

pub fn registration_body(platform: Platform, device_id: &str, token: &str) -> Value {
    match platform {
        Platform::Ios => json!({
            "v": 1, "deviceId": device_id, "platform": "ios", "token": token,
            "apnsEnvironment": "production",
        }),
        Platform::Android => json!({
            "v": 1, "deviceId": device_id, "platform": "android", "token": token,
        }),
    }
}

/// Hosts shared by a scenario's workers, handed out round-robin so each host's request rate stays
/// a small share of the total.
pub struct Pool {
    pub hosts: Vec<Arc<Host>>,
    /// The connections the hosts' sends go on.
    pub lines: crate::lines::Lines,
    next: AtomicUsize,
}

impl Pool {
    /// The next host with budget left, or None when every host has spent its quota budget.
    pub fn take(&self, dismissal: bool) -> Option<Arc<Host>> {
        for _ in 0..self.hosts.len() {
            let i = self.next.fetch_add(1, Ordering::Relaxed) % self.hosts.len();
            if self.hosts[i].spend(dismissal) {
                return Some(self.hosts[i].clone());
            }
        }
        None
    }
}

/// The phones each simulated host registers.
#[derive(Debug, Clone, Copy)]
pub enum Phones {
    /// This many, alternately iOS and Android.
    Alternating(usize),
    /// One Android phone.
    OneAndroid,
}

/// Logs in `hosts` hosts and registers `phones` on each, `concurrency` hosts at a time.
pub async fn build(
    base: &str,
    http: &reqwest::Client,
    hosts: usize,
    phones: Phones,
    concurrency: usize,
    progress: &indicatif::ProgressBar,
) -> anyhow::Result<Pool> {
    let devices = match phones {
        Phones::Alternating(n) => n,
        Phones::OneAndroid => 1,
    };
    let made: Vec<Result<Host, GatewayError>> = futures::stream::iter(0..hosts)
        .map(|n| async move {
            let ip = client_ip(10, n);
            let client = client(base, http, &ip)?;
            let session = client.login().await?;
            let mut registered = Vec::new();
            for d in 0..devices {
                let platform = if d % 2 == 0 && !matches!(phones, Phones::OneAndroid) {
                    Platform::Ios
                } else {
                    Platform::Android
                };
                let device_id = uuid::Uuid::new_v4().to_string();
                let token = fresh_token(platform);
                let reply = client
                    .call(
                        Method::POST,
                        "/v1/devices",
                        Some(&registration_body(platform, &device_id, &token)),
                    )
                    .await?;
                let registration_id = reply["registrationId"]
                    .as_str()
                    .ok_or(GatewayError::Malformed("registration reply"))?
                    .to_owned();
                registered.push(Device {
                    device_id,
                    registration_id,
                    platform,
                    token,
                });
            }
            progress.inc(1);
            Ok(Host {
                client,
                forwarded: forwarded_for(&ip)?,
                bearer: std::sync::Mutex::new(bearer_of(&session.session_token)?),
                devices: registered,
                epoch: uuid::Uuid::new_v4().to_string(),
                seq: AtomicU64::new(0),
                alerts: AtomicU32::new(0),
                dismissals: AtomicU32::new(0),
            })
        })
        .buffer_unordered(concurrency)
        .collect()
        .await;
    let hosts = made
        .into_iter()
        .map(|h| h.map(Arc::new))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| anyhow::anyhow!("setting up simulated hosts: {e}"))?;
    Ok(Pool {
        hosts,
        lines: crate::lines::Lines::new(base)?,
        next: AtomicUsize::new(0),
    })
}
