//! Self-hosted runners: just-in-time runner configs for a repository or an organisation, and
//! removing and listing runners. Requests go through the client's `send`, which owns
//! credentials, retries and rate limits; nothing here retries on its own.

use super::*;

fn jit_config(resp: wire::JitConfigResponse) -> JitConfig {
    JitConfig {
        runner_id: resp.runner.id,
        runner_name: resp.runner.name,
        encoded_jit_config: Secret::new(resp.encoded_jit_config),
    }
}

impl Client {
    /// Registers a just-in-time runner on `repo`.
    pub async fn generate_jitconfig(&self, repo: &Repo, spec: &JitRunnerSpec) -> Result<JitConfig, ApiError> {
        const OP: &str = "generate JIT runner config";
        let path = repo_path(OP, repo, &["actions", "runners", "generate-jitconfig"])?;
        let resp: wire::JitConfigResponse =
            self.send(OP, Method::POST, &path, &[], Auth::Repo(repo), Some(spec)).await?.success()?.json()?;
        Ok(jit_config(resp))
    }

    /// Registers a just-in-time runner on organisation `org`.
    pub async fn generate_org_jitconfig(&self, org: &str, spec: &JitRunnerSpec) -> Result<JitConfig, ApiError> {
        const OP: &str = "generate organization JIT runner config";
        let path = org_path(OP, org, &["actions", "runners", "generate-jitconfig"])?;
        let resp: wire::JitConfigResponse =
            self.send(OP, Method::POST, &path, &[], Auth::Org(org), Some(spec)).await?.success()?.json()?;
        Ok(jit_config(resp))
    }

    /// Removes a runner from `repo`; one that is already gone (404) counts as removed.
    pub async fn delete_runner(&self, repo: &Repo, runner_id: u64) -> Result<(), ApiError> {
        const OP: &str = "delete repository runner";
        let path = repo_path(OP, repo, &["actions", "runners", &runner_id.to_string()])?;
        let reply = self.send(OP, Method::DELETE, &path, &[], Auth::Repo(repo), NO_BODY).await?;
        if reply.status != StatusCode::NOT_FOUND {
            reply.success()?;
        }
        Ok(())
    }

    /// Removes a runner from organisation `org`; one that is already gone (404) counts as removed.
    pub async fn delete_org_runner(&self, org: &str, runner_id: u64) -> Result<(), ApiError> {
        const OP: &str = "delete organization runner";
        let path = org_path(OP, org, &["actions", "runners", &runner_id.to_string()])?;
        let reply = self.send(OP, Method::DELETE, &path, &[], Auth::Org(org), NO_BODY).await?;
        if reply.status != StatusCode::NOT_FOUND {
            reply.success()?;
        }
        Ok(())
    }

    /// The self-hosted runners registered on `repo` (all pages, up to 1000 runners).
    pub async fn list_runners(&self, repo: &Repo) -> Result<Vec<Runner>, ApiError> {
        const OP: &str = "list repository runners";
        let path = repo_path(OP, repo, &["actions", "runners"])?;
        self.paginate(OP, &path, Vec::new(), Auth::Repo(repo), |page: wire::RunnerPage| page.runners).await
    }
}
