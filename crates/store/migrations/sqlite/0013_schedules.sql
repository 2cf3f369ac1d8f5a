-- Schedules (`[[schedule]]` in the server config). `checked_at_ms`: when a coordinator last
-- looked at the schedule (first: when it was first seen); after downtime, occurrences since
-- then are owed (one catch-up run), never those from before. Each fire is recorded here before its pipeline is
-- submitted; the unique key makes a second fire of one occurrence impossible, also across a
-- restart. A fire without pipeline and error was cut short by a stop (marked at start).
CREATE TABLE schedule_state (
    name        TEXT PRIMARY KEY,
    checked_at_ms INTEGER NOT NULL
);

CREATE TABLE schedule_fires (
    id              INTEGER PRIMARY KEY AUTOINCREMENT,
    schedule        TEXT    NOT NULL,
    cause           TEXT    NOT NULL,
    scheduled_at_ms INTEGER NOT NULL,
    fired_at_ms     INTEGER NOT NULL,
    skipped_from_ms INTEGER,
    pipeline_id     INTEGER,
    error           TEXT,
    UNIQUE (schedule, cause, scheduled_at_ms)
);
CREATE INDEX schedule_fires_by_schedule ON schedule_fires (schedule, id);
