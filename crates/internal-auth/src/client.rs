//! Client side: channels to a service, in this process or across the network, whose calls carry
//! a token minted for it.

use std::future::Future;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, SystemTime};

use crate::token::{InternalKey, Scope, mint};
use crate::transport::{CALL_TIMEOUT, LocalCaller, Target, Transport};
use crate::{REMINT_BEFORE, RESOLVE_EVERY, SERVICE_TOKEN_TTL};

/// Client side: every call carries a full-scope token for `audience`, re-minted before it expires;
/// a call to a server in this process carries a [`LocalCaller`] instead.
#[derive(Clone)]
pub struct AttachToken<S> {
    inner: S,
    minter: Arc<Minter>,
    local: Option<LocalCaller>,
}

struct Minter {
    key: InternalKey,
    subject: String,
    audience: String,
    cached: Mutex<Option<(http::HeaderValue, SystemTime)>>,
}

impl Minter {
    fn header(&self) -> http::HeaderValue {
        let mut cached = self.cached.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((value, expires)) = cached.as_ref()
            && SystemTime::now() + REMINT_BEFORE < *expires
        {
            return value.clone();
        }
        let token = mint(
            &self.key,
            &self.subject,
            &self.audience,
            Scope::Full,
            SERVICE_TOKEN_TTL,
        );
        let mut value = http::HeaderValue::from_str(&format!("Bearer {token}"))
            .unwrap_or_else(|_| http::HeaderValue::from_static(""));
        value.set_sensitive(true);
        *cached = Some((value.clone(), SystemTime::now() + SERVICE_TOKEN_TTL));
        value
    }
}

impl<S, B> tower::Service<http::Request<B>> for AttachToken<S>
where
    S: tower::Service<http::Request<B>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: http::Request<B>) -> Self::Future {
        match &self.local {
            Some(local) => {
                request.extensions_mut().insert(local.clone());
            }
            None => {
                request
                    .headers_mut()
                    .insert(http::header::AUTHORIZATION, self.minter.header());
            }
        }
        self.inner.call(request)
    }
}

/// A traced transport whose calls carry `subject`'s identity to `audience`.
pub type InternalChannel = AttachToken<orca_push_telemetry::GrpcClientService<Transport>>;

/// A traced channel to `target` carrying `subject`'s identity: a token over the network, a
/// [`LocalCaller`] to a server in this process.
pub fn channel_to(
    target: &Target,
    key: &InternalKey,
    subject: &str,
    audience: &str,
) -> Result<InternalChannel, tonic::transport::Error> {
    match target {
        Target::Url(url) => channel(url, key, subject, audience),
        Target::Local(server) => Ok(AttachToken {
            inner: orca_push_telemetry::traced_in_process(Transport::Local(server.clone())),
            minter: minter(key, subject, audience),
            local: Some(LocalCaller {
                subject: Arc::from(subject),
            }),
        }),
    }
}

fn minter(key: &InternalKey, subject: &str, audience: &str) -> Arc<Minter> {
    Arc::new(Minter {
        key: key.clone(),
        subject: subject.to_owned(),
        audience: audience.to_owned(),
        cached: Mutex::new(None),
    })
}

/// A lazily connecting, traced, token-carrying channel to `url`.
///
/// `url` may name several replicas, comma-separated, and a host name may resolve to several
/// addresses (a headless Kubernetes Service): calls are then balanced client-side across every
/// address (power of two choices), an address that does not accept a connection is left out
/// until it does, and the names are resolved and the addresses probed again every 10 s so
/// replicas come and go.
pub fn channel(
    url: &str,
    key: &InternalKey,
    subject: &str,
    audience: &str,
) -> Result<InternalChannel, tonic::transport::Error> {
    let targets: Vec<&str> = url
        .split(',')
        .map(str::trim)
        .filter(|t| !t.is_empty())
        .collect();
    let single_address =
        targets.len() == 1 && target_address(targets[0]).is_some_and(|(_, literal)| literal);
    let channel = if single_address || targets.is_empty() {
        endpoint(targets.first().copied().unwrap_or(url))?.connect_lazy()
    } else {
        // Validate every target now, so a bad URL stops start-up rather than a background task.
        for target in &targets {
            endpoint(target)?;
        }
        let (channel, changes) =
            tonic::transport::Channel::balance_channel::<std::net::SocketAddr>(64);
        let targets: Vec<String> = targets.iter().map(|t| t.to_string()).collect();
        tokio::spawn(follow_replicas(targets, changes));
        channel
    };
    Ok(AttachToken {
        inner: orca_push_telemetry::traced(Transport::Remote(channel)),
        minter: minter(key, subject, audience),
        local: None,
    })
}

