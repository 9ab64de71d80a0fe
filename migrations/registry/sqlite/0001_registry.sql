-- Device registrations (owned by the registry service). Times are Unix milliseconds.

CREATE TABLE push_devices (
    registration_id  TEXT PRIMARY KEY NOT NULL,
    host_fingerprint TEXT NOT NULL,
    device_id        TEXT NOT NULL,
    platform         TEXT NOT NULL CHECK (platform IN ('ios', 'android')),
    token            TEXT NOT NULL,
    apns_environment TEXT CHECK (apns_environment IN ('sandbox', 'production')),
    filter_json      TEXT,
    dead_at          BIGINT,
    created_at       BIGINT NOT NULL,
    updated_at       BIGINT NOT NULL,
    UNIQUE (host_fingerprint, device_id)
);
CREATE INDEX push_devices_host ON push_devices (host_fingerprint, created_at);
