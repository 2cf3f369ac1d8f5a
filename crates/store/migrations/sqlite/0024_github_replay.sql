-- Webhook replay protection and ordering (docs/github.md). GitHub signs a delivery's body
-- only: X-GitHub-Delivery and X-GitHub-Event are not signed, so a captured body sent again
-- with a fresh delivery id passes the signature check. A body that starts work is acted on
-- once: its SHA-256 is kept here, recorded in the same transaction as its delivery.
CREATE TABLE github_payloads (
    body_sha256    TEXT    PRIMARY KEY,
    delivery       TEXT    NOT NULL,
    event          TEXT    NOT NULL,
    received_at_ms INTEGER NOT NULL
);
CREATE INDEX github_payloads_received ON github_payloads (received_at_ms);

-- Workflow jobs GitHub said had started or ended before gpuci knew them: a `queued` delivery
-- for one that arrives later (out of order, or from a standby's inbox) is ignored.
CREATE TABLE github_job_tombstones (
    job_id   INTEGER PRIMARY KEY,
    action   TEXT    NOT NULL,
    at_ms    INTEGER NOT NULL
);
CREATE INDEX github_job_tombstones_at ON github_job_tombstones (at_ms);

-- Deliveries were kept forever; now pruned with the same retention.
CREATE INDEX github_deliveries_received ON github_deliveries (received_at_ms);
