//! The GitHub integration: webhooks in, just-in-time runners for matching workflow jobs,
//! stuck-job cancelling, reconciliation, gpuci pipelines for pushes and pull requests, and
//! their results back as check runs or commit statuses.
//!
//! One task ([`service`]) owns the GitHub side's decisions and records; the scheduler owns
//! jobs. They talk through the scheduler's command queue and the job event hub. Calls to
//! GitHub never run on the scheduler: a runner's registration is the [`Registrar`]'s, results
//! go out through the reporter's queue in order.

pub mod backoff;
pub mod config;
pub mod intake;
mod report;
pub mod service;

use crate::brain::{self, RunnerGrant, RunnerRegistrar};
use crate::origin::RunnerOrigin;
use gpuci_github::{Client, JitRunnerSpec, Repo};
use gpuci_protocol::JobId;
use gpuci_store::{RunnerRecord, Store};
use std::sync::Arc;
use tokio::sync::mpsc;

pub use config::GithubConfig;
pub use service::{start, Handle};

/// Registers JIT runners for placed runner jobs and records them.
pub struct Registrar {
    pub client: Arc<Client>,
    pub store: Arc<dyn Store>,
}

#[async_trait::async_trait]
impl RunnerRegistrar for Registrar {
    async fn register(&self, job: JobId, agent_id: &str, origin: &RunnerOrigin) -> Result<RunnerGrant, String> {
        // Unique per registration: GitHub refuses a name already in use, and a requeued job
        // registers again.
        let suffix: u32 = rand::random();
        let host: String = agent_id.chars().filter(|c| c.is_ascii_alphanumeric()).take(8).collect();
        let name = format!("gpuci-{host}-j{job}-{suffix:08x}");
        let spec = JitRunnerSpec {
            name: name.clone(),
            runner_group_id: origin.runner_group_id,
            labels: origin.labels.clone(),
        };
        let now = brain::now_ms();
        let mut record = RunnerRecord {
            name: name.clone(),
            job_id: job,
            pool: origin.pool.clone(),
            repository: origin.repository.clone(),
            org: origin.org.clone(),
            runner_id: None,
            github_job_id: None,
            state: "registering".into(),
            created_at_ms: now,
            updated_at_ms: now,
        };
        // Recorded first: a registration whose answer is lost is still found and removed.
        self.store.put_runner(&record).await.map_err(|e| e.to_string())?;
        let result = match &origin.org {
            Some(org) => self.client.generate_org_jitconfig(org, &spec).await,
            None => match Repo::parse(&origin.repository) {
                Some(repo) => self.client.generate_jitconfig(&repo, &spec).await,
                None => return Err(format!("bad repository name {:?}", origin.repository)),
            },
        };
        match result {
            Ok(jit) => {
                record.runner_id = Some(jit.runner_id as i64);
                record.state = "registered".into();
                record.updated_at_ms = brain::now_ms();
                self.store.put_runner(&record).await.map_err(|e| e.to_string())?;
                Ok(RunnerGrant {
                    runner_name: jit.runner_name,
                    jit_config: jit.encoded_jit_config.expose().to_string(),
                })
            }
            Err(e) => {
                record.state = "removed".into();
                record.updated_at_ms = brain::now_ms();
                let _ = self.store.put_runner(&record).await;
                Err(e.to_string())
            }
        }
    }

    async fn discard(&self, grant: RunnerGrant) {
        let Ok(Some(mut record)) = self.store.get_runner(&grant.runner_name).await else { return };
        if let Some(id) = record.runner_id {
            let result = match (&record.org, Repo::parse(&record.repository)) {
                (Some(org), _) => self.client.delete_org_runner(org, id as u64).await,
                (None, Some(repo)) => self.client.delete_runner(&repo, id as u64).await,
                (None, None) => Ok(()),
            };
            if let Err(e) = result {
                tracing::warn!(runner = %record.name, error = %e, "could not remove an unneeded runner");
            }
        }
        record.state = "removed".into();
        record.updated_at_ms = brain::now_ms();
        let _ = self.store.put_runner(&record).await;
    }
}

/// What the webhook handler hands the service.
pub(crate) enum Inbound {
    Event(gpuci_github::Event),
}

pub(crate) type InboundTx = mpsc::Sender<Inbound>;
