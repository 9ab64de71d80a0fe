//! Writers side by side: a round counts as committing while it runs, and a small round gathers
//! until another's commit ends. Neither backend runs several writers since round 33
//! (docs/benchmarks.md); this stays for a store that does (`QueueStore::group_writers`).

use std::sync::atomic::Ordering;

use tokio::sync::mpsc;

use super::{Batch, Work};

/// Work waiting from which, with writers side by side, a round starts while another commits;
/// below it the round gathers until that one ends. Every round costs the server its round trips
/// whatever its size: on PostgreSQL at 8 connections, rounds that each took what was there made
/// groups of 1.45 admissions at 0.85 ms of server CPU per send; gathering, a third less
/// (docs/benchmarks.md, round 27). Neither backend runs several writers since round 33
/// (PostgreSQL's one writer on a thread of its own made larger rounds than two or four); this
/// stays for a store that does.
pub(super) const SIDE_BY_SIDE_FROM: usize = 8;
/// The longest a round gathers while another commits: a slow round (a row lock, a stalled
/// connection) delays the next round by no more than this.
pub(super) const GATHER_AT_MOST: std::time::Duration = std::time::Duration::from_millis(10);

/// Rounds committing now, and a signal as each ends.
#[derive(Default)]
pub(super) struct Running {
    rounds: std::sync::atomic::AtomicUsize,
    ended: tokio::sync::Notify,
}

/// Counts one round as committing until dropped (a panicking round included).
pub(super) struct Committing<'a>(&'a Running);

impl<'a> Committing<'a> {
    pub(super) fn start(running: &'a Running) -> Self {
        running.rounds.fetch_add(1, Ordering::SeqCst);
        Self(running)
    }
}

impl Drop for Committing<'_> {
    fn drop(&mut self) {
        self.0.rounds.fetch_sub(1, Ordering::SeqCst);
        self.0.ended.notify_waiters();
    }
}

/// With writers side by side, a small round waits while another commits, taking what arrives
/// meanwhile, until that one ends, `SIDE_BY_SIDE_FROM` wait or `GATHER_AT_MOST` has passed.
pub(super) async fn gather_while_another_commits(
    running: &Running,
    queue: &mut mpsc::Receiver<Work>,
    batch: &mut Batch,
) {
    let until = tokio::time::Instant::now() + GATHER_AT_MOST;
    while !batch.full() && batch.len() < SIDE_BY_SIDE_FROM {
        let ended = running.ended.notified();
        tokio::pin!(ended);
        ended.as_mut().enable();
        if running.rounds.load(Ordering::SeqCst) == 0 {
            return;
        }
        tokio::select! {
            () = &mut ended => return,
            () = tokio::time::sleep_until(until) => return,
            work = queue.recv() => match work {
                Some(work) => {
                    batch.add(work);
                    batch.take_waiting(queue);
                }
                // Stopping: this round goes as it is, and the next finds nothing.
                None => return,
            },
        }
    }
}
