//! The queue's statements, written once and run on either kind of transaction: sqlx's (PostgreSQL,
//! and SQLite outside the writer's rounds) or the SQLite writer's own connection
//! (`super::direct`).
//!
//! A [`Stmt`] is SQL text and its arguments: a whole statement with `$N` parameters (which both
//! backends and both SQLite drivers bind by number), or one built as sqlx's `QueryBuilder` builds,
//! its parameters `$N` on PostgreSQL and `?` on SQLite (bound in order). An [`Exec`] runs it and
//! hands back rows whose columns are read by name ([`Row`]).

use std::borrow::Cow;
use std::fmt::Write as _;
use std::future::Future;

mod args;

pub use args::{Arg, List};

/// Up to this many rows (or items of a list), a numbered statement (PostgreSQL's) binds them one by
/// one, as `VALUES` tuples or `IN (..)`; beyond, as arrays ([`Stmt::push_values`]). The server
/// decodes an array and materialises its rows, more work than a tuple's parameters: with every
/// group bound as arrays, admission at 8 connections (groups of one to three) did 1,725 sends/s
/// against 1,847 with tuples (means of four runs each), the server taking more CPU per admission.
/// Each statement is then at most five texts: some 75 for the fifteen built ones, which with the
/// store's fixed statements come to a little over the 100 sqlx keeps prepared per connection; the
/// least recently used (a dismissal's lock, the minute's clean-up) are prepared again when next
/// run.
pub const TUPLES_UP_TO: usize = 4;

/// A statement (or, where the executor [`Exec::joins`], several joined by `;`) and its arguments.
#[derive(Debug, Clone)]
pub struct Stmt<'a> {
    /// Borrowed until something is pushed: a whole statement is not copied.
    sql: Cow<'a, str>,
    args: Vec<Arg<'a>>,
    /// Kept prepared after it runs (sqlx's `persistent`).
    keep: bool,
    /// Its parameters are `$N`, bound by number; else `?`, bound in order. SQLite parses `$N` as a
    /// name, looked up among those before it, so a statement of thousands of them (a group's
    /// rows) costs quadratic time to prepare and to bind: only PostgreSQL's built statements use
    /// them.
    numbered: bool,
}

impl<'a> Stmt<'a> {
    /// A whole statement whose `$N` the `bind`s fill in order.
    pub fn new(sql: &'a str) -> Self {
        Self::build(sql, true)
    }

    /// The head of a statement the `push` methods finish, its parameters numbered (`$N`,
    /// PostgreSQL's) or not (`?`, SQLite's).
    pub fn build(head: &'a str, numbered: bool) -> Self {
        Self {
            sql: Cow::Borrowed(head),
            args: Vec::new(),
            keep: true,
            numbered,
        }
    }

    /// The next argument of a statement written with its own `$N`.
    pub fn bind(mut self, value: impl Into<Arg<'a>>) -> Self {
        self.args.push(value.into());
        self
    }

    /// Whether the statement stays prepared once run (by default it does).
    pub fn persistent(mut self, keep: bool) -> Self {
        self.keep = keep;
        self
    }

    pub fn push(&mut self, sql: &str) -> &mut Self {
        self.sql.to_mut().push_str(sql);
        self
    }

    /// A parameter (`$N` or `?`) here, bound to `value`.
    pub fn push_bind(&mut self, value: impl Into<Arg<'a>>) -> &mut Self {
        self.args.push(value.into());
        let sql = self.sql.to_mut();
        if self.numbered {
            // Writing to a String cannot fail.
            let _ = write!(sql, "${}", self.args.len());
        } else {
            sql.push('?');
        }
        self
    }

    /// Pieces pushed with `separator` between them.
    pub fn separated(&mut self, separator: &'static str) -> Separated<'_, 'a> {
        Separated {
            stmt: self,
            separator,
            first: true,
        }
    }

