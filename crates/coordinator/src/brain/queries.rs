//! Read-only views of live state for the API and the fleets: fleet machines' agents and the
//! jobs no agent can take ([`FleetView`]), and agents' summaries.

use super::*;

/// Connected agents that run on fleet machines, and queued jobs no connected agent can take.
#[derive(Clone, Debug, Default)]
pub struct FleetView {
    pub agents: Vec<FleetAgent>,
    pub waiting: Vec<WaitingJob>,
    /// Machines (their `gpuci.machine` tags) whose agents are known but not connected now, and
    /// whether each is lost (gone past `lost_after`) or may still come back (a coordinator
    /// restart, a network blip).
    pub absent: Vec<(String, bool)>,
    /// Every machine an agent ever registered from (its `gpuci.machine` tag) → that agent,
    /// connected or not: registrations are durable (the agents table), so a machine that ended
    /// between two reconcile passes is still known to have booted. With when that agent was
    /// last heard from (unix ms): a registration from before a machine's latest (re)start is
    /// not this boot's (a stopped machine started again keeps its agent's identity).
    pub registered: BTreeMap<String, (String, i64)>,
}

#[derive(Clone, Debug)]
pub struct FleetAgent {
    pub agent_id: String,
    /// Its `gpuci.machine` tag.
    pub machine: String,
    /// Jobs assigned to it or running on it.
    pub running: u32,
    /// GPUs leased to those jobs.
    pub gpus_busy: u32,
    /// Its machine is being taken back (the notice, in words).
    pub interrupted: Option<String>,
    /// When a job first started on it.
    pub first_job_at_ms: Option<i64>,
}

#[derive(Clone, Debug)]
pub struct WaitingJob {
    pub id: JobId,
    pub pipeline_id: PipelineId,
    /// When it became ready to place (ms).
    pub since_ms: i64,
    pub tags: BTreeMap<String, String>,
    pub gpu: gpuci_core::gpu::GpuRequirements,
    pub container: bool,
    pub timeout: Option<gpuci_core::duration::Duration>,
}

impl Brain {
    pub(super) fn fleet_view(&self) -> FleetView {
        let agents = self
            .agents
            .values()
            .filter(|a| a.link == Link::Connected)
            .filter_map(|a| {
                let machine = a.tags.get(gpuci_providers::TAG_MACHINE)?.clone();
                let jobs: Vec<&JobRecord> = self.jobs_on(&a.id).filter(|j| j.state != JobState::Queued).collect();
                let gpus_busy = jobs.iter().map(|j| j.gpus.len() as u32).sum();
                Some(FleetAgent {
                    agent_id: a.id.clone(),
                    machine,
                    running: jobs.len() as u32,
                    gpus_busy,
                    interrupted: a.interrupted.clone(),
                    first_job_at_ms: a.first_job_at_ms,
                })
            })
            .collect();
        let waiting = self
            .unplaceable
            .ids(&self.queue)
            .filter_map(|id| self.active.get(&id))
            .filter(|j| j.state == JobState::Queued)
            .map(|j| WaitingJob {
                id: j.id,
                pipeline_id: j.pipeline_id,
                since_ms: self.ready_since.get(&j.id).copied().unwrap_or(j.created_at_ms),
                tags: j.step.agents.clone(),
                gpu: j.step.gpu.clone(),
                container: j.step.image.is_some(),
                timeout: j.step.timeout,
            })
            .collect();
        let absent = self
            .agents
            .values()
            .filter(|a| a.link != Link::Connected)
            .filter_map(|a| Some((a.tags.get(gpuci_providers::TAG_MACHINE)?.clone(), a.link == Link::Lost)))
            .collect();
        let registered = self
            .agents
            .values()
            .filter_map(|a| Some((a.tags.get(gpuci_providers::TAG_MACHINE)?.clone(), (a.id.clone(), a.last_seen_ms))))
            .collect();
        FleetView { agents, waiting, absent, registered }
    }

    pub(super) fn agent_summaries(&self) -> Vec<AgentSummary> {
        self.agents
            .values()
            .map(|a| {
                let running: Vec<JobId> = self.jobs_on(&a.id).map(|j| j.id).collect();
                let gpus = a
                    .gpus
                    .iter()
                    .map(|g| {
                        let lease = self.active.values().find(|j| j.gpus.contains(&g.uuid));
                        let q = self.quarantine.get(&g.uuid);
                        GpuView {
                            info: g.clone(),
                            state: if q.is_some() {
                                "quarantined"
                            } else if lease.is_some() {
                                "leased"
                            } else {
                                "free"
                            }
                            .into(),
                            job_id: lease.map(|j| j.id),
                            reason: q.map(|q| q.reason.clone()),
                            health: a.health.get(&g.uuid).cloned(),
                        }
                    })
                    .collect();
                AgentSummary {
                    id: a.id.clone(),
                    name: a.name.clone(),
                    hostname: a.hostname.clone(),
                    state: match a.link {
                        Link::Connected => "connected",
                        Link::Disconnected => "disconnected",
                        Link::Lost => "lost",
                    }
                    .into(),
                    reason: match (a.interrupted.as_ref().or(a.withdrawn.as_ref()).or(a.paused.as_ref()), a.link) {
                        (Some(why), Link::Connected) => format!("takes no new jobs: {why}"),
                        _ => a.reason.clone(),
                    },
                    tags: a.tags.clone(),
                    slots: a.slots,
                    running,
                    gpu_backend: a.gpu_backend.clone(),
                    isolation: a.isolation.clone(),
                    container_runtime: a.container_runtime.clone(),
                    gpus,
                    last_seen_ms: Some(a.last_seen_ms).filter(|t| *t > 0),
                }
            })
            .collect()
    }
}
