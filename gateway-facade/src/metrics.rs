//! Prometheus text at `/metrics` on `ORCA_PUSH_METRICS_ADDR`: aggregate counters, gauges and
//! histograms from every service in this process. Labels are routes, methods, codes, providers
//! and outcomes only: never a token, a title, a body, an id or a fingerprint.
//!
//! Every process role (all in one, or one service) installs this recorder and listener, so each
//! reports the standard `process_*` families (collected at every scrape by `metrics-process`) and
//! `orca_push_build_info`.

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

/// The commit this binary was built from, when the build passed one: the image build's
/// `REVISION` argument (see the Dockerfile). No build script: a plain checkout builds as it is.
pub const REVISION: &str = match option_env!("REVISION") {
    Some(revision) if !revision.is_empty() => revision,
    _ => "unknown",
};

/// What [`install`] set up: the Prometheus handle `/metrics` renders, and, with metrics over
/// OTLP, the meter provider (dropping it flushes and stops the export).
pub struct Installed {
    pub prometheus: PrometheusHandle,
    pub otlp: Option<opentelemetry_sdk::metrics::SdkMeterProvider>,
}

/// Installs the process-wide recorder and records what this process is. Once per process.
/// With `otlp`, every metric also goes to an OpenTelemetry meter exported by OTLP (a fan-out of
/// the two recorders), and the process metrics are sampled on a timer as well as at each scrape.
pub fn install(
    otlp: Option<(
        &orca_push_telemetry::OtlpExport,
        opentelemetry_sdk::Resource,
    )>,
    shutdown: &CancellationToken,
) -> anyhow::Result<Installed> {
    let prometheus = PrometheusBuilder::new()
        .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), BUCKETS)
        .context("metrics buckets")?
        .build_recorder();
    let handle = prometheus.handle();
    let provider = match otlp {
        None => {
            metrics::set_global_recorder(prometheus)
                .map_err(|_| anyhow::anyhow!("metrics recorder: one is already installed"))?;
            None
        }
        Some((export, resource)) => {
            use opentelemetry::metrics::MeterProvider as _;
            let provider = orca_push_telemetry::meter_provider(resource, export, BUCKETS)
                .context("OTLP metric export")?;
            let otel =
                metrics_exporter_otel::OpenTelemetryRecorder::new(provider.meter("orca-push"));
            let fanout = metrics_util::layers::FanoutBuilder::default()
                .add_recorder(prometheus)
                .add_recorder(otel)
                .build();
            metrics::set_global_recorder(fanout)
                .map_err(|_| anyhow::anyhow!("metrics recorder: one is already installed"))?;
            let shutdown = shutdown.clone();
            tokio::spawn(async move {
                let process = metrics_process::Collector::default();
                let mut ticker = tokio::time::interval(Duration::from_secs(10));
                loop {
                    tokio::select! {
                        _ = shutdown.cancelled() => return,
                        _ = ticker.tick() => process.collect(),
                    }
                }
            });
            Some(provider)
        }
    };
    record_build_info();
    metrics_process::Collector::default().describe();
    Ok(Installed {
        prometheus: handle,
        otlp: provider,
    })
}

/// `orca_push_build_info{version, revision} 1`: which build a replica runs.
pub fn record_build_info() {
    metrics::gauge!(
        "orca_push_build_info",
        "version" => env!("CARGO_PKG_VERSION"),
        "revision" => REVISION,
    )
    .set(1.0);
}

/// The text a scrape answers: this process's CPU, memory, fds and threads sampled now, then
/// everything recorded.
pub fn render(handle: &PrometheusHandle, process: &metrics_process::Collector) -> String {
    process.collect();
    handle.render()
}

/// Serves `/metrics` on `addr` until `shutdown`.
pub async fn serve(
    addr: SocketAddr,
    handle: PrometheusHandle,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let listener = crate::connections::listen(addr)
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
    let process = metrics_process::Collector::default();
    let app = axum::Router::new().route(
        "/metrics",
        get(move || std::future::ready(render(&handle, &process))),
    );
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_scrape_shows_the_build_and_this_processs_resources() {
        let recorder = PrometheusBuilder::new().build_recorder();
        let handle = recorder.handle();
        let text = metrics::with_local_recorder(&recorder, || {
            record_build_info();
            let process = metrics_process::Collector::default();
            process.describe();
            render(&handle, &process)
        });
        let value = |series: &str| {
            text.lines()
                .find_map(|l| {
                    l.strip_prefix(series)?
                        .strip_prefix(' ')?
                        .parse::<f64>()
                        .ok()
                })
                .unwrap_or_else(|| panic!("no {series} in:\n{text}"))
        };
        let build = format!(
            "orca_push_build_info{{version=\"{}\",revision=\"{REVISION}\"}}",
            env!("CARGO_PKG_VERSION")
        );
        assert_eq!(value(&build), 1.0);
        assert!(value("process_resident_memory_bytes") > 0.0);
        assert!(value("process_open_fds") > 0.0);
        assert!(value("process_max_fds") > 0.0);
        assert!(value("process_threads") >= 1.0);
        assert!(value("process_start_time_seconds") > 1.6e9);
        assert!(value("process_cpu_seconds_total") >= 0.0);
    }
}