    /// `VALUES (..), (..)`: one tuple per item, its values bound by `push_tuple`. A numbered
    /// statement (PostgreSQL's) of more than `TUPLES_UP_TO` rows binds each column as one array
    /// instead, `SELECT * FROM UNNEST($1::text[], $2::int8[], ..)`, so that its text is the same
    /// for any number of rows: it is prepared and planned once per connection, where each number
    /// of rows was a statement of its own, parsed and planned again on most runs (profiled at 100
    /// end-to-end flows: planning a fifth of the server's CPU).
    pub fn push_values<I: IntoIterator>(
        &mut self,
        items: I,
        mut push_tuple: impl FnMut(Separated<'_, 'a>, I::Item),
    ) -> &mut Self {
        let items = items.into_iter();
        // Known to be a few (a slice, a chunk): bound as they come, with nothing collected first.
        let few = items.size_hint().1.is_some_and(|most| most <= TUPLES_UP_TO);
        if !self.numbered || few {
            self.push("VALUES ");
            for (i, item) in items.enumerate() {
                if i > 0 {
                    self.push(", ");
                }
                self.push("(");
                push_tuple(self.separated(", "), item);
                self.push(")");
            }
            return self;
        }
        let rows: Vec<Vec<Arg<'a>>> = items
            .map(|item| {
                let mut row = Stmt::build("", false);
                push_tuple(row.separated(", "), item);
                row.args
            })
            .collect();
        let as_arrays = if rows.len() > TUPLES_UP_TO {
            List::columns(rows)
        } else {
            Err(rows)
        };
        match as_arrays {
            Ok(columns) => {
                self.push("SELECT * FROM UNNEST(");
                for (i, column) in columns.into_iter().enumerate() {
                    if i > 0 {
                        self.push(", ");
                    }
                    let cast = column.cast();
                    self.push_bind(Arg::List(column)).push(cast);
                }
                self.push(")")
            }
            // A few rows, or rows whose columns do not line up: as tuples.
            Err(rows) => {
                self.push("VALUES ");
                for (i, row) in rows.into_iter().enumerate() {
                    if i > 0 {
                        self.push(", ");
                    }
                    self.push("(");
                    let mut tuple = self.separated(", ");
                    for value in row {
                        tuple.push_bind(value);
                    }
                    self.push(")");
                }
                self
            }
        }
    }

    /// ` IN (..)`, a parameter per item; or on a numbered statement (PostgreSQL's) of more than
    /// `TUPLES_UP_TO` items ` = ANY($1::text[])`, one array, so that the text is the same for any
    /// number of items (see `push_values`). The server reads `IN ($1, $2)` as
    /// `= ANY(ARRAY[$1, $2])`: the plans are the same.
    pub fn push_in<T: Into<Arg<'a>>>(&mut self, items: impl IntoIterator<Item = T>) -> &mut Self {
        let items = items.into_iter();
        // Known to be a few (as `push_values`), or SQLite's: bound as they come.
        let few = items.size_hint().1.is_some_and(|most| most <= TUPLES_UP_TO);
        if !self.numbered || few {
            return self.push_in_tuple(items.map(Into::into));
        }
        let items: Vec<Arg<'a>> = items.map(Into::into).collect();
        if items.len() <= TUPLES_UP_TO {
            return self.push_in_tuple(items);
        }
        match List::of(items) {
            Ok(list) => {
                let cast = list.cast();
                self.push(" = ANY(")
                    .push_bind(Arg::List(list))
                    .push(cast)
                    .push(")")
            }
            Err(items) => self.push_in_tuple(items),
        }
    }

    /// ` IN (..)`, a parameter per item.
    fn push_in_tuple(&mut self, items: impl IntoIterator<Item = Arg<'a>>) -> &mut Self {
        self.push(" IN (");
        let mut list = self.separated(", ");
        for item in items {
            list.push_bind(item);
        }
        self.push(")")
    }

    /// Runs in `tx`: the rows changed (summed over joined statements).
    pub async fn execute<E: Exec>(self, tx: &mut E) -> Result<u64, sqlx::Error> {
        tx.run(self).await
    }

    /// Runs in `tx`: the rows returned.
    pub async fn fetch_all<E: Exec>(self, tx: &mut E) -> Result<Vec<E::Row>, sqlx::Error> {
        tx.rows(self).await
    }

    /// Runs in `tx`: the first row returned, if any.
    pub async fn fetch_optional<E: Exec>(self, tx: &mut E) -> Result<Option<E::Row>, sqlx::Error> {
        tx.opt(self).await
    }

    /// Runs in `tx`: the first row returned; an error if none.
    pub async fn fetch_one<E: Exec>(self, tx: &mut E) -> Result<E::Row, sqlx::Error> {
        tx.one(self).await
    }

    pub fn sql(&self) -> &str {
        &self.sql
    }

    pub fn args(&self) -> &[Arg<'a>] {
        &self.args
    }

    pub fn keep(&self) -> bool {
        self.keep
    }

    pub fn numbered(&self) -> bool {
        self.numbered
    }
}

