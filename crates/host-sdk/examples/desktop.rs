//! What a desktop app does with the host SDK, end to end: load (or create) its key, log in,
//! register a paired phone, dispatch its agents' events, and keep the unregister outbox draining.
//!
//! ```sh
//! cargo run -p orca-push-host --example desktop -- http://127.0.0.1:8080 /tmp/orca-desktop \
//!     pixel-1 android demo-fcm-token-0123456789abcdefghijklmnopqrstuvwxyz
//! ```
//!
//! Arguments: gateway URL, data directory, then a phone's device id, platform and native token
//! (as the phone's `notifications.registerPush` RPC would hand them over).

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use orca_push_host::api::{Kind, Platform, Source};
use orca_push_host::{
    DispatchConfig, DispatchEvent, Dispatcher, GatewayClient, HostFilter, HostKey, KeyError,
    RegisterOutcome, Registrar, RegistrarConfig, RegistrationStore, UnregisterOutbox,
};

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [gateway, dir, device_id, platform, token] = args.as_slice() else {
        return Err(
            "usage: desktop <gateway-url> <data-dir> <device-id> <ios|android> <token>".into(),
        );
    };
    let dir = std::path::PathBuf::from(dir);

    // 1. The host key: created once, then loaded on every start. The session file beside it is
    //    shared with the CLI, so neither revokes the other's session.
    let key_path = dir.join("host.key");
    let key = match HostKey::load(&key_path) {
        Ok(key) => key,
        Err(KeyError::Io { .. }) => {
            let key = HostKey::generate();
            key.save_new(&key_path)?;
            key
        }
        Err(other) => return Err(other.into()),
    };
    let client = Arc::new(
        GatewayClient::new(gateway, key)?.with_session_file(key_path.with_extension("session")),
    );
    let session = client.session().await?;
    println!("logged in as {}", session.host_fingerprint);

    // 2. The registration store and the unregister outbox live in the app's data directory; the
    //    outbox worker drains deletes queued by earlier runs and retries with backoff.
    let store = Arc::new(RegistrationStore::open(&dir)?);
    let outbox = Arc::new(UnregisterOutbox::open(&dir)?);
    let registrar = Arc::new(Registrar::new(
        client.clone(),
        store.clone(),
        outbox,
        RegistrarConfig::default(),
    ));
    let (stop_outbox, outbox_stopped) = tokio::sync::watch::channel(false);
    let outbox_worker = registrar.spawn_outbox_worker(outbox_stopped);

    // 3. A phone's registerPush RPC: the answer goes back to the phone as-is.
    let platform = Platform::parse(platform).ok_or("platform must be ios or android")?;
    let environment =
        (platform == Platform::Ios).then_some(orca_push_host::api::ApnsEnvironment::Sandbox);
    match registrar
        .register(
            device_id,
            platform,
            token,
            environment,
            HostFilter::everything(),
        )
        .await
    {
        RegisterOutcome::Registered { registration_id } => {
            println!("registered {device_id} as {registration_id}")
        }
        RegisterOutcome::NotRegistered(reason) => println!("not registered: {}", reason.as_str()),
    }

    // 4. The dispatch hook: after the socket fan-out, every mobile notification goes here. It
    //    never blocks or fails the caller; filters, batching and the retry happen inside.
    let dispatcher = Dispatcher::new(client.clone(), store, DispatchConfig::default());
    let epoch = format!("example-{}", now_ms());
    for (seq, state) in [(1, "working"), (2, "blocked"), (3, "done")] {
        dispatcher.enqueue(DispatchEvent {
            notification_id: Some(format!("task-{seq}")),
            notification_seq: seq,
            notification_epoch: epoch.clone(),
            source: Source::AgentTaskComplete,
            agent_state: Some(state.to_owned()),
            title: format!("Agent is {state}"),
            body: "From the orca-push desktop example.".to_owned(),
            worktree_id: None,
            kind: Kind::Alert,
            expires_at: None,
            // Spaced past the 5 s burst window, as real events usually are.
            emitted_at: Some(now_ms() + seq * 10_000),
            desktop_allowed: true,
        });
    }

    // 5. Quitting: finish in-flight sends (bounded), flush the failure counts, stop the outbox.
    dispatcher.shutdown().await;
    let _ = stop_outbox.send(true);
    let _ = tokio::time::timeout(Duration::from_secs(5), outbox_worker).await;
    println!("failures: {:?}", dispatcher.failure_counts());
    Ok(())
}
