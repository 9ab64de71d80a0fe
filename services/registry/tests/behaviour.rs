//! The registry's behaviour, run unchanged against SQLite and PostgreSQL.

use std::sync::Arc;

use orca_push_registry::device::{ApnsEnvironment, DeviceFilter, Platform, Registration};
use orca_push_registry::{AnyRegistryStore, DeviceRegistry, RegistryError, open_and_migrate};
use orca_push_storage::ManualClock;
use orca_push_storage::testing::{Backend, TestDbGuard, fresh};

struct Harness {
    registry: Arc<DeviceRegistry<AnyRegistryStore>>,
    _db: TestDbGuard,
}

async fn harness(backend: Backend) -> Harness {
    DbSpans::install();
    let (config, guard) = fresh(backend).await;
    let pool = open_and_migrate(&config).await.expect("open and migrate");
    let clock = ManualClock::new(1_800_000_000_000);
    Harness {
        registry: Arc::new(DeviceRegistry::new(
            AnyRegistryStore::new(pool),
            Arc::new(clock),
        )),
        _db: guard,
    }
}

fn ios(host: &str, device: &str, token: &str) -> Registration {
    Registration {
        host_fingerprint: host.into(),
        device_id: device.into(),
        platform: Platform::Ios,
        token: token.into(),
        apns_environment: Some(ApnsEnvironment::Production),
        filter: None,
    }
}

fn android(host: &str, device: &str, token: &str) -> Registration {
    Registration {
        host_fingerprint: host.into(),
        device_id: device.into(),
        platform: Platform::Android,
        token: token.into(),
        apns_environment: None,
        filter: None,
    }
}

const HOST: &str = "hostAAAAAAAAAAAA";
const OTHER: &str = "hostBBBBBBBBBBBB";