/// Pieces of a statement with a separator between them (sqlx's `Separated`).
pub struct Separated<'s, 'a> {
    stmt: &'s mut Stmt<'a>,
    separator: &'static str,
    first: bool,
}

impl<'a> Separated<'_, 'a> {
    pub fn push_bind(&mut self, value: impl Into<Arg<'a>>) -> &mut Self {
        if !self.first {
            self.stmt.push(self.separator);
        }
        self.first = false;
        self.stmt.push_bind(value);
        self
    }
}

/// A column's value, read from either driver's row.
pub trait Col:
    Sized
    + for<'r> sqlx::Decode<'r, sqlx::Sqlite>
    + sqlx::Type<sqlx::Sqlite>
    + for<'r> sqlx::Decode<'r, sqlx::Postgres>
    + sqlx::Type<sqlx::Postgres>
{
    /// From a column of the SQLite writer's own connection; `None` if it holds another type.
    fn from_direct(value: rusqlite::types::ValueRef<'_>) -> Option<Self>;
}

impl Col for i64 {
    fn from_direct(value: rusqlite::types::ValueRef<'_>) -> Option<Self> {
        value.as_i64().ok()
    }
}

impl Col for i32 {
    fn from_direct(value: rusqlite::types::ValueRef<'_>) -> Option<Self> {
        value.as_i64().ok().and_then(|v| i32::try_from(v).ok())
    }
}

impl Col for String {
    fn from_direct(value: rusqlite::types::ValueRef<'_>) -> Option<Self> {
        value.as_str().ok().map(str::to_owned)
    }
}

impl<T: Col> Col for Option<T>
where
    Option<T>: for<'r> sqlx::Decode<'r, sqlx::Sqlite>
        + sqlx::Type<sqlx::Sqlite>
        + for<'r> sqlx::Decode<'r, sqlx::Postgres>
        + sqlx::Type<sqlx::Postgres>,
{
    fn from_direct(value: rusqlite::types::ValueRef<'_>) -> Option<Self> {
        match value {
            rusqlite::types::ValueRef::Null => Some(None),
            value => T::from_direct(value).map(Some),
        }
    }
}

/// A row whose columns are read by name.
pub trait Row {
    fn col<T: Col>(&self, name: &str) -> Result<T, sqlx::Error>;
}

impl Row for sqlx::sqlite::SqliteRow {
    fn col<T: Col>(&self, name: &str) -> Result<T, sqlx::Error> {
        sqlx::Row::try_get(self, name)
    }
}

impl Row for sqlx::postgres::PgRow {
    fn col<T: Col>(&self, name: &str) -> Result<T, sqlx::Error> {
        sqlx::Row::try_get(self, name)
    }
}

/// A transaction the queue's statements run in (or, for a statement that is a transaction of its
/// own, a connection outside any).
pub trait Exec: Send {
    type Row: Row + Send;

    /// Whether a statement of several joined by `;` runs in one go, saving round trips to a
    /// connection's thread (sqlx's SQLite driver). Where it does not, they go one by one.
    fn joins(&self) -> bool;

    /// Runs `stmt`: the rows it changed (summed over joined statements).
    fn run(&mut self, stmt: Stmt<'_>) -> impl Future<Output = Result<u64, sqlx::Error>> + Send;

    /// Runs `stmt`: the rows it returned.
    fn rows(
        &mut self,
        stmt: Stmt<'_>,
    ) -> impl Future<Output = Result<Vec<Self::Row>, sqlx::Error>> + Send;

    /// The first row `stmt` returns, if any.
    fn opt(
        &mut self,
        stmt: Stmt<'_>,
    ) -> impl Future<Output = Result<Option<Self::Row>, sqlx::Error>> + Send
    where
        Self: Sized,
    {
        async move { Ok(self.rows(stmt).await?.into_iter().next()) }
    }

    /// The first row `stmt` returns; an error if none.
    fn one(&mut self, stmt: Stmt<'_>) -> impl Future<Output = Result<Self::Row, sqlx::Error>> + Send
    where
        Self: Sized,
    {
        async move { self.opt(stmt).await?.ok_or(sqlx::Error::RowNotFound) }
    }
}

/// `stmt` as sqlx's query for `$db`, with its arguments.
macro_rules! sqlx_query {
    ($db:ty, $arguments:ty, $add_list:path, $stmt:expr) => {{
        let stmt: &Stmt<'_> = $stmt;
        let mut arguments = <$arguments>::default();
        for arg in &stmt.args {
            let added = match arg {
                Arg::Text(v) => sqlx::Arguments::add(&mut arguments, v.as_deref()),
                Arg::Int(v) => sqlx::Arguments::add(&mut arguments, *v),
                Arg::Int32(v) => sqlx::Arguments::add(&mut arguments, *v),
                Arg::List(list) => $add_list(&mut arguments, list),
            };
            added.map_err(sqlx::Error::Encode)?;
        }
        sqlx::query_with::<$db, _>(&stmt.sql, arguments).persistent(stmt.keep)
    }};
}

/// Runs a statement in one of sqlx's transactions on `$db`, or on a connection of its pool
/// outside any (each statement then commits on its own).
macro_rules! sqlx_exec {
    ($db:ty, $arguments:ty, $add_list:path, $row:ty, $joins:expr) => {
        sqlx_exec!(@on sqlx::Transaction<'_, $db>, $db, $arguments, $add_list, $row, $joins);
        sqlx_exec!(@on sqlx::pool::PoolConnection<$db>, $db, $arguments, $add_list, $row, $joins);
    };
    (@on $on:ty, $db:ty, $arguments:ty, $add_list:path, $row:ty, $joins:expr) => {
        impl Exec for $on {
            type Row = $row;

            fn joins(&self) -> bool {
                $joins
            }

            async fn run(&mut self, stmt: Stmt<'_>) -> Result<u64, sqlx::Error> {
                let query = sqlx_query!($db, $arguments, $add_list, &stmt);
                Ok(query.execute(&mut **self).await?.rows_affected())
            }

            async fn rows(&mut self, stmt: Stmt<'_>) -> Result<Vec<$row>, sqlx::Error> {
                let query = sqlx_query!($db, $arguments, $add_list, &stmt);
                query.fetch_all(&mut **self).await
            }
        }
    };
}

/// A list as one PostgreSQL array.
fn add_pg_list(
    arguments: &mut sqlx::postgres::PgArguments,
    list: &List<'_>,
) -> Result<(), sqlx::error::BoxDynError> {
    use sqlx::Arguments as _;
    match list {
        List::Text(l) => arguments.add(l.iter().map(|v| v.as_deref()).collect::<Vec<_>>()),
        List::Int(l) => arguments.add(l.as_slice()),
        List::Int32(l) => arguments.add(l.as_slice()),
    }
}

/// SQLite has no arrays: only numbered statements (PostgreSQL's) bind lists.
fn add_sqlite_list(
    _arguments: &mut sqlx::sqlite::SqliteArguments<'_>,
    _list: &List<'_>,
) -> Result<(), sqlx::error::BoxDynError> {
    Err("a list is bound only on PostgreSQL".into())
}

sqlx_exec!(
    sqlx::Postgres,
    sqlx::postgres::PgArguments,
    add_pg_list,
    sqlx::postgres::PgRow,
    false
);
sqlx_exec!(
    sqlx::Sqlite,
    sqlx::sqlite::SqliteArguments<'_>,
    add_sqlite_list,
    sqlx::sqlite::SqliteRow,
    true
);

#[cfg(test)]
mod tests {
    use super::{Arg, List, Stmt};

    #[test]
    fn a_built_statement_numbers_its_parameters_in_order() {
        let mut q = Stmt::build("INSERT INTO t (a, b) ", false);
        q.push_values([(1_i64, "x"), (2, "y")], |mut row, (a, b)| {
            row.push_bind(a).push_bind(b);
        });
        q.push(" WHERE c").push_in(["p", "q"]);
        assert_eq!(
            q.sql(),
            "INSERT INTO t (a, b) VALUES (?, ?), (?, ?) WHERE c IN (?, ?)"
        );
        assert_eq!(q.args().len(), 6);
        let mut q = Stmt::build("SELECT ", false);
        q.push_bind(1_i64).push(", ").push_bind("a");
        assert_eq!(q.sql(), "SELECT ?, ?");
    }

    /// A numbered statement (PostgreSQL's) binds rows and lists as arrays, one per column, so its
    /// text is the same for any number of rows.
    #[test]
    fn a_numbered_statement_binds_each_column_as_one_array() {
        let text = |rows: &[(i64, Option<&'static str>)], ids: &[&'static str]| {
            let mut q = Stmt::build("INSERT INTO t (a, b) ", true);
            q.push_values(rows.iter().copied(), |mut row, (a, b)| {
                row.push_bind(a).push_bind(b);
            });
            q.push(" WHERE c").push_in(ids.iter().copied());
            let lists = q
                .args()
                .iter()
                .map(|arg| match arg {
                    Arg::List(List::Int(l)) => l.len(),
                    Arg::List(List::Text(l)) => l.len(),
                    _ => 0,
                })
                .collect::<Vec<_>>();
            (q.sql().to_owned(), lists)
        };
        let ids = ["p", "q", "r", "s", "t", "u"];
        let rows: Vec<(i64, Option<&str>)> =
            (0..9).map(|i| (i, (i % 2 == 0).then_some("x"))).collect();
        let (five, lists) = text(&rows[..5], &ids[..5]);
        assert_eq!(
            five,
            "INSERT INTO t (a, b) SELECT * FROM UNNEST($1::int8[], $2::text[]) \
             WHERE c = ANY($3::text[])"
        );
        assert_eq!(lists, [5, 5, 5]);
        let (nine, lists) = text(&rows, &ids);
        assert_eq!(nine, five, "one text for any number of rows");
        assert_eq!(lists, [9, 9, 6]);
        // A few are bound one by one.
        let (two, lists) = text(&rows[..2], &ids[..1]);
        assert_eq!(
            two,
            "INSERT INTO t (a, b) VALUES ($1, $2), ($3, $4) WHERE c IN ($5)"
        );
        assert_eq!(lists, [0, 0, 0, 0, 0]);
    }

    /// Rows whose columns do not line up (never built by the store) are bound as tuples.
    #[test]
    fn rows_of_mixed_types_are_bound_as_tuples() {
        let mixed = || {
            (0..5).map(|i| {
                if i == 4 {
                    Arg::Text(None)
                } else {
                    Arg::Int(Some(i))
                }
            })
        };
        let mut q = Stmt::build("INSERT INTO t (a) ", true);
        q.push_values(mixed(), |mut row, v| {
            row.push_bind(v);
        });
        assert_eq!(
            q.sql(),
            "INSERT INTO t (a) VALUES ($1), ($2), ($3), ($4), ($5)"
        );
        let mut q = Stmt::build("SELECT 1 WHERE c", true);
        q.push_in(mixed());
        assert_eq!(q.sql(), "SELECT 1 WHERE c IN ($1, $2, $3, $4, $5)");
    }
}
