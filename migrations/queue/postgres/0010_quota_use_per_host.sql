-- What a host has spent of its quota, kept beside its events so that an admission need not count
-- them all. The quota's count visited, in the heap, every event of the host and kind accepted in
-- the last 15 minutes (a fresh event's index entry is not known visible without its row): a third
-- of the admission writer's server time at 64 connections (round 51, docs/benchmarks.md).
--
-- A row states that `used` events of the host and kind were accepted after `counted_after`. That
-- stays true whatever `counted_after` is, so a count over a window that starts elsewhere reads only
-- the events between the two (those that left the window since the row was written, a few for a
-- host that keeps sending). With no row, or one starting over a window before the window counted
-- (whose events between would be more than the window's own), the window's events are counted as
-- before.
--
-- The gateway writes a host's row in the statement that inserts its events (its rounds'
-- transactions say so: the setting orca_push.quota_use is 'written' in them). Every other insert
-- into push_events (a replica of an older version, which knows nothing of this table, during a
-- rolling upgrade; a hand-written one) runs the trigger below, which keeps the rows true: it moves
-- each of its hosts' rows to start a window before the newest event, counting from the old row and
-- the events between (or all of them, where there is no row or it is old). Run on every insert it
-- cost as much as it saved (round 51). Every writer of a host's events holds that host's advisory
-- lock (the gateway's rounds take it in their BEGIN, and the trigger takes it too, for an insert
-- by hand), so no two write one row at once. A row the clean-up deletes is written again, whole,
-- by the trigger's next insert or by a round once the host has 32 events in the window.
CREATE TABLE push_quota_use (
    host_fingerprint TEXT NOT NULL,
    kind             TEXT NOT NULL,
    counted_after    BIGINT NOT NULL,
    used             BIGINT NOT NULL,
    PRIMARY KEY (host_fingerprint, kind)
) WITH (fillfactor = 70);

-- The window (15 minutes) is written here as a number: were it to differ from the gateway's, the
-- rows would stay true and only their counts read more events.
CREATE FUNCTION push_quota_use_after_insert() RETURNS trigger
LANGUAGE plpgsql
-- Plans that find rows by key however small the tables were when they were made.
SET enable_seqscan = off
-- The queue's schema, as the migration runs in it, whatever the inserting session's search_path.
SET search_path FROM CURRENT
AS $$
BEGIN
    -- The hosts' locks, in the order the gateway's rounds take them (held already by a gateway's
    -- own insert): the rows below are then read after any round of these hosts has committed.
    PERFORM COUNT(pg_advisory_xact_lock(k)) FROM
        (SELECT DISTINCT hashtextextended('push_events:' || host_fingerprint, 0) AS k
         FROM inserted ORDER BY k) AS keys;
    UPDATE push_quota_use u SET
        counted_after = g.start,
        used = CASE
            WHEN u.counted_after < g.start - 900000 THEN
                (SELECT COUNT(*) FROM push_events q
                  WHERE q.host_fingerprint = u.host_fingerprint AND q.kind = u.kind
                  AND q.accepted_at > g.start AND q.accepted_at >= 0)
            WHEN u.counted_after <= g.start THEN
                u.used
                + (SELECT COUNT(*) FROM inserted i
                    WHERE i.host_fingerprint = u.host_fingerprint AND i.kind = u.kind
                    AND i.accepted_at > u.counted_after)
                - (SELECT COUNT(*) FROM push_events q
                    WHERE q.host_fingerprint = u.host_fingerprint AND q.kind = u.kind
                    AND q.accepted_at > u.counted_after AND q.accepted_at <= g.start
                    AND q.accepted_at >= 0)
            ELSE
                u.used
                + (SELECT COUNT(*) FROM inserted i
                    WHERE i.host_fingerprint = u.host_fingerprint AND i.kind = u.kind
                    AND i.accepted_at > u.counted_after)
                + (SELECT COUNT(*) FROM push_events q
                    WHERE q.host_fingerprint = u.host_fingerprint AND q.kind = u.kind
                    AND q.accepted_at > g.start AND q.accepted_at <= u.counted_after
                    AND q.accepted_at >= 0)
        END
    FROM (SELECT host_fingerprint, kind, MAX(accepted_at) - 900000 AS start
          FROM inserted GROUP BY host_fingerprint, kind) g
    WHERE u.host_fingerprint = g.host_fingerprint AND u.kind = g.kind;

    INSERT INTO push_quota_use (host_fingerprint, kind, counted_after, used)
    SELECT g.host_fingerprint, g.kind, g.start,
           (SELECT COUNT(*) FROM push_events q
             WHERE q.host_fingerprint = g.host_fingerprint AND q.kind = g.kind
             AND q.accepted_at > g.start AND q.accepted_at >= 0)
    FROM (SELECT host_fingerprint, kind, MAX(accepted_at) - 900000 AS start
          FROM inserted GROUP BY host_fingerprint, kind) g
    WHERE NOT EXISTS (SELECT 1 FROM push_quota_use u
                      WHERE u.host_fingerprint = g.host_fingerprint AND u.kind = g.kind)
    ON CONFLICT (host_fingerprint, kind) DO NOTHING;
    RETURN NULL;
END
$$;

CREATE TRIGGER push_events_quota_use AFTER INSERT ON push_events
    REFERENCING NEW TABLE AS inserted
    FOR EACH STATEMENT
    WHEN (current_setting('orca_push.quota_use', true) IS DISTINCT FROM 'written')
    EXECUTE FUNCTION push_quota_use_after_insert();
