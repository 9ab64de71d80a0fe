//! Admission one statement at a time: the path every group can take, and the one the batched
//! path of `crate::admission` must agree with.

/// The active batches of a list of registrations: the list (`Stmt::push_in`), then `ORDER BY`
/// and the row locks.
pub(super) const LOCK_ACTIVE_BATCHES_HEAD: &str = "SELECT batch_id FROM push_delivery_batches \
     WHERE state IN ('open', 'pending', 'leased') AND registration_id";

/// The event `($1, $2, $3, $4)` if stored, the host's quota use since `$5`, and the dismissal fence
/// of notification `$6`: this, then the quota use (`SEEN_COUNT`, `RoundQuota::by_time` and `)`; or
/// `0` where the writer counts it, SQLite), then `SEEN_TAIL`.
pub(super) const SEEN_HEAD: &str = "SELECT e.event_id, e.content_hash, e.expires_at, ";
pub(super) const SEEN_COUNT: &str = "(SELECT COUNT(*) FROM push_events q \
       WHERE q.host_fingerprint = $1 AND q.kind = $2 AND q.accepted_at > $5";
pub(super) const SEEN_TAIL: &str = " AS used, \
     (SELECT d.dismissed_seq FROM push_dismissed_events d \
       WHERE d.host_fingerprint = $1 AND d.notification_epoch = $3 \
       AND d.notification_id = $6) AS fence \
     FROM (SELECT 1 AS one) o LEFT JOIN push_events e \
       ON e.host_fingerprint = $1 AND e.kind = $2 \
       AND e.notification_epoch = $3 AND e.notification_seq = $4";

/// An event's payload, if it was cleared.
pub(super) const RESTORE_PAYLOAD_SQL: &str =
    "UPDATE push_events SET payload_json = COALESCE(payload_json, $2) WHERE event_id = $1";

/// A new event.
pub(super) const INSERT_EVENT_SQL: &str = "INSERT INTO push_events (event_id, host_fingerprint, \
     kind, notification_epoch, notification_seq, notification_id, content_hash, payload_json, \
     trace_parent, accepted_at, expires_at) \
     VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)";

/// Whether an event already has a recipient.
pub(super) const RECIPIENT_SQL: &str =
    "SELECT status FROM push_event_recipients WHERE event_id = $1 AND registration_id = $2";

/// An event's recipient, in a batch (none when a dismissal fenced it).
pub(super) const INSERT_RECIPIENT_SQL: &str = "INSERT INTO push_event_recipients (event_id, \
     registration_id, batch_id, status, silent, created_at, updated_at) \
     VALUES ($1, $2, $3, $4, $5, $6, $6)";

/// A notification's dismissal fence, raised to `$4` (never lowered).
pub(super) const RAISE_FENCE_SQL: &str = "INSERT INTO push_dismissed_events (host_fingerprint, \
     notification_epoch, notification_id, dismissed_seq, created_at) VALUES ($1, $2, $3, $4, $5) \
     ON CONFLICT (host_fingerprint, notification_epoch, notification_id) DO UPDATE SET \
     dismissed_seq = CASE WHEN excluded.dismissed_seq > push_dismissed_events.dismissed_seq \
       THEN excluded.dismissed_seq ELSE push_dismissed_events.dismissed_seq END, \
     created_at = excluded.created_at";

/// A batch of one member: open (`$5`) as a coalescing window, or pending.
pub(super) const OPEN_BATCH_SQL: &str = "INSERT INTO push_delivery_batches (batch_id, \
     registration_id, host_fingerprint, kind, state, coalescible, window_ends_at, available_at, \
     member_count, members_bytes, routing_bytes, deadline, silent, attempts, created_at, provider) \
     VALUES ($1, $2, $3, $4, $5, $6, $7, $7, 1, $8, $9, $10, $11, 0, $12, $13)";

/// The registration's newest window a member may join at `$3`. Every statement that finds batches
/// by registration names the live states as `push_delivery_batches_live` does, word for word:
/// SQLite uses a partial index only for a query whose conditions include the index's own.
pub(super) const OPEN_WINDOW_SQL: &str = "SELECT batch_id, member_count, members_bytes, \
     routing_bytes, window_ends_at FROM push_delivery_batches \
     WHERE registration_id = $1 AND state IN ('open', 'pending', 'leased') \
     AND host_fingerprint = $2 AND kind = 'alert' \
     AND state = 'open' AND coalescible = 1 AND window_ends_at > $3 AND member_count < $4 \
     ORDER BY created_at DESC LIMIT 1";

