//! The scenarios: handshake, send (closed and open loop), deliver (end to end into the provider
//! mocks) and mixed. Each measured phase yields one [`Phase`] row.

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use orca_push_host::GatewayError;
use orca_push_tests::Arrival;
use rand::Rng as _;
use reqwest::Method;
use serde::Serialize;
use serde_json::{Value, json};

use crate::population::{self, Platform, Pool};
use crate::procstat;

/// Latency percentiles, in milliseconds.
#[derive(Debug, Clone, Serialize)]
pub struct Percentiles {
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub p999: f64,
    pub max: f64,
}

/// One measured phase: a row of the table.
#[derive(Debug, Clone, Serialize)]
pub struct Phase {
    pub scenario: String,
    pub phase: String,
    pub ops: u64,
    pub seconds: f64,
    /// Successful operations per second.
    pub rate: f64,
    pub latency_ms: Option<Percentiles>,
    pub errors: u64,
    pub error_kinds: BTreeMap<String, u64>,
    /// CPU the gateway's processes used, in percent of one core (200 = both cores of this machine).
    pub gateway_cpu_percent: f64,
    /// CPU the PostgreSQL server used meanwhile (0 on SQLite).
    pub database_cpu_percent: f64,
    /// CPU this load generator (with its provider mocks) used meanwhile.
    pub bench_cpu_percent: f64,
    pub rss_mib: f64,
    pub peak_rss_mib: f64,
    /// Scenario-specific figures (ideal rate, streams in flight, connections, ...).
    pub extra: BTreeMap<String, f64>,
}

/// Successes with their latency, and failures by kind.
pub struct Recorder {
    latency: Mutex<Histogram<u64>>,
    ok: AtomicU64,
    errors: Mutex<BTreeMap<String, u64>>,
    /// Each success's start (Unix microseconds) and latency (microseconds), when asked for.
    timeline: Option<Mutex<Vec<(u128, u64)>>>,
}

impl Recorder {
    pub fn new() -> Self {
        Self {
            latency: Mutex::new(
                Histogram::new_with_bounds(1, 120_000_000, 3).expect("histogram bounds"),
            ),
            ok: AtomicU64::new(0),
            errors: Mutex::new(BTreeMap::new()),
            timeline: None,
        }
    }

    fn with_timeline() -> Self {
        Self {
            timeline: Some(Mutex::new(Vec::new())),
            ..Self::new()
        }
    }

    pub fn ok(&self, latency: Duration) {
        self.ok.fetch_add(1, Ordering::Relaxed);
        let micros = (latency.as_micros() as u64).clamp(1, 120_000_000);
        let _ = self.latency.lock().unwrap().record(micros);
        if let Some(timeline) = &self.timeline {
            let started = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap_or_default()
                .saturating_sub(latency);
            timeline.lock().unwrap().push((started.as_micros(), micros));
        }
    }

    /// The timeline as text, one success a line: its start (Unix microseconds) and latency
    /// (microseconds), in the order they finished.
    fn timeline_text(&self) -> Option<String> {
        let timeline = self.timeline.as_ref()?.lock().unwrap();
        Some(
            timeline
                .iter()
                .map(|(at, took)| format!("{at} {took}\n"))
                .collect(),
        )
    }

    pub fn error(&self, kind: impl Into<String>) {
        *self.errors.lock().unwrap().entry(kind.into()).or_default() += 1;
    }

    pub fn count(&self) -> u64 {
        self.ok.load(Ordering::Relaxed)
    }

    fn percentiles(&self) -> Option<Percentiles> {
        let h = self.latency.lock().unwrap();
        if h.is_empty() {
            return None;
        }
        let ms = |micros: u64| micros as f64 / 1000.0;
        Some(Percentiles {
            p50: ms(h.value_at_quantile(0.50)),
            p90: ms(h.value_at_quantile(0.90)),
            p99: ms(h.value_at_quantile(0.99)),
            p999: ms(h.value_at_quantile(0.999)),
            max: ms(h.max()),
        })
    }
}

