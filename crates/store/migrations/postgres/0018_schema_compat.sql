-- Rolling upgrades (issue 29): the oldest schema a coordinator may have and still run on this
-- database. A coordinator whose newest migration is older than the database's runs anyway
-- (a newer coordinator, say a standby of the next version, has migrated it during a rolling
-- upgrade) as long as its newest migration is at least `oldest_reader`. Every migration after
-- this one is additive (the store's compat test refuses one that is not), unless it is marked
-- `-- gpuci: breaking` and raises `oldest_reader` to its own version.
CREATE TABLE schema_compat (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    oldest_reader BIGINT NOT NULL
);
INSERT INTO schema_compat (id, oldest_reader) VALUES (1, 18);
CREATE TRIGGER gpuci_fence BEFORE INSERT OR UPDATE OR DELETE OR TRUNCATE ON schema_compat
    FOR EACH STATEMENT EXECUTE FUNCTION gpuci_fence();
