-- gpuci schema, version 1.
-- Times are milliseconds since the Unix epoch. JSON columns hold serde values of gpuci-core types.

CREATE TABLE pipelines (
    id            INTEGER PRIMARY KEY AUTOINCREMENT,
    file_name     TEXT    NOT NULL,
    source        TEXT    NOT NULL,
    created_at_ms INTEGER NOT NULL
);

CREATE TABLE jobs (
    id              INTEGER PRIMARY KEY AUTOINCREMENT,
    pipeline_id     INTEGER NOT NULL REFERENCES pipelines(id),
    step_key        TEXT    NOT NULL,
    name            TEXT    NOT NULL,
    step_json       TEXT    NOT NULL,
    env_json        TEXT    NOT NULL,
    state           TEXT    NOT NULL,
    reason          TEXT    NOT NULL DEFAULT '',
    attempt         INTEGER NOT NULL DEFAULT 1,
    retry_of        INTEGER REFERENCES jobs(id),
    agent_id        TEXT,
    gpus_json       TEXT    NOT NULL DEFAULT '[]',
    created_at_ms   INTEGER NOT NULL,
    assigned_at_ms  INTEGER,
    started_at_ms   INTEGER,
    finished_at_ms  INTEGER,
    exit_code       INTEGER,
    telemetry_json  TEXT
);
CREATE INDEX jobs_pipeline ON jobs(pipeline_id);
CREATE INDEX jobs_active ON jobs(state) WHERE state IN ('queued', 'assigned', 'running');

CREATE TABLE job_logs (
    job_id  INTEGER NOT NULL REFERENCES jobs(id),
    seq     INTEGER NOT NULL,
    ts_us   INTEGER NOT NULL,
    stream  TEXT    NOT NULL,
    text    TEXT    NOT NULL,
    PRIMARY KEY (job_id, seq)
) WITHOUT ROWID;

CREATE TABLE agents (
    id               TEXT PRIMARY KEY,
    name             TEXT NOT NULL,
    credential_hash  TEXT NOT NULL,
    registered_at_ms INTEGER NOT NULL,
    last_seen_ms     INTEGER,
    state            TEXT NOT NULL DEFAULT 'disconnected',
    reason           TEXT NOT NULL DEFAULT '',
    hello_json       TEXT
);

-- A GPU is leased to at most one job: the primary key is the GPU's UUID.
CREATE TABLE gpu_leases (
    gpu_uuid    TEXT PRIMARY KEY,
    agent_id    TEXT    NOT NULL,
    job_id      INTEGER NOT NULL REFERENCES jobs(id),
    since_ms    INTEGER NOT NULL
);

CREATE TABLE gpu_quarantine (
    gpu_uuid    TEXT PRIMARY KEY,
    agent_id    TEXT    NOT NULL,
    reason      TEXT    NOT NULL,
    since_ms    INTEGER NOT NULL
);
