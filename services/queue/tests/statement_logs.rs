//! No log line holds a whole host fingerprint, even with every target at DEBUG and sqlx's
//! statement log on (as an operator profiling turns it on). PostgreSQL's rounds write their hosts
//! into their `BEGIN` as literals (`begin_locking_hosts`), and sqlx logs a statement's text (every
//! one at DEBUG, one slower than a second at WARN); sqlx 0.8.6 sends a `BEGIN` outside its
//! statement log, and this test holds whatever a later sqlx, or a log line of ours, does.

mod support;

use std::io::Write;
use std::sync::{Arc, Mutex, OnceLock};

use orca_push_queue::model::AdmissionStatus;
use orca_push_storage::testing::Backend;
use support::*;

on_both_backends!(statement_logs_hold_no_fingerprint);

/// The whole log of this test binary, every target at DEBUG.
#[derive(Clone, Default)]
struct Lines(Arc<Mutex<Vec<u8>>>);

impl Write for Lines {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for Lines {
    type Writer = Lines;

    fn make_writer(&'a self) -> Self::Writer {
        self.clone()
    }
}

impl Lines {
    fn text(&self) -> String {
        String::from_utf8_lossy(
            &self
                .0
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
        )
        .into_owned()
    }
}

/// One subscriber for the process (the writer's thread logs too, so a thread's default would
/// miss its rounds): both backends' tests write to it.
fn captured() -> &'static Lines {
    static LINES: OnceLock<Lines> = OnceLock::new();
    LINES.get_or_init(|| {
        let lines = Lines::default();
        tracing::subscriber::set_global_default(
            tracing_subscriber::fmt()
                .with_env_filter("debug")
                .with_ansi(false)
                .with_writer(lines.clone())
                .finish(),
        )
        .expect("the only subscriber of this test binary");
        lines
    })
}

async fn statement_logs_hold_no_fingerprint(backend: Backend) {
    let lines = captured();
    let h = harness_with(backend, 0).await;
    assert_eq!(
        h.admit(&alert(1, &["phone-1"])).await,
        [AdmissionStatus::Queued]
    );
    assert_eq!(h.claim_all().await.len(), 1, "due at once");
    let log = lines.text();
    assert!(
        log.contains("sqlx::query"),
        "sqlx's statement log is on, so the check below can fail"
    );
    let holding: Vec<&str> = log.lines().filter(|l| l.contains(HOST)).take(3).collect();
    assert!(
        holding.is_empty(),
        "log lines hold a whole fingerprint: {holding:#?}"
    );
}