/// Provider arrivals, matched to the events a scenario waits for by notificationId.
#[derive(Default)]
pub struct Arrivals {
    waiters: Mutex<HashMap<String, tokio::sync::oneshot::Sender<Instant>>>,
    pub apns: AtomicU64,
    pub fcm: AtomicU64,
    /// Every arrival since `keep_all`, for the chaos runs that count each phone and event.
    kept: Mutex<Option<Vec<Arrival>>>,
}

impl Arrivals {
    pub fn total(&self) -> u64 {
        self.apns.load(Ordering::Relaxed) + self.fcm.load(Ordering::Relaxed)
    }

    /// Registered before the send, since the provider can see an event before its send returns.
    pub fn expect(&self, notification_id: &str) -> tokio::sync::oneshot::Receiver<Instant> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.waiters
            .lock()
            .unwrap()
            .insert(notification_id.to_owned(), tx);
        rx
    }

    pub fn forget(&self, notification_id: &str) {
        self.waiters.lock().unwrap().remove(notification_id);
    }

    /// From now on keeps every arrival until `take_kept` hands them over.
    pub fn keep_all(&self) {
        *self.kept.lock().unwrap() = Some(Vec::new());
    }

    /// The arrivals kept since the last call (empty unless `keep_all` was called).
    pub fn take_kept(&self) -> Vec<Arrival> {
        self.kept
            .lock()
            .unwrap()
            .as_mut()
            .map(std::mem::take)
            .unwrap_or_default()
    }

    pub async fn pump(self: Arc<Self>, mut rx: tokio::sync::mpsc::UnboundedReceiver<Arrival>) {
        while let Some(arrival) = rx.recv().await {
            match arrival.provider {
                "apns" => &self.apns,
                _ => &self.fcm,
            }
            .fetch_add(1, Ordering::Relaxed);
            if let Some(id) = &arrival.notification_id
                && let Some(tx) = self.waiters.lock().unwrap().remove(id)
            {
                let _ = tx.send(arrival.at);
            }
            if let Some(kept) = self.kept.lock().unwrap().as_mut() {
                kept.push(arrival);
            }
        }
    }
}

/// What every scenario needs of the gateway under test.
pub struct Target {
    pub base: String,
    pub pids: Vec<u32>,
    /// The database server's processes, when it is PostgreSQL.
    pub database_pids: bool,
    pub http: reqwest::Client,
    pub arrivals: Arc<Arrivals>,
    pub apns: Arc<orca_push_tests::mock_apns::MockApns>,
    pub provider_latency: Duration,
    /// Where each open loop's timeline goes (`--timeline`), if anywhere.
    pub timeline: Option<std::path::PathBuf>,
}

/// Runs `work` as one measured phase of `seconds` (the work stops itself at the deadline it is
/// given), with a progress bar and the gateway's CPU and memory read around it.
pub async fn measure<F, Fut>(
    target: &Target,
    scenario: &str,
    phase: &str,
    seconds: f64,
    work: F,
) -> (Phase, Arc<Recorder>)
where
    F: FnOnce(Arc<Recorder>, Instant) -> Fut,
    Fut: Future<Output = BTreeMap<String, f64>>,
{
    // Open loops, whose latency counts from each send's scheduled start, so a stall shows at the
    // time it happened; and deliveries, each flow's next send starting as its last one ends.
    let timeline = target
        .timeline
        .as_ref()
        .filter(|_| phase.starts_with("open loop") || scenario == "deliver");
    let recorder = Arc::new(match timeline {
        Some(_) => Recorder::with_timeline(),
        None => Recorder::new(),
    });
    let bar = crate::report::phase_bar(&format!("{scenario} {phase}"), seconds);
    let ticking = {
        let bar = bar.clone();
        let recorder = recorder.clone();
        tokio::spawn(async move {
            let started = Instant::now();
            loop {
                tokio::time::sleep(Duration::from_millis(200)).await;
                bar.set_position(started.elapsed().as_millis() as u64);
                bar.set_message(format!("{} ok", recorder.count()));
            }
        })
    };
    let database_before = if target.database_pids {
        procstat::cpu_by_pid(&procstat::postgres_pids())
    } else {
        Default::default()
    };
    let database_since = Instant::now();
    let before = procstat::read(&target.pids);
    let bench_before = procstat::own_cpu_seconds();
    let started = Instant::now();
    let deadline = started + Duration::from_secs_f64(seconds);
    let extra = work(recorder.clone(), deadline).await;
    let elapsed = started.elapsed().as_secs_f64();
    let after = procstat::read(&target.pids);
    let database_cpu_percent = if target.database_pids {
        procstat::postgres_cpu_percent(&database_before, database_since)
    } else {
        0.0
    };
    let bench_cpu = procstat::own_cpu_seconds() - bench_before;
    ticking.abort();
    bar.finish_and_clear();
    if let (Some(dir), Some(text)) = (timeline, recorder.timeline_text()) {
        let name: String = format!("{scenario} {phase}")
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
            .collect();
        let path = dir.join(format!("{name}.txt"));
        if let Err(e) = std::fs::create_dir_all(dir).and_then(|()| std::fs::write(&path, text)) {
            eprintln!("orca-push-bench: cannot write {}: {e}", path.display());
        }
    }
    let errors = recorder.errors.lock().unwrap().clone();
    let ops = recorder.count();
    let row = Phase {
        scenario: scenario.to_owned(),
        phase: phase.to_owned(),
        ops,
        seconds: elapsed,
        rate: ops as f64 / elapsed.max(1e-9),
        latency_ms: recorder.percentiles(),
        errors: errors.values().sum(),
        error_kinds: errors,
        gateway_cpu_percent: procstat::cpu_percent(&before, &after),
        database_cpu_percent,
        bench_cpu_percent: 100.0 * bench_cpu / elapsed.max(1e-9),
        rss_mib: after.rss_mib,
        peak_rss_mib: after.peak_rss_mib,
        extra,
    };
    (row, recorder)
}