/// A member joins a window, if it is still open (`$9`, bound as `open`) with the `$8` members it
/// was read with. The state is a parameter so that a plan made once (PostgreSQL's, on a nearly
/// empty table) can only find the batch by its id: compared with a constant, `state = 'open'`
/// let it walk the live index, every open window (docs/benchmarks.md, round 28).
pub(super) const JOIN_WINDOW_SQL: &str = "UPDATE push_delivery_batches SET member_count = $2, \
     members_bytes = $3, routing_bytes = $4, window_ends_at = $5, available_at = $5, silent = $6, \
     deadline = CASE WHEN deadline < $7 THEN $7 ELSE deadline END \
     WHERE batch_id = $1 AND state = $9 AND member_count = $8";

/// A window closed (due) at `$2`, if it is still open (`$3`, bound as `open`, as in
/// `JOIN_WINDOW_SQL`).
pub(super) const CLOSE_WINDOW_SQL: &str = "UPDATE push_delivery_batches \
     SET window_ends_at = $2, available_at = $2 WHERE batch_id = $1 AND state = $3";

/// A registration's pending alerts that a dismissal of notification `$4` at seq `$5` covers.
pub(super) const CANCEL_COVERED_SQL: &str = "UPDATE push_event_recipients \
     SET status = 'cancelled', updated_at = $6 \
     WHERE registration_id = $1 AND status = 'pending' \
     AND event_id IN (SELECT event_id FROM push_events WHERE host_fingerprint = $2 \
       AND kind = 'alert' AND notification_epoch = $3 AND notification_id = $4 \
       AND notification_seq < $5) \
     AND batch_id IN (SELECT batch_id FROM push_delivery_batches \
       WHERE registration_id = $1 AND state IN ('open', 'pending', 'leased'))";

/// A registration's active batches' member counts, counted again.
pub(super) const RECOUNT_MEMBERS_SQL: &str = "UPDATE push_delivery_batches SET member_count = \
     (SELECT COUNT(*) FROM push_event_recipients r \
       WHERE r.batch_id = push_delivery_batches.batch_id AND r.status = 'pending') \
     WHERE registration_id = $1 AND state IN ('open', 'pending', 'leased')";

/// A registration's batches left with no member, cancelled.
pub(super) const CANCEL_EMPTY_SQL: &str = "UPDATE push_delivery_batches SET state = 'cancelled', \
     finished_at = $2, last_reason = 'dismissed' \
     WHERE registration_id = $1 AND state IN ('open', 'pending', 'leased') AND state <> 'leased' \
     AND member_count = 0";

