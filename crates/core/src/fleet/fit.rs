//! Whether any fleet can ever serve a job, and if not, why each one cannot — in words a
//! person can act on.
//!
//! A job that no fleet's machine fits (it asks for more GPUs than a machine has, a GPU model
//! or memory no fleet offers, tags no fleet's machines carry, a container runtime they lack,
//! or a timeout longer than a machine lives) waits for nothing: no machine will be made for
//! it. Saying only "no agent is connected" while `gpuci fleets` reads "enough machines" sends
//! a person to wait; the reason must say that it will end at its `queue_timeout` and which
//! fleet fails which requirement, so they fix the step or the fleet.
//!
//! Rules (enforced here and nowhere else):
//! - [`why_not`] is `None` exactly when [`super::fits`] is true: both judge the same template
//!   host ([`super::autoscale`]'s `template`), so a fleet never both "fits" and "cannot".
//! - The reason names the first failing requirement in the order a person would fix it:
//!   tags, container runtime, GPU count, GPU kind (model, memory, compute capability, MIG),
//!   time limit. What a fleet's spec does not say (driver, CUDA, an unset compute capability)
//!   is assumed to fit, as [`super::fits`] assumes.

use super::autoscale::{template, MACHINE_START_ALLOWANCE_S};
use super::{fits, FleetSpec};
use crate::gpu::mismatch;
use crate::placement::{place, Deadline, Needs};

/// Why a machine of `spec` can never run a job with `needs`; `None` when it can.
pub fn why_not(spec: &FleetSpec, needs: &Needs<'_>) -> Option<String> {
    if fits(spec, needs) {
        return None;
    }
    let m = &spec.machine;
    if let Some((k, v)) = needs.tags.iter().find(|(k, v)| m.tags.get(*k) != Some(*v)) {
        return Some(match m.tags.get(k) {
            Some(other) => format!("its machines carry tag {k}={other}, the job asks for {k}={v}"),
            None => format!("its machines do not carry tag {k}={v}"),
        });
    }
    if needs.container && !m.container_runtime {
        return Some("its machines have no container runtime (the job has an `image`)".into());
    }
    let want = needs.gpu.count;
    if want > m.gpus {
        return Some(format!(
            "its machines have {} GPU{}, the job needs {want} (a job's GPUs are on one machine)",
            m.gpus,
            if m.gpus == 1 { "" } else { "s" }
        ));
    }
    let (host, gpu) = template(spec, needs);
    if want > 0 {
        if let Some(why) = host.gpus.first().and_then(|g| mismatch(&gpu, &g.info)) {
            return Some(format!("its GPUs ({}) do not match: {why}", m.gpu_model));
        }
    }
    if let (Some(limit), Some(d)) = (m.time_limit_s, needs.deadline) {
        let lasts_ms = limit.saturating_sub(MACHINE_START_ALLOWANCE_S).saturating_mul(1000);
        if d.runs_for_ms > lasts_ms {
            return Some(format!(
                "its machines live at most time_limit {} ({} of it left for jobs once the agent has started); \
                 the job may hold one for {} (its timeout and time to report)",
                human(limit),
                human(lasts_ms / 1000),
                human(d.runs_for_ms.div_ceil(1000))
            ));
        }
    }
    // Something the checks above do not name: placement's own words on the template.
    let deadline = needs.deadline.map(|d| Deadline { now_ms: 0, ..d });
    let template = Needs { tags: needs.tags, gpu: &gpu, container: needs.container, deadline };
    Some(match place(&template, std::slice::from_ref(&host)) {
        Err(u) => u.reason,
        Ok(_) => "its machines do not fit the job".into(),
    })
}

/// The reason for a job no fleet in `fleets` can serve, naming each fleet and why; `None` when
/// some fleet can (or there are no fleets: then nothing is promised by fleets at all).
pub fn no_fleet_serves(fleets: &[FleetSpec], needs: &Needs<'_>) -> Option<String> {
    if fleets.is_empty() {
        return None;
    }
    let mut whys = Vec::with_capacity(fleets.len());
    for f in fleets {
        whys.push(format!("fleet {}: {}", f.name, why_not(f, needs)?));
    }
    Some(format!(
        "no fleet can ever run this job, so none will make a machine for it; it ends at its queue_timeout unless a \
         fitting agent connects ({})",
        whys.join("; ")
    ))
}

