//! What the agent does not enforce for one job (issue 26, "no silent loss of protection").
//!
//! An agent runs a job without some protection only where its operator opted in
//! (`--allow-unenforced-limits`, `--allow-unsandboxed`, `--job-disk none`, `--job-network host`,
//! `--allow-metadata-trusted`) or where an agent that is not root cannot give it. Which of them
//! one job goes without is decided here and nowhere else, as a pure function of plain data:
//! what the agent could set up when it started ([`AgentFacts`]), the step, and what the
//! executor decided for the job before starting it ([`JobFacts`]). The executor says every
//! item in the job's log and sends the list with the job's start; the coordinator keeps it with
//! the job, and `gpuci jobs show`, the API and the job page show it.
//!
//! The list names losses, not restrictions: a job with no network because its agent has no
//! network namespace per slot, or a step with `network: none`, goes without nothing (its log
//! still says why it has no network).
//!
//! Image steps: the container engine owns the job's namespaces; the network it gets is the
//! one decided here all the same (the engine is told the slot's namespace, none, or the
//! host's), so the rules below hold for them, except that outside the sandbox an image step
//! still gets no network unless it was given one.

use gpuci_core::pipeline::Step;
use gpuci_protocol::agent::{Protection, Unenforced};

/// What the agent could enforce, fixed when it started.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AgentFacts {
    /// Why memory, CPU and process limits are not enforced (no job cgroups for an agent that
    /// is not root); `None`: they are.
    pub limits_problem: Option<String>,
    /// `--allow-unenforced-limits`: steps with `resources:` run although they are not enforced.
    pub allow_unenforced_limits: bool,
    /// Why jobs get no disk of their slot's own (`--job-disk none`, an agent that is not
    /// root); `None`: each slot has one.
    pub disk_quota_problem: Option<String>,
}

/// The network a job's sandbox (or container) was given.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum JobNet {
    /// None at all (`network: none`, `--job-network none`, or no slot network to give).
    None,
    /// The slot's own network namespace.
    Own,
    /// The host's (`--job-network host`).
    Host,
}

/// What the executor decided for one job before starting it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct JobFacts<'a> {
    /// Why the job runs outside the sandbox (the note of `decide_isolation`, which only an
    /// agent started with `--allow-unsandboxed` gives, and only to trusted jobs); `None`: it
    /// runs inside.
    pub unsandboxed: Option<&'a str>,
    pub network: JobNet,
    /// Whether the job's slot has a disk of its own (its workspace's quota).
    pub slot_disk: bool,
    /// Whether cloud metadata endpoints were opened in the slot's network for this trusted
    /// job (`--allow-metadata-trusted`).
    pub metadata_opened: bool,
}