macro_rules! on_both_backends {
    ($($name:ident),* $(,)?) => {$(
        mod $name {
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn sqlite() {
                super::$name(orca_push_storage::testing::Backend::Sqlite).await;
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn postgres() {
                super::$name(orca_push_storage::testing::Backend::Postgres).await;
            }
        }
    )*};
}

on_both_backends!(
    registering_again_keeps_the_id_and_replaces_the_token,
    cap_is_64_devices_and_a_delete_frees_a_slot,
    cap_holds_under_200_parallel_registrations,
    only_the_owner_sees_or_deletes_a_registration,
    mark_dead_only_while_the_sent_token_still_stands,
    a_new_token_revives_a_dead_registration,
    filter_is_stored_and_returned,
    hosts_with_devices_names_only_hosts_that_have_some,
    for_delivery_reads_many_devices_in_the_order_asked,
    only_a_resolve_that_reads_has_a_db_span,
    a_resolved_hosts_phones_are_looked_up_without_a_read,
);

async fn for_delivery_reads_many_devices_in_the_order_asked(backend: Backend) {
    let h = harness(backend).await;
    let mut ids = Vec::new();
    for (device, token) in [("phone", "aa"), ("tablet", "bb"), ("watch", "cc")] {
        ids.push(
            h.registry
                .register(&ios(HOST, device, token))
                .await
                .unwrap(),
        );
    }
    let asked = vec![
        ids[2].clone(),
        "unknown-registration-id".to_owned(),
        ids[0].clone(),
        ids[2].clone(),
        ids[1].clone(),
    ];
    let found = h.registry.for_delivery(&asked).await.unwrap();
    let seen: Vec<(&str, &str)> = found
        .iter()
        .map(|d| (d.registration_id.as_str(), d.token.as_str()))
        .collect();
    assert_eq!(
        seen,
        [
            (ids[2].as_str(), "cc"),
            (ids[0].as_str(), "aa"),
            (ids[1].as_str(), "bb")
        ],
        "unknown ids are left out and each device comes once"
    );
    assert!(h.registry.for_delivery(&[]).await.unwrap().is_empty());
}

async fn registering_again_keeps_the_id_and_replaces_the_token(backend: Backend) {
    let h = harness(backend).await;
    let first = h
        .registry
        .register(&ios(HOST, "phone", "aa"))
        .await
        .unwrap();
    assert_eq!(first.len(), 24);
    let again = h
        .registry
        .register(&ios(HOST, "phone", "bb"))
        .await
        .unwrap();
    assert_eq!(first, again);
    let delivery = h
        .registry
        .for_delivery(std::slice::from_ref(&first))
        .await
        .unwrap();
    assert_eq!(delivery[0].token, "bb");
    // A second device gets a different, unguessable id.
    let second = h
        .registry
        .register(&ios(HOST, "tablet", "cc"))
        .await
        .unwrap();
    assert_ne!(second, first);
    assert_eq!(h.registry.list(HOST).await.unwrap().len(), 2);
}

async fn cap_is_64_devices_and_a_delete_frees_a_slot(backend: Backend) {
    let h = harness(backend).await;
    let mut ids = Vec::new();
    for i in 0..64 {
        ids.push(
            h.registry
                .register(&ios(HOST, &format!("d{i}"), "aa"))
                .await
                .unwrap(),
        );
    }
    let err = h
        .registry
        .register(&ios(HOST, "d64", "aa"))
        .await
        .unwrap_err();
    assert!(matches!(err, RegistryError::TooManyDevices), "{err:?}");
    // Re-registering an owned device always succeeds at the cap.
    h.registry.register(&ios(HOST, "d3", "bb")).await.unwrap();
    // Another host is unaffected.
    h.registry.register(&ios(OTHER, "d64", "aa")).await.unwrap();
    h.registry.delete(HOST, &ids[0]).await.unwrap();
    h.registry.register(&ios(HOST, "d64", "aa")).await.unwrap();
    assert_eq!(h.registry.list(HOST).await.unwrap().len(), 64);
}

async fn cap_holds_under_200_parallel_registrations(backend: Backend) {
    let h = harness(backend).await;
    let attempts = (0..200).map(|i| {
        let registry = h.registry.clone();
        tokio::spawn(async move {
            registry
                .register(&ios(HOST, &format!("p{i}"), "abcd"))
                .await
        })
    });
    let results = futures::future::join_all(attempts).await;
    let mut ok = 0;
    for result in results {
        match result.unwrap() {
            Ok(_) => ok += 1,
            Err(RegistryError::TooManyDevices) => {}
            Err(other) => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(ok, 64);
    assert_eq!(h.registry.list(HOST).await.unwrap().len(), 64);
}

async fn only_the_owner_sees_or_deletes_a_registration(backend: Backend) {
    let h = harness(backend).await;
    let id = h
        .registry
        .register(&ios(HOST, "phone", "aa"))
        .await
        .unwrap();
    assert!(h.registry.list(OTHER).await.unwrap().is_empty());
    assert!(matches!(
        h.registry.delete(OTHER, &id).await,
        Err(RegistryError::NotFound)
    ));
    assert!(matches!(
        h.registry.delete(OTHER, "no-such-id").await,
        Err(RegistryError::NotFound)
    ));
    assert!(
        h.registry
            .resolve(OTHER, std::slice::from_ref(&id))
            .await
            .unwrap()
            .is_empty()
    );
    let resolved = h
        .registry
        .resolve(HOST, &[id.clone(), "nope".into()])
        .await
        .unwrap();
    assert_eq!(resolved.len(), 1);
    assert_eq!(resolved[0].platform, Platform::Ios);
    h.registry.delete(HOST, &id).await.unwrap();
    assert!(matches!(
        h.registry.delete(HOST, &id).await,
        Err(RegistryError::NotFound)
    ));
    assert!(h.registry.for_delivery(&[id]).await.unwrap().is_empty());
}

async fn mark_dead_only_while_the_sent_token_still_stands(backend: Backend) {
    let h = harness(backend).await;
    let id = h
        .registry
        .register(&ios(HOST, "phone", "aa"))
        .await
        .unwrap();
    // The token was replaced after the send: the new one stays alive.
    h.registry
        .register(&ios(HOST, "phone", "bb"))
        .await
        .unwrap();
    let env = Some(ApnsEnvironment::Production);
    assert!(
        !h.registry
            .mark_dead(&id, "aa", Platform::Ios, env)
            .await
            .unwrap()
    );
    // Same token but another environment or platform: not what was sent.
    assert!(
        !h.registry
            .mark_dead(&id, "bb", Platform::Ios, Some(ApnsEnvironment::Sandbox))
            .await
            .unwrap()
    );
    assert!(
        !h.registry
            .mark_dead(&id, "bb", Platform::Android, None)
            .await
            .unwrap()
    );
    assert!(
        !h.registry
            .resolve(HOST, std::slice::from_ref(&id))
            .await
            .unwrap()[0]
            .dead
    );
    assert!(
        h.registry
            .mark_dead(&id, "bb", Platform::Ios, env)
            .await
            .unwrap()
    );
    assert!(
        h.registry
            .resolve(HOST, std::slice::from_ref(&id))
            .await
            .unwrap()[0]
            .dead
    );
    assert!(h.registry.list(HOST).await.unwrap()[0].dead);
    let fcm = "f".repeat(40);
    let aid = h
        .registry
        .register(&android(HOST, "pixel", &fcm))
        .await
        .unwrap();
    assert!(
        h.registry
            .mark_dead(&aid, &fcm, Platform::Android, None)
            .await
            .unwrap()
    );
}

async fn a_new_token_revives_a_dead_registration(backend: Backend) {
    let h = harness(backend).await;
    let env = Some(ApnsEnvironment::Production);
    let id = h
        .registry
        .register(&ios(HOST, "phone", "aa"))
        .await
        .unwrap();
    assert!(
        h.registry
            .mark_dead(&id, "aa", Platform::Ios, env)
            .await
            .unwrap()
    );
    // The same token registered again stays dead: the provider already refused it.
    h.registry
        .register(&ios(HOST, "phone", "aa"))
        .await
        .unwrap();
    assert!(
        h.registry
            .resolve(HOST, std::slice::from_ref(&id))
            .await
            .unwrap()[0]
            .dead
    );
    h.registry
        .register(&ios(HOST, "phone", "cc"))
        .await
        .unwrap();
    assert!(!h.registry.resolve(HOST, &[id]).await.unwrap()[0].dead);
}

async fn filter_is_stored_and_returned(backend: Backend) {
    let h = harness(backend).await;
    let filter = DeviceFilter {
        sources: vec!["plugin".into()],
        agent_states: vec!["needs-input".into(), "finished".into()],
    };
    let mut r = ios(HOST, "phone", "aa");
    r.filter = Some(filter.clone());
    h.registry.register(&r).await.unwrap();
    h.registry
        .register(&ios(HOST, "tablet", "aa"))
        .await
        .unwrap();
    let devices = h.registry.list(HOST).await.unwrap();
    let by_id = |id: &str| {
        devices
            .iter()
            .find(|d| d.device_id == id)
            .unwrap()
            .filter
            .clone()
    };
    assert_eq!(by_id("phone"), Some(filter));
    assert_eq!(by_id("tablet"), None);
}

async fn hosts_with_devices_names_only_hosts_that_have_some(backend: Backend) {
    let h = harness(backend).await;
    h.registry
        .register(&ios(HOST, "phone", "aa"))
        .await
        .unwrap();
    let with = h
        .registry
        .hosts_with_devices(&[HOST.into(), OTHER.into()])
        .await
        .unwrap();
    assert_eq!(with, vec![HOST.to_owned()]);
}

/// Counts the `db` spans opened on the test's thread.
///
/// One subscriber serves the whole binary, installed by `harness` before any test makes a span.
/// A scoped one (`set_default`) is not enough: tracing registers a call site when it is first
/// reached after some subscriber exists, and while one scoped subscriber is the only one alive it
/// asks the reaching thread's own default. A parallel test with none could so mark the `db` span
/// as never wanted, and this test would count nothing (CI saw it once on PostgreSQL).
struct DbSpans;

thread_local! {
    static DB_SPANS_HERE: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

struct CountDbSpans;

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for CountDbSpans {
    fn on_new_span(
        &self,
        attrs: &tracing::span::Attributes<'_>,
        _: &tracing::span::Id,
        _: tracing_subscriber::layer::Context<'_, S>,
    ) {
        if attrs.metadata().name() == "db" {
            DB_SPANS_HERE.with(|n| n.set(n.get() + 1));
        }
    }
}

impl DbSpans {
    fn install() {
        use tracing_subscriber::layer::SubscriberExt as _;
        static INSTALLED: std::sync::Once = std::sync::Once::new();
        INSTALLED.call_once(|| {
            tracing::subscriber::set_global_default(
                tracing_subscriber::registry().with(CountDbSpans),
            )
            .expect("no other subscriber in this binary");
            tracing::callsite::rebuild_interest_cache();
        });
    }

    fn start() -> Self {
        DB_SPANS_HERE.with(|n| n.set(0));
        DbSpans
    }

    fn taken(&self) -> usize {
        DB_SPANS_HERE.with(|n| n.replace(0))
    }
}

/// A resolve the cache answers reads nothing and has no `db` span (before, every send's resolve
/// had one); one that reads has. On PostgreSQL without a relay the cache serves nothing.
async fn only_a_resolve_that_reads_has_a_db_span(backend: Backend) {
    let h = harness(backend).await;
    let id = h
        .registry
        .register(&ios(HOST, "phone-1", "aaaaaaaaaaaaaaaaaaaa"))
        .await
        .unwrap();
    let spans = DbSpans::start();
    let ids = std::slice::from_ref(&id);
    assert_eq!(h.registry.resolve(HOST, ids).await.unwrap().len(), 1);
    assert_eq!(spans.taken(), 1, "the first resolve reads");
    assert_eq!(h.registry.resolve(HOST, ids).await.unwrap().len(), 1);
    let cached = backend == Backend::Sqlite;
    assert_eq!(spans.taken(), usize::from(!cached), "cached: {cached}");
}

/// A lane's look-up of phones whose host a send resolved reads nothing on SQLite (the registry
/// owns the file), and sees a new token at once: the write drops the host's entry. On PostgreSQL
/// without a relay every look-up reads.
async fn a_resolved_hosts_phones_are_looked_up_without_a_read(backend: Backend) {
    let h = harness(backend).await;
    let phone = h
        .registry
        .register(&ios(HOST, "phone", "aaaaaaaaaaaaaaaaaaaa"))
        .await
        .unwrap();
    let tablet = h
        .registry
        .register(&android(OTHER, "tablet", &"b".repeat(40)))
        .await
        .unwrap();
    let spans = DbSpans::start();
    let cached = backend == Backend::Sqlite;
    let tokens = |rows: Vec<orca_push_registry::store::DeliveryRow>| -> Vec<(String, String)> {
        rows.into_iter()
            .map(|r| (r.registration_id, r.token))
            .collect()
    };

    h.registry
        .resolve(HOST, std::slice::from_ref(&phone))
        .await
        .unwrap();
    spans.taken();
    let both = [tablet.clone(), phone.clone(), phone.clone()];
    let found = tokens(h.registry.for_delivery(&both).await.unwrap());
    assert_eq!(
        found,
        [
            (tablet.clone(), "b".repeat(40)),
            (phone.clone(), "aaaaaaaaaaaaaaaaaaaa".to_owned())
        ],
        "in the order asked, once each"
    );
    assert_eq!(spans.taken(), 1, "the unresolved host's phone is read");
    let alone = std::slice::from_ref(&phone);
    assert_eq!(
        tokens(h.registry.for_delivery(alone).await.unwrap()),
        [(phone.clone(), "aaaaaaaaaaaaaaaaaaaa".to_owned())]
    );
    assert_eq!(spans.taken(), usize::from(!cached), "cached: {cached}");

    h.registry
        .register(&ios(HOST, "phone", "cccccccccccccccccccc"))
        .await
        .unwrap();
    spans.taken();
    assert_eq!(
        tokens(h.registry.for_delivery(alone).await.unwrap()),
        [(phone.clone(), "cccccccccccccccccccc".to_owned())],
        "a new token at once"
    );
    assert_eq!(spans.taken(), 1);
    h.registry.resolve(HOST, alone).await.unwrap();
    spans.taken();
    let found = h.registry.for_delivery(alone).await.unwrap();
    assert_eq!(found[0].token, "cccccccccccccccccccc");
    assert_eq!(found[0].apns_environment, Some(ApnsEnvironment::Production));
    assert_eq!(found[0].host_fingerprint, HOST);
    assert_eq!(spans.taken(), usize::from(!cached));
}

/// PostgreSQL: a delete that commits between a re-registration's read of the phone's row and its
/// update (deletes take no host lock) leaves the update nothing to change; the re-registration
/// then makes a new registration rather than answer the id of the one just deleted.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_re_registration_racing_a_delete_answers_a_registration_that_exists_postgres() {
    use secrecy::ExposeSecret as _;
    let (config, _guard) = fresh(Backend::Postgres).await;
    let orca_push_storage::DatabaseConfig::Postgres { url } = &config else {
        unreachable!("a PostgreSQL database")
    };
    let pool = open_and_migrate(&config).await.expect("open and migrate");
    let registry = Arc::new(DeviceRegistry::new(
        AnyRegistryStore::new(pool),
        Arc::new(ManualClock::new(1_800_000_000_000)),
    ));
    let first = registry.register(&ios(HOST, "phone", "aa")).await.unwrap();
    // Another session holds the row, so the re-registration reads it and then waits at its
    // update; the row is deleted meanwhile.
    let mut other = sqlx::PgConnection::connect(url.expose_secret())
        .await
        .unwrap();
    use sqlx::Connection as _;
    let mut held = other.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM push_registry.push_devices WHERE registration_id = $1 FOR UPDATE")
        .bind(&first)
        .execute(&mut *held)
        .await
        .unwrap();
    let again = {
        let registry = registry.clone();
        tokio::spawn(async move { registry.register(&ios(HOST, "phone", "bb")).await })
    };
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    assert!(
        !again.is_finished(),
        "the re-registration waits for the row"
    );
    sqlx::query("DELETE FROM push_registry.push_devices WHERE registration_id = $1")
        .bind(&first)
        .execute(&mut *held)
        .await
        .unwrap();
    held.commit().await.unwrap();
    let again = again.await.unwrap().unwrap();
    assert_ne!(again, first, "the id of a deleted registration");
    let listed: Vec<String> = registry
        .list(HOST)
        .await
        .unwrap()
        .into_iter()
        .map(|d| d.registration_id)
        .collect();
    assert_eq!(listed, [again]);
}
