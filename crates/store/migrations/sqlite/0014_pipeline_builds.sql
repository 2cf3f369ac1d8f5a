-- What each pipeline builds, as the builds list shows it: the build facts its submitter or
-- GitHub gave (branch, tag, event, commit, subject, author; JSON of
-- `gpuci_core::condition::BuildFacts`, changed paths left out), bounded by the coordinator.
-- A pipeline from before this table, or one whose facts could not be stored, has no row:
-- the list shows what its origin says.
CREATE TABLE pipeline_builds (
    pipeline_id INTEGER PRIMARY KEY REFERENCES pipelines (id) ON DELETE CASCADE,
    facts       TEXT    NOT NULL
);