/// An idle gateway: what it costs doing nothing.
pub async fn idle(target: &Target, seconds: f64) -> Phase {
    measure(
        target,
        "idle",
        "no traffic",
        seconds,
        |_, deadline| async move {
            tokio::time::sleep_until(deadline.into()).await;
            BTreeMap::new()
        },
    )
    .await
    .0
}

pub fn error_kind(error: &GatewayError) -> String {
    match error {
        GatewayError::Api { status, code, .. } => format!("{status} {code}"),
        GatewayError::Http(e) if e.is_timeout() => "timeout".into(),
        GatewayError::Http(_) => "transport".into(),
        other => format!("{other}"),
    }
}

/// `handshake`: challenge + session pairs, each from a new host key at a new client IP.
pub async fn handshake(target: &Target, seconds: f64, concurrency: usize) -> Phase {
    let counter = Arc::new(AtomicU64::new(0));
    measure(
        target,
        "handshake",
        &format!("closed loop, {concurrency} at once"),
        seconds,
        |recorder, deadline| async move {
            let workers = (0..concurrency).map(|_| {
                let recorder = recorder.clone();
                let counter = counter.clone();
                async move {
                    while Instant::now() < deadline {
                        let n = counter.fetch_add(1, Ordering::Relaxed) as usize;
                        // Blocks 11.x.x.x onwards: never an address a simulated host uses.
                        let ip = population::client_ip(11 + (n >> 24) as u8, n);
                        let started = Instant::now();
                        let result = match population::client(&target.base, &target.http, &ip) {
                            Ok(client) => client.login().await.map(|_| ()),
                            Err(e) => Err(e),
                        };
                        match result {
                            Ok(()) => recorder.ok(started.elapsed()),
                            Err(e) => recorder.error(error_kind(&e)),
                        }
                    }
                }
            });
            futures::future::join_all(workers).await;
            BTreeMap::new()
        },
    )
    .await
    .0
}

pub fn alert(host: &population::Host, ids: Vec<String>, notification_id: &str) -> Value {
    json!({
        "v": 1,
        "registrationIds": ids,
        "notification": {
            "notificationId": notification_id,
            "notificationSeq": host.next_seq(),
            "notificationEpoch": host.epoch,
            "source": "agent-task-complete",
            "agentState": "finished",
            "title": "Agent finished",
            "body": "The benchmark's task is done.",
        }
    })
}

fn dismissal(host: &population::Host, ids: Vec<String>, notification_id: &str) -> Value {
    let mut body = alert(host, ids, notification_id);
    body["notification"]["kind"] = json!("dismiss");
    body
}

