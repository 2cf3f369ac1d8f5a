-- What the coordinator's loops learn and a restart or a takeover should not forget (the fleets'
-- offer back-off, so an outage is not asked about again at once): one JSON document per name,
-- read by whichever coordinator leads.
CREATE TABLE coordinator_state (
    name          TEXT    PRIMARY KEY,
    json          TEXT    NOT NULL,
    updated_at_ms BIGINT  NOT NULL
);
-- Fenced like every gpuci table (0013): a former leader cannot overwrite what the new one learnt.
CREATE TRIGGER gpuci_fence BEFORE INSERT OR UPDATE OR DELETE OR TRUNCATE ON coordinator_state
    FOR EACH STATEMENT EXECUTE FUNCTION gpuci_fence();
