//! The host SDK's duties against a real `orca-push serve` with mock providers: typed calls, the
//! 401 race, the session a CLI login shares with a running desktop, the dispatcher (filters,
//! batches of 20, silent requests, burst suppression, dead registrations, dismissals), the
//! registration throttle, and the unregister outbox across a host restart and a gateway outage.
//!
//! These are host-side duties: the gateway's backend does not change them, so they run on SQLite.

use std::sync::Arc;
use std::time::Duration;

use orca_push_host::api::{
    AgentState, ErrorCode, Kind, Notification, Platform, SendRequest, SendStatus, Source,
};
use orca_push_host::{
    DispatchConfig, DispatchEvent, Dispatcher, GatewayClient, GatewayError, HostFilter, HostKey,
    NotRegistered, Outcome, RegisterOutcome, Registrar, RegistrarConfig, RegistrationStore,
    UnregisterOutbox,
};
use orca_push_storage::Pool;
use orca_push_tests::mock_fcm::fcm_error;
use orca_push_tests::world::{WAIT, World};
use orca_push_tests::{Backend, Gateway, now_ms};

fn fcm_token(name: &str) -> String {
    format!("{name}-{}", "f".repeat(40))
}

fn notification(seq: u64) -> Notification {
    Notification {
        notification_id: Some(format!("n-{seq}")),
        notification_seq: seq,
        notification_epoch: "epoch-1".into(),
        source: Source::AgentTaskComplete,
        agent_state: Some(AgentState::Finished),
        title: "Task done".into(),
        body: "The agent finished.".into(),
        worktree_id: None,
        kind: None,
        expires_at: None,
        sound: None,
    }
}

fn event(seq: u64, emitted_at: u64) -> DispatchEvent {
    DispatchEvent {
        notification_id: Some(format!("n-{seq}")),
        notification_seq: seq,
        notification_epoch: "epoch-1".into(),
        source: Source::AgentTaskComplete,
        agent_state: Some("done".into()),
        title: "Task done".into(),
        body: "The agent finished.".into(),
        worktree_id: None,
        kind: Kind::Alert,
        expires_at: None,
        emitted_at: Some(emitted_at),
        desktop_allowed: true,
    }
}

/// Challenges the gateway has issued so far: each login costs exactly one.
async fn challenges(gateway: &Gateway) -> i64 {
    let sql = "SELECT COUNT(*) FROM push_challenges";
    match gateway.auth_pool().await {
        Pool::Sqlite(p) => sqlx::query_scalar(sql).fetch_one(&p).await.unwrap(),
        Pool::Postgres(p) => sqlx::query_scalar(sql).fetch_one(&p).await.unwrap(),
    }
}

