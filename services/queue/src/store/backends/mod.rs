//! What differs between the backends: how a transaction begins and locks, which statements read
//! with row locks, and how other replicas are woken: `sqlite` and `postgres`, one type each.
//! Everything else is written once in the store's other modules' macros.

mod postgres;
mod sqlite;

pub use postgres::PgQueueStore;
pub use sqlite::SqliteQueueStore;

/// What differs between the backends.
pub trait Backend {
    type Db: sqlx::Database;
    type Tx;
}
