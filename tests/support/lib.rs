//! Test support: a real `orca-push serve` process on an isolated database, driven over HTTP, and
//! mock APNs and FCM for it to deliver to.

pub mod fault_proxy;
pub mod mock_apns;
pub mod mock_fcm;
pub mod traced;
pub mod world;

use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use orca_push_host::{ChallengeEnvelope, HostKey, answer_challenge};
use orca_push_storage::DatabaseConfig;
pub use orca_push_storage::testing::Backend;
use serde_json::{Value, json};
use tokio::io::AsyncBufReadExt as _;

static BINARY: std::sync::OnceLock<std::path::PathBuf> = std::sync::OnceLock::new();

/// Runs `path` instead of the test build of the gateway (the benchmark's `--gateway`).
pub fn use_binary(path: std::path::PathBuf) {
    let _ = BINARY.set(path);
}

/// Provider requests as the mocks receive them, for callers that wait on particular events.
#[derive(Debug, Clone)]
pub struct Arrival {
    pub provider: &'static str,
    /// `orca.notificationId` (APNs) or `data.notificationId` (FCM) of the request.
    pub notification_id: Option<String>,
    /// The device token the request was addressed to.
    pub token: String,
    /// `apns-collapse-id` (APNs) or `android.notification.tag` (FCM), when the request has one.
    pub collapse_id: Option<String>,
    pub at: std::time::Instant,
}

pub type ArrivalSink = tokio::sync::mpsc::UnboundedSender<Arrival>;

/// Path of the gateway binary under test: Cargo builds this package's `orca-push-e2e` beside the
/// `deps/` folder that holds the running test binary, fresh for every test run.
pub fn binary() -> std::path::PathBuf {
    if let Some(path) = BINARY.get() {
        return path.clone();
    }
    let exe = std::env::current_exe().expect("current exe");
    let target_dir = exe
        .parent()
        .and_then(|deps| deps.parent())
        .expect("target dir");
    target_dir.join(format!("orca-push-e2e{}", std::env::consts::EXE_SUFFIX))
}

/// The key split-mode test fleets share (ORCA_PUSH_INTERNAL_KEY).
pub const INTERNAL_KEY: &str = "test-internal-key-0123456789abcdef-0123456789";

/// A running gateway: one process, or several in split mode. Killed when dropped.
pub struct Gateway {
    processes: Vec<Process>,
    pub base: String,
    pub database: DatabaseConfig,
    _data_dir: tempfile::TempDir,
}

impl Drop for Gateway {
    /// A failing test shows what the gateway logged.
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!(
                "--- gateway log ---\n{}\n--- end of gateway log ---",
                self.logs()
            );
        }
    }
}

async fn fresh_database(backend: Backend, data_dir: &std::path::Path) -> DatabaseConfig {
    match backend {
        Backend::Sqlite => DatabaseConfig::Sqlite {
            data_dir: data_dir.to_owned(),
            durability: orca_push_storage::SqliteDurability::Full,
        },
        Backend::Postgres => DatabaseConfig::Postgres {
            url: orca_push_storage::testing::fresh_postgres_url()
                .await
                .into(),
        },
    }
}

/// One `orca-push` process, its log, and how to start it again.
pub struct Process {
    child: tokio::process::Child,
    pub port: u16,
    logs: Arc<Mutex<Vec<String>>>,
    metrics_port: Arc<Mutex<Option<u16>>>,
    recipe: Recipe,
}

#[derive(Clone)]
struct Recipe {
    args: Vec<String>,
    database: DatabaseConfig,
    data_dir: std::path::PathBuf,
    env: Vec<(String, String)>,
    marker: &'static str,
}

impl Process {
    /// Spawns `orca-push <args>` and waits for the log line `marker` with the address it bound.
    pub async fn spawn(
        args: &[&str],
        database: &DatabaseConfig,
        data_dir: &std::path::Path,
        env: &[(&str, &str)],
        marker: &'static str,
    ) -> Self {
        let recipe = Recipe {
            args: args.iter().map(|a| a.to_string()).collect(),
            database: database.clone(),
            data_dir: data_dir.to_owned(),
            env: env
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            marker,
        };
        Self::spawn_recipe(recipe).await
    }

