-- When a machine's spot interruption notice was seen (as SQLite's 0008).
ALTER TABLE machines ADD COLUMN interrupted_at_ms BIGINT;
