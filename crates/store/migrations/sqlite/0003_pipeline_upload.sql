-- The workspace upload a pipeline was submitted with (`POST /api/v1/uploads`): the sha256 of
-- a gzip'ed tar that every job of the pipeline starts from. NULL: the workspace starts empty.
ALTER TABLE pipelines ADD COLUMN workspace_upload TEXT;
