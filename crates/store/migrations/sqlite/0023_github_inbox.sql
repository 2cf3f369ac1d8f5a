-- Webhook deliveries a coordinator accepted but does not act on itself (a standby: issue 29),
-- kept until the leader takes them. A delivery is recorded in github_deliveries in the same
-- transaction, so a redelivery to any coordinator is known as one.
CREATE TABLE github_inbox (
    delivery       TEXT    PRIMARY KEY,
    event          TEXT    NOT NULL,
    body           BLOB    NOT NULL,
    received_at_ms INTEGER NOT NULL
);
