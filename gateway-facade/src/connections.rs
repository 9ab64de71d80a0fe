//! The public listener's connections, served by hyper directly because `axum::serve` exposes none
//! of these limits: a request head must arrive within the header timeout, a connection with no
//! request in flight is closed after the idle timeout, and at most `max_connections` are served at
//! once. Past the cap a new connection is not accepted: it waits in the kernel's accept queue until
//! a served one closes, so a slow client can hold a slot for at most one of those timeouts.

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto::Builder;
use hyper_util::service::TowerToHyperService;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, watch};
use tokio_util::sync::CancellationToken;
use tower::ServiceExt as _;

/// How the public listener treats connections (`ORCA_PUSH_HTTP_*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HttpLimits {
    /// An HTTP/1 request head must be complete this long after the server starts waiting for it.
    /// hyper starts that clock as soon as a kept-alive connection waits for its next request, so
    /// an idle HTTP/1 connection is closed after the shorter of this and `idle_timeout`.
    pub header_read_timeout: Duration,
    /// A connection (HTTP/1 or HTTP/2) with no request in flight for this long is closed.
    pub idle_timeout: Duration,
    /// Connections served at once.
    pub max_connections: usize,
}

impl Default for HttpLimits {
    fn default() -> Self {
        Self {
            header_read_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(30),
            max_connections: 1024,
        }
    }
}

/// Connections the kernel completes and keeps for a listener until it accepts them. `bind` in
/// Rust's standard library and in tokio asks for 128: at the start of the benchmark's 1,000
/// end-to-end flows, which connect at once while both cores are busy, 607 connections overflowed
/// that queue and 421 clients waited a second to send their SYN again (round 34,
/// docs/benchmarks.md). Linux caps it at `net.core.somaxconn` (4,096 by default since 5.4).
pub const ACCEPT_BACKLOG: u32 = 4096;

/// A listener on `addr` with an accept queue of `ACCEPT_BACKLOG`. Like `TcpListener::bind`, it
/// sets `SO_REUSEADDR` (not on Windows, where it would let another socket take the port), so a
/// restarted process listens again at once. Called within a tokio runtime, as `bind` is.
pub fn listen(addr: std::net::SocketAddr) -> std::io::Result<TcpListener> {
    let socket = if addr.is_ipv4() {
        tokio::net::TcpSocket::new_v4()?
    } else {
        tokio::net::TcpSocket::new_v6()?
    };
    #[cfg(not(windows))]
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(ACCEPT_BACKLOG)
}

/// Serves `router` on `listener` until `shutdown`, then lets every open connection finish the
/// requests it has in flight (no new ones) and returns once all are closed.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    limits: HttpLimits,
    shutdown: CancellationToken,
) {
    let slots = Arc::new(Semaphore::new(limits.max_connections));
    let mut builder = Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout);
    builder.http2().timer(TokioTimer::new());
    let builder = Arc::new(builder);
    loop {
        // A slot first: at the cap, the next connection stays in the accept queue.
        let slot = tokio::select! {
            () = shutdown.cancelled() => break,
            slot = slots.clone().acquire_owned() => match slot {
                Ok(slot) => slot,
                Err(_) => break,
            },
        };
        let stream = tokio::select! {
            () = shutdown.cancelled() => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(error) => {
                    on_accept_error(error).await;
                    continue;
                }
            },
        };
        // Small answers go out at once rather than waiting on the client's delayed ACK.
        let _ = stream.set_nodelay(true);
        tokio::spawn(serve_connection(
            stream,
            router.clone(),
            builder.clone(),
            limits,
            shutdown.clone(),
            slot,
        ));
    }
    drop(listener);
    // Every open connection holds a slot until it ends.
    let all = u32::try_from(limits.max_connections).unwrap_or(u32::MAX);
    let _ = slots.acquire_many(all).await;
}

/// A failed accept: a connection reset before it was accepted is the client's business; anything
/// else (out of file descriptors) is ours, and retrying at once would spin.
async fn on_accept_error(error: std::io::Error) {
    use std::io::ErrorKind::{ConnectionAborted, ConnectionRefused, ConnectionReset};
    if matches!(
        error.kind(),
        ConnectionAborted | ConnectionRefused | ConnectionReset
    ) {
        return;
    }
    tracing::warn!(%error, "accepting a connection failed");
    tokio::time::sleep(Duration::from_millis(100)).await;
}

