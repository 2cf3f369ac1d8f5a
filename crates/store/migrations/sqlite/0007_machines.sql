-- Machines fleets created (issue 11): boot stages and what they cost.
CREATE TABLE machines (
    id TEXT PRIMARY KEY,
    fleet TEXT NOT NULL,
    provider_id TEXT,
    instance_type TEXT NOT NULL,
    zone TEXT NOT NULL,
    capacity TEXT NOT NULL,
    price_per_hour REAL NOT NULL,
    gpus INTEGER NOT NULL,
    state TEXT NOT NULL,
    reason TEXT,
    agent_id TEXT,
    requested_at_ms INTEGER NOT NULL,
    running_at_ms INTEGER,
    connected_at_ms INTEGER,
    first_job_at_ms INTEGER,
    ended_at_ms INTEGER,
    boot_failed INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX machines_active ON machines (ended_at_ms);
-- Billed stretches: launch (or start) to delete (or stop); to_ms NULL while it lasts.
CREATE TABLE machine_billing (
    machine_id TEXT NOT NULL REFERENCES machines (id),
    from_ms INTEGER NOT NULL,
    to_ms INTEGER,
    PRIMARY KEY (machine_id, from_ms)
);
CREATE INDEX machine_billing_to ON machine_billing (to_ms);
