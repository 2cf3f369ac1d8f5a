-- Rolling upgrades (issue 29): the oldest schema a coordinator may have and still run on this
-- database. A coordinator whose newest migration is older than the database's runs anyway
-- (a newer coordinator has migrated it during a rolling upgrade) as long as its newest
-- migration is at least `oldest_reader`. Every migration after this one is additive (the
-- store's compat test refuses one that is not), unless it is marked `-- gpuci: breaking` and
-- raises `oldest_reader` to its own version.
CREATE TABLE schema_compat (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    oldest_reader INTEGER NOT NULL
);
INSERT INTO schema_compat (id, oldest_reader) VALUES (1, 19);
