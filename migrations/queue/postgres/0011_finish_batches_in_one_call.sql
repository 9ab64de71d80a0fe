-- A lane's final answers (sent, dead, failed, expired) in one call: the five statements the
-- gateway sent one at a time, each a round trip, run here in the server. A report flush was its
-- transaction's BEGIN, these five and its COMMIT, seven round trips; now it is one (the call, in a
-- transaction of its own). At 100 end-to-end flows, report flushes made more than a third of the
-- round trips the server answered; in one call, the gateway and the server spent a fifth less CPU
-- a delivery (round 52, docs/benchmarks.md).
--
-- The statements are those the gateway sent before (services/queue/src/store/reports.rs, round
-- 51), in the same order and with the same row locks: the batches locked in id order (a dismissal takes them
-- in that order too), each finished only under its own lease (the ones finished are returned),
-- their pending recipients given their batch's state, then their events locked in id order and
-- the payloads that no recipient waits for any more cleared. Each statement reads with a snapshot
-- of its own, as it did when sent alone: the clearing reads the recipients after any admission
-- adding one to those events has committed.
--
-- A build before this one never calls it; one that does needs it, and its migrations add it
-- before it serves. The function lives in the database, not in the build: a change of what it
-- does goes in a function of another name (push_finish_batches_v2, its build calling that), this
-- one kept until no build calls it. Replaced in place, the replicas of the build before would run
-- the new statements mid-rollout, and a rollback would keep them.
CREATE FUNCTION push_finish_batches(
    batch_ids TEXT[], new_states TEXT[], reasons TEXT[], leases TEXT[], answers INT[], at_ms BIGINT
) RETURNS SETOF TEXT
LANGUAGE plpgsql
-- Plans that find rows by key however small the tables were when they were made, as the lanes'
-- transactions plan (PgQueueStore::begin_claim): each statement planned once per connection.
SET enable_seqscan = off
SET enable_hashjoin = off
SET enable_mergejoin = off
SET plan_cache_mode = force_generic_plan
-- The queue's schema, as the migration runs in it, whatever the calling session's search_path.
SET search_path FROM CURRENT
AS $$
DECLARE
    ended TEXT[];
    ended_states TEXT[];
BEGIN
    PERFORM 1 FROM push_delivery_batches WHERE batch_id = ANY (batch_ids) ORDER BY batch_id FOR UPDATE;

    WITH v (id, state, reason, lease, answered) AS (
        SELECT * FROM UNNEST(batch_ids, new_states, reasons, leases, answers)
    ), done AS (
        UPDATE push_delivery_batches SET state = v.state,
            lease_token = NULL, last_reason = v.reason,
            attempts = push_delivery_batches.attempts + v.answered, finished_at = at_ms
        FROM v WHERE push_delivery_batches.batch_id = v.id
        AND (v.lease IS NULL OR (push_delivery_batches.lease_token = v.lease
            AND push_delivery_batches.state = 'leased'))
        RETURNING push_delivery_batches.batch_id, push_delivery_batches.state
    )
    SELECT array_agg(done.batch_id), array_agg(done.state) INTO ended, ended_states FROM done;
    IF ended IS NULL THEN
        RETURN;
    END IF;

    UPDATE push_event_recipients SET status = e.state, updated_at = at_ms
    FROM UNNEST(ended, ended_states) AS e (id, state)
    WHERE push_event_recipients.batch_id = e.id AND push_event_recipients.status = 'pending';

    PERFORM 1 FROM push_events e
    WHERE e.payload_json IS NOT NULL
    AND e.event_id IN (SELECT r.event_id FROM push_event_recipients r WHERE r.batch_id = ANY (ended))
    ORDER BY e.event_id FOR UPDATE;

    UPDATE push_events SET payload_json = NULL
    WHERE payload_json IS NOT NULL
    AND NOT EXISTS (SELECT 1 FROM push_event_recipients p
        WHERE p.event_id = push_events.event_id AND p.status = 'pending')
    AND event_id IN (SELECT r.event_id FROM push_event_recipients r WHERE r.batch_id = ANY (ended));

    RETURN QUERY SELECT UNNEST(ended);
END
$$;