async fn serve_connection(
    stream: TcpStream,
    router: Router,
    builder: Arc<Builder<TokioExecutor>>,
    limits: HttpLimits,
    shutdown: CancellationToken,
    _slot: OwnedSemaphorePermit,
) {
    let (in_flight_tx, in_flight) = watch::channel(0usize);
    let in_flight_tx = Arc::new(in_flight_tx);
    let service = tower::service_fn(move |mut request: http::Request<Incoming>| {
        let guard = InFlight::enter(in_flight_tx.clone());
        let router = router.clone();
        request
            .extensions_mut()
            .insert(BodyTimeout(limits.header_read_timeout));
        async move {
            let response = router.oneshot(request.map(axum::body::Body::new)).await;
            drop(guard);
            response
        }
    });
    let connection = builder
        .serve_connection_with_upgrades(TokioIo::new(stream), TowerToHyperService::new(service));
    tokio::pin!(connection);
    let idle = idle_for(in_flight, limits.idle_timeout);
    tokio::pin!(idle);
    // After an idle close starts, a connection that still does not end (a request head half sent,
    // which a graceful close waits for) is dropped once this runs out.
    let grace = tokio::time::sleep(Duration::ZERO);
    tokio::pin!(grace);
    let (mut draining, mut idle_closing) = (false, false);
    loop {
        tokio::select! {
            result = connection.as_mut() => {
                if let Err(error) = result {
                    tracing::debug!(%error, "connection ended with an error");
                }
                break;
            }
            () = shutdown.cancelled(), if !draining && !idle_closing => {
                draining = true;
                connection.as_mut().graceful_shutdown();
            }
            () = &mut idle, if !draining && !idle_closing => {
                idle_closing = true;
                connection.as_mut().graceful_shutdown();
                grace
                    .as_mut()
                    .reset(tokio::time::Instant::now() + limits.header_read_timeout);
            }
            () = &mut grace, if idle_closing => break,
        }
    }
}

/// How long a request's body may take to arrive whole once its handler starts reading it: the
/// header timeout. Hyper's own timeout covers only the head, and a request in flight stops the
/// idle clock, so a body that never came would hold its connection's slot for ever
/// (`json::StrictJson` reads bodies under it). Counted from the read, not the head: a body the
/// client holds back until asked (`Expect: 100-continue`), behind a slow session look-up, is not
/// the client's delay.
#[derive(Debug, Clone, Copy)]
pub struct BodyTimeout(pub std::time::Duration);

/// Counts a request in flight on its connection until its response is ready.
struct InFlight(Arc<watch::Sender<usize>>);

impl InFlight {
    fn enter(counter: Arc<watch::Sender<usize>>) -> Self {
        counter.send_modify(|n| *n += 1);
        Self(counter)
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.send_modify(|n| *n = n.saturating_sub(1));
    }
}

/// Resolves once no request has been in flight for `idle`, counted from the end of the last one
/// (or from the start of the connection).
async fn idle_for(mut in_flight: watch::Receiver<usize>, idle: Duration) {
    loop {
        if in_flight.wait_for(|n| *n == 0).await.is_err() {
            return std::future::pending().await;
        }
        tokio::select! {
            () = tokio::time::sleep(idle) => return,
            changed = in_flight.changed() => {
                if changed.is_err() {
                    return std::future::pending().await;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Clients that connect together all get their connection while the server has yet to accept
    /// them: with `bind`'s queue of 128, those past it waited a second for their SYN to be sent
    /// again. Where the kernel caps the queue at 128 or less, the burst fits either queue and the
    /// test shows nothing.
    #[tokio::test]
    async fn a_burst_of_connections_waits_in_the_accept_queue() {
        let listener = listen(std::net::SocketAddr::from(([127, 0, 0, 1], 0))).unwrap();
        let addr = listener.local_addr().unwrap();
        // Linux caps the queue at `net.core.somaxconn` (4,096 by default since 5.4; 128 before).
        let cap = std::fs::read_to_string("/proc/sys/net/core/somaxconn")
            .ok()
            .and_then(|v| v.trim().parse::<usize>().ok())
            .unwrap_or(4096);
        let burst = cap.min(400);
        let connects = (0..burst)
            .map(|_| tokio::time::timeout(Duration::from_millis(700), TcpStream::connect(addr)));
        let connected = futures::future::join_all(connects).await;
        let waited = connected.iter().filter(|c| c.is_err()).count();
        let failed: Vec<String> = connected
            .iter()
            .filter_map(|c| c.as_ref().ok()?.as_ref().err().map(ToString::to_string))
            .collect();
        assert!(failed.is_empty(), "connections failed: {failed:?}");
        assert_eq!(
            waited, 0,
            "of {burst} connections, {waited} were not completed within 700 ms"
        );
        drop(listener);
    }

    #[tokio::test(start_paused = true)]
    async fn idleness_counts_from_the_end_of_the_last_request() {
        let (tx, rx) = watch::channel(0usize);
        let tx = Arc::new(tx);
        let idle = tokio::spawn(idle_for(rx, Duration::from_secs(5)));
        let after = |secs| async move {
            tokio::time::sleep(Duration::from_secs(secs)).await;
            tokio::task::yield_now().await;
        };
        after(4).await;
        assert!(!idle.is_finished());
        let request = InFlight::enter(tx.clone());
        // However long a request runs, its connection is not idle.
        after(60).await;
        assert!(!idle.is_finished());
        drop(request);
        after(4).await;
        assert!(!idle.is_finished());
        after(2).await;
        assert!(idle.is_finished());
    }
}
