-- Machines fleets created (issue 11; as SQLite's 0007): boot stages and what they cost.
CREATE TABLE machines (
    id TEXT PRIMARY KEY,
    fleet TEXT NOT NULL,
    provider_id TEXT,
    instance_type TEXT NOT NULL,
    zone TEXT NOT NULL,
    capacity TEXT NOT NULL,
    price_per_hour DOUBLE PRECISION NOT NULL,
    gpus BIGINT NOT NULL,
    state TEXT NOT NULL,
    reason TEXT,
    agent_id TEXT,
    requested_at_ms BIGINT NOT NULL,
    running_at_ms BIGINT,
    connected_at_ms BIGINT,
    first_job_at_ms BIGINT,
    ended_at_ms BIGINT,
    boot_failed BIGINT NOT NULL DEFAULT 0
);
CREATE INDEX machines_active ON machines (ended_at_ms);
-- Billed stretches: launch (or start) to delete (or stop); to_ms NULL while it lasts.
CREATE TABLE machine_billing (
    machine_id TEXT NOT NULL REFERENCES machines (id),
    from_ms BIGINT NOT NULL,
    to_ms BIGINT,
    PRIMARY KEY (machine_id, from_ms)
);
CREATE INDEX machine_billing_to ON machine_billing (to_ms);
