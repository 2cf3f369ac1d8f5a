//! A queued job's secrets in the placement pass, in two steps: **vetting** (may this job
//! have each secret it names, in which scope: decided from the stored secrets' names and the
//! job's origin, and remembered while those names stay the same) and **opening** (the values,
//! read and decrypted only for a job about to be placed).
//!
//! Vetting runs for every queued job that names secrets, placeable or not, so that one that
//! may not have them ends at once rather than after waiting its turn for a GPU. It reads the
//! store once a pass (the names), not once a job: a pass that read the job's pipeline, every
//! secret's name and its values for each queued job took 3.0 s for 8,000 waiting jobs
//! (BENCHMARKS.md, "Queued jobs with secrets").

use super::*;
use gpuci_core::secret_scope::JobSource;

/// The stored secrets' names as one pass sees them: each name's scopes, and a fingerprint
/// of the whole list (a job vetted under the same fingerprint is not vetted again).
pub(super) struct StoredSecrets {
    scopes: HashMap<String, Vec<SecretScope>>,
    pub(super) fingerprint: u64,
}

/// Why a vetted job's values could not be opened.
pub(super) enum NotOpened {
    /// A secret changed while the job was placed: it waits for the next pass.
    Wait(String),
    /// It can never open (another key, a changed row, a sealed value for another place):
    /// the job fails, saying why.
    Fail(String),
}

impl Brain {
    /// Reads the stored secrets' names (one statement), once a pass.
    pub(super) async fn stored_secrets(&self) -> Result<StoredSecrets, StoreError> {
        use std::hash::{Hash, Hasher};
        let rows = self.store.secret_names().await?;
        let mut hasher = std::collections::hash_map::DefaultHasher::new();
        rows.hash(&mut hasher);
        let mut scopes: HashMap<String, Vec<SecretScope>> = HashMap::new();
        for (row, _) in &rows {
            if let Some((name, scope)) = SecretScope::parse_storage_name(row) {
                scopes.entry(name).or_default().push(scope);
            }
        }
        Ok(StoredSecrets { scopes, fingerprint: hasher.finish() })
    }

    /// Where a job came from, for choosing its secrets' scopes: its pipeline's origin (read
    /// once a pass per pipeline, kept in `sources`) and its step's environment.
    pub(super) async fn job_source(
        &self,
        sources: &mut HashMap<PipelineId, JobSource>,
        j: &JobRecord,
    ) -> Result<JobSource, StoreError> {
        let of_pipeline = match sources.get(&j.pipeline_id) {
            Some(s) => s.clone(),
            None => {
                let pipeline = self.store.get_pipeline(j.pipeline_id).await?;
                let s = secret_source(pipeline.as_ref(), &self.github_host);
                sources.insert(j.pipeline_id, s.clone());
                s
            }
        };
        Ok(JobSource { environment: j.step.environment.clone(), ..of_pipeline })
    }

    /// Which secrets `j` is given and in which scope, or why it may have none (which ends
    /// the job). Encrypted values in the pipeline file are decrypted to check where they
    /// may be used, then dropped: [`Brain::open_secrets`] opens them again at placement.
    pub(super) fn vet_secrets(
        &self,
        j: &JobRecord,
        source: &JobSource,
        stored: &StoredSecrets,
    ) -> Result<Vec<(String, SecretScope)>, String> {
        // Checked again here, not only when the pipeline was parsed: the stored step is a
        // plain row, and a name no pipeline may hold (`gpuci:coordinator-identity`, the
        // identity key's sealing name) would open a row that is not a user's secret.
        if let Some(n) =
            j.step.secrets.iter().chain(j.step.encrypted_secrets.keys()).find(|n| !gpuci_core::pipeline::is_env_name(n))
        {
            let shown: String = n.chars().take(80).collect();
            return Err(format!(
                "secret {shown:?} is not a secret name a pipeline may hold (letters, digits, `_`); \
                 the stored step was changed outside gpuci: refused"
            ));
        }
        let mut given: Vec<(String, SecretScope)> = Vec::new();
        // Values encrypted in the pipeline file open only where the key lives, and only for
        // the repository, ref and name they were encrypted for.
        for (name, text) in &j.step.encrypted_secrets {
            let (scope, _) = self.decrypt_from_file(name, text, source)?;
            given.push((name.clone(), scope));
        }
        for name in &j.step.secrets {
            let scopes = stored.scopes.get(name).map_or(&[][..], Vec::as_slice);
            let scope = gpuci_core::secret_scope::choose(name, scopes, source).map_err(|r| r.to_string())?;
            given.push((name.clone(), scope.clone()));
        }
        Ok(given)
    }

