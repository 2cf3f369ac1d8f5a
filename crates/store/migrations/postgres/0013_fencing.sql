-- Fencing (issue 29): one coordinator leads a database at a time, by the claim in
-- coordinator_lease. Each claim made raises `epoch`; the leader's connections carry the epoch
-- they were opened under (the `gpuci.epoch` setting, PostgresStore::fence), and every
-- statement that writes to a gpuci table first checks it against the claim's, holding the
-- claim's row in share mode until its transaction ends. A former leader (paused, cut off,
-- slow to learn it lost its claim) can then write nothing once another coordinator took the
-- claim: a takeover waits for the writes already under way, and every write after it is
-- refused by the database itself (SQLSTATE GF001). Connections without the setting (psql, the
-- store's own tests, migrations) are not fenced.
ALTER TABLE coordinator_lease ADD COLUMN epoch BIGINT NOT NULL DEFAULT 0;

CREATE FUNCTION gpuci_fence() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    mine TEXT := current_setting('gpuci.epoch', true);
    claimed BIGINT;
BEGIN
    IF mine IS NULL OR mine = '' THEN
        RETURN NULL;
    END IF;
    SELECT epoch INTO claimed FROM coordinator_lease WHERE id = 1 FOR SHARE;
    IF claimed IS DISTINCT FROM mine::BIGINT THEN
        RAISE EXCEPTION 'this coordinator no longer leads this database (its claim, epoch %, was taken over: epoch %); nothing was written', mine, claimed
            USING ERRCODE = 'GF001';
    END IF;
    RETURN NULL;
END
$$;

-- Every table gpuci writes, but the claim itself. A later migration that adds a table adds
-- this trigger to it too (the store suite checks that every table has it).
DO $$
DECLARE
    t TEXT;
BEGIN
    FOR t IN
        SELECT table_name FROM information_schema.tables
        WHERE table_schema = current_schema() AND table_type = 'BASE TABLE'
          AND table_name NOT IN ('coordinator_lease', '_sqlx_migrations')
    LOOP
        EXECUTE format(
            'CREATE TRIGGER gpuci_fence BEFORE INSERT OR UPDATE OR DELETE OR TRUNCATE ON %I '
            'FOR EACH STATEMENT EXECUTE FUNCTION gpuci_fence()', t);
    END LOOP;
END
$$;
