-- Dynamic steps (`gpuci pipeline upload`): the token a running job uses to add steps to its
-- own pipeline, stored only as its sha256 (hex), and how many uploads the job has made (the
-- per-job cap). One row per job id: a retry is a new job with a new token. Rows of jobs that
-- have ended are deleted when the next tokens are stored (and when an ended job's token is
-- presented); whether the job still runs is checked on every use, so a row left behind
-- opens nothing.
CREATE TABLE job_tokens (
    job_id        INTEGER PRIMARY KEY REFERENCES jobs (id) ON DELETE CASCADE,
    token_sha256  TEXT    NOT NULL,
    uploads       INTEGER NOT NULL DEFAULT 0,
    created_at_ms INTEGER NOT NULL
);
