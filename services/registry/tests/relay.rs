//! PostgreSQL: replicas share `push_devices`, and each keeps what hosts resolve to only while its
//! relay of every replica's writes vouches for it.

use std::sync::Arc;
use std::time::{Duration, Instant};

use orca_push_registry::device::{Platform, Registration};
use orca_push_registry::{AnyRegistryStore, DeviceRegistry, open_and_migrate};
use orca_push_storage::ManualClock;
use orca_push_storage::testing::{Backend, fresh};
use tokio_util::sync::CancellationToken;

const HOST: &str = "hostAAAAAAAAAAAA";

/// FCM registration strings are long: 40 of one character.
fn token(c: char) -> String {
    c.to_string().repeat(40)
}

fn android(device: &str, token: &str) -> Registration {
    Registration {
        host_fingerprint: HOST.into(),
        device_id: device.into(),
        platform: Platform::Android,
        token: token.into(),
        apns_environment: None,
        filter: None,
    }
}

/// Resolves `id` on `registry` until `done` holds of the answer, for at most `within`.
async fn resolve_until(
    registry: &DeviceRegistry<AnyRegistryStore>,
    id: &str,
    within: Duration,
    done: impl Fn(&[orca_push_registry::store::ResolvedRow]) -> bool,
) -> bool {
    let until = Instant::now() + within;
    while Instant::now() < until {
        if done(&registry.resolve(HOST, &[id.to_owned()]).await.unwrap()) {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    false
}

/// Looks `id` up for delivery on `registry` until `done` holds of the answer, for at most
/// `within`.
async fn delivered_until(
    registry: &DeviceRegistry<AnyRegistryStore>,
    id: &str,
    within: Duration,
    done: impl Fn(&[orca_push_registry::store::DeliveryRow]) -> bool,
) -> bool {
    let until = Instant::now() + within;
    while Instant::now() < until {
        if done(&registry.for_delivery(&[id.to_owned()]).await.unwrap()) {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    false
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_drops_what_another_replica_changed() {
    let (config, _guard) = fresh(Backend::Postgres).await;
    let pool = open_and_migrate(&config).await.unwrap();
    let shutdown = CancellationToken::new();
    let cached = AnyRegistryStore::new(pool.clone());
    let AnyRegistryStore::Postgres(relayed) = &cached else {
        unreachable!("a PostgreSQL pool")
    };
    tokio::spawn(relayed.clone().relay(shutdown.clone()));
    let clock = Arc::new(ManualClock::new(1_800_000_000_000));
    let watching = DeviceRegistry::new(cached.clone(), clock.clone());
    let writing = DeviceRegistry::new(AnyRegistryStore::new(pool), clock);

    let id = writing
        .register(&android("phone", &token('a')))
        .await
        .unwrap();
    // Once the relay is heard from, the host is kept.
    let kept = resolve_until(&watching, &id, Duration::from_secs(5), |rows| {
        rows.len() == 1 && cached.cached_hosts() == 1
    })
    .await;
    assert!(kept, "the host was never kept");

    // The other replica's token failure: seen dead here soon after.
    assert!(
        writing
            .mark_dead(&id, &token('a'), Platform::Android, None)
            .await
            .unwrap()
    );
    let dead = resolve_until(&watching, &id, Duration::from_secs(1), |rows| {
        rows.len() == 1 && rows[0].dead
    })
    .await;
    assert!(
        dead,
        "still resolved alive a second after another replica marked it dead"
    );

    // A new token revives it there, and here.
    writing
        .register(&android("phone", &token('b')))
        .await
        .unwrap();
    let alive = resolve_until(&watching, &id, Duration::from_secs(1), |rows| {
        rows.len() == 1 && !rows[0].dead
    })
    .await;
    assert!(
        alive,
        "still resolved dead after another replica revived it"
    );
    // A lane's look-up here takes the kept host's phone, with the new token.
    let new_token = delivered_until(&watching, &id, Duration::from_secs(1), |rows| {
        rows.len() == 1 && rows[0].token == token('b') && !rows[0].dead
    })
    .await;
    assert!(new_token, "a look-up here never saw the new token");

    // A newer token there: a look-up here sees it soon after, kept or read.
    writing
        .register(&android("phone", &token('c')))
        .await
        .unwrap();
    let newer = delivered_until(&watching, &id, Duration::from_secs(1), |rows| {
        rows.len() == 1 && rows[0].token == token('c')
    })
    .await;
    assert!(newer, "still looked up the old token a second after");

    // Deleted there: gone here.
    writing.delete(HOST, &id).await.unwrap();
    let gone = resolve_until(&watching, &id, Duration::from_secs(1), <[_]>::is_empty).await;
    assert!(
        gone,
        "still resolved a second after another replica deleted it"
    );
    let gone = delivered_until(&watching, &id, Duration::from_secs(1), <[_]>::is_empty).await;
    assert!(
        gone,
        "still looked up a second after another replica deleted it"
    );
    shutdown.cancel();
}
