-- The quota index serves only the quota's count, which asks by time. Keyed (host, kind,
-- accepted_at), it also matched the first two columns of an event's identity (host, kind, epoch,
-- seq), and a plan made on a small table, before its first analyze, found an event by its
-- identity through it: it read every event of that host and kind kept for the 24 hours of
-- retention, where the identity's unique index goes straight to the one (round 28 and round 32,
-- docs/benchmarks.md). The seen read of every admission does that look-up.
--
-- As with the due index (0007), a statement can read this index only if its conditions imply
-- accepted_at >= 0, always true of a time: the quota's counts name it, and an identity look-up
-- does not. The index holds the same rows. Writes to push_events (admissions) wait while it
-- builds: 3.1 s for 2 million events (300 MB) on the benchmark machine.
CREATE INDEX push_events_quota_by_time ON push_events (host_fingerprint, kind, accepted_at)
    WHERE accepted_at >= 0;
DROP INDEX push_events_quota;
ALTER INDEX push_events_quota_by_time RENAME TO push_events_quota;