/// The row-by-row admission's statements for one backend (`$store` implements `Backend`).
macro_rules! row_by_row_admission {
    ($store:ty) => {
        impl $store {
            /// The group one admission at a time, each statement on its own.
            async fn admit_each(
                tx: &mut <$store as Backend>::Tx,
                quota: &mut RoundQuota,
                group: &[&Admission],
                now: i64,
                coalesce_ms: i64,
            ) -> Result<Vec<Enqueued>, QueueError> {
                Self::lock_dismissed_batches(tx, group).await?;
                let mut admitted = Vec::with_capacity(group.len());
                for a in group {
                    admitted.push(Self::admit(tx, quota, a, now, coalesce_ms).await?);
                }
                Ok(admitted)
            }

            /// A dismissal takes back pending alerts from batches a lane may be reporting. The
            /// group's dismissals lock every named phone's active batches first, all of them in
            /// one statement and one id order, as a report flush takes them, and before any event
            /// row: locked a dismissal at a time, two dismissals of the group took their batches
            /// in two runs of that order, and a report holding one batch of each waited on the
            /// group while the group waited on it (PostgreSQL; SQLite has one writer).
            async fn lock_dismissed_batches(
                tx: &mut <$store as Backend>::Tx,
                group: &[&Admission],
            ) -> Result<(), sqlx::Error> {
                if Self::FOR_UPDATE.is_empty() {
                    return Ok(());
                }
                let phones: std::collections::BTreeSet<&str> = group
                    .iter()
                    .filter(|a| a.kind == Kind::Dismiss)
                    .flat_map(|a| a.recipients.iter().map(|r| r.registration_id.as_str()))
                    .collect();
                if phones.is_empty() {
                    return Ok(());
                }
                let mut lock = Stmt::build(
                    $crate::store::admit::LOCK_ACTIVE_BATCHES_HEAD,
                    Self::NUMBERED,
                );
                lock.push_in(phones.into_iter());
                lock.push(" ORDER BY batch_id");
                lock.push(Self::FOR_UPDATE);
                lock.fetch_all(tx).await?;
                Ok(())
            }

            /// One admission inside the group's transaction, after the group's host locks and its
            /// dismissals' batch locks (`lock_dismissed_batches`).
            async fn admit(
                tx: &mut <$store as Backend>::Tx,
                quota: &mut RoundQuota,
                a: &Admission,
                now: i64,
                coalesce_ms: i64,
            ) -> Result<Enqueued, QueueError> {
                let every = |status| Enqueued {
                    statuses: a
                        .recipients
                        .iter()
                        .map(|r| (r.registration_id.clone(), status))
                        .collect(),
                    next_due_at: None,
                };
                let hash = a.content.hash();
                // One read for what admission needs to know first: the event if it is a retry, the
                // host's quota use, and the dismissal fence of the notification.
                let mut seen = Stmt::new($crate::store::admit::SEEN_HEAD);
                if let Some(by_time) = quota.by_time() {
                    seen.push($crate::store::admit::SEEN_COUNT)
                        .push(by_time)
                        .push(")");
                } else {
                    seen.push("0");
                }
                seen.push($crate::store::admit::SEEN_TAIL);
                let seen = seen
                    .bind(&a.host_fingerprint)
                    .bind(a.kind.as_str())
                    .bind(&a.notification_epoch)
                    .bind(a.notification_seq)
                    .bind(now - QUOTA_WINDOW_MS)
                    .bind(a.content.notification_id.as_deref())
                    .fetch_one(tx)
                    .await?;
                let existing: Option<String> = seen.col("event_id")?;
                let is_new = existing.is_none();
                let (event_id, deadline) = match existing {
                    Some(event_id) => {
                        let stored_hash: String = seen.col("content_hash")?;
                        let deadline: i64 = seen.col("expires_at")?;
                        if stored_hash != hash || now >= deadline {
                            return Ok(every(AdmissionStatus::Error));
                        }
                        // Restores a payload cleared once earlier recipients were done (a later
                        // request for more of the host's devices repeats the same content), and
                        // holds the event's row lock until commit, so that a concurrent clean-up
                        // cannot clear it under the recipient this admission adds.
                        Stmt::new($crate::store::admit::RESTORE_PAYLOAD_SQL)
                            .bind(&event_id)
                            .bind(a.content.to_json())
                            .execute(tx)
                            .await?;
                        (event_id, deadline)
                    }
                    None => {
                        if a.expires_at_ms.is_some_and(|at| at <= now) {
                            return Ok(every(AdmissionStatus::Error));
                        }
                        let used: i64 = match quota.used(&a.host_fingerprint, a.kind, now)? {
                            Some(used) => used,
                            None => seen.col("used")?,
                        };
                        if used >= QUOTA_PER_KIND {
                            return Ok(every(AdmissionStatus::RateLimited));
                        }
                        let cap = now + MAX_LIFETIME_MS;
                        let deadline = a.expires_at_ms.map_or(cap, |at| at.min(cap));
                        let event_id = ordered_id();
                        // Where the host's quota use is kept (PostgreSQL), the event's insert
                        // writes it too, in the same round trip.
                        let quota_use = Self::QUOTA_USE_ROWS.then(|| {
                            if a.kind == Kind::Alert
                                && used + 1 >= $crate::admission::QUOTA_ROW_FROM
                            {
                                $crate::admission::QUOTA_USE_ROW_HEAD
                            } else {
                                $crate::admission::QUOTA_USE_KEPT_HEAD
                            }
                        });
                        let mut insert = Stmt::new($crate::store::admit::INSERT_EVENT_SQL);
                        if let Some(head) = quota_use {
                            insert = Stmt::new(head);
                            insert.push($crate::store::admit::INSERT_EVENT_SQL);
                        }
                        let mut insert = insert
                            .bind(&event_id)
                            .bind(&a.host_fingerprint)
                            .bind(a.kind.as_str())
                            .bind(&a.notification_epoch)
                            .bind(a.notification_seq)
                            .bind(a.content.notification_id.as_deref())
                            .bind(&hash)
                            .bind(a.content.to_json())
                            .bind(a.trace_parent.as_deref())
                            .bind(now)
                            .bind(deadline);
                        if quota_use.is_some() {
                            insert = insert.bind(now - QUOTA_WINDOW_MS).bind(used + 1);
                        }
                        insert.execute(tx).await?;
                        quota.admitted(&a.host_fingerprint, a.kind, now);
                        (event_id, deadline)
                    }
                };

                let fenced = match (a.kind, a.content.notification_id.as_deref()) {
                    (Kind::Alert, Some(_)) => seen
                        .col::<Option<i64>>("fence")?
                        .is_some_and(|seq| a.notification_seq < seq),
                    _ => false,
                };

                let mut statuses = Vec::with_capacity(a.recipients.len());
                let mut next_due_at: Option<i64> = None;
                let mut named = std::collections::HashSet::with_capacity(a.recipients.len());
                for recipient in &a.recipients {
                    // A fresh event has no recipients yet but those named earlier in this request; a
                    // retry may name some it already has.
                    let known = !named.insert(recipient.registration_id.as_str())
                        || (!is_new
                            && Stmt::new($crate::store::admit::RECIPIENT_SQL)
                                .bind(&event_id)
                                .bind(&recipient.registration_id)
                                .fetch_optional(tx)
                                .await?
                                .is_some());
                    if !known {
                        let (batch_id, status) = if fenced {
                            (None, "cancelled")
                        } else {
                            let (batch_id, due) = match a.kind {
                                Kind::Dismiss => {
                                    Self::cancel_covered_alerts(
                                        tx,
                                        a,
                                        &recipient.registration_id,
                                        now,
                                    )
                                    .await?;
                                    let bytes = member_bytes(
                                        a.content.notification_id.as_deref().unwrap_or_default(),
                                        &a.notification_epoch,
                                    );
                                    let id = Self::open_batch(
                                        tx, a, recipient, false, now, bytes, deadline, now,
                                    )
                                    .await?;
                                    (id, now)
                                }
                                Kind::Alert
                                    if coalesce_ms == 0 || a.content.notification_id.is_none() =>
                                {
                                    let id = Self::open_batch(
                                        tx, a, recipient, false, now, 0, deadline, now,
                                    )
                                    .await?;
                                    (id, now)
                                }
                                Kind::Alert => {
                                    Self::coalesce(tx, a, recipient, deadline, now, coalesce_ms)
                                        .await?
                                }
                            };
                            next_due_at = Some(next_due_at.map_or(due, |d| d.min(due)));
                            (Some(batch_id), "pending")
                        };
                        Stmt::new($crate::store::admit::INSERT_RECIPIENT_SQL)
                            .bind(&event_id)
                            .bind(&recipient.registration_id)
                            .bind(batch_id)
                            .bind(status)
                            .bind(flag(recipient.silent))
                            .bind(now)
                            .execute(tx)
                            .await?;
                    }
                    statuses.push((recipient.registration_id.clone(), AdmissionStatus::Queued));
                }
                if let (Kind::Dismiss, Some(id)) = (a.kind, a.content.notification_id.as_deref()) {
                    Stmt::new($crate::store::admit::RAISE_FENCE_SQL)
                        .bind(&a.host_fingerprint)
                        .bind(&a.notification_epoch)
                        .bind(id)
                        .bind(a.notification_seq)
                        .bind(now)
                        .execute(tx)
                        .await?;
                }
                Ok(Enqueued {
                    statuses,
                    next_due_at,
                })
            }

            /// A new batch for one member.
            #[allow(clippy::too_many_arguments)]
            async fn open_batch(
                tx: &mut <$store as Backend>::Tx,
                a: &Admission,
                recipient: &AdmissionRecipient,
                coalescible: bool,
                window_ends_at: i64,
                members_bytes: i64,
                deadline: i64,
                now: i64,
            ) -> Result<String, sqlx::Error> {
                let batch_id = ordered_id();
                Stmt::new($crate::store::admit::OPEN_BATCH_SQL)
                    .bind(&batch_id)
                    .bind(&recipient.registration_id)
                    .bind(&a.host_fingerprint)
                    .bind(a.kind.as_str())
                    .bind(if coalescible { "open" } else { "pending" })
                    .bind(flag(coalescible))
                    .bind(window_ends_at)
                    .bind(members_bytes)
                    .bind(a.routing_bytes())
                    .bind(deadline)
                    .bind(flag(recipient.silent))
                    .bind(now)
                    .bind(recipient.provider.as_str())
                    .execute(tx)
                    .await?;
                Ok(batch_id)
            }

            /// Joins the registration's open window if the member fits; otherwise closes that window
            /// (due at once) and opens a new one. Returns the batch and the earliest time this made
            /// work due: the batch's, or now when it closed a window.
            async fn coalesce(
                tx: &mut <$store as Backend>::Tx,
                a: &Admission,
                recipient: &AdmissionRecipient,
                deadline: i64,
                now: i64,
                coalesce_ms: i64,
            ) -> Result<(String, i64), sqlx::Error> {
                let (registration_id, silent) =
                    (recipient.registration_id.as_str(), recipient.silent);
                let id = a.content.notification_id.as_deref().unwrap_or_default();
                let bytes = member_bytes(id, &a.notification_epoch);
                let routing = a.routing_bytes();
                let mut closed_now = false;
                let open = Stmt::new($crate::store::admit::OPEN_WINDOW_SQL)
                    .bind(registration_id)
                    .bind(&a.host_fingerprint)
                    .bind(now)
                    .bind(MAX_BATCH_MEMBERS)
                    .fetch_optional(tx)
                    .await?;
                if let Some(row) = open {
                    let batch_id: String = row.col("batch_id")?;
                    let count = i64::from(row.col::<i32>("member_count")?) + 1;
                    let members = i64::from(row.col::<i32>("members_bytes")?) + bytes;
                    let routing = i64::from(row.col::<i32>("routing_bytes")?).max(routing);
                    let window_ends_at: i64 = row.col("window_ends_at")?;
                    if summary_fits(members, routing) {
                        // A batch that is full is due at once; the burst goes on in a new batch.
                        let due = if count >= MAX_BATCH_MEMBERS {
                            now
                        } else {
                            $crate::model::window_due(window_ends_at, deadline, now)
                        };
                        // Guarded by its state: on PostgreSQL a lane may have claimed the window
                        // since it was read (claims take no host lock); then the member opens a
                        // new window instead of joining work already handed out.
                        let joined = Stmt::new($crate::store::admit::JOIN_WINDOW_SQL)
                            .bind(&batch_id)
                            .bind(count)
                            .bind(members)
                            .bind(routing)
                            .bind(due)
                            .bind(flag(silent))
                            .bind(deadline)
                            .bind(count - 1)
                            .bind("open")
                            .execute(tx)
                            .await?;
                        if joined == 1 {
                            return Ok((batch_id, due));
                        }
                    } else {
                        // Out of payload room: this window closes now and the member opens the next.
                        let closed = Stmt::new($crate::store::admit::CLOSE_WINDOW_SQL)
                            .bind(&batch_id)
                            .bind(now)
                            .bind("open")
                            .execute(tx)
                            .await?;
                        closed_now = closed == 1;
                    }
                }
                let due = $crate::model::window_due(now + coalesce_ms, deadline, now);
                let batch_id =
                    Self::open_batch(tx, a, recipient, true, due, bytes, deadline, now).await?;
                // The window closed is due now: lanes asleep until its old end are told.
                Ok((batch_id, if closed_now { now } else { due }))
            }

            /// A dismissal takes back the pending alerts it covers for this registration.
            async fn cancel_covered_alerts(
                tx: &mut <$store as Backend>::Tx,
                a: &Admission,
                registration_id: &str,
                now: i64,
            ) -> Result<(), sqlx::Error> {
                let cancelled = Stmt::new($crate::store::admit::CANCEL_COVERED_SQL)
                    .bind(registration_id)
                    .bind(&a.host_fingerprint)
                    .bind(&a.notification_epoch)
                    .bind(a.content.notification_id.as_deref())
                    .bind(a.notification_seq)
                    .bind(now)
                    .execute(tx)
                    .await?;
                if cancelled == 0 {
                    return Ok(());
                }
                Stmt::new($crate::store::admit::RECOUNT_MEMBERS_SQL)
                    .bind(registration_id)
                    .execute(tx)
                    .await?;
                Stmt::new($crate::store::admit::CANCEL_EMPTY_SQL)
                    .bind(registration_id)
                    .bind(now)
                    .execute(tx)
                    .await?;
                Ok(())
            }
        }
    };
}
pub(crate) use row_by_row_admission;
