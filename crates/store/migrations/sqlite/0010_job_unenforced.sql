-- What the job's agent did not enforce for it (limits, sandbox, disk quota, network isolation,
-- cloud metadata), as the agent said when the job started: a JSON list of {key, detail}.
-- NULL: nothing said (all enforced, not started on its current placement, or an older agent).
ALTER TABLE jobs ADD COLUMN unenforced_json TEXT;
