-- The partial index push_events_payload_deadline named payload_json in its condition: every
-- event's insert wrote an entry and clearing its payload removed it again. The clean-up's sweep now
-- finds payloads that completion missed by acceptance time (push_events_accepted, see
-- services/queue/src/store/cleanup.rs); PostgreSQL drops it so that the clearing update can stay
-- on its page (0006 there).
DROP INDEX IF EXISTS push_events_payload_deadline;
