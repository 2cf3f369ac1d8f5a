-- GitHub integration.
-- Where a pipeline came from beyond its file: a GitHub push or pull request, or an Actions
-- runner job (JSON, read by the coordinator).
ALTER TABLE pipelines ADD COLUMN origin TEXT;

-- Webhook deliveries already handled (X-GitHub-Delivery): a redelivery is acknowledged and ignored.
CREATE TABLE github_deliveries (
    delivery TEXT PRIMARY KEY,
    event TEXT NOT NULL,
    received_at_ms INTEGER NOT NULL
);

-- Workflow jobs that matched a runner pool, keyed by GitHub's job id.
CREATE TABLE github_jobs (
    id INTEGER PRIMARY KEY,
    repository TEXT NOT NULL,
    run_id INTEGER NOT NULL,
    name TEXT NOT NULL,
    labels TEXT NOT NULL,
    pool TEXT NOT NULL,
    state TEXT NOT NULL,
    runner_job_id INTEGER,
    runner_name TEXT,
    reason TEXT NOT NULL,
    queued_at_ms INTEGER NOT NULL,
    updated_at_ms INTEGER NOT NULL
);
CREATE INDEX github_jobs_state ON github_jobs (state);

-- Just-in-time runners gpuci started, one per runner job.
CREATE TABLE github_runners (
    name TEXT PRIMARY KEY,
    job_id INTEGER NOT NULL UNIQUE,
    pool TEXT NOT NULL,
    repository TEXT NOT NULL,
    org TEXT,
    runner_id INTEGER,
    github_job_id INTEGER,
    state TEXT NOT NULL,
    created_at_ms INTEGER NOT NULL,
    updated_at_ms INTEGER NOT NULL
);
CREATE INDEX github_runners_state ON github_runners (state);

-- A maintainer's approval to run a pull request's pipeline: for one head SHA only.
CREATE TABLE github_approvals (
    repository TEXT NOT NULL,
    pr INTEGER NOT NULL,
    head_sha TEXT NOT NULL,
    approved_by TEXT NOT NULL,
    approved_at_ms INTEGER NOT NULL,
    PRIMARY KEY (repository, pr, head_sha)
);

-- The check run (or nothing, with commit statuses) that reports each gpuci job to GitHub.
CREATE TABLE github_checks (
    job_id INTEGER PRIMARY KEY,
    check_run_id INTEGER NOT NULL
);
