-- Webhook deliveries a coordinator accepted but does not act on itself (a standby: issue 29),
-- kept until the leader takes them. A delivery is recorded in github_deliveries in the same
-- transaction, so a redelivery to any coordinator is known as one.
CREATE TABLE github_inbox (
    delivery       TEXT    PRIMARY KEY,
    event          TEXT    NOT NULL,
    body           BYTEA   NOT NULL,
    received_at_ms BIGINT  NOT NULL
);
-- Fenced like every gpuci table (0013). A standby's connections carry no epoch and are not
-- fenced: it writes here while another leads; a former leader's (fenced) cannot.
CREATE TRIGGER gpuci_fence BEFORE INSERT OR UPDATE OR DELETE OR TRUNCATE ON github_inbox
    FOR EACH STATEMENT EXECUTE FUNCTION gpuci_fence();
