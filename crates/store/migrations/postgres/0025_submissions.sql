-- A pipeline submitted with a client's submission key (`gpuci submit` makes one per command)
-- is created once: the same key sent again (an answer lost in a failover, a retried request)
-- gets the pipeline made the first time, never a second one. `digest` is the SHA-256 of the
-- request, so a key reused for another pipeline is refused, not answered with this one.
CREATE TABLE submissions (
    key            TEXT    PRIMARY KEY,
    digest         TEXT    NOT NULL,
    pipeline_id    BIGINT  NOT NULL,
    created_at_ms  BIGINT  NOT NULL
);
CREATE INDEX submissions_created ON submissions (created_at_ms);

-- Fenced like every gpuci table (0013): a former leader cannot record a submission.
CREATE TRIGGER gpuci_fence BEFORE INSERT OR UPDATE OR DELETE OR TRUNCATE ON submissions
    FOR EACH STATEMENT EXECUTE FUNCTION gpuci_fence();
