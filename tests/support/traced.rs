//! An all-in-one gateway in this process, its spans captured by the SDK's in-memory exporter and
//! its logs by a buffer, with mock APNs: what the trace tests follow a request through. The
//! tracing subscriber is global, so each test binary starts one.

use std::io::Write as _;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider, SpanData};
use tokio_util::sync::CancellationToken;

use crate::Raw;
use crate::mock_apns::MockApns;

/// Log lines as written.
#[derive(Clone, Default)]
pub struct LogBuffer(Arc<Mutex<Vec<u8>>>);

impl LogBuffer {
    fn lines(&self) -> std::sync::MutexGuard<'_, Vec<u8>> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

impl std::io::Write for LogBuffer {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.lines().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for LogBuffer {
    type Writer = LogBuffer;
    fn make_writer(&'a self) -> LogBuffer {
        self.clone()
    }
}

/// The gateway, what it exported and logged, and the mock APNs it delivers to.
pub struct TracedGateway {
    pub exporter: InMemorySpanExporter,
    pub provider: SdkTracerProvider,
    pub logs: LogBuffer,
    pub apns: MockApns,
    pub raw: Raw,
    drain: CancellationToken,
    gateway: tokio::task::JoinHandle<anyhow::Result<()>>,
    _data: tempfile::TempDir,
    _telemetry: orca_push_telemetry::TelemetryGuard,
}

impl TracedGateway {
    /// Starts it on SQLite with no coalescing window, `vars` added to its environment, and waits
    /// until it is ready. Installs the global subscriber: once per test binary.
    pub async fn start(vars: &[(&str, &str)]) -> Self {
        let exporter = InMemorySpanExporter::default();
        let provider = SdkTracerProvider::builder()
            .with_simple_exporter(exporter.clone())
            .build();
        let logs = LogBuffer::default();
        let telemetry = orca_push_telemetry::init_with_log_writer(
            provider.clone(),
            orca_push_telemetry::LogFormat::Text,
            logs.clone(),
        )
        .expect("the test binary's only subscriber");

        let apns = MockApns::start().await;
        let data = tempfile::tempdir().expect("a data directory");
        let mut env = apns.env();
        env.push((
            "ORCA_PUSH_DATA_DIR".into(),
            data.path().display().to_string(),
        ));
        env.push(("ORCA_PUSH_COALESCE_MS".into(), "0".into()));
        env.extend(vars.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())));
        // The transport `scripts/test` runs the suite over a second time, unless the test names
        // one (the suite's other gateways are processes, which inherit it).
        const TRANSPORT: &str = "ORCA_PUSH_INTERNAL_TRANSPORT";
        if let Ok(transport) = std::env::var(TRANSPORT)
            && !env.iter().any(|(name, _)| name == TRANSPORT)
        {
            env.push((TRANSPORT.into(), transport));
        }
        let config = orca_push::Config::from_lookup(|k| {
            env.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone())
        })
        .expect("a valid configuration");
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("a port");
        let port = listener.local_addr().expect("its address").port();
        let drain = CancellationToken::new();
        let gateway = tokio::spawn(orca_push::topology::serve_all_in_one(
            Arc::new(config),
            listener,
            drain.clone(),
        ));
        let raw = Raw {
            http: reqwest::Client::new(),
            base: format!("http://127.0.0.1:{port}"),
        };
        for _ in 0..100 {
            if raw.get("/ready", &[]).await.status == 200 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Self {
            exporter,
            provider,
            logs,
            apns,
            raw,
            drain,
            gateway,
            _data: data,
            _telemetry: telemetry,
        }
    }

    /// Every span finished so far.
    pub fn spans(&self) -> Vec<SpanData> {
        self.provider.force_flush().expect("spans flushed");
        self.exporter.get_finished_spans().expect("spans read")
    }

    /// Fails if any of `secrets` is in a span of `spans` or a log line.
    pub fn assert_nothing_leaked(&self, spans: &[SpanData], secrets: &[&str]) {
        let everything = format!("{spans:?}");
        let logged = String::from_utf8_lossy(&self.logs.lines()).into_owned();
        for secret in secrets {
            assert!(!everything.contains(secret), "{secret} in a span");
            assert!(!logged.contains(secret), "{secret} in the logs");
        }
    }

    /// Stops the gateway (waiting up to 10 s for it).
    pub async fn stop(self) {
        self.drain.cancel();
        let _ = self.logs.clone().flush();
        let _ = tokio::time::timeout(Duration::from_secs(10), self.gateway).await;
    }
}

/// The trace tests' send: one alert to `id` with the marker `title` and `body` (which must never
/// reach a span or a log line), as sequence `seq` of one epoch.
pub fn marked_alert(id: &str, seq: u64, title: &str, body: &str) -> serde_json::Value {
    serde_json::json!({ "v": 1, "registrationIds": [id], "notification": {
        "notificationId": format!("n-{seq}"), "notificationSeq": seq, "notificationEpoch": "e-1",
        "source": "agent-task-complete", "agentState": "finished", "title": title, "body": body } })
}
