//! What the fleet policy learns from the store, for `gpuci_core::fleet::decide`: each
//! fleet's hour-of-week arrival profile (`gpuci_core::fleet::profile`), each step's recent
//! run times, and the GPU jobs of running pipelines that wait on other steps, with when they
//! are expected (`gpuci_core::fleet::fanout`). The fleets loop owns one [`FleetInputs`] and
//! hands its answers to `decide`; the rules themselves live in the core.
//!
//! Read from the jobs table, nothing of its own persisted (no migration): a restarted
//! coordinator relearns on its first pass. The profile is relearned every [`RELEARN_S`] from
//! the jobs that started in the last [`PROFILE_WEEKS`] weeks; an arrival is when a job was
//! created, or, for a step that waited on others (`depends_on`), when it started (the store
//! does not keep when it became ready; its start is at most its wait later). A job counts for
//! the first fleet whose machines it fits, as the autoscaler counts its demand. Steps are
//! known by their key: two pipelines with a step `test` share its history.
//!
//! What must not happen here: a decision (the core makes them), a provider call, a write.

use gpuci_core::fleet::profile::PROFILE_WEEKS;
use gpuci_core::fleet::{
    fits, ArrivalProfile, FleetSpec, PipelineStep, StepDurations, StepState, UnixSecs, UpcomingJob,
};
use gpuci_core::job::JobState;
use gpuci_core::placement::Needs;
use gpuci_store::{JobRecord, Store};
use std::collections::{BTreeMap, BTreeSet};

/// How often the profile and the step history are read again from the store.
pub const RELEARN_S: u64 = 3600;

/// The policy's inputs learned from the store; owned by the fleets loop.
#[derive(Default)]
pub struct FleetInputs {
    durations: StepDurations,
    profiles: BTreeMap<String, ArrivalProfile>,
    learned_at: Option<UnixSecs>,
}

impl FleetInputs {
    /// Relearn from the store when [`RELEARN_S`] has passed (at once the first time). A store
    /// error keeps what was learned before, and says so.
    pub async fn refresh(&mut self, store: &dyn Store, specs: &[FleetSpec], now: UnixSecs) {
        if self.learned_at.is_some_and(|t| now < t + RELEARN_S) {
            return;
        }
        self.learned_at = Some(now);
        let from = now.saturating_sub(PROFILE_WEEKS * 7 * 86_400);
        match store.jobs_ran_since(from as i64 * 1000).await {
            Ok(jobs) => {
                let (durations, profiles) = learn(&jobs, specs, from, now);
                self.durations = durations;
                self.profiles = profiles;
            }
            Err(e) => {
                tracing::warn!(error = %e, "fleets: cannot read the job history; the arrival profile stays as it was")
            }
        }
    }

    /// The fleet's arrival profile, if any job of it was seen.
    pub fn profile(&self, fleet: &str) -> Option<ArrivalProfile> {
        self.profiles.get(fleet).cloned()
    }

    /// How long runs of the step with this key usually take (the median of its recent runs).
    pub fn expected_run_s(&self, step_key: &str) -> Option<u64> {
        self.durations.expected(step_key)
    }

    /// The GPU jobs of active pipelines that wait on other steps, with their expected start.
    pub fn upcoming(&self, active: &[JobRecord], specs: &[FleetSpec], now: UnixSecs) -> Vec<UpcomingJob> {
        let steps = pipeline_steps(active, specs, now);
        gpuci_core::fleet::fanout::upcoming(&steps, &self.durations, now)
    }
}

/// The first fleet whose machines the job fits, for a GPU job.
pub fn fleet_of(job: &JobRecord, specs: &[FleetSpec], now_ms: i64) -> Option<usize> {
    if job.step.gpu.count == 0 {
        return None;
    }
    let needs = Needs {
        tags: &job.step.agents,
        gpu: &job.step.gpu,
        container: job.step.image.is_some(),
        deadline: crate::brain::job_deadline(job.step.timeout, now_ms),
    };
    specs.iter().position(|s| fits(s, &needs))
}

/// Step run times and per-fleet arrival profiles over `[from, to)` from jobs that ran. Pure.
pub fn learn(
    jobs: &[JobRecord],
    specs: &[FleetSpec],
    from: UnixSecs,
    to: UnixSecs,
) -> (StepDurations, BTreeMap<String, ArrivalProfile>) {
    let mut durations = StepDurations::default();
    let mut arrivals: Vec<Vec<(UnixSecs, f64)>> = vec![Vec::new(); specs.len()];
    let mut first_seen: Option<UnixSecs> = None;
    let mut ordered: Vec<&JobRecord> = jobs.iter().collect();
    ordered.sort_by_key(|j| (j.finished_at_ms, j.id));
    for j in ordered {
        let Some(started) = j.started_at_ms else { continue };
        let ran_s = j.finished_at_ms.map(|f| ((f - started).max(0) / 1000) as u64);
        // Runs that ended on their own (not cancelled, not lost) say how long the step takes.
        if let Some(ran) = ran_s.filter(|_| matches!(j.state, JobState::Succeeded | JobState::Failed)) {
            durations.record(&j.step.key, ran);
        }
        let at_ms = if j.step.depends_on.is_empty() { j.created_at_ms } else { started };
        let at = (at_ms.max(0) / 1000) as u64;
        first_seen = Some(first_seen.map_or(at, |f| f.min(at)));
        let Some(f) = fleet_of(j, specs, at_ms) else { continue };
        let share = f64::from(j.step.gpu.count) / f64::from(specs[f].machine.gpus.max(1));
        arrivals[f].push((at, ran_s.unwrap_or(0) as f64 * share.min(1.0)));
    }
    // Observed from the first job seen (a new install is not a quiet month).
    let from = first_seen.map_or(to, |f| f.max(from));
    let profiles =
        specs.iter().zip(arrivals).map(|(s, a)| (s.name.clone(), ArrivalProfile::learn(&a, from, to))).collect();
    (durations, profiles)
}