    async fn spawn_recipe(recipe: Recipe) -> Self {
        let (args, database, data_dir, env, marker) = (
            &recipe.args,
            &recipe.database,
            recipe.data_dir.as_path(),
            &recipe.env,
            recipe.marker,
        );
        let mut command = tokio::process::Command::new(binary());
        command
            .args(args)
            .env("PORT", "0")
            .env("ORCA_PUSH_DATA_DIR", data_dir)
            .env("RUST_LOG", "info")
            .env("ORCA_PUSH_METRICS_ADDR", "127.0.0.1:0")
            .env_remove("ORCA_PUSH_DATABASE_URL")
            .env_remove("ORCA_PUSH_PUBLIC_URL")
            .env_remove("ORCA_PUSH_TRUSTED_PROXY_HOPS")
            .env_remove("ORCA_PUSH_INTERNAL_KEY")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        if let DatabaseConfig::Postgres { url } = database {
            use secrecy::ExposeSecret as _;
            command.env("ORCA_PUSH_DATABASE_URL", url.expose_secret());
        }
        for (k, v) in env {
            command.env(k, v);
        }
        let mut child = command.spawn().expect("spawn orca-push");
        let stderr = child.stderr.take().expect("stderr");
        let logs = Arc::new(Mutex::new(Vec::new()));
        let (port_tx, port_rx) = tokio::sync::oneshot::channel();
        let metrics_port = Arc::new(Mutex::new(None));
        tokio::spawn(collect_logs(
            stderr,
            logs.clone(),
            marker,
            port_tx,
            metrics_port.clone(),
        ));
        let port = match tokio::time::timeout(Duration::from_secs(60), port_rx).await {
            Ok(Ok(port)) => port,
            _ => panic!(
                "orca-push {args:?} did not start listening; its log:\n{}",
                logs.lock().unwrap().join("\n")
            ),
        };
        Self {
            child,
            port,
            logs,
            recipe,
            metrics_port,
        }
    }

    /// Where this process serves `/metrics`.
    pub fn metrics_url(&self) -> String {
        let port = self
            .metrics_port
            .lock()
            .unwrap()
            .expect("metrics listening");
        format!("http://127.0.0.1:{port}/metrics")
    }

    /// SIGKILL: no chance to clean up, as when a machine dies.
    pub async fn kill(&mut self) {
        let _ = self.child.start_kill();
        let _ = self.child.wait().await;
    }

    /// SIGTERM, then the time it took the process to exit (or None after `within`).
    pub async fn terminate(&mut self, within: Duration) -> Option<Duration> {
        self.terminate_with_status(within)
            .await
            .map(|(took, _)| took)
    }

    /// SIGTERM, then the time it took the process to exit and how it exited.
    pub async fn terminate_with_status(
        &mut self,
        within: Duration,
    ) -> Option<(Duration, std::process::ExitStatus)> {
        let pid = self.child.id()?;
        let started = std::time::Instant::now();
        let _ = std::process::Command::new("kill")
            .args(["-TERM", &pid.to_string()])
            .status();
        match tokio::time::timeout(within, self.child.wait()).await {
            Ok(Ok(status)) => Some((started.elapsed(), status)),
            _ => None,
        }
    }

    /// Starts the same command again (same database, environment and data folder).
    pub async fn respawn(&mut self) {
        self.respawn_with(&[]).await
    }

