-- The key session tokens are tagged with (HMAC-SHA256), created once and shared by every replica so
-- the facade can refuse a forged bearer without a look-up. One row.
CREATE TABLE push_session_keys (
    id              SMALLINT PRIMARY KEY CHECK (id = 1),
    mac_key         BYTEA NOT NULL,
    -- Sessions minted before this key carry no tag; they are looked up until this time.
    legacy_until    BIGINT NOT NULL,
    created_at      BIGINT NOT NULL
);
