-- Backoff state of a workflow job record, kept across coordinator restarts.
-- Runners in a row that exited without taking the job, and how the last one ended
-- (`exit 0, 'Must not run interactively with sudo'`): the backoff and the reason come from them.
ALTER TABLE github_jobs ADD COLUMN runner_exits INTEGER NOT NULL DEFAULT 0;
ALTER TABLE github_jobs ADD COLUMN last_runner_exit TEXT;
-- Failed attempts to ask GitHub about the job (whether its run comes from a fork); above 0 the
-- check is still owed and no runner is started until it passes.
ALTER TABLE github_jobs ADD COLUMN check_failures INTEGER NOT NULL DEFAULT 0;
-- No runner (or check) is started for the job before this time.
ALTER TABLE github_jobs ADD COLUMN retry_at_ms INTEGER;
