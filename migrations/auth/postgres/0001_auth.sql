-- Host authentication (owned by the auth service, in its own schema). Times are Unix milliseconds.

CREATE TABLE push_hosts (
    host_fingerprint TEXT PRIMARY KEY,
    host_public_key  BYTEA NOT NULL,
    created_at       BIGINT NOT NULL,
    last_seen_at     BIGINT NOT NULL
);
CREATE INDEX push_hosts_last_seen ON push_hosts (last_seen_at);

CREATE TABLE push_challenges (
    challenge_id     TEXT PRIMARY KEY,
    host_fingerprint TEXT NOT NULL,
    host_public_key  BYTEA NOT NULL,
    -- sha256 (hex) of the expected proof; the challenge secret itself is never stored.
    secret_hash      TEXT NOT NULL,
    transcript       BYTEA NOT NULL,
    issued_at        BIGINT NOT NULL,
    expires_at       BIGINT NOT NULL,
    consumed_at      BIGINT
);
CREATE INDEX push_challenges_expires ON push_challenges (expires_at);

CREATE TABLE push_sessions (
    -- sha256 (hex) of the bearer token; the token itself is never stored.
    token_hash       TEXT PRIMARY KEY,
    host_fingerprint TEXT NOT NULL,
    expires_at       BIGINT NOT NULL,
    created_at       BIGINT NOT NULL
);
-- One session per host.
CREATE UNIQUE INDEX push_sessions_one_per_host ON push_sessions (host_fingerprint);
CREATE INDEX push_sessions_expires ON push_sessions (expires_at);