    /// Starts the same command again with `env` set over its environment (e.g. another
    /// `ORCA_PUSH_INTERNAL_KEY`). Later calls of [`Process::respawn`] keep it.
    pub async fn respawn_with(&mut self, env: &[(&str, &str)]) {
        let mut recipe = self.recipe.clone();
        for (key, value) in env {
            recipe.env.retain(|(k, _)| k != key);
            recipe.env.push((key.to_string(), value.to_string()));
        }
        // A facade keeps its port, so the origin bound into challenges stays the same.
        // Same port again, so every caller's URL stays right.
        if recipe.marker == "facade listening" {
            recipe.env.retain(|(k, _)| k != "PORT");
            recipe.env.push(("PORT".into(), self.port.to_string()));
        } else {
            recipe.env.retain(|(k, _)| k != "ORCA_PUSH_GRPC_ADDR");
            recipe.env.push((
                "ORCA_PUSH_GRPC_ADDR".into(),
                format!("127.0.0.1:{}", self.port),
            ));
        }
        let old_logs = self.logs();
        *self = Self::spawn_recipe(recipe).await;
        self.logs.lock().unwrap().insert(0, old_logs);
    }

    pub fn logs(&self) -> String {
        self.logs.lock().unwrap().join("\n")
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.id()
    }

    /// `serve --service <name>`, or `serve` for the all-in-one process.
    pub fn service(&self) -> &str {
        self.recipe.args.get(2).map_or("all", String::as_str)
    }
}

impl Gateway {
    pub async fn start(backend: Backend) -> Self {
        Self::start_with(backend, &[]).await
    }

    /// Starts `orca-push serve` on a kernel-chosen port with a fresh database of `backend`.
    pub async fn start_with(backend: Backend, env: &[(&str, &str)]) -> Self {
        let data_dir = tempfile::tempdir().expect("temp dir");
        let database = fresh_database(backend, data_dir.path()).await;
        let process = Process::spawn(
            &["serve"],
            &database,
            data_dir.path(),
            env,
            "facade listening",
        )
        .await;
        let gateway = Self {
            base: format!("http://127.0.0.1:{}", process.port),
            database,
            processes: vec![process],
            _data_dir: data_dir,
        };
        gateway.wait_ready().await;
        gateway
    }

    /// The split topology: auth, registry, queue and sender each in its own process, and a facade
    /// process that reaches them over gRPC, all on one fresh database.
    pub async fn start_split(backend: Backend) -> Self {
        Self::start_split_with(backend, &[]).await
    }

    /// The split topology, with `extra` in every process's environment.
    pub async fn start_split_with(backend: Backend, extra: &[(&str, &str)]) -> Self {
        Self::start_fleet(backend, extra, 1).await
    }

