//! The `admission` and `outage` scenarios: what the gateway admits and what it burns while the
//! providers are down. Both run against providers at one local port the bench controls: nothing
//! listening (connections refused), or a server answering every request with one status.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU16, Ordering};
use std::time::{Duration, Instant};

use crate::population::Pool;
use crate::scenarios::{
    Phase, Target, measure, open_loop, open_loop_of_sends, send_one, warm_up_open_loop,
};

/// A provider endpoint (APNs over h2c and FCM over HTTP/1 or h2c, at one port) that refuses
/// connections until told to answer.
pub struct FlakyProvider {
    port: u16,
    status: Arc<AtomicU16>,
    server: std::sync::Mutex<Option<tokio::task::JoinHandle<()>>>,
}

impl FlakyProvider {
    /// A free loopback port with nothing listening on it yet.
    pub fn new() -> anyhow::Result<Self> {
        let port = orca_push_tests::free_port();
        Ok(Self {
            port,
            status: Arc::new(AtomicU16::new(503)),
            server: std::sync::Mutex::new(None),
        })
    }

    /// The gateway's provider settings pointing both providers here.
    pub fn env(&self) -> Vec<(String, String)> {
        let url = format!("http://127.0.0.1:{}", self.port);
        vec![
            ("ORCA_PUSH_APNS_URL".into(), url.clone()),
            ("ORCA_PUSH_FCM_URL".into(), url),
        ]
    }

    /// From now on, connections are accepted and every request is answered `status` (200 is a
    /// delivery as either provider acknowledges it).
    pub async fn answer(&self, status: u16) -> anyhow::Result<()> {
        self.status.store(status, Ordering::Relaxed);
        let mut server = self.server.lock().unwrap();
        if server.is_none() {
            let listener = std::net::TcpListener::bind(("127.0.0.1", self.port))?;
            listener.set_nonblocking(true)?;
            let listener = tokio::net::TcpListener::from_std(listener)?;
            let status = self.status.clone();
            let app = axum::Router::new().fallback(move || {
                let status = status.load(Ordering::Relaxed);
                async move { answer(status) }
            });
            *server = Some(tokio::spawn(async move {
                let _ = axum::serve(listener, app).await;
            }));
        }
        Ok(())
    }

    /// Refuses connections again.
    pub fn refuse(&self) {
        if let Some(server) = self.server.lock().unwrap().take() {
            server.abort();
        }
    }
}

impl Drop for FlakyProvider {
    fn drop(&mut self) {
        self.refuse();
    }
}

fn answer(status: u16) -> axum::response::Response {
    use axum::response::IntoResponse as _;
    let code = axum::http::StatusCode::from_u16(status)
        .unwrap_or(axum::http::StatusCode::SERVICE_UNAVAILABLE);
    if code.is_success() {
        // APNs reads only the status; FCM's answer names the message.
        (code, r#"{"name":"projects/bench/messages/1"}"#).into_response()
    } else {
        (
            code,
            r#"{"reason":"ServiceUnavailable","error":{"code":503,"status":"UNAVAILABLE"}}"#,
        )
            .into_response()
    }
}

/// What drives the admission scenario's closed loops.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Client {
    /// The bench's own HTTP/1 connections (`crate::lines`).
    Bench,
    /// wrk, as the performance issue measured (`crate::wrk`).
    Wrk,
}