fn registrar(
    client: &Arc<GatewayClient>,
    dir: &std::path::Path,
    config: RegistrarConfig,
) -> Registrar<GatewayClient> {
    Registrar::new(
        client.clone(),
        Arc::new(RegistrationStore::open(dir).unwrap()),
        Arc::new(UnregisterOutbox::open(dir).unwrap()),
        config,
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn typed_calls_carry_the_contracts_shapes_and_codes() {
    let world = World::start(Backend::Sqlite, "0").await;
    let client = GatewayClient::new(&world.gateway.base, HostKey::generate()).unwrap();
    let health = client.health().await.unwrap();
    assert_eq!(
        health.delivery_protocol,
        orca_push_host::api::DELIVERY_PROTOCOL_WITH_KIND
    );
    let token = fcm_token("typed");
    let request = orca_push_host::api::RegisterRequest {
        v: orca_push_host::api::V1,
        device_id: "phone-1".into(),
        platform: Platform::Android,
        token: token.clone(),
        apns_environment: None,
        filter: None,
    };
    let id = client.register(&request).await.unwrap().registration_id;
    let listed = client.devices().await.unwrap();
    assert_eq!(listed.devices.len(), 1);
    assert_eq!(listed.devices[0].registration_id, id);
    assert_eq!(listed.devices[0].platform, Platform::Android);

    let reply = client
        .send(&SendRequest::new(
            vec![id.clone(), "nobody".into()],
            notification(1),
        ))
        .await
        .unwrap();
    assert_eq!(reply.results[0].status, SendStatus::Queued);
    assert_eq!(reply.results[1].status, SendStatus::Error);
    world.fcm.wait_for(&token, 1, WAIT).await;

    // Refused locally, before anything is sent: 21 ids.
    let ids = (0..21).map(|i| format!("r{i}")).collect();
    let refused = client
        .send(&SendRequest::new(ids, notification(2)))
        .await
        .unwrap_err();
    assert!(matches!(refused, GatewayError::Invalid(_)), "{refused:?}");

    client.unregister(&id).await.unwrap();
    let again = client.unregister(&id).await.unwrap_err();
    assert_eq!(again.code(), Some(ErrorCode::NotFound));
    assert_eq!(again.status(), Some(404));
    assert!(!again.is_retryable());
    // A token the gateway refuses comes back as the contract's code, typed.
    let mut ios = request.clone();
    ios.platform = Platform::Ios;
    ios.apns_environment = Some(orca_push_host::api::ApnsEnvironment::Sandbox);
    ios.token = "not-hex-but-long-enough".repeat(2);
    let invalid = client.register(&ios).await.unwrap_err();
    assert!(matches!(invalid, GatewayError::Invalid(_)), "{invalid:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_401s_cost_one_login_and_keep_every_task_working() {
    let gateway = Gateway::start(Backend::Sqlite).await;
    let key = HostKey::generate();
    let desktop = Arc::new(GatewayClient::new(&gateway.base, key.clone()).unwrap());
    desktop.session().await.unwrap();
    // Another process of this host (without a shared session file) logs in: the gateway keeps
    // one session per host, so the desktop's token is now refused.
    let other = GatewayClient::new(&gateway.base, key.clone()).unwrap();
    other.login().await.unwrap();
    let before = challenges(&gateway).await;
    // All eight start together, each with the refused token in hand.
    let barrier = Arc::new(tokio::sync::Barrier::new(8));
    let tasks: Vec<_> = (0..8)
        .map(|_| {
            let desktop = desktop.clone();
            let barrier = barrier.clone();
            tokio::spawn(async move {
                barrier.wait().await;
                desktop.devices().await
            })
        })
        .collect();
    for task in tasks {
        task.await.unwrap().expect("every task gets through");
    }
    assert_eq!(
        challenges(&gateway).await - before,
        1,
        "eight concurrent 401s prove the key once, not once each"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cli_login_shares_the_desktops_session_instead_of_revoking_it() {
    let gateway = Gateway::start(Backend::Sqlite).await;
    let dir = tempfile::tempdir().unwrap();
    let key_path = dir.path().join("host.key");
    HostKey::generate().save_new(&key_path).unwrap();
    let session_file = key_path.with_extension("session");
    let desktop = GatewayClient::new(&gateway.base, HostKey::load(&key_path).unwrap())
        .unwrap()
        .with_session_file(session_file.clone());
    desktop.devices().await.unwrap();
    let cli = |extra: &[&str]| {
        let mut args = vec!["host", "login", "--gateway", &gateway.base, "--key"];
        args.push(key_path.to_str().unwrap());
        args.extend_from_slice(extra);
        let out = std::process::Command::new(orca_push_tests::binary())
            .args(&args)
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
    };
    let before = challenges(&gateway).await;
    cli(&[]);
    assert_eq!(
        challenges(&gateway).await,
        before,
        "the cached session is reused"
    );
    desktop
        .devices()
        .await
        .expect("the desktop keeps its session");

    // A forced login replaces the session; the desktop's next call is refused once, finds the new
    // session in the shared file, and proves nothing itself.
    cli(&["--force"]);
    assert_eq!(challenges(&gateway).await, before + 1);
    desktop
        .devices()
        .await
        .expect("the desktop picks up the new session");
    assert_eq!(challenges(&gateway).await, before + 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dispatcher_filters_batches_and_drops_dead_registrations() {
    let world = World::start(Backend::Sqlite, "0").await;
    let dir = tempfile::tempdir().unwrap();
    let client = Arc::new(GatewayClient::new(&world.gateway.base, HostKey::generate()).unwrap());
    let registrar = registrar(&client, dir.path(), RegistrarConfig::default());
    let register = |name: String, filter: HostFilter| {
        let registrar = &registrar;
        async move {
            match registrar
                .register(&name, Platform::Android, &fcm_token(&name), None, filter)
                .await
            {
                RegisterOutcome::Registered { registration_id } => registration_id,
                other => panic!("{name}: {other:?}"),
            }
        }
    };
    // 21 audible phones (a full batch and one more), one silent, one wanting plugins only.
    let mut audible = Vec::new();
    for i in 0..21 {
        audible.push(register(format!("phone-{i}"), HostFilter::everything()).await);
    }
    let mut silent_filter = HostFilter::everything();
    silent_filter.sound = Some(false);
    let silent = register("quiet".into(), silent_filter).await;
    let mut plugins = HostFilter::everything();
    plugins.sources = vec![Source::Plugin];
    let plugin_only = register("plugins".into(), plugins).await;

    let store = registrar.store().clone();
    let dispatcher = Dispatcher::new(client.clone(), store.clone(), DispatchConfig::default());
    let t0 = now_ms();
    let report = dispatcher.dispatch(event(1, t0)).await;
    let sizes: Vec<(usize, bool)> = report
        .requests
        .iter()
        .map(|r| (r.registration_ids.len(), r.silent))
        .collect();
    assert_eq!(
        sizes
            .iter()
            .filter(|(_, s)| !s)
            .map(|(n, _)| n)
            .sum::<usize>(),
        21
    );
    assert!(sizes.iter().all(|(n, _)| *n <= 20), "{sizes:?}");
    assert!(
        sizes.contains(&(1, true)),
        "the silent phone has a request of its own"
    );
    assert!(report.skipped.contains_key(&plugin_only));
    for id in audible.iter().chain([&silent]) {
        assert_eq!(
            report.outcomes.get(id),
            Some(&Outcome::Status(SendStatus::Queued))
        );
    }
    for i in 0..21 {
        world
            .fcm
            .wait_for(&fcm_token(&format!("phone-{i}")), 1, WAIT)
            .await;
    }
    let quiet = world.fcm.wait_for(&fcm_token("quiet"), 1, WAIT).await;
    assert_eq!(
        quiet[0].message["android"]["notification"]["channel_id"],
        "orca-desktop-silent"
    );
    assert!(world.fcm.calls_for(&fcm_token("plugins")).is_empty());

    // Within 5 s of the last alert, a phone gets no second one; a working agent sends nothing.
    let burst = dispatcher.dispatch(event(2, t0 + 1_000)).await;
    assert!(burst.requests.is_empty(), "{burst:?}");
    let mut working = event(3, t0 + 10_000);
    working.agent_state = Some("working".into());
    assert!(dispatcher.dispatch(working).await.not_final);

    // A dismissal goes to this gateway (deliveryProtocol 2) as a silent data message.
    let mut dismissal = event(1, t0 + 10_000);
    dismissal.kind = Kind::Dismiss;
    let report = dispatcher.dispatch(dismissal).await;
    assert_eq!(report.delivery_protocol, Some(2));
    let calls = world.fcm.wait_for(&fcm_token("phone-0"), 2, WAIT).await;
    assert_eq!(calls[1].message["data"]["kind"], "dismiss");

    // The provider says phone-0's token is gone: the gateway marks it dead, and the next dispatch
    // drops exactly that registration here.
    world.fcm.script(
        &fcm_token("phone-0"),
        vec![fcm_error(404, "NOT_FOUND", "UNREGISTERED", "gone")],
    );
    dispatcher.dispatch(event(4, t0 + 20_000)).await;
    world.fcm.wait_for(&fcm_token("phone-0"), 3, WAIT).await;
    world.wait_outcome(&audible[0], "dead").await;
    let report = dispatcher.dispatch(event(5, t0 + 30_000)).await;
    assert_eq!(
        report.outcomes.get(&audible[0]),
        Some(&Outcome::Status(SendStatus::Dead))
    );
    assert_eq!(report.dropped_dead, vec![audible[0].clone()]);
    assert!(store.get("phone-0").is_none());
    assert!(store.get("phone-1").is_some());
    dispatcher.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registering_is_throttled_per_device_and_keeps_the_earlier_registration() {
    let gateway = Gateway::start(Backend::Sqlite).await;
    let dir = tempfile::tempdir().unwrap();
    let client = Arc::new(GatewayClient::new(&gateway.base, HostKey::generate()).unwrap());
    let registrar = registrar(&client, dir.path(), RegistrarConfig::default());
    let mut first = None;
    for i in 0..10 {
        let outcome = registrar
            .register(
                "phone",
                Platform::Android,
                &fcm_token(&format!("t{i}")),
                None,
                HostFilter::everything(),
            )
            .await;
        let RegisterOutcome::Registered { registration_id } = outcome else {
            panic!("{i}: {outcome:?}");
        };
        first.get_or_insert(registration_id);
    }
    let eleventh = registrar
        .register(
            "phone",
            Platform::Android,
            &fcm_token("t10"),
            None,
            HostFilter::everything(),
        )
        .await;
    assert_eq!(
        eleventh,
        RegisterOutcome::NotRegistered(NotRegistered::Throttled)
    );
    let stored = registrar.store().get("phone").unwrap();
    assert_eq!(
        stored.token,
        fcm_token("t9"),
        "the earlier registration is untouched"
    );
    assert_eq!(Some(stored.registration_id), first);
    // Another phone is not throttled by this one.
    let other = registrar
        .register(
            "tablet",
            Platform::Android,
            &fcm_token("x"),
            None,
            HostFilter::everything(),
        )
        .await;
    assert!(matches!(other, RegisterOutcome::Registered { .. }));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_outbox_survives_a_host_restart_and_a_gateway_outage() {
    let mut gateway = Gateway::start(Backend::Sqlite).await;
    let dir = tempfile::tempdir().unwrap();
    let key_path = dir.path().join("host.key");
    HostKey::generate().save_new(&key_path).unwrap();
    let base = gateway.base.clone();
    let open_client = || {
        Arc::new(
            GatewayClient::new(&base, HostKey::load(&key_path).unwrap())
                .unwrap()
                .with_session_file(key_path.with_extension("session")),
        )
    };
    let client = open_client();
    let first = registrar(&client, dir.path(), RegistrarConfig::default());
    let outcome = first
        .register(
            "phone",
            Platform::Android,
            &fcm_token("p"),
            None,
            HostFilter::everything(),
        )
        .await;
    let RegisterOutcome::Registered { registration_id } = outcome else {
        panic!("{outcome:?}");
    };

    // The gateway goes away; the phone is unregistered meanwhile.
    gateway.process("all").kill().await;
    assert!(first.unregister("phone").await);
    assert!(first.store().get("phone").is_none(), "removed here at once");
    let pass = first.drain().await;
    assert_eq!((pass.deleted, pass.remaining), (0, 1), "{pass:?}");
    drop(first);
    drop(client);

    // The host process restarts: a new client and registrar over the same directory.
    let client = open_client();
    let second = registrar(&client, dir.path(), RegistrarConfig::default());
    assert_eq!(
        second.outbox().pending().len(),
        1,
        "the delete survived the restart"
    );
    assert_eq!(second.drain().await.remaining, 1, "still down");

    gateway.process("all").respawn().await;
    let pass = second.drain().await;
    assert_eq!((pass.deleted, pass.remaining), (1, 0), "{pass:?}");
    let listed = client.devices().await.unwrap();
    assert!(
        listed
            .devices
            .iter()
            .all(|d| d.registration_id != registration_id),
        "the gateway no longer holds the registration"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_outbox_worker_retries_with_backoff_until_the_gateway_is_back() {
    let mut gateway = Gateway::start(Backend::Sqlite).await;
    let dir = tempfile::tempdir().unwrap();
    let client = Arc::new(GatewayClient::new(&gateway.base, HostKey::generate()).unwrap());
    let config = RegistrarConfig {
        retry_initial: Duration::from_millis(200),
        retry_max: Duration::from_millis(800),
        ..RegistrarConfig::default()
    };
    let registrar = Arc::new(registrar(&client, dir.path(), config));
    let outcome = registrar
        .register(
            "phone",
            Platform::Android,
            &fcm_token("w"),
            None,
            HostFilter::everything(),
        )
        .await;
    assert!(
        matches!(outcome, RegisterOutcome::Registered { .. }),
        "{outcome:?}"
    );
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let worker = registrar.spawn_outbox_worker(stopped);
    gateway.process("all").kill().await;
    assert!(registrar.unregister("phone").await);
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        registrar.outbox().pending().len(),
        1,
        "kept while the gateway is down"
    );
    gateway.process("all").respawn().await;
    let deadline = std::time::Instant::now() + WAIT;
    while !registrar.outbox().pending().is_empty() {
        assert!(
            std::time::Instant::now() < deadline,
            "the worker never drained the outbox"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(client.devices().await.unwrap().devices.is_empty());
    stop.send(true).unwrap();
    worker.await.unwrap();
}

/// The README's five-minute walk-through, run as written: only the build line is replaced by the
/// test build's binaries, and port 8080 by a free one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_readme_walkthrough_works_as_written() {
    let readme =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../README.md")).unwrap();
    let block = readme
        .split("<!-- walkthrough:start -->")
        .nth(1)
        .and_then(|rest| rest.split("<!-- walkthrough:end -->").next())
        .expect("the README has the walk-through");
    let script = block
        .trim()
        .trim_start_matches("```sh")
        .trim_end_matches("```");
    let (build, rest) = script.trim().split_once('\n').unwrap();
    assert!(build.starts_with("cargo build --release"), "{build}");
    let port = orca_push_tests::free_port();
    let bin = tempfile::tempdir().unwrap();
    std::os::unix::fs::symlink(orca_push_tests::binary(), bin.path().join("orca-push")).unwrap();
    std::os::unix::fs::symlink(
        env!("CARGO_BIN_EXE_orca-push-mock-providers"),
        bin.path().join("orca-push-mock-providers"),
    )
    .unwrap();
    let rest = rest
        .replace(
            r#"export PATH="$PWD/target/release:$PATH""#,
            &format!(r#"export PATH="{}:$PATH""#, bin.path().display()),
        )
        .replace("8080", &port.to_string());
    let run = tokio::process::Command::new("bash")
        .arg("-euc")
        .arg(&rest)
        .env_remove("ORCA_PUSH_GATEWAY_URL")
        .env_remove("ORCA_PUSH_HOST_KEY")
        .env_remove("ORCA_PUSH_DATABASE_URL")
        // Other tests' gateways may hold the default metrics port on this machine.
        .env("ORCA_PUSH_METRICS_ADDR", "127.0.0.1:0")
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(Duration::from_secs(120), run)
        .await
        .expect("the walk-through finishes")
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(stdout.contains("hostFingerprint"), "{stdout}");
    assert!(stdout.contains("registrationId"), "{stdout}");
    assert!(stdout.contains("device pixel-1"), "{stdout}");
    assert!(
        stdout.contains("push arrived: provider=fcm token=demo-fcm"),
        "{stdout}\n{stderr}"
    );
    assert!(stdout.contains("device pixel-1 unregistered"), "{stdout}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_registration_the_host_cannot_store_is_deleted_at_the_gateway() {
    let gateway = Gateway::start(Backend::Sqlite).await;
    let dir = tempfile::tempdir().unwrap();
    let client = Arc::new(GatewayClient::new(&gateway.base, HostKey::generate()).unwrap());
    let registrar = registrar(&client, dir.path(), RegistrarConfig::default());
    // The store's file becomes a non-empty directory: every write fails, even for root.
    let file = dir.path().join(orca_push_host::REGISTRATIONS_FILE);
    std::fs::create_dir_all(file.join("blocker")).unwrap();
    let outcome = registrar
        .register(
            "phone",
            Platform::Android,
            &fcm_token("s"),
            None,
            HostFilter::everything(),
        )
        .await;
    assert_eq!(
        outcome,
        RegisterOutcome::NotRegistered(NotRegistered::StorageFailed)
    );
    assert_eq!(
        registrar.outbox().pending().len(),
        1,
        "its delete is queued"
    );
    let pass = registrar.drain().await;
    assert_eq!((pass.deleted, pass.remaining), (1, 0), "{pass:?}");
    assert!(
        client.devices().await.unwrap().devices.is_empty(),
        "nothing is left registered that the host does not know of"
    );
}

/// A gateway of an older deployment in front of a real one: `/health` answers
/// `deliveryProtocol: 1`, and a notification carrying `kind`, `expiresAt` or `sound` is refused
/// `invalid_request`, as an older gateway's strict schema refuses unknown fields. Everything else
/// is forwarded as is.
async fn older_gateway_in_front_of(base: &str) -> String {
    use axum::body::Bytes;
    use axum::http::{HeaderMap, Method, StatusCode, Uri};
    let upstream = base.to_owned();
    let client = reqwest::Client::new();
    let proxy = move |method: Method, uri: Uri, headers: HeaderMap, body: Bytes| {
        let client = client.clone();
        let upstream = upstream.clone();
        async move {
            if uri.path() == "/health" {
                let body = r#"{"ok":true,"pushProtocol":1,"deliveryProtocol":1,"mode":"serve"}"#;
                return (StatusCode::OK, body.to_owned());
            }
            if uri.path() == "/v1/send" {
                let sent: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
                let n = &sent["notification"];
                if ["kind", "expiresAt", "sound"]
                    .iter()
                    .any(|f| n.get(*f).is_some())
                {
                    let refused = r#"{"error":"invalid_request"}"#.to_owned();
                    return (StatusCode::BAD_REQUEST, refused);
                }
            }
            let mut request = client
                .request(method, format!("{upstream}{uri}"))
                .body(body);
            for (name, value) in &headers {
                if name != "host" && name != "content-length" {
                    request = request.header(name, value);
                }
            }
            let answer = request.send().await.unwrap();
            let status = StatusCode::from_u16(answer.status().as_u16()).unwrap();
            (status, answer.text().await.unwrap())
        }
    };
    let app = axum::Router::new().fallback(proxy);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://127.0.0.1:{}", listener.local_addr().unwrap().port());
    tokio::spawn(async move { axum::serve(listener, app).await });
    url
}

/// Against an older gateway the dispatcher sends neither kind, expiresAt nor sound (so its alerts
/// are not refused), and no dismissal at all; a failure is counted by category, never by payload.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_older_gateway_gets_only_the_fields_it_knows() {
    let world = World::start(Backend::Sqlite, "0").await;
    // The proxy has its own origin: the host logs in to the real gateway, whose origin the
    // challenge names, and reuses the session through the proxy by the shared session file.
    let dir = tempfile::tempdir().unwrap();
    let key_path = dir.path().join("host.key");
    HostKey::generate().save_new(&key_path).unwrap();
    let session_file = key_path.with_extension("session");
    let direct = GatewayClient::new(&world.gateway.base, HostKey::load(&key_path).unwrap())
        .unwrap()
        .with_session_file(session_file.clone());
    let session = direct.session().await.unwrap();
    let older = older_gateway_in_front_of(&world.gateway.base).await;
    let origin = orca_push_host::origin_of(&older).unwrap();
    orca_push_host::SessionFile::new(session_file.clone())
        .store(&origin, &session)
        .unwrap();
    let client = Arc::new(
        GatewayClient::new(&older, HostKey::load(&key_path).unwrap())
            .unwrap()
            .with_session_file(session_file),
    );
    let registrar = registrar(&client, dir.path(), RegistrarConfig::default());
    let mut quiet = HostFilter::everything();
    quiet.sound = Some(false);
    let outcome = registrar
        .register("quiet", Platform::Android, &fcm_token("old"), None, quiet)
        .await;
    let RegisterOutcome::Registered { registration_id } = outcome else {
        panic!("{outcome:?}");
    };
    let dispatcher = Dispatcher::new(
        client.clone(),
        registrar.store().clone(),
        DispatchConfig::default(),
    );
    let mut alert = event(1, now_ms());
    alert.expires_at = Some((now_ms() + 60_000) as i64);
    let report = dispatcher.dispatch(alert).await;
    assert_eq!(report.delivery_protocol, Some(1));
    assert_eq!(
        report.outcomes.get(&registration_id),
        Some(&Outcome::Status(SendStatus::Queued)),
        "{report:?}"
    );
    let message = world
        .fcm
        .wait_for(&fcm_token("old"), 1, WAIT)
        .await
        .remove(0)
        .message;
    assert_eq!(
        message["android"]["notification"]["channel_id"], "orca-desktop",
        "an older gateway cannot be asked for silence"
    );
    let mut dismissal = event(1, now_ms() + 10_000);
    dismissal.kind = Kind::Dismiss;
    let report = dispatcher.dispatch(dismissal).await;
    assert!(report.requests.is_empty(), "{report:?}");
    assert_eq!(
        report.skipped.get(&registration_id),
        Some(&orca_push_host::Skip::DismissUnsupported)
    );

    // A registration the gateway does not know answers `error`: counted, by category only.
    let ghost = orca_push_host::Registration {
        registration_id: "not-a-registration".into(),
        ..registrar.store().get("quiet").unwrap()
    };
    assert!(
        !format!("{ghost:?}").contains(&fcm_token("old")),
        "Debug hides the token"
    );
    let store = Arc::new(GhostSource(ghost));
    let counting = Dispatcher::new(client, store, DispatchConfig::default());
    let report = counting.dispatch(event(2, now_ms() + 20_000)).await;
    assert_eq!(
        report.outcomes.get("not-a-registration"),
        Some(&Outcome::Status(SendStatus::Error))
    );
    let counts = counting.failure_counts();
    assert_eq!(counts.get("result.error"), Some(&1), "{counts:?}");
    assert!(counts.keys().all(|k| !k.contains("not-a-registration")));
}

/// One registration, as a source the dispatcher reads.
struct GhostSource(orca_push_host::Registration);

impl orca_push_host::RegistrationSource for GhostSource {
    fn active(&self, _now_ms: u64) -> Vec<orca_push_host::Registration> {
        vec![self.0.clone()]
    }

    fn drop_dead(&self, _sent: &orca_push_host::Registration) -> bool {
        false
    }
}

/// A TLS front for `upstream` on `localhost`, served from `listener`, with a self-signed
/// certificate written (PEM) to the returned file: as a corporate TLS-inspecting proxy presents a
/// CA only the OS store trusts.
async fn tls_front_on(
    listener: tokio::net::TcpListener,
    upstream: String,
) -> (String, tempfile::NamedTempFile) {
    use std::convert::Infallible;

    use http_body_util::BodyExt as _;
    use hyper_util::rt::{TokioExecutor, TokioIo};
    let certified = rcgen::generate_simple_self_signed(vec!["localhost".into()]).unwrap();
    let ca = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(ca.path(), certified.cert.pem()).unwrap();
    let key: rustls::pki_types::PrivateKeyDer<'static> = certified.signing_key.into();
    let mut config = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_no_client_auth()
    .with_single_cert(vec![certified.cert.der().clone()], key)
    .unwrap();
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    let port = listener.local_addr().unwrap().port();
    let client = reqwest::Client::new();
    tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            let (acceptor, client, upstream) = (acceptor.clone(), client.clone(), upstream.clone());
            tokio::spawn(async move {
                let Ok(tls) = acceptor.accept(tcp).await else {
                    return;
                };
                let service = hyper::service::service_fn(
                    move |request: hyper::Request<hyper::body::Incoming>| {
                        let (client, upstream) = (client.clone(), upstream.clone());
                        async move {
                            let (parts, body) = request.into_parts();
                            let body = body.collect().await.unwrap().to_bytes();
                            let mut forward = client
                                .request(parts.method, format!("{upstream}{}", parts.uri.path()))
                                .body(body);
                            for (name, value) in &parts.headers {
                                if name != "host" && name != "content-length" {
                                    forward = forward.header(name, value);
                                }
                            }
                            let answer = forward.send().await.unwrap();
                            let mut response = hyper::Response::builder().status(answer.status());
                            for (name, value) in answer.headers() {
                                response = response.header(name, value);
                            }
                            let body = http_body_util::Full::new(answer.bytes().await.unwrap());
                            Ok::<_, Infallible>(response.body(body).unwrap())
                        }
                    },
                );
                let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(tls), service)
                    .await;
            });
        }
    });
    (format!("https://localhost:{port}"), ca)
}

/// The SDK trusts the operating system's certificate store (rustls-native-certs, which on Linux
/// also honours SSL_CERT_FILE): behind TLS inspection the CLI logs in through a certificate only
/// that store trusts, and without it the same login is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_trusts_the_operating_systems_certificate_store() {
    // The front's origin is what hosts call, so the gateway binds it into its challenges. Its
    // listener is held from here on: a port released and bound again after the gateway starts was
    // once handed to the gateway's own metrics listener (bound at port 0) in between.
    let front_listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let front_port = front_listener.local_addr().unwrap().port();
    let gateway = Gateway::start_with(
        Backend::Sqlite,
        &[(
            "ORCA_PUSH_PUBLIC_URL",
            format!("https://localhost:{front_port}").as_str(),
        )],
    )
    .await;
    let (front, ca) = tls_front_on(front_listener, gateway.base.clone()).await;
    let dir = tempfile::tempdir().unwrap();
    let key = dir.path().join("host.key");
    HostKey::generate().save_new(&key).unwrap();
    let login = |trust: Option<&std::path::Path>| {
        let mut command = std::process::Command::new(orca_push_tests::binary());
        command
            .args(["host", "login", "--gateway", &front, "--key"])
            .arg(&key)
            .env_remove("SSL_CERT_DIR");
        match trust {
            Some(ca) => command.env("SSL_CERT_FILE", ca),
            None => command.env("SSL_CERT_FILE", "/nonexistent/ca.pem"),
        };
        command.output().unwrap()
    };
    let refused = login(None);
    assert!(!refused.status.success(), "an untrusted CA is refused");
    let trusted = login(Some(ca.path()));
    assert!(
        trusted.status.success(),
        "{}",
        String::from_utf8_lossy(&trusted.stderr)
    );
    assert!(String::from_utf8_lossy(&trusted.stdout).contains("hostFingerprint"));
}