    /// The split topology with `replicas` processes of auth, registry, queue and sender, each
    /// caller given the comma-separated list of a service's replicas, behind one facade.
    pub async fn start_fleet(backend: Backend, extra: &[(&str, &str)], replicas: usize) -> Self {
        let data_dir = tempfile::tempdir().expect("temp dir");
        let database = fresh_database(backend, data_dir.path()).await;
        let dir = data_dir.path().to_owned();
        let spawn = |service: &'static str, pairs: Vec<(String, String)>| {
            let database = database.clone();
            let dir = dir.clone();
            let mut env: Vec<(String, String)> =
                vec![("ORCA_PUSH_INTERNAL_KEY".into(), INTERNAL_KEY.into())];
            env.extend(extra.iter().map(|(k, v)| (k.to_string(), v.to_string())));
            env.extend(pairs);
            async move {
                let env: Vec<(&str, &str)> =
                    env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
                let marker = if service == "facade" {
                    "facade listening"
                } else {
                    "gRPC service listening"
                };
                Process::spawn(
                    &["serve", "--service", service],
                    &database,
                    &dir,
                    &env,
                    marker,
                )
                .await
            }
        };
        let any = || vec![("ORCA_PUSH_GRPC_ADDR".to_owned(), "127.0.0.1:0".to_owned())];
        let urls = |ps: &[Process]| {
            ps.iter()
                .map(|p| format!("http://127.0.0.1:{}", p.port))
                .collect::<Vec<_>>()
                .join(",")
        };
        let mut processes = Vec::new();
        let mut registries = Vec::new();
        let mut queues = Vec::new();
        for _ in 0..replicas {
            registries.push(spawn("registry", any()).await);
            queues.push(spawn("queue", any()).await);
        }
        let (registry_url, queue_url) = (urls(&registries), urls(&queues));
        let mut with_backends = any();
        with_backends.push(("ORCA_PUSH_REGISTRY_URL".into(), registry_url.clone()));
        with_backends.push(("ORCA_PUSH_QUEUE_URL".into(), queue_url.clone()));
        let mut senders = Vec::new();
        for _ in 0..replicas {
            senders.push(spawn("sender", with_backends.clone()).await);
        }
        // The facade's origin must be known before auth starts, so its port is picked here, with
        // one for the facade's metrics, outside the range port-0 listeners are handed: a port
        // probed at `:0` was once handed to the facade's own metrics listener, and the facade
        // could not listen.
        let (port, metrics_port) = (free_port(), free_port());
        let origin = format!("http://127.0.0.1:{port}");
        let mut auth_env = any();
        auth_env.push(("ORCA_PUSH_REGISTRY_URL".into(), registry_url.clone()));
        auth_env.push(("ORCA_PUSH_PUBLIC_URL".into(), origin.clone()));
        let mut auths = Vec::new();
        for _ in 0..replicas {
            auths.push(spawn("auth", auth_env.clone()).await);
        }
        let facade_env = vec![
            ("PORT".to_owned(), port.to_string()),
            ("ORCA_PUSH_PUBLIC_URL".to_owned(), origin.clone()),
            ("ORCA_PUSH_AUTH_URL".to_owned(), urls(&auths)),
            ("ORCA_PUSH_REGISTRY_URL".to_owned(), registry_url),
            ("ORCA_PUSH_QUEUE_URL".to_owned(), queue_url),
            ("ORCA_PUSH_SENDER_URL".to_owned(), urls(&senders)),
            (
                "ORCA_PUSH_METRICS_ADDR".to_owned(),
                format!("127.0.0.1:{metrics_port}"),
            ),
        ];
        let facade = spawn("facade", facade_env).await;
        processes.extend(registries);
        processes.extend(queues);
        processes.extend(senders);
        processes.extend(auths);
        processes.push(facade);
        let gateway = Self {
            base: origin,
            database,
            processes,
            _data_dir: data_dir,
        };
        gateway.wait_ready().await;
        gateway
    }

    /// Process ids of every process of this gateway, for reading their CPU time and RSS.
    pub fn pids(&self) -> Vec<u32> {
        self.processes.iter().filter_map(Process::pid).collect()
    }

    /// Every process running `service`.
    pub fn replicas(&mut self, service: &str) -> Vec<&mut Process> {
        self.processes
            .iter_mut()
            .filter(|p| p.service() == service)
            .collect()
    }

    async fn wait_ready(&self) {
        let http = reqwest::Client::new();
        for _ in 0..200 {
            if let Ok(r) = http.get(self.url("/ready")).send().await
                && r.status() == 200
            {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("gateway never became ready; log:\n{}", self.logs());
    }

    /// The process running `service` ("all" for the all-in-one process).
    pub fn process(&mut self, service: &str) -> &mut Process {
        self.processes
            .iter_mut()
            .find(|p| p.service() == service)
            .unwrap_or_else(|| panic!("no {service} process"))
    }

    pub fn data_dir(&self) -> &std::path::Path {
        self._data_dir.path()
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{}", self.base, path)
    }

    pub fn logs(&self) -> String {
        self.processes
            .iter()
            .map(Process::logs)
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// A direct connection to the auth service's own tables, for tests that move its clock.
    pub async fn auth_pool(&self) -> orca_push_storage::Pool {
        orca_push_storage::open(&self.database, &orca_push_auth::STORAGE)
            .await
            .expect("open auth database")
    }
}

async fn collect_logs(
    stderr: tokio::process::ChildStderr,
    logs: Arc<Mutex<Vec<String>>>,
    marker: &'static str,
    port_tx: tokio::sync::oneshot::Sender<u16>,
    metrics_port: Arc<Mutex<Option<u16>>>,
) {
    let mut port_tx = Some(port_tx);
    let mut lines = tokio::io::BufReader::new(stderr).lines();
    // The port of `addr=host:port` in a text line, or of `"addr":"host:port"` in a JSON one.
    let port_of = |line: &str| -> Option<u16> {
        let addr = match serde_json::from_str::<Value>(line) {
            Ok(json) => json["addr"].as_str()?.to_owned(),
            Err(_) => line
                .split_whitespace()
                .find_map(|w| w.strip_prefix("addr="))?
                .to_owned(),
        };
        addr.rsplit(':').next()?.parse().ok()
    };
    while let Ok(Some(line)) = lines.next_line().await {
        if line.contains("metrics listening") {
            *metrics_port.lock().unwrap() = port_of(&line);
        }
        if line.contains(marker)
            && let Some(port) = port_of(&line)
            && let Some(tx) = port_tx.take()
        {
            let _ = tx.send(port);
        }
        logs.lock().unwrap().push(line);
    }
}

/// A raw HTTP answer: status and parsed JSON body (Null when empty).
#[derive(Debug)]
pub struct Answer {
    pub status: u16,
    pub body: Value,
    pub headers: reqwest::header::HeaderMap,
}

impl Answer {
    pub fn error(&self) -> Option<&str> {
        self.body.get("error").and_then(Value::as_str)
    }
}

pub async fn answer(response: reqwest::Response) -> Answer {
    let status = response.status().as_u16();
    let headers = response.headers().clone();
    let bytes = response.bytes().await.expect("body");
    let body = if bytes.is_empty() {
        Value::Null
    } else {
        serde_json::from_slice(&bytes)
            .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into()))
    };
    Answer {
        status,
        body,
        headers,
    }
}

