-- Which coordinator uses this database: one at a time (PostgresStore::claim_sole_use). A
-- claim lasts while it is renewed; `holder` names the host and data dir, so the same
-- coordinator restarted after a crash takes its claim back at once.
CREATE TABLE coordinator_lease (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    holder TEXT NOT NULL,
    process TEXT NOT NULL,
    renewed_at TIMESTAMPTZ NOT NULL
);
