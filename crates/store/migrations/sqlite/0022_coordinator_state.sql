-- What the coordinator's loops learn and a restart or a takeover should not forget (the fleets'
-- offer back-off, so an outage is not asked about again at once): one JSON document per name,
-- read by whichever coordinator leads.
CREATE TABLE coordinator_state (
    name          TEXT    PRIMARY KEY,
    json          TEXT    NOT NULL,
    updated_at_ms INTEGER NOT NULL
);
