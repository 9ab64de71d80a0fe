//! Prometheus text at `/metrics` on `ORCA_PUSH_METRICS_ADDR`: aggregate counters, gauges and
//! histograms from every service in this process. Labels are routes, methods, codes, providers
//! and outcomes only: never a token, a title, a body, an id or a fingerprint.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::Context as _;
use axum::routing::get;
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use tokio_util::sync::CancellationToken;

/// Latency buckets in seconds, from sub-millisecond gRPC hops to provider timeouts.
const BUCKETS: &[f64] = &[
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];

/// Installs the process-wide recorder. Once per process.
pub fn install() -> anyhow::Result<PrometheusHandle> {
    PrometheusBuilder::new()
        .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), BUCKETS)
        .context("metrics buckets")?
        .install_recorder()
        .context("metrics recorder")
}

/// Serves `/metrics` on `addr` until `shutdown`.
pub async fn serve(
    addr: SocketAddr,
    handle: PrometheusHandle,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("ORCA_PUSH_METRICS_ADDR: cannot listen on {addr}"))?;
    tracing::info!(addr = %listener.local_addr()?, "metrics listening");
    {
        // Histograms are kept in windows that need draining now and then.
        let handle = handle.clone();
        let shutdown = shutdown.clone();
        tokio::spawn(async move {
            let mut ticker = tokio::time::interval(Duration::from_secs(5));
            loop {
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    _ = ticker.tick() => handle.run_upkeep(),
                }
            }
        });
    }
    let app =
        axum::Router::new().route("/metrics", get(move || std::future::ready(handle.render())));
    tokio::spawn(async move {
        if let Err(error) = axum::serve(listener, app)
            .with_graceful_shutdown(shutdown.cancelled_owned())
            .await
        {
            tracing::error!(%error, "metrics listener failed");
        }
    });
    Ok(())
}
