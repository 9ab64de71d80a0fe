//! A forged-bearer flood from one IP next to a real host on the same IP, against a real gateway:
//! the host is never refused, the flood never reaches auth, and the gateway's memory stays flat.
//! It prints its figures (docs/reliability.md); `FLOOD_REQUESTS` sets the flood's size.

use std::time::{Duration, Instant};

use futures::StreamExt as _;
use orca_push_host::HostKey;
use orca_push_tests::{Backend, Gateway, Raw, bearer, metric_sum};

const IP: &str = "203.0.113.7";

fn rss_mib(pid: u32) -> f64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        })
        .map_or(0.0, |kb| kb / 1024.0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forged_bearer_flood_next_to_a_real_host_on_its_ip_costs_no_look_ups() {
    let flood: usize = std::env::var("FLOOD_REQUESTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(5_000);
    let mut gateway = Gateway::start(Backend::Sqlite).await;
    let raw = Raw::new(&gateway);
    let from_ip = [("x-forwarded-for", IP)];
    let auth = bearer(&raw.login(&HostKey::generate(), &from_ip).await);
    let metrics = gateway.process("all").metrics_url();
    let pid = gateway.process("all").pid().unwrap();
    let look_ups = |text: &str| {
        metric_sum(
            text,
            "orca_push_grpc_server_calls_total",
            &[("method", "Authenticate")],
        )
    };
    let before = reqwest::get(&metrics).await.unwrap().text().await.unwrap();
    let rss_before = rss_mib(pid);

    // The real host keeps working: one request every 20 ms for the whole flood.
    let stop = tokio_util::sync::CancellationToken::new();
    let host = {
        let (raw, auth, stop) = (Raw::new(&gateway), auth.clone(), stop.clone());
        tokio::spawn(async move {
            let mut latencies = Vec::new();
            let mut refused = 0;
            while !stop.is_cancelled() {
                let started = Instant::now();
                let reply = raw
                    .get(
                        "/v1/devices",
                        &[("authorization", &auth), ("x-forwarded-for", IP)],
                    )
                    .await;
                latencies.push(started.elapsed());
                if reply.status != 200 {
                    refused += 1;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            (latencies, refused)
        })
    };

    let http = reqwest::Client::new();
    let url = gateway.url("/v1/devices");
    let started = Instant::now();
    let statuses: Vec<u16> = futures::stream::iter(0..flood)
        .map(|i| {
            let (http, url) = (http.clone(), url.clone());
            async move {
                // 43 characters of base64url, like a real token, and never a valid one.
                let forged = format!("{i:0>43}");
                http.get(&url)
                    .header("authorization", format!("Bearer {forged}"))
                    .header("x-forwarded-for", IP)
                    .send()
                    .await
                    .map_or(0, |r| r.status().as_u16())
            }
        })
        .buffer_unordered(32)
        .collect()
        .await;
    let took = started.elapsed();
    stop.cancel();
    let (mut latencies, refused) = host.await.unwrap();
    let after = reqwest::get(&metrics).await.unwrap().text().await.unwrap();
    let rss_after = rss_mib(pid);

    let count = |code: u16| statuses.iter().filter(|s| **s == code).count();
    latencies.sort();
    let p99 = latencies[(latencies.len() * 99 / 100).min(latencies.len() - 1)];
    println!(
        "forged-bearer flood: {flood} requests in {took:.1?} ({:.0}/s), 401: {}, 429: {}, other: {}; \
         auth look-ups during the flood: {}; real host on the same IP: {} requests, {refused} refused, \
         p99 {p99:.1?}; gateway RSS {rss_before:.1} -> {rss_after:.1} MiB",
        flood as f64 / took.as_secs_f64(),
        count(401),
        count(429),
        flood - count(401) - count(429),
        look_ups(&after) - look_ups(&before),
        latencies.len(),
    );
    assert_eq!(refused, 0, "the real host was refused");
    assert_eq!(count(401) + count(429), flood, "only 401 and 429");
    // The IP's budget: 30, refilling one every 2 s.
    let budget = 31.0 + took.as_secs_f64() / 2.0;
    assert!(
        count(401) as f64 <= budget,
        "the IP's budget is 30 a minute"
    );
    // The host's own look-ups (about one a second) are all auth sees.
    assert!(
        look_ups(&after) - look_ups(&before) <= took.as_secs_f64() + 3.0,
        "forged bearers reached auth"
    );
    assert!(rss_after - rss_before < 32.0, "memory grew");
}
