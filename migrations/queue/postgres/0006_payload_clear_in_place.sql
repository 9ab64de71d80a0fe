-- Clearing a finished event's payload is the update push_events gets on every delivery. The partial index
-- push_events_payload_deadline named payload_json in its condition, so that update could never be
-- heap-only: each one wrote a new row version away from the old and an entry into each of the
-- table's four other indexes. Profiled at 100 end-to-end flows (round 31, docs/benchmarks.md),
-- it was the costliest statement of the server's (0.92 ms a call); heap-only, 0.29 ms. The
-- clean-up's sweep now finds payloads that completion missed by acceptance time
-- (push_events_accepted, see services/queue/src/store/cleanup.rs), not by this index.
DROP INDEX IF EXISTS push_events_payload_deadline;
-- Room on each page for the cleared versions (heap-only updates stay on their page). New pages
-- only; existing ones fill as they did.
ALTER TABLE push_events SET (fillfactor = 70);
