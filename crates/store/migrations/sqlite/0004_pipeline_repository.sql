-- The repository a pipeline came from (its git remote, or the work tree's path): the key
-- under which agents keep a step's `cache:` paths between jobs.
ALTER TABLE pipelines ADD COLUMN repository TEXT;