/// Plain HTTP calls, with no SDK in between, for failure paths.
#[derive(Clone)]
pub struct Raw {
    pub http: reqwest::Client,
    pub base: String,
}

impl Raw {
    pub fn new(gateway: &Gateway) -> Self {
        Self {
            http: reqwest::Client::new(),
            base: gateway.base.clone(),
        }
    }

    pub async fn post(&self, path: &str, body: &Value, headers: &[(&str, &str)]) -> Answer {
        let mut request = self.http.post(format!("{}{}", self.base, path)).json(body);
        for (k, v) in headers {
            request = request.header(*k, *v);
        }
        answer(request.send().await.expect("send")).await
    }

    pub async fn post_raw(&self, path: &str, body: &'static str) -> Answer {
        let request = self
            .http
            .post(format!("{}{}", self.base, path))
            .header("content-type", "application/json")
            .body(body);
        answer(request.send().await.expect("send")).await
    }

    pub async fn get(&self, path: &str, headers: &[(&str, &str)]) -> Answer {
        let mut request = self.http.get(format!("{}{}", self.base, path));
        for (k, v) in headers {
            request = request.header(*k, *v);
        }
        answer(request.send().await.expect("send")).await
    }

    pub async fn delete(&self, path: &str, headers: &[(&str, &str)]) -> Answer {
        let mut request = self.http.delete(format!("{}{}", self.base, path));
        for (k, v) in headers {
            request = request.header(*k, *v);
        }
        answer(request.send().await.expect("send")).await
    }

    /// POST /v1/host/challenge for `key`, returning the envelope as the SDK reads it.
    pub async fn challenge(
        &self,
        key: &HostKey,
        headers: &[(&str, &str)],
    ) -> (Answer, Option<ChallengeEnvelope>) {
        let reply = self
            .post(
                "/v1/host/challenge",
                &json!({ "v": 1, "hostPublicKeyB64": STANDARD.encode(key.public_key()) }),
                headers,
            )
            .await;
        let envelope = (reply.status == 200).then(|| envelope_of(&reply.body));
        (reply, envelope)
    }