/// The protections `step` goes without on this agent, in a fixed order (limits, sandbox,
/// disk quota, network isolation, metadata); empty when all are enforced.
pub fn unenforced(agent: &AgentFacts, step: &Step, job: &JobFacts) -> Vec<Unenforced> {
    let mut out = Vec::new();
    let mut add = |key, detail: String| out.push(Unenforced { key, detail });
    if let Some(why) = &agent.limits_problem {
        let r = &step.resources;
        let asked = r.memory.is_some() || r.cpu_millis.is_some() || r.pids.is_some();
        // Worded as the job's log always said it (docs/sandbox.md quotes these).
        add(
            Protection::Limits,
            match (asked, agent.allow_unenforced_limits) {
                (true, true) => format!(
                    "this step's resources: are NOT enforced on this agent ({why}); its operator allowed that \
                     (--allow-unenforced-limits)"
                ),
                (true, false) => format!(
                    "this step's resources: are NOT enforced on this agent ({why}), and its operator did not \
                     allow that (--allow-unenforced-limits)"
                ),
                (false, _) => format!("no memory, CPU or process limit is enforced on this agent ({why})"),
            },
        );
    }
    if let Some(why) = job.unsandboxed {
        add(Protection::Sandbox, format!("{why} (--allow-unsandboxed)"));
    }
    if !job.slot_disk {
        let why = agent.disk_quota_problem.as_deref().unwrap_or("its slot has no disk of its own");
        add(
            Protection::DiskQuota,
            format!("no disk quota: the job's workspace is on the agent's disk, shared with other jobs ({why})"),
        );
    }
    let host_network = match (job.network, job.unsandboxed) {
        (JobNet::Host, _) => Some(
            "the job is on the host's network (--job-network host): it reaches services on the host's and other \
             jobs' loopback",
        ),
        // Outside the sandbox nothing takes the host's network away unless the slot's own
        // namespace was joined; an image step still gets the engine's `--network=none`.
        (JobNet::None, Some(_)) if step.image.is_none() => Some(
            "the job is on the host's network: it runs outside the sandbox (--allow-unsandboxed) and its slot has \
             no network namespace of its own",
        ),
        _ => None,
    };
    if let Some(detail) = host_network {
        add(Protection::NetworkIsolation, detail.to_string());
    }
    if job.metadata_opened {
        add(
            Protection::Metadata,
            "cloud metadata endpoints are reachable for this trusted job (--allow-metadata-trusted)".into(),
        );
    } else if host_network.is_some() {
        add(Protection::Metadata, "cloud metadata endpoints are not refused: the job is on the host's network".into());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpuci_core::quantity::Bytes;

    /// A root agent that sets up everything, and a job that got all of it.
    fn enforcing() -> (AgentFacts, JobFacts<'static>) {
        (
            AgentFacts::default(),
            JobFacts { unsandboxed: None, network: JobNet::Own, slot_disk: true, metadata_opened: false },
        )
    }

    fn keys(list: &[Unenforced]) -> Vec<&'static str> {
        list.iter().map(|u| u.key.as_str()).collect()
    }

    fn limited() -> Step {
        let mut step = Step::new("limited", "echo ran");
        step.resources.memory = Some(Bytes(1 << 30));
        step
    }

    #[test]
    fn a_fully_enforcing_agent_lists_nothing() {
        let (agent, job) = enforcing();
        assert_eq!(unenforced(&agent, &Step::new("plain", "true"), &job), vec![]);
        assert_eq!(unenforced(&agent, &limited(), &job), vec![]);
        // Less than asked for is not a loss: no network at all.
        let none = JobFacts { network: JobNet::None, ..job };
        assert_eq!(unenforced(&agent, &Step::new("plain", "true"), &none), vec![]);
    }

    /// The unprivileged agent of the Slurm guide: no job cgroups, no slot disks, no slot
    /// networks (its jobs get no network, which is no loss).
    #[test]
    fn an_agent_that_is_not_root_says_limits_and_disk() {
        let agent = AgentFacts {
            limits_problem: Some("no job cgroups for an agent that is not root: EACCES".into()),
            allow_unenforced_limits: true,
            disk_quota_problem: Some("the agent is not root".into()),
        };
        let job = JobFacts { unsandboxed: None, network: JobNet::None, slot_disk: false, metadata_opened: false };
        let plain = unenforced(&agent, &Step::new("plain", "true"), &job);
        assert_eq!(keys(&plain), ["limits", "disk_quota"]);
        assert_eq!(
            plain[0].detail,
            "no memory, CPU or process limit is enforced on this agent (no job cgroups for an agent that is not root: EACCES)"
        );
        assert!(plain[1].detail.contains("(the agent is not root)"), "{}", plain[1].detail);
        let asked = unenforced(&agent, &limited(), &job);
        assert!(
            asked[0].detail.contains("resources: are NOT enforced")
                && asked[0].detail.contains("its operator allowed that (--allow-unenforced-limits)"),
            "{}",
            asked[0].detail
        );
        // Placed without the operator's leave (an older coordinator): said as it is.
        let strict = AgentFacts { allow_unenforced_limits: false, ..agent };
        let d = &unenforced(&strict, &limited(), &job)[0].detail;
        assert!(d.contains("did not allow that"), "{d}");
    }

    #[test]
    fn outside_the_sandbox_without_a_slot_network_the_job_is_on_the_host_network() {
        let (agent, _) = enforcing();
        let why = "bubblewrap is not installed or cannot work on this host: the job runs WITHOUT the sandbox, on the host file system";
        let job = JobFacts { unsandboxed: Some(why), network: JobNet::None, slot_disk: true, metadata_opened: false };
        let list = unenforced(&agent, &Step::new("s", "true"), &job);
        assert_eq!(keys(&list), ["sandbox", "network_isolation", "metadata"]);
        assert_eq!(list[0].detail, format!("{why} (--allow-unsandboxed)"));
        // A root agent's slot namespace is joined outside the sandbox too.
        let own = JobFacts { network: JobNet::Own, ..job };
        assert_eq!(keys(&unenforced(&agent, &Step::new("s", "true"), &own)), ["sandbox"]);
        // An image step gets the engine's `--network=none`.
        let mut image = Step::new("s", "true");
        image.image = Some("alpine:3".into());
        assert_eq!(keys(&unenforced(&agent, &image, &job)), ["sandbox"]);
    }

    #[test]
    fn the_host_network_and_no_disk_quota_are_said() {
        let agent = AgentFacts {
            disk_quota_problem: Some("the agent was started with --job-disk none".into()),
            ..AgentFacts::default()
        };
        let job = JobFacts { unsandboxed: None, network: JobNet::Host, slot_disk: false, metadata_opened: false };
        let list = unenforced(&agent, &Step::new("s", "true"), &job);
        assert_eq!(keys(&list), ["disk_quota", "network_isolation", "metadata"]);
        assert!(list[0].detail.contains("--job-disk none"), "{}", list[0].detail);
        assert!(list[1].detail.contains("--job-network host"), "{}", list[1].detail);
    }

    #[test]
    fn metadata_opened_for_a_trusted_job_is_said() {
        let (agent, job) = enforcing();
        let opened = JobFacts { metadata_opened: true, ..job };
        let list = unenforced(&agent, &Step::new("s", "true"), &opened);
        assert_eq!(keys(&list), ["metadata"]);
        assert!(list[0].detail.contains("--allow-metadata-trusted"));
    }

    /// Whatever the agent and the job, the list is in the fixed order, each key at most once,
    /// and every sentence names why or the flag behind it.
    #[test]
    fn every_combination_lists_each_key_once_in_order_with_a_reason() {
        let nets = [JobNet::None, JobNet::Own, JobNet::Host];
        let mut image = Step::new("i", "true");
        image.image = Some("alpine:3".into());
        let steps = [Step::new("s", "true"), limited(), image];
        for bits in 0..64u32 {
            let bit = |i: u32| bits & (1 << i) != 0;
            let agent = AgentFacts {
                limits_problem: bit(0).then(|| "no cgroups".to_string()),
                allow_unenforced_limits: bit(1),
                disk_quota_problem: bit(2).then(|| "--job-disk none".to_string()),
            };
            for net in nets {
                for step in &steps {
                    let job = JobFacts {
                        unsandboxed: bit(3).then_some("outside"),
                        network: net,
                        slot_disk: bit(4),
                        metadata_opened: bit(5),
                    };
                    let list = unenforced(&agent, step, &job);
                    let ks: Vec<Protection> = list.iter().map(|u| u.key).collect();
                    let mut sorted = ks.clone();
                    sorted.sort();
                    sorted.dedup();
                    assert_eq!(ks, sorted, "{agent:?} {job:?}");
                    assert_eq!(ks.contains(&Protection::Limits), agent.limits_problem.is_some());
                    assert_eq!(ks.contains(&Protection::Sandbox), job.unsandboxed.is_some());
                    assert_eq!(ks.contains(&Protection::DiskQuota), !job.slot_disk);
                    if net == JobNet::Host {
                        assert!(ks.contains(&Protection::NetworkIsolation) && ks.contains(&Protection::Metadata));
                    }
                    if job.unsandboxed.is_none() && net != JobNet::Host {
                        assert!(!ks.contains(&Protection::NetworkIsolation));
                    }
                    for u in &list {
                        assert!(u.detail.contains('(') || u.detail.contains(':'), "{u:?}");
                    }
                }
            }
        }
    }
}