/// The steps of active pipelines that have a GPU job waiting on others, as plain data for
/// `fanout::upcoming`: a queued job whose `depends_on` names an active job of its pipeline is
/// blocked; steps that ended are not listed (they count as ended). Pure.
pub fn pipeline_steps(active: &[JobRecord], specs: &[FleetSpec], now: UnixSecs) -> Vec<PipelineStep> {
    let now_ms = now as i64 * 1000;
    // Per pipeline, the latest active job of each step key.
    let mut by_key: BTreeMap<(i64, &str), &JobRecord> = BTreeMap::new();
    for j in active {
        let slot = by_key.entry((j.pipeline_id, j.step.key.as_str())).or_insert(j);
        if j.id > slot.id {
            *slot = j;
        }
    }
    let blocked = |j: &JobRecord| {
        j.state == JobState::Queued
            && j.step.depends_on.iter().any(|d| by_key.contains_key(&(j.pipeline_id, d.as_str())))
    };
    let pipelines: BTreeSet<i64> =
        by_key.values().filter(|j| blocked(j) && j.step.gpu.count > 0).map(|j| j.pipeline_id).collect();
    by_key
        .values()
        .filter(|j| pipelines.contains(&j.pipeline_id))
        .map(|j| {
            let state = match j.state {
                JobState::Queued if blocked(j) => StepState::Blocked,
                JobState::Queued => StepState::Queued,
                _ => StepState::Running {
                    since: (j.started_at_ms.or(j.assigned_at_ms).unwrap_or(now_ms).max(0) / 1000) as u64,
                },
            };
            PipelineStep {
                id: j.id.to_string(),
                step: j.step.key.clone(),
                after: j
                    .step
                    .depends_on
                    .iter()
                    .filter_map(|d| by_key.get(&(j.pipeline_id, d.as_str())).map(|dep| dep.id.to_string()))
                    .collect(),
                state,
                gpus: j.step.gpu.count,
                fleets: fleet_of(j, specs, now_ms).map(|f| specs[f].name.clone()).into_iter().collect(),
                repository: None,
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpuci_core::pipeline::Step;

    const FLEET: &str = "[[fleet]]\nname = \"t4\"\nprovider = \"exec\"\nmax = 4\n[fleet.machine]\n\
                         gpu_model = \"NVIDIA T4\"\ngpus = 1\ngpu_memory = \"16GiB\"\ncpus = 4\nmemory = \"16GiB\"\n\
                         [[fleet.offer]]\ninstance_type = \"t4-box\"\nprice_per_hour = 0.5\n";
    const NOW: UnixSecs = 1_704_103_200; // Monday 2024-01-01 10:00 UTC

    fn job(id: i64, pipeline: i64, key: &str, gpus: u32, after: &[&str], state: JobState) -> JobRecord {
        let mut step = Step::new(key, "true");
        step.gpu.count = gpus;
        step.depends_on = after.iter().map(|s| s.to_string()).collect();
        JobRecord {
            id,
            pipeline_id: pipeline,
            step,
            env: Default::default(),
            state,
            reason: String::new(),
            attempt: 1,
            retry_of: None,
            agent_id: None,
            gpus: Vec::new(),
            created_at_ms: (NOW as i64 - 100) * 1000,
            assigned_at_ms: None,
            started_at_ms: None,
            finished_at_ms: None,
            exit_code: None,
            telemetry: None,
            unenforced: Vec::new(),
        }
    }

    #[test]
    fn a_running_build_makes_its_gpu_steps_upcoming_from_the_steps_history() {
        let specs = gpuci_core::fleet::parse_fleets("server.toml", FLEET).expect("fleet");
        // History: two finished builds of 200 s and 300 s (median of two: the later), a cancelled one ignored.
        let mut past = Vec::new();
        for (k, (ran, state)) in
            [(200, JobState::Succeeded), (300, JobState::Failed), (5, JobState::Cancelled)].into_iter().enumerate()
        {
            let mut j = job(10 + k as i64, 9, "build", 0, &[], state);
            let start = (NOW as i64 - 3600) * 1000;
            j.started_at_ms = Some(start);
            j.finished_at_ms = Some(start + ran * 1000);
            past.push(j);
        }
        let (durations, profiles) = learn(&past, &specs, NOW - 86_400, NOW);
        assert_eq!(durations.expected("build"), Some(300));
        assert!(profiles["t4"].counts.iter().all(|&c| c == 0), "no GPU job ran: nothing for t4");

        let inputs = FleetInputs { durations, profiles, learned_at: Some(NOW) };
        let mut build = job(20, 1, "build", 0, &[], JobState::Running);
        build.started_at_ms = Some((NOW as i64 - 100) * 1000);
        let active = vec![
            build,
            job(21, 1, "test", 1, &["build"], JobState::Queued),
            job(22, 1, "test2", 1, &["build"], JobState::Queued),
            // Another pipeline's GPU job with nothing to wait on: queued, not upcoming.
            job(23, 2, "solo", 1, &[], JobState::Queued),
        ];
        let up = inputs.upcoming(&active, &specs, NOW);
        let got: Vec<(&str, u64, &[String])> =
            up.iter().map(|u| (u.id.as_str(), u.expected_at, u.fleets.as_slice())).collect();
        let t4 = ["t4".to_string()];
        assert_eq!(got, [("21", NOW + 200, &t4[..]), ("22", NOW + 200, &t4[..])]);
    }
}
