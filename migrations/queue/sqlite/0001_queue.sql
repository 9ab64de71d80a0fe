-- Quota, events, coalescing windows and delivery batches (owned by the queue service).
-- Times are Unix milliseconds.

CREATE TABLE push_events (
    event_id           TEXT PRIMARY KEY NOT NULL,
    host_fingerprint   TEXT NOT NULL,
    kind               TEXT NOT NULL CHECK (kind IN ('alert', 'dismiss')),
    notification_epoch TEXT NOT NULL,
    notification_seq   BIGINT NOT NULL,
    notification_id    TEXT,
    -- sha256 of the notification's content (not its deadline or sound): a retry must match it.
    content_hash       TEXT NOT NULL,
    -- What the phone is shown; cleared at completion or expiry.
    payload_json       TEXT,
    -- W3C traceparent of the admission, so delivery spans can link to it.
    trace_parent       TEXT,
    -- The quota timestamp.
    accepted_at        BIGINT NOT NULL,
    -- The event's fixed deadline: expiresAt, capped at five minutes after first acceptance.
    expires_at         BIGINT NOT NULL,
    UNIQUE (host_fingerprint, kind, notification_epoch, notification_seq)
);
CREATE INDEX push_events_quota ON push_events (host_fingerprint, kind, accepted_at);
CREATE INDEX push_events_accepted ON push_events (accepted_at);
CREATE INDEX push_events_payload_deadline ON push_events (expires_at) WHERE payload_json IS NOT NULL;
CREATE INDEX push_events_notification ON push_events (host_fingerprint, notification_epoch, notification_id);

CREATE TABLE push_delivery_batches (
    batch_id         TEXT PRIMARY KEY NOT NULL,
    registration_id  TEXT NOT NULL,
    host_fingerprint TEXT NOT NULL,
    kind             TEXT NOT NULL CHECK (kind IN ('alert', 'dismiss')),
    -- open: accepting members until window_ends_at; pending: waiting for available_at;
    -- leased: a lane holds it until available_at; the rest are final.
    state            TEXT NOT NULL CHECK (state IN
                       ('open', 'pending', 'leased', 'sent', 'dead', 'failed', 'expired', 'cancelled')),
    -- 0 for dismissals and for events without a notification identity: they go alone.
    coalescible      INTEGER NOT NULL,
    window_ends_at   BIGINT NOT NULL,
    -- When the batch may next be claimed: window end, retry time, or lease expiry.
    available_at     BIGINT NOT NULL,
    member_count     INTEGER NOT NULL,
    members_bytes    INTEGER NOT NULL,
    routing_bytes    INTEGER NOT NULL,
    deadline         BIGINT NOT NULL,
    silent           INTEGER NOT NULL,
    attempts         INTEGER NOT NULL DEFAULT 0,
    lease_token      TEXT,
    lease_owner      TEXT,
    last_reason      TEXT,
    created_at       BIGINT NOT NULL,
    finished_at      BIGINT
);
CREATE INDEX push_delivery_batches_due ON push_delivery_batches (available_at)
    WHERE state IN ('open', 'pending', 'leased');
CREATE INDEX push_delivery_batches_window ON push_delivery_batches (registration_id, state);
CREATE INDEX push_delivery_batches_created ON push_delivery_batches (created_at);

CREATE TABLE push_event_recipients (
    event_id        TEXT NOT NULL REFERENCES push_events (event_id) ON DELETE CASCADE,
    registration_id TEXT NOT NULL,
    batch_id        TEXT,
    status          TEXT NOT NULL CHECK (status IN
                      ('pending', 'sent', 'dead', 'failed', 'expired', 'cancelled')),
    silent          INTEGER NOT NULL,
    created_at      BIGINT NOT NULL,
    updated_at      BIGINT NOT NULL,
    PRIMARY KEY (event_id, registration_id)
);
CREATE INDEX push_event_recipients_batch ON push_event_recipients (batch_id);
CREATE INDEX push_event_recipients_registration ON push_event_recipients (registration_id, status);

-- A dismissal fences older alerts of the same notification: never delivered afterwards.
CREATE TABLE push_dismissed_events (
    host_fingerprint      TEXT NOT NULL,
    notification_epoch    TEXT NOT NULL,
    notification_id       TEXT NOT NULL,
    -- Alerts with a lower sequence are fenced.
    dismissed_seq         BIGINT NOT NULL,
    created_at            BIGINT NOT NULL,
    PRIMARY KEY (host_fingerprint, notification_epoch, notification_id)
);
CREATE INDEX push_dismissed_events_created ON push_dismissed_events (created_at);
