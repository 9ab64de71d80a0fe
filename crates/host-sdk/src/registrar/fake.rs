//! A scripted gateway and the set-up shared by the registrar's tests.

use std::collections::VecDeque;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use orca_push_api::{Health, RegisterReply, SendReply, SendRequest};
use tokio::sync::Semaphore;
use tokio::time::Instant;

use super::*;
use crate::proof::ChallengeRefusal;

/// A scripted failure (`GatewayError` is not `Clone`).
#[derive(Debug, Clone, Copy)]
pub(super) enum Fail {
    Api(u16, ErrorCode),
    Refused,
}

impl Fail {
    fn error(self) -> GatewayError {
        match self {
            Self::Api(status, code) => GatewayError::Api {
                status,
                code,
                retry_after: None,
            },
            Self::Refused => GatewayError::Refused(ChallengeRefusal::Expired),
        }
    }
}

/// Holds a gateway call until the test opens it.
pub(super) struct Gate {
    entered: Notify,
    release: Semaphore,
}

impl Gate {
    pub(super) fn new() -> Arc<Self> {
        Arc::new(Self {
            entered: Notify::new(),
            release: Semaphore::new(0),
        })
    }

    async fn pass(&self) {
        self.entered.notify_one();
        self.release.acquire().await.unwrap().forget();
    }

    pub(super) async fn entered(&self) {
        self.entered.notified().await;
    }

    pub(super) fn open(&self) {
        self.release.add_permits(1);
    }
}

/// Answers from scripts; unscripted registers return `reg-<device>` (the gateway keeps one id per
/// device), unscripted deletes succeed unless `unregister_default` says otherwise.
#[derive(Default)]
pub(super) struct FakeGateway {
    pub(super) register_script: Mutex<VecDeque<Result<String, Fail>>>,
    pub(super) unregister_script: Mutex<VecDeque<Result<(), Fail>>>,
    pub(super) unregister_default: Mutex<Option<Fail>>,
    pub(super) register_gate: Mutex<Option<Arc<Gate>>>,
    pub(super) unregister_gate: Mutex<Option<Arc<Gate>>>,
    pub(super) requests: Mutex<Vec<RegisterRequest>>,
    /// Every call in order: `register:<device>` or `unregister:<registration id>`.
    pub(super) log: Mutex<Vec<String>>,
    pub(super) unregister_times: Mutex<Vec<Instant>>,
}

impl FakeGateway {
    pub(super) fn log(&self) -> Vec<String> {
        self.log.lock().unwrap().clone()
    }

    pub(super) fn script_register(&self, answer: Result<&str, Fail>) {
        let answer = answer.map(str::to_owned);
        self.register_script.lock().unwrap().push_back(answer);
    }

    pub(super) fn script_unregister(&self, answer: Result<(), Fail>) {
        self.unregister_script.lock().unwrap().push_back(answer);
    }
}

impl Gateway for FakeGateway {
    async fn register(&self, request: &RegisterRequest) -> Result<RegisterReply, GatewayError> {
        let entry = format!("register:{}", request.device_id);
        self.log.lock().unwrap().push(entry);
        self.requests.lock().unwrap().push(request.clone());
        let gate = self.register_gate.lock().unwrap().clone();
        if let Some(gate) = gate {
            gate.pass().await;
        }
        let scripted = self.register_script.lock().unwrap().pop_front();
        match scripted.unwrap_or_else(|| Ok(format!("reg-{}", request.device_id))) {
            Ok(registration_id) => Ok(RegisterReply { registration_id }),
            Err(fail) => Err(fail.error()),
        }
    }

    async fn unregister(&self, registration_id: &str) -> Result<(), GatewayError> {
        self.log
            .lock()
            .unwrap()
            .push(format!("unregister:{registration_id}"));
        self.unregister_times.lock().unwrap().push(Instant::now());
        let gate = self.unregister_gate.lock().unwrap().clone();
        if let Some(gate) = gate {
            gate.pass().await;
        }
        let scripted = self.unregister_script.lock().unwrap().pop_front();
        let default = *self.unregister_default.lock().unwrap();
        match scripted.unwrap_or_else(|| default.map_or(Ok(()), Err)) {
            Ok(()) => Ok(()),
            Err(fail) => Err(fail.error()),
        }
    }

    async fn send(&self, _: &SendRequest) -> Result<SendReply, GatewayError> {
        Err(GatewayError::Malformed("not scripted"))
    }

    async fn health(&self) -> Result<Health, GatewayError> {
        Err(GatewayError::Malformed("not scripted"))
    }
}

pub(super) struct Setup {
    pub(super) dir: tempfile::TempDir,
    pub(super) gateway: Arc<FakeGateway>,
    pub(super) registrar: Arc<Registrar<FakeGateway>>,
    pub(super) now: Arc<AtomicU64>,
}

pub(super) fn setup_with(config: RegistrarConfig) -> Setup {
    let dir = tempfile::tempdir().unwrap();
    let gateway = Arc::new(FakeGateway::default());
    let (registrar, now) = registrar_in(dir.path(), &gateway, config);
    Setup {
        dir,
        gateway,
        registrar,
        now,
    }
}

pub(super) fn setup() -> Setup {
    setup_with(RegistrarConfig::default())
}

/// A registrar over the store and outbox files in `dir`, as a restarted host would open them.
pub(super) fn registrar_in(
    dir: &std::path::Path,
    gateway: &Arc<FakeGateway>,
    config: RegistrarConfig,
) -> (Arc<Registrar<FakeGateway>>, Arc<AtomicU64>) {
    let store = Arc::new(RegistrationStore::open(dir).unwrap());
    let outbox = Arc::new(UnregisterOutbox::open(dir).unwrap());
    let now = Arc::new(AtomicU64::new(1_000));
    let clock = Arc::clone(&now);
    let registrar = Registrar::new(Arc::clone(gateway), store, outbox, config)
        .with_clock(Arc::new(move || clock.load(Ordering::SeqCst)));
    (Arc::new(registrar), now)
}

pub(super) async fn register(
    registrar: &Registrar<FakeGateway>,
    device: &str,
    token: &str,
) -> RegisterOutcome {
    let env = Some(ApnsEnvironment::Sandbox);
    registrar
        .register(device, Platform::Ios, token, env, HostFilter::everything())
        .await
}

pub(super) fn registered(id: &str) -> RegisterOutcome {
    RegisterOutcome::Registered {
        registration_id: id.into(),
    }
}
