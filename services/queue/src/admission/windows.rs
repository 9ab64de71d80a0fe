//! The coalescing windows of a group's registrations, as `plan` sees them: the stored windows
//! the group read, and the ones it opens, each member joining the newest it fits in as the per-row
//! path would after each earlier admission of the group.

use std::collections::HashMap;

use super::{NewBatch, OpenWindow, WindowUpdate};
use crate::model::{
    Admission, AdmissionRecipient, MAX_BATCH_MEMBERS, member_bytes, summary_fits, window_due,
};
use crate::store::ordered_id;

/// Where a window's state lives until the writes: a stored row or a batch the group opens.
#[derive(Debug)]
enum Origin {
    Stored { read_count: i64, touched: bool },
    New(usize),
}

#[derive(Debug)]
struct Window {
    batch_id: String,
    origin: Origin,
    member_count: i64,
    members_bytes: i64,
    routing_bytes: i64,
    window_ends_at: i64,
    silent: Option<bool>,
    deadline_at_least: i64,
}

impl Window {
    /// The stored path's window read: open, still before its end, and not full.
    fn joinable(&self, now: i64) -> bool {
        self.window_ends_at > now && self.member_count < MAX_BATCH_MEMBERS
    }
}

/// The coalescing windows of the group's registrations, as the per-row path would see them after
/// each earlier admission of the group.
pub(super) struct Windows {
    all: Vec<Window>,
    /// (registration, host) to the window a new member would try first.
    latest: HashMap<(String, String), usize>,
}

impl Windows {
    /// Keeps, per registration and host, the newest window a member may join (the per-row
    /// path's read: `ORDER BY created_at DESC LIMIT 1` over the joinable ones).
    pub(super) fn new(stored: Vec<OpenWindow>, now: i64) -> Self {
        let mut newest: HashMap<(String, String), OpenWindow> = HashMap::new();
        let joinable = stored
            .into_iter()
            .filter(|w| w.window_ends_at > now && w.member_count < MAX_BATCH_MEMBERS);
        for w in joinable {
            let key = (w.registration_id.clone(), w.host_fingerprint.clone());
            match newest.get(&key) {
                Some(kept) if kept.created_at >= w.created_at => {}
                _ => {
                    newest.insert(key, w);
                }
            }
        }
        let mut windows = Self {
            all: Vec::with_capacity(newest.len()),
            latest: HashMap::with_capacity(newest.len()),
        };
        for (key, w) in newest {
            windows.latest.insert(key, windows.all.len());
            windows.all.push(Window {
                batch_id: w.batch_id,
                origin: Origin::Stored {
                    read_count: w.member_count,
                    touched: false,
                },
                member_count: w.member_count,
                members_bytes: w.members_bytes,
                routing_bytes: w.routing_bytes,
                window_ends_at: w.window_ends_at,
                silent: None,
                deadline_at_least: 0,
            });
        }
        windows
    }

    /// Joins the registration's window if the member fits; otherwise closes that window (due at
    /// once) and opens a new one. Returns the batch and the earliest time this made work due: the
    /// batch's, or now when it closed a window.
    pub(super) fn coalesce<'a>(
        &mut self,
        batches: &mut Vec<NewBatch<'a>>,
        a: &'a Admission,
        recipient: &'a AdmissionRecipient,
        deadline: i64,
        now: i64,
        coalesce_ms: i64,
    ) -> (String, i64) {
        let id = a.content.notification_id.as_deref().unwrap_or_default();
        let bytes = member_bytes(id, &a.notification_epoch);
        let routing = a.routing_bytes();
        let key = (
            recipient.registration_id.clone(),
            a.host_fingerprint.clone(),
        );
        let mut closed_now = false;
        if let Some(&index) = self.latest.get(&key)
            && self.all[index].joinable(now)
        {
            let w = &mut self.all[index];
            let count = w.member_count + 1;
            let members = w.members_bytes + bytes;
            let joined_routing = w.routing_bytes.max(routing);
            if summary_fits(members, joined_routing) {
                // A batch that is full is due at once; the burst goes on in a new batch.
                let due = if count >= MAX_BATCH_MEMBERS {
                    now
                } else {
                    window_due(w.window_ends_at, deadline, now)
                };
                w.member_count = count;
                w.members_bytes = members;
                w.routing_bytes = joined_routing;
                w.window_ends_at = due;
                w.silent = Some(recipient.silent);
                w.deadline_at_least = w.deadline_at_least.max(deadline);
                w.touch();
                return (w.batch_id.clone(), due);
            }
            // Out of payload room: this window closes now and the member opens the next.
            w.window_ends_at = now;
            w.touch();
            closed_now = true;
        }
        let due = window_due(now + coalesce_ms, deadline, now);
        let batch_id = ordered_id();
        self.latest.insert(key, self.all.len());
        self.all.push(Window {
            batch_id: batch_id.clone(),
            origin: Origin::New(batches.len()),
            member_count: 1,
            members_bytes: bytes,
            routing_bytes: routing,
            window_ends_at: due,
            silent: Some(recipient.silent),
            deadline_at_least: deadline,
        });
        batches.push(NewBatch {
            batch_id: batch_id.clone(),
            registration_id: &recipient.registration_id,
            host_fingerprint: &a.host_fingerprint,
            coalescible: true,
            window_ends_at: due,
            member_count: 1,
            members_bytes: bytes,
            routing_bytes: routing,
            deadline,
            silent: recipient.silent,
            provider: recipient.provider,
            lease: None,
        });
        // The window closed is due now: lanes asleep until its old end are told.
        (batch_id, if closed_now { now } else { due })
    }

    /// Writes each window's final state: into the new batch it opened, or as an update of the
    /// stored row it touched.
    pub(super) fn finish(self, batches: &mut [NewBatch<'_>]) -> Vec<WindowUpdate> {
        let mut updates = Vec::new();
        for w in self.all {
            match w.origin {
                Origin::New(index) => {
                    let batch = &mut batches[index];
                    batch.member_count = w.member_count;
                    batch.members_bytes = w.members_bytes;
                    batch.routing_bytes = w.routing_bytes;
                    batch.window_ends_at = w.window_ends_at;
                    batch.silent = w.silent.unwrap_or(batch.silent);
                    batch.deadline = batch.deadline.max(w.deadline_at_least);
                }
                Origin::Stored {
                    read_count,
                    touched: true,
                } => updates.push(WindowUpdate {
                    batch_id: w.batch_id,
                    read_count,
                    member_count: w.member_count,
                    members_bytes: w.members_bytes,
                    routing_bytes: w.routing_bytes,
                    due: w.window_ends_at,
                    silent: w.silent,
                    deadline_at_least: w.deadline_at_least,
                }),
                Origin::Stored { touched: false, .. } => {}
            }
        }
        updates
    }
}

impl Window {
    fn touch(&mut self) {
        if let Origin::Stored { touched, .. } = &mut self.origin {
            *touched = true;
        }
    }
}
