//! Process deaths and stops: a sender SIGKILLed mid-burst loses nothing, and SIGTERM finishes what
//! is in flight within the 9 s grace and leaves the rest for later.

use std::collections::HashMap;
use std::time::Duration;

use orca_push_host::HostKey;
use orca_push_storage::Pool;
use orca_push_tests::mock_apns::MockApns;
use orca_push_tests::{Backend, Gateway, Raw, bearer, on_both_backends};
use serde_json::{Value, json};

const TOKEN: &str = "c0ffee0123456789";

fn alert(seq: u64) -> Value {
    json!({
        "notificationId": format!("task-{seq}"), "notificationSeq": seq, "notificationEpoch": "epoch-1",
        "source": "agent-task-complete", "agentState": "finished", "title": "Done", "body": "",
    })
}

async fn host_with_device(gateway: &Gateway, token: &str) -> (Raw, String, String) {
    let raw = Raw::new(gateway);
    let auth = bearer(&raw.login(&HostKey::generate(), &[]).await);
    let id = raw.register(&auth, &json!({ "v": 1, "deviceId": token, "platform": "ios", "token": token, "apnsEnvironment": "production" })).await;
    (raw, auth, id)
}

async fn send(raw: &Raw, auth: &str, id: &str, seq: u64) -> orca_push_tests::Answer {
    raw.post(
        "/v1/send",
        &json!({ "v": 1, "registrationIds": [id], "notification": alert(seq) }),
        &[("authorization", auth)],
    )
    .await
}

on_both_backends!(a_sender_killed_mid_burst_loses_nothing);

