//! Test databases: every test gets its own SQLite folder or its own PostgreSQL database.
//!
//! PostgreSQL tests need `ORCA_PUSH_TEST_POSTGRES_URL` (a superuser URL on a throwaway cluster);
//! `scripts/test` starts one. Without it they fail, never skip: a green run must mean both backends.

use crate::DatabaseConfig;

pub const POSTGRES_URL_VAR: &str = "ORCA_PUSH_TEST_POSTGRES_URL";

/// The two backends every storage behaviour test runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Sqlite,
    Postgres,
}

/// A fresh, empty database of the given kind. Keep the returned guard alive for the test.
pub async fn fresh(backend: Backend) -> (DatabaseConfig, TestDbGuard) {
    match backend {
        Backend::Sqlite => {
            let dir = std::env::temp_dir().join(format!("orca-push-test-{}", uuid::Uuid::new_v4()));
            std::fs::create_dir_all(&dir).expect("create test data dir");
            (
                DatabaseConfig::Sqlite {
                    data_dir: dir.clone(),
                    durability: crate::SqliteDurability::Full,
                },
                TestDbGuard { dir: Some(dir) },
            )
        }
        Backend::Postgres => (
            DatabaseConfig::Postgres {
                url: fresh_postgres_url().await.into(),
            },
            TestDbGuard { dir: None },
        ),
    }
}

/// Creates a new database on the test cluster and returns its URL.
pub async fn fresh_postgres_url() -> String {
    let base = std::env::var(POSTGRES_URL_VAR).unwrap_or_else(|_| {
        panic!(
            "{POSTGRES_URL_VAR} is not set: PostgreSQL tests need a server. \
             Run the suite with scripts/test, which starts a throwaway one."
        )
    });
    let name = format!("orca_push_test_{}", uuid::Uuid::new_v4().simple());
    let admin = sqlx::PgPool::connect(&base)
        .await
        .unwrap_or_else(|e| panic!("cannot reach {POSTGRES_URL_VAR}: {e}"));
    // The database name is generated here from a UUID: no caller input reaches this statement.
    let statement = format!("CREATE DATABASE {name}");
    sqlx::query(&statement)
        .execute(&admin)
        .await
        .expect("create test database");
    admin.close().await;
    let (prefix, _) = base
        .rsplit_once('/')
        .expect("ORCA_PUSH_TEST_POSTGRES_URL ends in /<database>");
    format!("{prefix}/{name}")
}

/// Removes a SQLite test folder when dropped.
#[derive(Debug, Default)]
pub struct TestDbGuard {
    dir: Option<std::path::PathBuf>,
}

impl Drop for TestDbGuard {
    fn drop(&mut self) {
        if let Some(dir) = self.dir.take() {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}
