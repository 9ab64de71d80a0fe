//! The pool writer's connection that the SQLite writer's rounds hold as a gate (`super::direct`),
//! kept from one round to the next while the writer is busy.
//!
//! sqlx tests a connection given back to its pool with a round trip to the connection's thread
//! before the next caller may take it: taken and given back every round, that round trip (a
//! wake-up of sqlx's thread, then of the writer's) stood between each round's sync and the next's
//! BEGIN (docs/benchmarks.md, round 26). So while the writer says it is busy (`Kept::keep`), a
//! round keeps the connection for the next, until `GATE_HELD_AT_MOST` after it was taken or until
//! a write outside the rounds asks for it (`Kept::release`), and the writer gives it back once it
//! has no work.

use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

/// The longest the writer keeps the pool's writer connection over rounds that follow each other:
/// a round that commits later than this after it was taken gives it back at its commit, before
/// its sync, and one that begins later gives it back first (sqlx's pool hands a connection given
/// back to those waiting first). A write of the store's that asks for it (`Kept::release`) gets
/// it at once if it is kept between rounds, else at the end of the round under way; another (the
/// checkpoint's last step) after at most this and a round.
pub const GATE_HELD_AT_MOST: Duration = Duration::from_millis(10);

/// The pool writer's connection, held by a round.
#[derive(Debug)]
pub struct Gate {
    pub conn: sqlx::pool::PoolConnection<sqlx::Sqlite>,
    since: Instant,
}

/// Where the gate waits between rounds, and whether a round keeps it: one lock for all three, so
/// that a round's end and the writer's word that it is idle cannot pass each other.
#[derive(Debug, Default)]
pub struct Kept(Mutex<KeptState>);

#[derive(Debug, Default)]
struct KeptState {
    /// The writer is busy: a round keeps the gate for the next.
    keep: bool,
    /// A write outside the rounds asked for the gate: the round that holds it, or the next to
    /// end, gives it back.
    wanted: bool,
    gate: Option<Gate>,
}

impl Kept {
    fn state(&self) -> MutexGuard<'_, KeptState> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The gate for a round: the one the last round kept, if that was taken lately; else taken
    /// from `pool`, after giving back one kept too long, so that writes waiting in the pool go
    /// before this round.
    pub async fn take(&self, pool: &sqlx::SqlitePool) -> Result<Gate, sqlx::Error> {
        let kept = self.state().gate.take();
        match kept {
            Some(gate) if gate.since.elapsed() < GATE_HELD_AT_MOST => Ok(gate),
            stale => {
                if let Some(gate) = stale {
                    give_back(gate);
                }
                Ok(Gate {
                    conn: pool.acquire().await?,
                    since: Instant::now(),
                })
            }
        }
    }

    /// A round's end: the gate is kept for the next round while the writer is busy, nobody asked
    /// for it and the hold is not over; else given back.
    pub fn round_ended(&self, gate: Gate) {
        let mut state = self.state();
        if state.keep && !state.wanted && gate.since.elapsed() < GATE_HELD_AT_MOST {
            // One writer: no other round can have kept one meanwhile.
            debug_assert!(state.gate.is_none(), "two gates kept");
            state.gate = Some(gate);
        } else {
            state.wanted = false;
            drop(state);
            give_back(gate);
        }
    }

    /// Whether a round keeps the gate for the next: while the writer is busy. Not keeping it
    /// gives back what a round kept.
    pub fn keep(&self, keep: bool) {
        let mut state = self.state();
        state.keep = keep;
        let kept = if keep { None } else { state.gate.take() };
        drop(state);
        if let Some(gate) = kept {
            give_back(gate);
        }
    }

    /// A write outside the rounds needs the pool's writer connection: given back now if a round
    /// kept it, else by the round that holds it, at its end. Asked either way: a round may take
    /// the connection again before the write queues for it, and then gives it back as it ends.
    pub fn release(&self) {
        let mut state = self.state();
        let kept = state.gate.take();
        state.wanted = true;
        drop(state);
        if let Some(gate) = kept {
            give_back(gate);
        }
    }

    /// Whether a round kept the gate.
    #[cfg(test)]
    pub fn holds(&self) -> bool {
        self.state().gate.is_some()
    }

    /// Whether a write outside the rounds asked for the gate.
    #[cfg(test)]
    pub fn wanted(&self) -> bool {
        self.state().wanted
    }
}

impl Drop for Kept {
    fn drop(&mut self) {
        let kept = self.state().gate.take();
        if let Some(gate) = kept {
            give_back(gate);
        }
    }
}

/// Gives the gate back to its pool. sqlx does that from a task on the current runtime, and panics
/// without one: outside a runtime (a store dropped as the process ends) the connection is let go
/// of instead.
fn give_back(gate: Gate) {
    if tokio::runtime::Handle::try_current().is_ok() {
        drop(gate.conn);
    } else {
        drop(gate.conn.detach());
    }
}
