-- Artifacts: files a job uploaded when its step ended (`artifacts:` in a pipeline). The bytes
-- live content-addressed in the coordinator's data dir (`<data-dir>/artifacts/<sha256>`);
-- a row names one file of one job. `repository` is the job's pipeline's, copied here so the
-- per-repository cap is one indexed sum.
CREATE TABLE artifacts (
    job_id INTEGER NOT NULL,
    path TEXT NOT NULL,
    size INTEGER NOT NULL,
    sha256 TEXT NOT NULL,
    repository TEXT,
    created_at_ms INTEGER NOT NULL,
    PRIMARY KEY (job_id, path)
);
CREATE INDEX artifacts_repository ON artifacts (repository);
CREATE INDEX artifacts_created ON artifacts (created_at_ms);
CREATE INDEX artifacts_sha256 ON artifacts (sha256);

-- Test reports (`test_reports:`): the coordinator's reading of each JUnit file a job
-- uploaded (gpuci_core::test_report::TestReport as JSON), or why it could not be read.
-- Deleted with the artifact of the same job and path.
CREATE TABLE test_reports (
    job_id INTEGER NOT NULL,
    path TEXT NOT NULL,
    report_json TEXT,
    error TEXT,
    PRIMARY KEY (job_id, path)
);