async fn a_sender_killed_mid_burst_loses_nothing(backend: Backend) {
    let apns = MockApns::start().await;
    apns.set_latency(Duration::from_millis(400));
    let mut env = apns.env();
    env.push(("ORCA_PUSH_COALESCE_MS".into(), "0".into()));
    env.push(("ORCA_PUSH_LEASE_MS".into(), "2000".into()));
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let mut gateway = Gateway::start_split_with(backend, &env).await;
    let (raw, auth, id) = host_with_device(&gateway, TOKEN).await;

    // A burst of 200 alerts; the sender dies once deliveries are under way.
    let mut killed_at = None;
    for seq in 0..200 {
        let reply = send(&raw, &auth, &id, seq).await;
        assert_eq!(reply.body["results"][0]["status"], "queued", "{seq}");
        if seq == 100 {
            apns.wait_for(TOKEN, 20, Duration::from_secs(20)).await;
            gateway.process("sender").kill().await;
            killed_at = Some(std::time::Instant::now());
        }
    }
    let killed_at = killed_at.expect("killed mid-burst");
    let at_kill = apns.calls_for(TOKEN).len();
    gateway.process("sender").respawn().await;

    // After the leases lapse, another sender delivers everything.
    let deadline = std::time::Instant::now() + Duration::from_secs(90);
    let mut first_at: HashMap<String, std::time::Instant> = HashMap::new();
    let delivered = loop {
        let calls = apns.calls_for(TOKEN);
        let mut by_id: HashMap<String, Vec<String>> = HashMap::new();
        for call in &calls {
            let id = call.body["orca"]["notificationId"]
                .as_str()
                .unwrap()
                .to_owned();
            first_at.entry(id.clone()).or_insert(call.at);
            by_id
                .entry(id)
                .or_default()
                .push(call.headers["apns-collapse-id"].clone());
        }
        if by_id.len() == 200 {
            break by_id;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{} of 200 delivered",
            by_id.len()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let twice: Vec<_> = delivered.iter().filter(|(_, c)| c.len() > 1).collect();
    println!(
        "killed after {at_kill} requests; {} alerts delivered twice (in flight at the kill)",
        twice.len()
    );
    for (id, collapse_ids) in &delivered {
        assert!(
            collapse_ids.len() <= 2,
            "{id} delivered {} times",
            collapse_ids.len()
        );
        assert!(
            collapse_ids.iter().all(|c| c == &collapse_ids[0]),
            "a repeat keeps its collapse id"
        );
    }
    // Only what was in flight at the kill can repeat: sent in the last moments before it (the
    // provider's 400 ms, the report's flush, a loaded machine's slack), not whatever was ever
    // delivered before it.
    assert!(twice.len() <= at_kill);
    for (id, _) in &twice {
        let first = first_at[id.as_str()];
        assert!(
            first <= killed_at && killed_at.duration_since(first) < Duration::from_secs(3),
            "{id} was sent {:?} before the kill, answered and reported long before it, and sent again",
            killed_at.saturating_duration_since(first)
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_finishes_in_flight_work_within_the_grace_and_loses_nothing() {
    let apns = MockApns::start().await;
    apns.set_latency(Duration::from_secs(3));
    let mut env = apns.env();
    env.push(("ORCA_PUSH_COALESCE_MS".into(), "0".into()));
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let mut gateway = Gateway::start_with(Backend::Sqlite, &env).await;
    let (raw, auth, id) = host_with_device(&gateway, TOKEN).await;
    for seq in 0..10 {
        send(&raw, &auth, &id, seq).await;
    }
    apns.wait_for(TOKEN, 10, Duration::from_secs(10)).await;
    // Ten deliveries are in flight (each takes 3 s at the provider). Stop the process.
    let exited = gateway
        .process("all")
        .terminate(Duration::from_secs(12))
        .await;
    let exited = exited.expect("exited");
    assert!(exited < Duration::from_secs(9), "exited after {exited:?}");
    assert!(
        exited >= Duration::from_millis(1500),
        "waited for the in-flight sends ({exited:?})"
    );
    assert_eq!(apns.completed(), 10, "every in-flight send finished");
    let sql = "SELECT status FROM push_event_recipients";
    let statuses: Vec<String> =
        match orca_push_storage::open(&gateway.database, &orca_push_queue::STORAGE)
            .await
            .unwrap()
        {
            Pool::Sqlite(p) => sqlx::query_scalar(sql).fetch_all(&p).await.unwrap(),
            Pool::Postgres(p) => sqlx::query_scalar(sql).fetch_all(&p).await.unwrap(),
        };
    assert_eq!(statuses.len(), 10);
    assert!(statuses.iter().all(|s| s == "sent"), "{statuses:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_draining_gateway_refuses_new_work_and_recovers_the_rest_after_restart() {
    let apns = MockApns::start().await;
    apns.set_latency(Duration::from_secs(2));
    let mut env = apns.env();
    // A long window: admitted alerts wait in it while the process stops.
    env.push(("ORCA_PUSH_COALESCE_MS".into(), "4000".into()));
    env.push(("ORCA_PUSH_LEASE_MS".into(), "2000".into()));
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let mut gateway = Gateway::start_with(Backend::Sqlite, &env).await;
    let (raw, auth, id) = host_with_device(&gateway, TOKEN).await;
    for seq in 0..3 {
        assert_eq!(
            send(&raw, &auth, &id, seq).await.body["results"][0]["status"],
            "queued"
        );
    }
    // A dismissal goes at once and keeps the provider busy for 2 s: the process drains meanwhile.
    let mut dismissal = alert(10);
    dismissal["kind"] = json!("dismiss");
    dismissal["notificationId"] = json!("another-task");
    raw.post(
        "/v1/send",
        &json!({ "v": 1, "registrationIds": [id], "notification": dismissal }),
        &[("authorization", &auth)],
    )
    .await;
    apns.wait_for(TOKEN, 1, Duration::from_secs(10)).await;
    let pid = gateway.process("all").pid().unwrap();
    let _ = std::process::Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status();
    // The facade refuses new work first, while the in-flight send finishes.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let reply = send(&raw, &auth, &id, 99).await;
    assert_eq!((reply.status, reply.error()), (503, Some("shutting_down")));
    assert_eq!(raw.get("/ready", &[]).await.status, 503);
    assert!(
        gateway
            .process("all")
            .terminate(Duration::from_secs(10))
            .await
            .is_some()
    );
    assert_eq!(apns.completed(), 1, "the in-flight dismissal finished");
    assert_eq!(
        apns.calls_for(TOKEN).len(),
        1,
        "the alerts' window had not ended"
    );
    // Nothing admitted was lost: a new process delivers the burst as one summary.
    gateway.process("all").respawn().await;
    let calls = apns.wait_for(TOKEN, 2, Duration::from_secs(20)).await;
    assert_eq!(calls[1].body["orca"]["coalescedCount"], 3);
}

/// A deploy migrates before it moves traffic, so the previous build keeps running on the migrated
/// database: it restarts, scales out, and is what a rollback starts again. Each service leaves
/// migrations newer than it knows alone rather than refuse to start.
async fn an_older_build_starts_on_a_database_a_newer_one_migrated(
    backend: orca_push_storage::testing::Backend,
) {
    let (config, _guard) = orca_push_storage::testing::fresh(backend).await;
    const NEWER: &str = "INSERT INTO _sqlx_migrations \
        (version, description, success, checksum, execution_time) VALUES ($1, $2, TRUE, $3, 0)";
    for service in ["auth", "registry", "queue"] {
        let migrate = || async {
            match service {
                "auth" => orca_push_auth::open_and_migrate(&config).await,
                "registry" => orca_push_registry::open_and_migrate(&config).await,
                _ => orca_push_queue::open_and_migrate(&config).await,
            }
        };
        let pool = migrate().await.unwrap();
        let (version, description, checksum) = (99_999_i64, "from a newer build", vec![0u8; 48]);
        match &pool {
            Pool::Sqlite(p) => sqlx::query(NEWER)
                .bind(version)
                .bind(description)
                .bind(checksum)
                .execute(p)
                .await
                .map(drop),
            Pool::Postgres(p) => sqlx::query(NEWER)
                .bind(version)
                .bind(description)
                .bind(checksum)
                .execute(p)
                .await
                .map(drop),
        }
        .unwrap();
        migrate()
            .await
            .unwrap_or_else(|e| panic!("{service} refused a newer database: {e}"));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_older_build_starts_on_a_database_a_newer_one_migrated_on_sqlite() {
    an_older_build_starts_on_a_database_a_newer_one_migrated(
        orca_push_storage::testing::Backend::Sqlite,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_older_build_starts_on_a_database_a_newer_one_migrated_on_postgresql() {
    an_older_build_starts_on_a_database_a_newer_one_migrated(
        orca_push_storage::testing::Backend::Postgres,
    )
    .await;
}

/// One process owns a SQLite queue (its writer counts the quota in memory): a second `serve` (all
/// in one, or the queue alone) on the same data folder is refused at start, saying why, before it
/// migrates anything, and the first goes on serving. Once the first has stopped, however it
/// stopped, the folder can be served again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_process_on_a_sqlite_data_folder_is_refused() {
    let mut gateway = Gateway::start(Backend::Sqlite).await;
    // All in one, and the queue alone (`--service queue`, as split mode runs it): each takes the
    // folder's lock on its own path.
    let all_in_one: [(&str, String); 0] = [];
    let queue_alone = [
        (
            "ORCA_PUSH_INTERNAL_KEY",
            orca_push_tests::INTERNAL_KEY.to_owned(),
        ),
        (
            "ORCA_PUSH_GRPC_ADDR",
            format!("127.0.0.1:{}", orca_push_tests::free_port()),
        ),
    ];
    let second = |args: &[&str], env: &[(&str, String)]| {
        tokio::process::Command::new(orca_push_tests::binary())
            .args(args)
            .env("ORCA_PUSH_DATA_DIR", gateway.data_dir())
            .env("PORT", orca_push_tests::free_port().to_string())
            .env("ORCA_PUSH_METRICS_ADDR", "127.0.0.1:0")
            .env_remove("ORCA_PUSH_DATABASE_URL")
            .env_remove("ORCA_PUSH_GRPC_ADDR")
            .env_remove("ORCA_PUSH_PUBLIC_URL")
            .env_remove("ORCA_PUSH_TRUSTED_PROXY_HOPS")
            .env_remove("ORCA_PUSH_INTERNAL_KEY")
            .envs(env.iter().cloned())
            .kill_on_drop(true)
            .output()
    };
    for (args, env) in [
        (&["serve"][..], &all_in_one[..]),
        (&["serve", "--service", "queue"][..], &queue_alone[..]),
    ] {
        let out = tokio::time::timeout(Duration::from_secs(30), second(args, env))
            .await
            .expect("refused at once")
            .unwrap();
        assert!(!out.status.success(), "{args:?} ran");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            stderr.contains("another process serves the SQLite queue"),
            "{args:?}: {stderr}"
        );
    }
    let (raw, auth, id) = host_with_device(&gateway, TOKEN).await;
    assert_eq!(send(&raw, &auth, &id, 1).await.status, 200);
    // SIGKILL: the kernel lets go of the lock with the process.
    gateway.process("all").kill().await;
    gateway.process("all").respawn().await;
    let (raw, auth, id) = host_with_device(&gateway, TOKEN).await;
    assert_eq!(send(&raw, &auth, &id, 2).await.status, 200);
}
