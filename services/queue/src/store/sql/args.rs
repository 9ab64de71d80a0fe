//! A statement's arguments: scalars typed as they are bound, and columns of them bound as one
//! PostgreSQL array.

use std::borrow::Cow;

/// One argument, typed as the statement binds it: PostgreSQL checks a parameter's type, a NULL's
/// too.
#[derive(Debug, Clone)]
pub enum Arg<'a> {
    Text(Option<Cow<'a, str>>),
    Int(Option<i64>),
    Int32(Option<i32>),
    /// Values of one type bound as one PostgreSQL array ([`Stmt::push_values`],
    /// [`Stmt::push_in`]); SQLite binds none.
    List(List<'a>),
}

/// A column of values bound as one PostgreSQL array.
#[derive(Debug, Clone)]
pub enum List<'a> {
    Text(Vec<Option<Cow<'a, str>>>),
    Int(Vec<Option<i64>>),
    Int32(Vec<Option<i32>>),
}

impl<'a> List<'a> {
    /// An empty list of `value`'s type, if it is a scalar.
    pub(super) fn like(value: &Arg<'_>, capacity: usize) -> Option<Self> {
        match value {
            Arg::Text(_) => Some(List::Text(Vec::with_capacity(capacity))),
            Arg::Int(_) => Some(List::Int(Vec::with_capacity(capacity))),
            Arg::Int32(_) => Some(List::Int32(Vec::with_capacity(capacity))),
            Arg::List(_) => None,
        }
    }

    /// Whether `value` is of this list's type.
    pub(super) fn takes(&self, value: &Arg<'_>) -> bool {
        matches!(
            (self, value),
            (List::Text(_), Arg::Text(_))
                | (List::Int(_), Arg::Int(_))
                | (List::Int32(_), Arg::Int32(_))
        )
    }

    /// Adds `value`, which [`List::takes`] says is of its type.
    pub(super) fn push(&mut self, value: Arg<'a>) {
        match (self, value) {
            (List::Text(l), Arg::Text(v)) => l.push(v),
            (List::Int(l), Arg::Int(v)) => l.push(v),
            (List::Int32(l), Arg::Int32(v)) => l.push(v),
            _ => {}
        }
    }

    /// `values` as one list, if they are scalars of one type; else the values back.
    pub(super) fn of(values: Vec<Arg<'a>>) -> Result<Self, Vec<Arg<'a>>> {
        let list = values.first().and_then(|v| List::like(v, values.len()));
        match list {
            Some(mut list) if values.iter().all(|v| list.takes(v)) => {
                for value in values {
                    list.push(value);
                }
                Ok(list)
            }
            _ => Err(values),
        }
    }

    /// Rows of values as one list per column, if every row has as many values and each column
    /// holds scalars of one type; else the rows back.
    pub(super) fn columns(rows: Vec<Vec<Arg<'a>>>) -> Result<Vec<Self>, Vec<Vec<Arg<'a>>>> {
        let Some(first) = rows.first() else {
            return Err(rows);
        };
        let lists: Option<Vec<List<'a>>> =
            first.iter().map(|v| List::like(v, rows.len())).collect();
        let Some(mut lists) = lists.filter(|l| !l.is_empty()) else {
            return Err(rows);
        };
        let lines_up = rows.iter().all(|row| {
            row.len() == lists.len() && lists.iter().zip(row).all(|(list, v)| list.takes(v))
        });
        if !lines_up {
            return Err(rows);
        }
        for row in rows {
            for (list, value) in lists.iter_mut().zip(row) {
                list.push(value);
            }
        }
        Ok(lists)
    }

    /// The array type it is bound as, written after its parameter.
    pub(super) fn cast(&self) -> &'static str {
        match self {
            List::Text(_) => "::text[]",
            List::Int(_) => "::int8[]",
            List::Int32(_) => "::int4[]",
        }
    }
}

impl<'a> From<&'a str> for Arg<'a> {
    fn from(value: &'a str) -> Self {
        Arg::Text(Some(Cow::Borrowed(value)))
    }
}

impl<'a> From<&'a String> for Arg<'a> {
    fn from(value: &'a String) -> Self {
        Arg::Text(Some(Cow::Borrowed(value.as_str())))
    }
}

impl From<String> for Arg<'_> {
    fn from(value: String) -> Self {
        Arg::Text(Some(Cow::Owned(value)))
    }
}

impl<'a> From<Option<&'a str>> for Arg<'a> {
    fn from(value: Option<&'a str>) -> Self {
        Arg::Text(value.map(Cow::Borrowed))
    }
}

impl From<Option<String>> for Arg<'_> {
    fn from(value: Option<String>) -> Self {
        Arg::Text(value.map(Cow::Owned))
    }
}

impl From<i64> for Arg<'_> {
    fn from(value: i64) -> Self {
        Arg::Int(Some(value))
    }
}

impl From<Option<i64>> for Arg<'_> {
    fn from(value: Option<i64>) -> Self {
        Arg::Int(value)
    }
}

impl From<i32> for Arg<'_> {
    fn from(value: i32) -> Self {
        Arg::Int32(Some(value))
    }
}

impl From<Option<i32>> for Arg<'_> {
    fn from(value: Option<i32>) -> Self {
        Arg::Int32(value)
    }
}