/// Posts one send on the pool's connections; Ok when every recipient is `queued`.
async fn post_send(pool: &Pool, host: &population::Host, body: &Value) -> Result<(), String> {
    pool.lines.send(host, body).await
}

/// One alert to every phone of the next host with budget; the deliveries it should cause.
pub async fn send_one(
    pool: Arc<Pool>,
    recorder: &Recorder,
    scheduled: Instant,
    label: &str,
) -> u64 {
    let Some(host) = pool.take(false) else {
        recorder.error("hosts' quota budget spent");
        return 0;
    };
    let id = format!("{label}-{}", uuid::Uuid::new_v4().simple());
    let body = alert(&host, host.registration_ids(None), &id);
    match post_send(&pool, &host, &body).await {
        Ok(()) => {
            recorder.ok(scheduled.elapsed());
            host.devices.len() as u64
        }
        Err(kind) => {
            recorder.error(kind);
            0
        }
    }
}

/// Waits until the providers have seen `expected` deliveries since `baseline`, or `within`.
async fn settle(target: &Target, baseline: u64, expected: u64, within: Duration) -> u64 {
    let deadline = Instant::now() + within;
    loop {
        let got = target.arrivals.total() - baseline;
        if got >= expected || Instant::now() >= deadline {
            return got;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// `send`: a closed loop at `concurrency` for the peak, then (once its deliveries are done) an
/// open loop at half of it, latency measured from each request's scheduled start so a stall is
/// not hidden. A last row counts the provider deliveries those sends caused, per second over the
/// whole scenario, with the CPU it took.
pub async fn send(
    target: &Target,
    pool: &Arc<Pool>,
    seconds: f64,
    concurrency: usize,
    fixed_rates: &[f64],
    drain_within: Duration,
) -> Vec<Phase> {
    let expected = Arc::new(AtomicU64::new(0));
    let baseline = target.arrivals.total();
    let scenario_started = Instant::now();
    let gateway_before = procstat::read(&target.pids);
    let database_before = target
        .database_pids
        .then(|| procstat::cpu_by_pid(&procstat::postgres_pids()));
    let bench_before = procstat::own_cpu_seconds();
    let (closed, _) = measure(
        target,
        "send",
        &format!("closed loop, {concurrency} at once"),
        seconds,
        |recorder, deadline| {
            let expected = expected.clone();
            async move {
                let workers = (0..concurrency).map(|_| {
                    let recorder = recorder.clone();
                    let expected = expected.clone();
                    async move {
                        while Instant::now() < deadline {
                            let caused =
                                send_one(pool.clone(), &recorder, Instant::now(), "s").await;
                            expected.fetch_add(caused, Ordering::Relaxed);
                        }
                    }
                });
                futures::future::join_all(workers).await;
                BTreeMap::new()
            }
        },
    )
    .await;
    let mut rows = vec![closed.clone()];
    let half = (closed.rate / 2.0).max(1.0);
    for (i, rate) in std::iter::once(half)
        .chain(fixed_rates.iter().copied())
        .enumerate()
    {
        // Each open loop starts on a quiet gateway, not on the backlog of deliveries before it.
        settle(
            target,
            baseline,
            expected.load(Ordering::Relaxed),
            drain_within,
        )
        .await;
        let name = if i == 0 {
            format!("open loop at {rate:.0}/s (half the peak)")
        } else {
            format!("open loop at {rate:.0}/s")
        };
        let warm_up = warm_up_open_loop(pool, rate, seconds, "o", expected.clone()).await;
        let (mut open, _) = measure(target, "send", &name, seconds, |recorder, deadline| {
            open_loop_of_sends(pool, recorder, rate, deadline, "o", expected.clone())
        })
        .await;
        open.extra.extend(warm_up);
        rows.push(open);
    }
    let expected = expected.load(Ordering::Relaxed);
    let delivered = settle(target, baseline, expected, drain_within).await;
    let elapsed = scenario_started.elapsed().as_secs_f64();
    let gateway_after = procstat::read(&target.pids);
    let mut error_kinds = BTreeMap::new();
    if delivered < expected {
        error_kinds.insert("not delivered in time".to_owned(), expected - delivered);
    }
    let deliveries = Phase {
        scenario: "send".into(),
        phase: "provider deliveries of those sends, over the whole scenario".into(),
        ops: delivered,
        seconds: elapsed,
        rate: delivered as f64 / elapsed,
        latency_ms: None,
        errors: expected.saturating_sub(delivered),
        error_kinds,
        gateway_cpu_percent: procstat::cpu_percent(&gateway_before, &gateway_after),
        database_cpu_percent: database_before.map_or(0.0, |before| {
            procstat::postgres_cpu_percent(&before, scenario_started)
        }),
        bench_cpu_percent: 100.0 * (procstat::own_cpu_seconds() - bench_before) / elapsed,
        rss_mib: gateway_after.rss_mib,
        peak_rss_mib: gateway_after.peak_rss_mib,
        extra: BTreeMap::from([("expected_deliveries".into(), expected as f64)]),
    };
    rows.push(deliveries);
    rows
}

/// Sends from `pool` at `rate` per second until `deadline` ([`open_loop`], at most 4,096 in
/// flight), each recorded from its scheduled start and adding the deliveries it should cause to
/// `caused`; the row's extra figures.
pub async fn open_loop_of_sends(
    pool: &Arc<Pool>,
    recorder: Arc<Recorder>,
    rate: f64,
    deadline: Instant,
    label: &'static str,
    caused: Arc<AtomicU64>,
) -> BTreeMap<String, f64> {
    let dropped = open_loop(rate, deadline, 4096, |scheduled| {
        let recorder = recorder.clone();
        let caused = caused.clone();
        let pool = pool.clone();
        async move {
            let deliveries = send_one(pool, &recorder, scheduled, label).await;
            caused.fetch_add(deliveries, Ordering::Relaxed);
        }
    })
    .await;
    BTreeMap::from([
        ("offered_per_second".into(), rate),
        ("not_started_over_4096_in_flight".into(), dropped as f64),
    ])
}

/// How long an open loop runs before it is measured ([`warm_up_open_loop`]), at most.
pub const OPEN_LOOP_WARM_UP: Duration = Duration::from_secs(2);

/// Runs the open loop of [`open_loop_of_sends`] at `rate` for [`OPEN_LOOP_WARM_UP`] without
/// recording it, so that the loop measured next starts with the connections that rate keeps open
/// and on a gateway already at that rate. Without it, the loop after a wrk closed loop (whose
/// connections are wrk's) opened one connection per request at its start, and that ramp, not the
/// gateway at half its peak, decided its p99 (docs/benchmarks.md, round 46). The figures it
/// returns go in the measured row's extras: the warm-up's own p99, so nothing is hidden.
pub async fn warm_up_open_loop(
    pool: &Arc<Pool>,
    rate: f64,
    seconds: f64,
    label: &'static str,
    caused: Arc<AtomicU64>,
) -> BTreeMap<String, f64> {
    // No longer than the loop it warms (a smoke run's loops last a second: the hosts' budget).
    let warm_up = OPEN_LOOP_WARM_UP.min(Duration::from_secs_f64(seconds.max(0.0)));
    let recorder = Arc::new(Recorder::new());
    let deadline = Instant::now() + warm_up;
    open_loop_of_sends(pool, recorder.clone(), rate, deadline, label, caused).await;
    let errors: u64 = recorder.errors.lock().unwrap().values().sum();
    let mut figures = BTreeMap::from([
        ("warm_up_seconds".to_owned(), warm_up.as_secs_f64()),
        ("warm_up_errors".to_owned(), errors as f64),
    ]);
    if let Some(latency) = recorder.percentiles() {
        figures.insert("warm_up_p99_ms".into(), latency.p99);
    }
    figures
}

/// Starts `task(scheduled_at)` at `rate` per second until `deadline`, never more than `cap` at
/// once (those not started are counted and returned).
pub async fn open_loop<F, Fut>(rate: f64, deadline: Instant, cap: usize, task: F) -> u64
where
    F: Fn(Instant) -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    let started = Instant::now();
    let limit = Arc::new(tokio::sync::Semaphore::new(cap));
    let mut running = tokio::task::JoinSet::new();
    let mut issued: u64 = 0;
    let mut dropped = 0;
    while Instant::now() < deadline {
        // Request i is due at i / rate: the first at once.
        let due = (started.elapsed().as_secs_f64() * rate) as u64 + 1;
        while issued < due {
            let scheduled = started + Duration::from_secs_f64(issued as f64 / rate);
            issued += 1;
            match limit.clone().try_acquire_owned() {
                Ok(permit) => {
                    let work = task(scheduled);
                    running.spawn(async move {
                        work.await;
                        drop(permit);
                    });
                }
                Err(_) => dropped += 1,
            }
        }
        while running.try_join_next().is_some() {}
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    while running.join_next().await.is_some() {}
    dropped
}

/// One end-to-end flow: an alert to one phone, then wait until the provider has it and has held
/// it for its latency (so at most `flows` requests are open at the provider), then the next.
#[allow(clippy::too_many_arguments)]
async fn flow(
    target: &Target,
    pool: &Pool,
    own_host: Option<usize>,
    platform: Platform,
    recorder: &Recorder,
    accept: &Recorder,
    deadline: Instant,
    stop: &AtomicBool,
) {
    while Instant::now() < deadline && !stop.load(Ordering::Relaxed) {
        let host = match own_host {
            Some(i) => pool.hosts[i].spend(false).then(|| pool.hosts[i].clone()),
            None => pool.take(false),
        };
        let Some(host) = host else {
            recorder.error("hosts' quota budget spent");
            return;
        };
        let id = format!("d-{}", uuid::Uuid::new_v4().simple());
        let arrived = target.arrivals.expect(&id);
        let body = alert(&host, host.registration_ids(Some(platform)), &id);
        let started = Instant::now();
        if let Err(kind) = post_send(pool, &host, &body).await {
            target.arrivals.forget(&id);
            // A well-behaved host waits out `503 busy` (Retry-After: 1) instead of hammering.
            if kind.starts_with("503") {
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
            recorder.error(kind);
            continue;
        }
        accept.ok(started.elapsed());
        match tokio::time::timeout(Duration::from_secs(30), arrived).await {
            Ok(Ok(at)) => {
                recorder.ok(at.saturating_duration_since(started));
                tokio::time::sleep_until((at + target.provider_latency).into()).await;
            }
            _ => {
                target.arrivals.forget(&id);
                recorder.error("not delivered within 30 s");
            }
        }
    }
}

/// `deliver`: `flows` end-to-end flows at once into the provider mock for `platform`. Latency is
/// accept-to-provider (from the send's start to the provider's receipt); the rate is deliveries
/// per second, against the ideal of `flows / provider latency`.
pub async fn deliver(
    target: &Target,
    pool: &Pool,
    seconds: f64,
    flows: usize,
    platform: Platform,
    window: &str,
    exclusive_hosts: bool,
) -> Phase {
    let provider = match platform {
        Platform::Ios => "APNs",
        Platform::Android => "FCM",
    };
    target.apns.reset_peak_in_flight();
    let connections_before = target.apns.connections();
    let accept = Arc::new(Recorder::new());
    let stop = Arc::new(AtomicBool::new(false));
    let (mut row, _) = measure(
        target,
        "deliver",
        &format!("{provider}, {flows} flows, window {window}"),
        seconds,
        |recorder, deadline| {
            let accept = accept.clone();
            async move {
                let flows_run = (0..flows).map(|i| {
                    let own = exclusive_hosts.then_some(i % pool.hosts.len());
                    flow(
                        target, pool, own, platform, &recorder, &accept, deadline, &stop,
                    )
                });
                futures::future::join_all(flows_run).await;
                BTreeMap::new()
            }
        },
    )
    .await;
    let latency = target.provider_latency.as_secs_f64();
    let ideal = flows as f64 / (latency + window_seconds(window));
    row.extra.insert("ideal_per_second".into(), ideal);
    row.extra.insert("ratio_to_ideal".into(), row.rate / ideal);
    if let Some(p) = accept.percentiles() {
        row.extra.insert("send_p50_ms".into(), p.p50);
        row.extra.insert("send_p99_ms".into(), p.p99);
    }
    if platform == Platform::Ios {
        row.extra.insert(
            "apns_peak_streams_in_flight".into(),
            target.apns.peak_in_flight() as f64,
        );
        row.extra.insert(
            "apns_new_connections".into(),
            (target.apns.connections() - connections_before) as f64,
        );
    }
    row
}

fn window_seconds(window: &str) -> f64 {
    window
        .strip_suffix(" ms")
        .and_then(|ms| ms.parse::<f64>().ok())
        .map_or(0.0, |ms| ms / 1000.0)
}

/// `mixed`: an open loop of a realistic blend at `rate` operations per second: single alerts to
/// every phone of a host, bursts of several alerts from one host (which the window folds into a
/// summary), dismissals of a host's last alert, re-registrations with a new token, device lists.
pub async fn mixed(target: &Target, pool: &Arc<Pool>, seconds: f64, rate: f64) -> Phase {
    let counts: Arc<Mutex<BTreeMap<String, f64>>> = Arc::default();
    let arrivals_before = target.arrivals.total();
    let (mut row, _) = measure(
        target,
        "mixed",
        &format!("open loop at {rate:.0} ops/s"),
        seconds,
        |recorder, deadline| {
            let counts = counts.clone();
            async move {
                let dropped = open_loop(rate, deadline, 4096, |scheduled| {
                    let recorder = recorder.clone();
                    let counts = counts.clone();
                    let roll: u32 = rand::thread_rng().gen_range(0..100);
                    let pool = pool.clone();
                    async move {
                        let (kind, result) = mixed_op(&pool, roll).await;
                        *counts.lock().unwrap().entry(kind.into()).or_default() += 1.0;
                        match result {
                            Ok(()) => recorder.ok(scheduled.elapsed()),
                            Err(e) => recorder.error(format!("{kind}: {e}")),
                        }
                    }
                })
                .await;
                let mut extra = counts.lock().unwrap().clone();
                extra.insert("not_started_over_4096_in_flight".into(), dropped as f64);
                extra
            }
        },
    )
    .await;
    row.extra.insert(
        "provider_deliveries".into(),
        (target.arrivals.total() - arrivals_before) as f64,
    );
    row
}

async fn mixed_op(pool: &Pool, roll: u32) -> (&'static str, Result<(), String>) {
    let dismiss = (80..90).contains(&roll);
    let Some(host) = pool.take(dismiss) else {
        return ("any", Err("hosts' quota budget spent".into()));
    };
    let ids = host.registration_ids(None);
    match roll {
        0..=69 => {
            let id = format!("m-{}", uuid::Uuid::new_v4().simple());
            (
                "alert",
                post_send(pool, &host, &alert(&host, ids, &id)).await,
            )
        }
        70..=79 => {
            // A burst: five alerts from one host at once, as when several agents finish together.
            let sends = (0..5).map(|_| {
                let id = format!("m-{}", uuid::Uuid::new_v4().simple());
                let body = alert(&host, ids.clone(), &id);
                let host = host.clone();
                async move { post_send(pool, &host, &body).await }
            });
            let results = futures::future::join_all(sends).await;
            let first_error = results.into_iter().find_map(Result::err);
            for _ in 0..4 {
                host.spend(false);
            }
            ("burst of 5", first_error.map_or(Ok(()), Err))
        }
        80..=89 => {
            // A dismissal for a notification the host alerted about just before.
            let id = format!("m-{}", uuid::Uuid::new_v4().simple());
            host.spend(false);
            let _ = post_send(pool, &host, &alert(&host, ids.clone(), &id)).await;
            (
                "dismiss",
                post_send(pool, &host, &dismissal(&host, ids, &id)).await,
            )
        }
        90..=94 => {
            let device = &host.devices[roll as usize % host.devices.len()];
            let token = population::fresh_token(device.platform);
            let body = population::registration_body(device.platform, &device.device_id, &token);
            let result = host
                .client
                .call(Method::POST, "/v1/devices", Some(&body))
                .await
                .map(|_| ())
                .map_err(|e| error_kind(&e));
            ("re-register", result)
        }
        _ => {
            let result = host
                .client
                .call(Method::GET, "/v1/devices", None)
                .await
                .map(|_| ())
                .map_err(|e| error_kind(&e));
            ("list devices", result)
        }
    }
}