    /// Registers a device with `bearer` (an `Authorization` value) and returns its registrationId.
    pub async fn register(&self, bearer: &str, body: &Value) -> String {
        let reply = self
            .post("/v1/devices", body, &[("authorization", bearer)])
            .await;
        assert_eq!(reply.status, 200, "{reply:?}");
        reply.body["registrationId"].as_str().unwrap().to_owned()
    }

    /// A full handshake without the SDK's client, returning the session token.
    pub async fn login(&self, key: &HostKey, headers: &[(&str, &str)]) -> String {
        let (reply, envelope) = self.challenge(key, headers).await;
        let envelope = envelope.unwrap_or_else(|| panic!("challenge refused: {reply:?}"));
        let proof = answer_challenge(key, &origin(&self.base), &envelope, now_ms()).expect("proof");
        let session = self
            .post(
                "/v1/host/session",
                &json!({ "v": 1, "challengeId": envelope.challenge_id, "proofB64": STANDARD.encode(proof) }),
                headers,
            )
            .await;
        assert_eq!(session.status, 200, "{session:?}");
        session.body["sessionToken"].as_str().unwrap().to_owned()
    }
}

/// A loopback port free now and below the kernel's ephemeral range, for a process that binds it
/// later. A port probed at `:0` and released comes from that range, and any listener bound at
/// port 0 meanwhile (another test's, or the gateway's own metrics) could be handed it.
pub fn free_port() -> u16 {
    use std::hash::{BuildHasher as _, RandomState};
    let ephemeral: Vec<u16> = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .map(|range| {
            range
                .split_whitespace()
                .filter_map(|p| p.parse().ok())
                .collect()
        })
        .unwrap_or_default();
    let (start, end) = match ephemeral[..] {
        [start, end] => (start, end),
        _ => (32768, 60999),
    };
    // Below the range where it leaves room (Linux's default starts at 32768), else above it.
    let (low, high) = if start > 11_000 {
        (10_000u16, start)
    } else {
        (end.saturating_add(1).max(1024), u16::MAX)
    };
    assert!(
        high > low,
        "no port outside the ephemeral range {start}-{end}"
    );
    let seed = RandomState::new().hash_one(std::process::id());
    for attempt in 0..1_000u64 {
        let port = low + ((seed.wrapping_add(attempt * 7919)) % u64::from(high - low)) as u16;
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!("no free port in {low}..{high}");
}

pub fn envelope_of(body: &Value) -> ChallengeEnvelope {
    let b = |k: &str| STANDARD.decode(body[k].as_str().unwrap()).unwrap();
    ChallengeEnvelope {
        challenge_id: body["challengeId"].as_str().unwrap().to_owned(),
        gateway_ephemeral_public_key: b("gatewayEphemeralPublicKeyB64").try_into().unwrap(),
        nonce: b("nonceB64").try_into().unwrap(),
        ciphertext: b("ciphertextB64"),
        expires_at_ms: body["expiresAt"].as_u64().unwrap(),
    }
}

pub fn origin(base: &str) -> String {
    orca_push_host::origin_of(base).unwrap()
}

pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

pub fn bearer(token: &str) -> String {
    format!("Bearer {token}")
}

/// Runs a test body once on SQLite and once on PostgreSQL.
#[macro_export]
macro_rules! on_both_backends {
    ($($name:ident),* $(,)?) => {$(
        mod $name {
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn sqlite() {
                super::$name($crate::Backend::Sqlite).await;
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn postgres() {
                super::$name($crate::Backend::Postgres).await;
            }
        }
    )*};
}

/// A Prometheus sample's value, summed over every series of `name` that has all of `labels`.
pub fn metric_sum(text: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| l.starts_with(name) && l[name.len()..].starts_with(['{', ' ']))
        .filter(|l| {
            labels
                .iter()
                .all(|(k, v)| l.contains(&format!("{k}=\"{v}\"")))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// `metric_sum` of what the process answers at `metrics_url` now.
pub async fn scrape_sum(metrics_url: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    let text = reqwest::get(metrics_url)
        .await
        .expect("metrics answer")
        .text()
        .await
        .expect("metrics body");
    metric_sum(&text, name, labels)
}
