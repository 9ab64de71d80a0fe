//! A million distinct client IPs through the real router: the facade's limiter state stays under its
//! cap, its memory under a stated bound, and it sheds that state once the flood is over.
//! (Alone in its binary so the RSS it reads is its own.)

use std::time::Duration;

use axum::body::Body;
use axum::http::Request;
use orca_push::app::{AppState, router};
use orca_push::backends::{BackendTargets, Backends};
use orca_push::limits::{Limits, MAX_KEYS_PER_MAP};
use tower::ServiceExt as _;

/// The stated bound: limiter state may grow the facade by at most this much, whatever the flood.
const MAX_GROWTH_BYTES: u64 = 64 * 1024 * 1024;

fn rss_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("procfs");
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS");
    kb * 1024
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_million_distinct_ips_leave_memory_bounded() {
    // No service is reached: each request is charged to its IP's bucket, then refused for its body.
    let nowhere = "http://127.0.0.1:9".to_owned();
    let backends = Backends::connect(
        &BackendTargets {
            auth: nowhere.clone().into(),
            registry: nowhere.clone().into(),
            queue: nowhere.clone().into(),
            sender: nowhere.into(),
        },
        &orca_push_internal_auth::InternalKey::generate(),
    )
    .unwrap();
    let limits = Limits::new(0);
    let app = router(AppState::serving(backends, limits.clone()));
    let send = |i: u32| {
        let app = app.clone();
        async move {
            let ip = std::net::Ipv4Addr::from(i.wrapping_add(0x0b00_0000));
            let request = Request::post("/v1/host/session")
                .header("x-forwarded-for", ip.to_string())
                .body(Body::from(r#"{"v":1}"#))
                .unwrap();
            app.oneshot(request).await.unwrap().status().as_u16()
        }
    };
    for i in 0..50_000 {
        assert_eq!(send(i).await, 400);
    }
    let baseline = rss_bytes();
    let mut peak_keys = 0;
    for i in 50_000..1_000_000 {
        let status = send(i).await;
        // Past the cap the flood shares one overflow bucket: 400 while it has tokens, then 429.
        assert!(status == 400 || status == 429, "{status}");
        if i % 10_000 == 0 {
            peak_keys = peak_keys.max(limits.tracked_keys());
        }
    }
    let grown = rss_bytes().saturating_sub(baseline);
    println!(
        "limiter keys at peak: {peak_keys}; RSS growth over the flood: {} KiB",
        grown / 1024
    );
    assert!(peak_keys <= MAX_KEYS_PER_MAP, "{peak_keys}");
    assert!(grown < MAX_GROWTH_BYTES, "grew {grown} bytes");
    // governor forgets a key once its state is indistinguishable from a fresh one: two emission
    // intervals (2 x 2 s) after its last use. Then a sweep drops every bucket of the flood.
    tokio::time::sleep(Duration::from_millis(4_100)).await;
    limits.sweep();
    assert_eq!(limits.tracked_keys(), 0);
}