/// `admission`: a closed loop of sends at each of `levels` connections, every host new to the
/// gateway with one Android phone, every send naming that one phone, while the providers refuse
/// connections (so failed deliveries retry beside the admissions). The open loops after them send
/// from hosts of their own (`open_pool`), as new and as many: at some 17,000 sends/s the closed
/// loops had spent their hosts' quotas before the open loop at half the peak was done.
pub async fn admission(
    target: &Target,
    (pool, open_pool): (&Arc<Pool>, &Arc<Pool>),
    seconds: f64,
    levels: &[usize],
    rates: &[f64],
    client: Client,
) -> anyhow::Result<Vec<Phase>> {
    let mut rows = Vec::new();
    for (level, &connections) in levels.iter().enumerate() {
        if client == Client::Wrk {
            rows.push(admission_by_wrk(target, pool, seconds, connections, level).await?);
            continue;
        }
        let (row, _) = measure(
            target,
            "admission",
            &format!("closed loop, {connections} connections"),
            seconds,
            |recorder, deadline| async move {
                let workers = (0..connections).map(|_| {
                    let recorder = recorder.clone();
                    async move {
                        while Instant::now() < deadline {
                            send_one(pool.clone(), &recorder, Instant::now(), "a").await;
                        }
                    }
                });
                futures::future::join_all(workers).await;
                BTreeMap::new()
            },
        )
        .await;
        rows.push(row);
    }
    // The latency target's load: half the best closed loop's rate, offered open loop (latency
    // from each request's scheduled start, so a stall is not hidden), on the same gateway, from
    // hosts of its own, the providers still refusing, once a warm-up at that rate has run. Then
    // any rates asked for, the same way.
    let pool = open_pool;
    let peak = rows.iter().map(|r| r.rate).fold(0.0, f64::max);
    let half_peak = (peak > 0.0).then(|| ((peak / 2.0).max(1.0), " (half the peak)"));
    // Rates named as their rows are (whole sends a second), each once: one row and one timeline
    // file per rate.
    let mut asked: Vec<f64> = rates
        .iter()
        .map(|r| r.round())
        .filter(|&r| r > 0.0)
        .collect();
    asked.sort_by(f64::total_cmp);
    asked.dedup();
    let asked = asked.into_iter().map(|r| (r, ""));
    for (rate, why) in half_peak.into_iter().chain(asked) {
        // Nothing waits for these sends' deliveries: the providers refuse them.
        let warm_up = warm_up_open_loop(pool, rate, seconds, "h", Arc::default()).await;
        let (mut open, _) = measure(
            target,
            "admission",
            &format!("open loop at {rate:.0}/s{why}"),
            seconds,
            |recorder, deadline| {
                open_loop_of_sends(pool, recorder, rate, deadline, "h", Arc::default())
            },
        )
        .await;
        open.extra.extend(warm_up);
        rows.push(open);
    }
    Ok(rows)
}

/// One closed loop of `admission` driven by wrk: the row from wrk's own counts and latencies,
/// the gateway's and the server's CPU as for every phase, and wrk's CPU in the bench's.
async fn admission_by_wrk(
    target: &Target,
    pool: &Arc<Pool>,
    seconds: f64,
    connections: usize,
    level: usize,
) -> anyhow::Result<Phase> {
    let hosts: Vec<&crate::population::Host> = pool.hosts.iter().map(|h| &**h).collect();
    // Sequences (and ids) far above the bench's own, and apart for each loop.
    let first_seq = 1_000_000_000 * (level as u64 + 1);
    // Requests go to the hosts in turn: at most what the host with the least budget left may
    // spend, for each (quota would refuse the rest).
    let each = hosts.iter().map(|h| h.alerts_left()).min().unwrap_or(0);
    let limit = u64::from(each) * hosts.len() as u64;
    let ran = std::sync::Mutex::new(None);
    let (mut row, _) = measure(
        target,
        "admission",
        &format!("closed loop, {connections} connections (wrk)"),
        seconds,
        |_, _| async {
            let before = crate::procstat::children_cpu_seconds();
            let figures =
                crate::wrk::run(&target.base, connections, seconds, &hosts, first_seq, limit).await;
            let cpu = crate::procstat::children_cpu_seconds() - before;
            *ran.lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner) = Some((figures, cpu));
            BTreeMap::new()
        },
    )
    .await;
    let (figures, wrk_cpu) = ran
        .into_inner()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .ok_or_else(|| anyhow::anyhow!("wrk did not run"))?;
    let figures = figures?;
    // What each host spent, rounded up: every host got that many requests or one fewer.
    let per_host = figures.requests.div_ceil(hosts.len().max(1) as u64);
    for host in &hosts {
        host.spent_alerts(u32::try_from(per_host).unwrap_or(u32::MAX));
    }
    // The CPU columns are over the phase (`row.seconds`), as every row's; the rate over wrk's run.
    let elapsed = row.seconds;
    row.ops = figures.ok();
    row.rate = figures.ok() as f64 / figures.seconds().max(1e-9);
    row.extra.insert("wrk_seconds".into(), figures.seconds());
    if figures.requests >= limit {
        // wrk's threads stopped at the budget before the run's end: its rate understates.
        row.extra.insert("stopped_at_quota_budget".into(), 1.0);
    }
    row.errors = figures.errors();
    row.error_kinds = [
        ("503", figures.busy),
        (
            "not queued",
            figures.refused - figures.busy.min(figures.refused),
        ),
        ("connect", figures.connect_errors),
        ("read", figures.read_errors),
        ("write", figures.write_errors),
        ("timeout", figures.timeouts),
    ]
    .into_iter()
    .filter(|(_, n)| *n > 0)
    .map(|(kind, n)| (kind.to_owned(), n))
    .collect();
    row.latency_ms = Some(crate::scenarios::Percentiles {
        p50: figures.p50_us / 1000.0,
        p90: figures.p90_us / 1000.0,
        p99: figures.p99_us / 1000.0,
        p999: figures.p999_us / 1000.0,
        max: figures.max_us / 1000.0,
    });
    row.bench_cpu_percent += 100.0 * wrk_cpu / elapsed.max(1e-9);
    row.extra.insert(
        "wrk_cpu_percent".into(),
        100.0 * wrk_cpu / elapsed.max(1e-9),
    );
    Ok(row)
}

