-- When a machine's spot interruption notice was seen: the fleet's breaker survives a restart.
ALTER TABLE machines ADD COLUMN interrupted_at_ms INTEGER;
