-- Artifacts of untrusted jobs (pull requests from forks, Actions runner jobs) have a budget of
-- their own within their repository's, so they can never use up the room of its trusted jobs.
ALTER TABLE artifacts ADD COLUMN untrusted INTEGER NOT NULL DEFAULT 0;
