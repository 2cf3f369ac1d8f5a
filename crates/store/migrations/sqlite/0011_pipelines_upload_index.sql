-- Upload garbage collection asks which pipelines name an upload (and the agent's download
-- of a deleted one, whether any did): without this, every pass would read every pipeline.
CREATE INDEX pipelines_workspace_upload ON pipelines (workspace_upload) WHERE workspace_upload IS NOT NULL;
