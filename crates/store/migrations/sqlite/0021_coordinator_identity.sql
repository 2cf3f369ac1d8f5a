-- The installation's identity key (ed25519), which agents and the CLI pin and every
-- coordinator of this database proves before it is sent a credential. One row, made by the
-- first coordinator that starts; its secret is sealed with the secrets key (a copy of the
-- database does not give the key away).
CREATE TABLE coordinator_identity (
    id            INTEGER PRIMARY KEY CHECK (id = 1),
    public_key    TEXT    NOT NULL,
    sealed_secret TEXT    NOT NULL,
    created_at_ms INTEGER NOT NULL
);
