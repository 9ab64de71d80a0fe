-- The queue's one writer counts each host's quota itself, from the window's events it reads from
-- push_events_accepted on its first round (services/queue/src/store/quota.rs). The quota index
-- (host, kind, accepted_at) took one entry in a random leaf page per admission: at the admission
-- benchmark's peak, 30% of the pages a commit wrote (docs/benchmarks.md, round 49). A build
-- before this one still counts without it, through the event identity's unique index (host, kind,
-- ...), reading each of the host's events kept for the day: slower for a busy host, the same count.
DROP INDEX IF EXISTS push_events_quota;