/// A fleet's summary with the waiting jobs that fit no fleet at all, and why not this one:
/// `gpuci fleets` would otherwise read "enough machines" while they wait for nothing.
/// `unfit` is (job id, why this fleet cannot run it); at most three are named.
pub fn with_unservable(why: &str, unfit: &[(String, String)]) -> String {
    const SHOWN: usize = 3;
    if unfit.is_empty() {
        return why.to_string();
    }
    let named: Vec<String> =
        unfit.iter().take(SHOWN).map(|(job, reason)| format!("job {job} cannot run here: {reason}")).collect();
    let more = match unfit.len().saturating_sub(SHOWN) {
        0 => String::new(),
        n => format!("; and {n} more"),
    };
    let n = unfit.len();
    format!("{why}; {n} waiting job{} no fleet can run ({}{more})", if n == 1 { "" } else { "s" }, named.join("; "))
}

/// `2h`, `1h 30m`, `59m`, `45s`.
fn human(s: u64) -> String {
    match (s / 3600, s % 3600 / 60, s % 60) {
        (0, 0, s) => format!("{s}s"),
        (0, m, 0) => format!("{m}m"),
        (0, m, s) => format!("{m}m {s}s"),
        (h, 0, _) => format!("{h}h"),
        (h, m, _) => format!("{h}h {m}m"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fleet::{CapacityPolicy, IdleAction, MachineSpec, ProviderKind, SpotBreaker};
    use crate::gpu::GpuRequirements;
    use crate::quantity::Bytes;
    use std::collections::BTreeMap;

    fn slurm(name: &str, gpus: u32, time_limit_s: Option<u64>) -> FleetSpec {
        FleetSpec {
            name: name.into(),
            provider: ProviderKind::Slurm,
            settings: toml::Table::new(),
            machine: MachineSpec {
                gpu_model: "NVIDIA A100-SXM4-80GB".into(),
                gpus,
                gpu_memory: Bytes(80 << 30),
                compute_capability: None,
                cpus: 8,
                memory: Bytes(64 << 30),
                tags: [("site".to_string(), "hpc".to_string())].into(),
                container_runtime: false,
                time_limit_s,
            },
            offers: Vec::new(),
            capacity: CapacityPolicy::OnDemand,
            min_idle: 0,
            max: 2,
            idle_timeout_s: Some(600),
            boot_timeout_s: 600,
            idle_action: IdleAction::Delete,
            stopped_timeout_s: None,
            stopped_price_per_hour: 0.0,
            warm: Vec::new(),
            daily_budget: None,
            spot_breaker: SpotBreaker::default(),
            simulate: None,
        }
    }

    fn needs<'a>(tags: &'a BTreeMap<String, String>, gpu: &'a GpuRequirements, timeout_s: Option<u64>) -> Needs<'a> {
        // As the coordinator hands it: timeout plus a minute to report.
        let deadline = timeout_s.map(|t| Deadline { now_ms: 1_000_000, runs_for_ms: t * 1000 + 60_000 });
        Needs { tags, gpu, container: false, deadline }
    }

    #[test]
    fn a_timeout_longer_than_every_time_limit_is_named_per_fleet() {
        let fleets = [slurm("short", 1, Some(3600)), slurm("shorter", 4, Some(1800))];
        let (t, g) = (BTreeMap::new(), GpuRequirements { count: 1, ..Default::default() });
        let n = needs(&t, &g, Some(2 * 3600));
        let why = no_fleet_serves(&fleets, &n).expect("no fleet fits");
        assert!(why.starts_with("no fleet can ever run this job"), "{why}");
        assert!(why.contains("ends at its queue_timeout"), "{why}");
        assert!(why.contains("fleet short: its machines live at most time_limit 1h (59m of it left"), "{why}");
        assert!(why.contains("fleet shorter: its machines live at most time_limit 30m"), "{why}");
        assert!(why.contains("the job may hold one for 2h 1m"), "{why}");
        assert!(!why.contains('\n'));
        // Fits once the timeout does.
        assert_eq!(no_fleet_serves(&fleets, &needs(&t, &g, Some(600))), None);
    }

    #[test]
    fn too_many_gpus_a_model_no_fleet_offers_and_missing_tags_say_so() {
        let f = slurm("a100", 2, None);
        let t = BTreeMap::new();
        let four = GpuRequirements { count: 4, ..Default::default() };
        assert_eq!(
            why_not(&f, &needs(&t, &four, None)).as_deref(),
            Some("its machines have 2 GPUs, the job needs 4 (a job's GPUs are on one machine)")
        );
        let h100 = GpuRequirements { count: 1, model: Some("H100*".into()), ..Default::default() };
        let why = why_not(&f, &needs(&t, &h100, None)).expect("no H100 here");
        assert!(why.starts_with("its GPUs (NVIDIA A100-SXM4-80GB) do not match: model"), "{why}");
        assert!(why.contains("H100*"), "{why}");
        let big = GpuRequirements {
            count: 1,
            memory: Some(crate::gpu::Constraint { op: crate::gpu::CmpOp::Ge, value: Bytes(100 << 30) }),
            ..Default::default()
        };
        assert!(why_not(&f, &needs(&t, &big, None)).expect("80 GiB < 100").contains("memory"));
        let one = GpuRequirements { count: 1, ..Default::default() };
        let tags: BTreeMap<String, String> = [("site".to_string(), "cloud".to_string())].into();
        assert_eq!(
            why_not(&f, &needs(&tags, &one, None)).as_deref(),
            Some("its machines carry tag site=hpc, the job asks for site=cloud")
        );
        let tags: BTreeMap<String, String> = [("arch".to_string(), "arm64".to_string())].into();
        assert_eq!(why_not(&f, &needs(&tags, &one, None)).as_deref(), Some("its machines do not carry tag arch=arm64"));
        let mut n = needs(&t, &one, None);
        n.container = true;
        assert!(why_not(&f, &n).expect("no runtime").contains("no container runtime"));
    }

    #[test]
    fn why_not_is_none_exactly_when_the_fleet_fits() {
        let fleets = [slurm("a", 1, Some(3600)), slurm("b", 8, None)];
        let t = BTreeMap::new();
        for count in 0..10 {
            for timeout in [None, Some(60), Some(3540), Some(3541), Some(100_000)] {
                let g = GpuRequirements { count, ..Default::default() };
                let n = needs(&t, &g, timeout);
                for f in &fleets {
                    assert_eq!(why_not(f, &n).is_none(), fits(f, &n), "{} {count} {timeout:?}", f.name);
                }
                assert_eq!(no_fleet_serves(&fleets, &n).is_none(), fleets.iter().any(|f| fits(f, &n)));
            }
        }
        assert_eq!(no_fleet_serves(&[], &needs(&t, &GpuRequirements::default(), None)), None);
    }

    #[test]
    fn a_fleet_summary_names_the_jobs_it_cannot_run() {
        assert_eq!(with_unservable("enough machines", &[]), "enough machines");
        let one = [("7".to_string(), "its machines have 1 GPU, the job needs 2".to_string())];
        assert_eq!(
            with_unservable("enough machines", &one),
            "enough machines; 1 waiting job no fleet can run (job 7 cannot run here: its machines have 1 GPU, the job needs 2)"
        );
        let many: Vec<(String, String)> = (1..=5).map(|i| (i.to_string(), "x".to_string())).collect();
        let s = with_unservable("enough machines", &many);
        assert!(s.starts_with("enough machines; 5 waiting jobs no fleet can run (job 1"), "{s}");
        assert!(s.ends_with("; and 2 more)"), "{s}");
    }
}