    /// The values of a vetted job's secrets: read from the store and opened with the
    /// secrets key, or decrypted from the pipeline file.
    pub(super) async fn open_secrets(
        &self,
        j: &JobRecord,
        given: &[(String, SecretScope)],
        source: &JobSource,
    ) -> Result<BTreeMap<String, String>, NotOpened> {
        let mut values: BTreeMap<String, String> = BTreeMap::new();
        for (name, text) in &j.step.encrypted_secrets {
            let (_, value) = self.decrypt_from_file(name, text, source).map_err(NotOpened::Fail)?;
            values.insert(name.clone(), value);
        }
        let stored: Vec<(&String, &SecretScope)> =
            given.iter().filter(|(n, _)| !values.contains_key(n)).map(|(n, s)| (n, s)).collect();
        let rows: Vec<String> = stored.iter().map(|(n, scope)| scope.storage_name(n)).collect();
        let sealed = self.store.secret_values(&rows).await.map_err(|e| {
            tracing::error!(job = j.id, error = %e, "could not read secrets");
            NotOpened::Wait(format!("waiting: the job's secrets could not be read ({})", e.reason()))
        })?;
        for ((name, scope), row) in stored.into_iter().zip(&rows) {
            // Deleted since the names were read: the next pass decides again.
            let Some(text) = sealed.get(row) else {
                return Err(NotOpened::Wait(format!("waiting: secret `{name}` changed while the job was placed")));
            };
            match self.secrets_key.open(row, text) {
                Ok(v) => {
                    values.insert(name.clone(), v);
                }
                // Start-up checked every row's key; a row written since by a coordinator
                // with another key, or altered, lands here. Waiting mends nothing (issue 27:
                // the job sat until its queue timeout): the job fails now, naming the secret
                // (never its value) and the fix.
                Err(e) => {
                    return Err(NotOpened::Fail(format!(
                        "secret `{name}` (scope: {scope}) does not open with this coordinator's secrets key: {e}; \
                         set it again (`gpuci secret set {name}` in that scope) or start the coordinator \
                         with the key file it was sealed with (--secrets-key-file)"
                    )));
                }
            }
        }
        Ok(values)
    }

    /// A value encrypted in the pipeline file: its scope and plain text, if this job may
    /// have it.
    fn decrypt_from_file(&self, name: &str, text: &str, source: &JobSource) -> Result<(SecretScope, String), String> {
        let opened = match &self.repo_keys {
            None => Err("this coordinator keeps no key for encrypted secrets".to_string()),
            Some(ring) => {
                let ring = ring.read().unwrap_or_else(|e| e.into_inner());
                ring.decrypt(text).map_err(|e| e.to_string())
            }
        };
        opened
            .map_err(|why| format!("encrypted secret `{name}`: {why}"))
            .and_then(|sealed| Ok((sealed.scope(), sealed.check(name, source)?.to_string())))
    }
}

/// Where a job came from, for choosing its secrets' scopes.
pub(super) fn secret_source(pipeline: Option<&gpuci_store::PipelineRecord>, github_host: &str) -> JobSource {
    let origin = pipeline.and_then(|p| Origin::parse(p.origin.as_deref()));
    match origin {
        Some(Origin::Github(g)) => {
            let (git_ref, description) = match (g.event.as_str(), g.pr) {
                ("pull_request", Some(n)) if !g.secrets => {
                    let d = match &g.approved_by {
                        Some(by) => {
                            format!("an approved pull request from a fork ({} #{n}, approved by {by})", g.repository)
                        }
                        None => format!("a pull request from a fork ({} #{n})", g.repository),
                    };
                    (Some(format!("refs/pull/{n}/merge")), d)
                }
                ("pull_request", Some(n)) => {
                    (Some(format!("refs/pull/{n}/merge")), format!("pull request {} #{n}", g.repository))
                }
                _ => {
                    let r = g.git_ref.clone();
                    let d = format!("a push to {} {}", g.repository, r.as_deref().unwrap_or("(ref unknown)"));
                    (r, d)
                }
            };
            JobSource {
                // Approval policy: a fork's pull request that ran on a maintainer's approval
                // may get values set for approved forks, and nothing else.
                approved_fork: !g.secrets && g.approved_by.is_some(),
                repository: Some(g.repository),
                git_ref,
                environment: None,
                may_have_secrets: g.secrets,
                description,
            }
        }
        Some(Origin::ActionsRunner(r)) => JobSource {
            description: format!("an Actions runner job for {}", r.repository),
            repository: Some(r.repository),
            git_ref: None,
            environment: None,
            may_have_secrets: true,
            approved_fork: false,
        },
        // An origin that is stored but cannot be read (a newer coordinator's, a damaged row)
        // is not "submitted through the API": whoever it was, it gets no secret.
        None if pipeline.is_some_and(|p| p.origin.is_some()) => JobSource {
            repository: None,
            git_ref: None,
            environment: None,
            may_have_secrets: false,
            approved_fork: false,
            description: "a pipeline whose recorded origin cannot be read (no secrets)".to_string(),
        },
        None => {
            // `gpuci submit` reports its work tree's origin URL (or path); scopes name
            // repositories as `owner/name` on the GitHub host, `host/path` elsewhere.
            let repository = pipeline
                .and_then(|p| p.repository.as_deref())
                .and_then(|r| gpuci_core::secret_scope::repository_of_remote(r, github_host));
            let description = match &repository {
                Some(r) => format!("a pipeline submitted through the API from a work tree of {r}"),
                None => "a pipeline submitted through the API (no repository)".to_string(),
            };
            JobSource {
                repository,
                git_ref: None,
                environment: None,
                may_have_secrets: true,
                approved_fork: false,
                description,
            }
        }
    }
}