/// `outage`: sends at `rate` per second while the providers refuse connections, then while they
/// answer 503; then the same outage with no new sends (what the backlog's retries cost), and
/// the providers back (what draining it costs).
pub async fn outage(
    target: &Target,
    pool: &Arc<Pool>,
    provider: &FlakyProvider,
    seconds: f64,
    rate: f64,
) -> anyhow::Result<Vec<Phase>> {
    let quiet = |phase: &'static str| {
        measure(target, "outage", phase, seconds, |_, deadline| async move {
            tokio::time::sleep_until(deadline.into()).await;
            BTreeMap::new()
        })
    };
    let mut rows = Vec::new();
    provider.refuse();
    rows.push(
        sending(
            target,
            pool,
            &format!("sends at {rate:.0}/s, providers refusing connections"),
            seconds,
            rate,
        )
        .await
        .0,
    );
    provider.answer(503).await?;
    rows.push(
        sending(
            target,
            pool,
            &format!("sends at {rate:.0}/s, providers answering 503"),
            seconds,
            rate,
        )
        .await
        .0,
    );
    rows.push(quiet("no sends, providers still answering 503").await.0);
    provider.answer(200).await?;
    rows.push(quiet("providers back (answering 200)").await.0);
    // Give the drain a moment to end before the next mode starts.
    tokio::time::sleep(Duration::from_millis(100)).await;
    Ok(rows)
}

/// One phase of sends at `rate` per second, from `pool`'s hosts in turn.
async fn sending(
    target: &Target,
    pool: &Arc<Pool>,
    phase: &str,
    seconds: f64,
    rate: f64,
) -> (Phase, Arc<crate::scenarios::Recorder>) {
    measure(
        target,
        "outage",
        phase,
        seconds,
        move |recorder, deadline| {
            let pool = pool.clone();
            async move {
                let dropped = open_loop(rate, deadline, 4096, move |scheduled| {
                    let recorder = recorder.clone();
                    let pool = pool.clone();
                    async move {
                        send_one(pool, &recorder, scheduled, "u").await;
                    }
                })
                .await;
                BTreeMap::from([
                    ("offered_per_second".into(), rate),
                    ("not_started_over_4096_in_flight".into(), dropped as f64),
                ])
            }
        },
    )
    .await
}
