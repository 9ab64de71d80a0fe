-- The key session tokens are tagged with (HMAC-SHA256), created once and kept across restarts so
-- the facade can refuse a forged bearer without a look-up. One row.
CREATE TABLE push_session_keys (
    id              INTEGER PRIMARY KEY NOT NULL CHECK (id = 1),
    mac_key         BLOB NOT NULL,
    -- Sessions minted before this key carry no tag; they are looked up until this time.
    legacy_until    INTEGER NOT NULL,
    created_at      INTEGER NOT NULL
);