fn endpoint(url: &str) -> Result<tonic::transport::Endpoint, tonic::transport::Error> {
    Ok(tonic::transport::Endpoint::from_shared(url.to_owned())?
        .connect_timeout(Duration::from_secs(3))
        .timeout(CALL_TIMEOUT)
        .tcp_nodelay(true)
        .http2_keep_alive_interval(Duration::from_secs(30))
        .keep_alive_while_idle(true))
}

/// `host:port` of an `http://host:port` target, and whether the host is an IP literal.
fn target_address(target: &str) -> Option<(String, bool)> {
    let uri: http::Uri = target.parse().ok()?;
    let host = uri.host()?.trim_start_matches('[').trim_end_matches(']');
    let port = uri.port_u16().unwrap_or(80);
    let literal = host.parse::<std::net::IpAddr>().is_ok();
    Some((format!("{host}:{port}"), literal))
}

/// How long a replica's address has to accept a connection to be balanced over.
const PROBE_TIMEOUT: Duration = Duration::from_secs(1);

/// The addresses of `candidates` that accept a TCP connection within [`PROBE_TIMEOUT`].
async fn answering(
    candidates: &std::collections::HashSet<std::net::SocketAddr>,
) -> std::collections::HashSet<std::net::SocketAddr> {
    let probes = candidates.iter().map(|addr| async move {
        let connected =
            tokio::time::timeout(PROBE_TIMEOUT, tokio::net::TcpStream::connect(addr)).await;
        matches!(connected, Ok(Ok(_))).then_some(*addr)
    });
    futures::future::join_all(probes)
        .await
        .into_iter()
        .flatten()
        .collect()
}

/// Keeps the balanced channel's set of addresses in step with what the targets resolve to and
/// which of those accept connections. tonic's balancer never drops a lazy connection that failed
/// to connect (it stays "ready" and fails each call it gets at once), so a replica that is down
/// must be taken out here: each round probes every address, adds those that answer and were not
/// in, and removes those in that no longer answer. If none answers, all stay in, so that calls
/// fail at once rather than wait for an address.
async fn follow_replicas(
    targets: Vec<String>,
    changes: tokio::sync::mpsc::Sender<
        tonic::transport::channel::Change<std::net::SocketAddr, tonic::transport::Endpoint>,
    >,
) {
    use tonic::transport::channel::Change;
    let mut known = std::collections::HashSet::new();
    loop {
        let mut now = std::collections::HashSet::new();
        for target in &targets {
            let Some((host_port, _)) = target_address(target) else {
                continue;
            };
            match tokio::net::lookup_host(host_port.as_str()).await {
                Ok(addrs) => now.extend(addrs),
                // Keep what we had for a name that does not resolve right now.
                Err(_) => now.extend(known.iter().copied()),
            }
        }
        let mut up = answering(&now).await;
        if up.is_empty() {
            up = now;
        }
        for addr in up.difference(&known) {
            let Ok(endpoint) = endpoint(&format!("http://{addr}")) else {
                continue;
            };
            if changes.send(Change::Insert(*addr, endpoint)).await.is_err() {
                return; // the channel is gone
            }
        }
        for addr in known.difference(&up) {
            if changes.send(Change::Remove(*addr)).await.is_err() {
                return;
            }
        }
        known = up;
        tokio::time::sleep(RESOLVE_EVERY).await;
    }
}

/// Whether `status` is a call's own time running out: tonic's timeout and the in-process deadline
/// both answer `Cancelled` with this message, the same code a connection that died turns into.
fn timed_out(status: &tonic::Status) -> bool {
    status.code() == tonic::Code::Cancelled && status.message() == "Timeout expired"
}

/// Calls `call` again when an attempt found its replica unavailable, up to 4 attempts over about
/// 200 ms, so the balancer can route around a replica that just died. Only for idempotent calls
/// (admissions are: the event identity makes a repeat a no-op), and not for an attempt that ran
/// out its time ([`timed_out`]): retried, a call that ran out its 40 s would take four times
/// that, and pile four abandoned handlers on a stalled service. (Not by how long the attempt
/// took: that counts time queued before it reached a replica.)
pub async fn retry_unavailable<T, F, Fut>(mut call: F) -> Result<T, tonic::Status>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, tonic::Status>>,
{
    let mut pause = Duration::from_millis(25);
    for _ in 0..3 {
        match call().await {
            // Unknown, Internal and Cancelled without a contract code are what a connection that
            // died mid-call (an HTTP/2 reset) turns into. A service's own refusal names a contract
            // code (e.g. its database is down) and is final.
            Err(status)
                if matches!(
                    status.code(),
                    tonic::Code::Unavailable
                        | tonic::Code::Unknown
                        | tonic::Code::Internal
                        | tonic::Code::Cancelled
                ) && status.metadata().get("x-orca-error").is_none()
                    && !timed_out(&status) =>
            {
                tokio::time::sleep(pause).await;
                pause *= 2;
            }
            other => return other,
        }
    }
    call().await
}
