-- A queued delivery keeps its X-Hub-Signature-256: the leader checks it again before acting,
-- so a row written into the inbox by anything but a coordinator that checked it is dropped.
ALTER TABLE github_inbox ADD COLUMN signature TEXT;
