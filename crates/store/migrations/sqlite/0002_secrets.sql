-- Secrets a job can ask for by name (`secrets: [HF_TOKEN]`). Values are never returned by
-- the API; the data dir holding this file is mode 0700.
CREATE TABLE secrets (
    name          TEXT PRIMARY KEY,
    value         TEXT    NOT NULL,
    updated_at_ms INTEGER NOT NULL
);
