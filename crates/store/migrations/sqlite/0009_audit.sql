-- The audit log: who (kind of credential, its name, a fingerprint) did what (action) to which
-- object, and how it ended. Written in the same transaction as the change it describes where
-- the change is in this database. Never holds a secret value or a token.
CREATE TABLE audit_log (
    id          INTEGER PRIMARY KEY AUTOINCREMENT,
    at_ms       INTEGER NOT NULL,
    actor_kind  TEXT    NOT NULL,
    actor       TEXT    NOT NULL,
    credential  TEXT,
    action      TEXT    NOT NULL,
    object      TEXT    NOT NULL,
    outcome     TEXT    NOT NULL
);
CREATE INDEX audit_log_at ON audit_log (at_ms);

-- Named API tokens, by the SHA-256 of their value. A name is never reused (revoked tokens
-- keep their row), so a name in the audit log always means one token.
CREATE TABLE api_tokens (
    name          TEXT PRIMARY KEY,
    hash          TEXT    NOT NULL UNIQUE,
    created_at_ms INTEGER NOT NULL,
    created_by    TEXT    NOT NULL,
    revoked_at_ms INTEGER
);
