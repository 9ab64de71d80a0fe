//! PostgreSQL's final answers in one call (`push_finish_batches`, queue migration 0011): the
//! batches' locks, their update under their leases, their recipients, their events' locks and the
//! payloads cleared, run in the server, where they were five statements sent one after another.

use std::borrow::Cow;
use std::collections::HashSet;

use crate::store::sql::{Arg, Exec, List, Row as _, Stmt};

/// The batches (ids, states, reasons, leases, whether the provider answered) and the time: the
/// ids of those it ended.
pub(in crate::store) const FINISH_BATCHES_CALL: &str = "SELECT f.batch_id FROM \
     push_finish_batches($1::text[], $2::text[], $3::text[], $4::text[], $5::int4[], $6) \
     AS f (batch_id)";

/// One batch's final answer: id, lease (None: none to check, as for an expiry), state, reason,
/// and whether the provider answered.
pub(in crate::store) type Finish<'a> = (&'a str, Option<&'a str>, &'a str, &'a str, bool);

/// Ends the batches at `rows` of `batches` (each once, in batch id order) in one call on `ex`:
/// the ids of those it ended.
pub(in crate::store) async fn finish_by_call<'a, E: Exec>(
    ex: &mut E,
    batches: &[Finish<'a>],
    rows: &[usize],
    now: i64,
) -> Result<HashSet<String>, sqlx::Error> {
    let texts = |pick: fn(&Finish<'a>) -> Option<&'a str>| {
        let column = rows.iter().map(|&i| pick(&batches[i]).map(Cow::Borrowed));
        Arg::List(List::Text(column.collect()))
    };
    let answered = rows
        .iter()
        .map(|&i| Some(i32::from(batches[i].4)))
        .collect();
    let call = Stmt::new(FINISH_BATCHES_CALL)
        .bind(texts(|b| Some(b.0)))
        .bind(texts(|b| Some(b.2)))
        .bind(texts(|b| Some(b.3)))
        .bind(texts(|b| b.1))
        .bind(Arg::List(List::Int32(answered)))
        .bind(now);
    ex.rows(call)
        .await?
        .iter()
        .map(|row| row.col::<String>("batch_id"))
        .collect()
}

/// A report's final answer, as `finish_by_call` takes it.
pub(in crate::store) fn finish_of(c: &crate::store::Completion) -> Finish<'_> {
    (
        c.batch_id.as_str(),
        Some(c.lease_token.as_str()),
        c.outcome.as_str(),
        c.reason.as_str(),
        c.answered,
    )
}

/// The rows of `batches` in batch id order, if no batch is there twice (two answers for one
/// batch go one after the other, `finish_reported`).
pub(in crate::store) fn each_once(batches: &[Finish<'_>]) -> Option<Vec<usize>> {
    let mut rows: Vec<usize> = (0..batches.len()).collect();
    rows.sort_unstable_by_key(|&i| batches[i].0);
    let twice = rows.windows(2).any(|w| batches[w[0]].0 == batches[w[1]].0);
    (!twice).then_some(rows)
}
