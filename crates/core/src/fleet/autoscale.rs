//! The autoscaler: which machines to create, start, stop and delete now, and why each queued
//! job is still waiting. One pure function, [`decide`], over what the caller observed.
//!
//! Rules (the product's, enforced here and nowhere else):
//! - **Demand.** Queued jobs (oldest first, ties by id) are matched against machines that
//!   exist: connected ones with enough free GPUs first, then booting ones (earliest first). A
//!   job that matches none counts as demand for the first of its fleets that can still grow
//!   (else its first fleet). New machines are packed first-fit: a machine takes several jobs
//!   only when its GPUs cover all of them (one 1-GPU job per 1-GPU machine; four on a 4-GPU
//!   machine); a job never spans machines.
//! - **Warm pool.** A fleet keeps `min_idle` machines (the largest of the fleet's and its
//!   active warm schedules') idle or booting with no job waiting for them. None while the
//!   daily budget is reached.
//! - **Stopped before new.** A fleet starts its stopped machines (most recently stopped first)
//!   before it creates any — except one whose offer and capacity type are skipped now
//!   ([`super::unavailable`]): a stopped machine is pinned to its offer, so a refused start
//!   skips the offer as a failed create does, and the fleet creates on another offer instead
//!   of asking for the same machine every pass.
//! - **`max`** counts every machine that exists and holds GPUs: requested, booting, idle,
//!   busy, draining and stopping. Stopped machines do not count (they hold no GPU and bill only
//!   their disk); starting one counts again. So `max` bounds GPU spend per hour.
//! - **Budget.** When the fleet's spend today (UTC day, handed in) reaches `daily_budget`, no
//!   create and no start until 00:00 UTC. Below it, the machines for jobs are made in queue
//!   order only while spend plus their expected cost (boot or start, and the longest expected
//!   run of their jobs: [`super::budget::machine_usd`]) stays within it; the rest wait, say
//!   why, and no warm machine is made. A repository's budget counts its jobs' expected shares
//!   the same way before one makes demand. Running and idle machines are left to their rules.
//!   A job whose repository's budget is reached ([`super::budget`]) is no demand and claims
//!   no fleet machine until then (the scheduler holds it off them: [`super::budget::all_reached`]);
//!   it says why it waits.
//! - **Capacity.** The policy and the spot breaker give the capacity types in order
//!   ([`CapacityPolicy::order`]); within a type the offers are tried in order, skipping those
//!   marked unavailable (a capacity error, a refusal, a boot failure: [`super::unavailable`])
//!   until their time passes (how long: each offer's back-off, [`super::backoff`], kept by
//!   the caller). When every offer is skipped, the fleet and its waiting jobs say
//!   which of those happened, in the provider's words ([`super::no_offer_reason`]).
//! - **Boot timeout.** A machine requested or booting for `boot_timeout` without its agent
//!   connecting is deleted and counted as a boot failure ([`Action::BootFailed`]); its offer
//!   is then skipped as after a capacity error, so a broken image is not booted in a loop.
//! - **Idle hold.** A machine idle for its hold that no queued job is waiting for is stopped or
//!   deleted (the fleet's idle action), oldest idle first, keeping the warm pool. The hold is
//!   `idle_timeout` when the fleet sets one, else rent or buy from the fleet's recent arrivals
//!   ([`super::idle::idle_hold`]). A machine that runs a job is never stopped or deleted here.
//! - **Stopped hold.** A stopped machine not started this pass is deleted after its hold:
//!   `stopped_timeout`, else rent or buy of its disk against what a restart saves over a boot
//!   ([`super::idle::stopped_hold`]); never, when a stopped machine costs nothing. Both holds
//!   say why in [`FleetSummary::rules`] and in each stop's and delete's reason.
//!
//! Everything is ordered by ids and times, so the same input gives the same decision.
//! [`Decision::wake_at`] says when the answer could change with no new event (a timeout, a
//! schedule edge, an offer coming back, the breaker closing, midnight for a budget), so the
//! reconcile loop (and the simulator) need not poll.
//!
//! Layout: [`decide`] and the matching of queued jobs to the machines that exist are here;
//! `grow` grows and shrinks each fleet and words the reasons.

use super::fanout::UpcomingJob;
use super::idle::FleetHistory;
use super::profile::{learned_warm, LearnedWarm};
use super::unavailable::{offer_unavailable_after_error, SkipCause, UnavailableOffer};
use super::{secs, Capacity, FleetSpec, UnixSecs};
use crate::gpu::{GpuInfo, Version};
use crate::placement::{place, Deadline, GpuSlot, GpuSlotState, HostView, Needs};
use serde::Serialize;
use std::collections::BTreeMap;

mod grow;

use grow::grow_and_shrink;

/// What of a machine's `time_limit` is taken as gone before its agent can take a job (the
/// agent starting, registering): a job must fit in the rest.
pub const MACHINE_START_ALLOWANCE_S: u64 = 60;

/// A job waiting for a GPU.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct QueuedJob {
    pub id: String,
    pub queued_since: UnixSecs,
    pub gpus: u32,
    /// The fleets whose machines it would fit ([`fits`]), in preference order.
    pub fleets: Vec<String>,
    /// `owner/name` of the repository it is for, if any (for repository budgets).
    pub repository: Option<String>,
    /// How long it is expected to run (its step's recent runs: [`super::fanout::StepDurations`]),
    /// for budgets ([`super::budget`]); `None`: not known.
    pub expected_run_s: Option<u64>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum MachineState {
    /// Asked of the provider, not yet known to exist.
    Requested,
    /// Exists (or was started again); its agent has not connected yet.
    Booting,
    /// Agent connected, no job.
    Idle,
    /// Agent connected, runs at least one job.
    Busy,
    Stopping,
    Stopped,
    /// Takes no new job; deleted when its jobs end (the caller's rule).
    Draining,
}

/// A machine of a fleet as observed at the provider and the agent channel.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Machine {
    pub id: String,
    pub fleet: String,
    /// Index into the fleet's offers.
    pub offer: usize,
    pub capacity: Capacity,
    pub state: MachineState,
    pub created_at: UnixSecs,
    /// When it entered `state`: requested or started, connected or last job ended, stopped.
    pub since: UnixSecs,
    /// GPUs leased to the jobs it runs.
    pub gpus_busy: u32,
    pub jobs: Vec<String>,
    /// What its provider says of it, for people: why a booting machine waits (a Slurm job's
    /// pending reason, a pod that cannot be scheduled).
    pub note: Option<String>,
}

impl Machine {
    /// Whether it counts toward the fleet's `max` (see the module header).
    pub fn counts_toward_max(&self) -> bool {
        self.state != MachineState::Stopped
    }

    fn is_booting(&self) -> bool {
        matches!(self.state, MachineState::Requested | MachineState::Booting)
    }

    fn runs_jobs(&self) -> bool {
        self.gpus_busy > 0 || !self.jobs.is_empty()
    }
}

/// What the caller observed, handed in.
#[derive(Clone, Copy, Debug)]
pub struct AutoscaleInput<'a> {
    pub now: UnixSecs,
    pub fleets: &'a [FleetSpec],
    pub queued: &'a [QueuedJob],
    pub machines: &'a [Machine],
    /// USD spent today (UTC) per fleet; a fleet not named has spent nothing.
    pub spend_today: &'a BTreeMap<String, f64>,
    /// `[[budget]]`s, and USD spent today (UTC) per repository (its jobs' shares).
    pub budgets: &'a [super::RepoBudget],
    pub repo_spend_today: &'a BTreeMap<String, f64>,
    pub unavailable: &'a [UnavailableOffer],
    /// Times of recent spot interruptions per fleet (any order; older than the breaker's
    /// window plus its on-demand period may be dropped by the caller).
    pub interruptions: &'a BTreeMap<String, Vec<UnixSecs>>,
    /// What the idle rules remember per fleet (arrivals, boot and start times): see
    /// [`super::idle`]. A fleet not named has no history (the rules' defaults).
    pub history: &'a BTreeMap<String, FleetHistory>,
    /// GPU jobs not queued yet, with when they are expected to be ([`super::fanout`]): demand
    /// once that is within one boot time of their fleet.
    pub upcoming: &'a [UpcomingJob],
}

#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(tag = "action", rename_all = "snake_case")]
pub enum Action {
    Create {
        fleet: String,
        offer: usize,
        capacity: Capacity,
        reason: String,
    },
    Start {
        machine: String,
        reason: String,
    },
    Stop {
        machine: String,
        reason: String,
    },
    Delete {
        machine: String,
        reason: String,
    },
    /// Its agent did not connect within `boot_timeout`: delete it and count a boot failure.
    BootFailed {
        machine: String,
        reason: String,
    },
}

/// One fleet after the decision.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct FleetSummary {
    pub fleet: String,
    /// Machines counting toward `max` before the actions.
    pub machines: u32,
    /// Machines counting toward `max` the fleet wants (what exists and stays, plus what this
    /// decision starts or creates).
    pub wanted: u32,
    pub why: String,
    pub breaker_open_until: Option<UnixSecs>,
    pub budget_reached: bool,
    /// How long idle and stopped machines are kept now, and why ([`super::idle`]), for
    /// `gpuci fleets`.
    pub rules: Vec<String>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Decision {
    pub actions: Vec<Action>,
    pub fleets: Vec<FleetSummary>,
    /// Queued job id → why it waits, in words.
    pub waiting: BTreeMap<String, String>,
    /// When to decide again even if nothing happens (strictly after `now`).
    pub wake_at: Option<UnixSecs>,
}

/// Until when the spot breaker is open at `now`, if it is: after `interruptions` spot
/// interruptions within `window_s`, on-demand only for `on_demand_for_s` after the last of
/// them.
pub fn breaker_open_until(spec: &FleetSpec, interruptions: &[UnixSecs], now: UnixSecs) -> Option<UnixSecs> {
    let b = spec.spot_breaker;
    let n = b.interruptions.max(1) as usize;
    let mut times: Vec<UnixSecs> = interruptions.iter().copied().filter(|&t| t <= now).collect();
    times.sort_unstable();
    let mut until = None;
    let mut first = 0;
    for (k, &t) in times.iter().enumerate() {
        while times[first] + b.window_s <= t {
            first += 1;
        }
        if k + 1 - first >= n {
            until = Some(t + b.on_demand_for_s);
        }
    }
    until.filter(|&u| u > now)
}

/// Whether a job with `needs` would fit a machine of this fleet, by placement on a template
/// host built from the machine spec. What the spec does not say (compute capability when not
/// given, driver and CUDA versions: the image decides them) is assumed to fit; the agent's real
/// inventory decides at placement. MIG is never assumed.
pub fn fits(spec: &FleetSpec, needs: &Needs<'_>) -> bool {
    let (host, gpu) = template(spec, needs);
    let deadline = needs.deadline.map(|d| Deadline { now_ms: 0, ..d });
    let template = Needs { tags: needs.tags, gpu: &gpu, container: needs.container, deadline };
    place(&template, std::slice::from_ref(&host)).is_ok()
}

/// The host a machine of `spec` will register as, free, with its clock at 0 (its `time_limit`
/// counted from its start), and the job's GPU requirement less what the spec cannot say.
/// Shared by [`fits`] and [`super::fit::why_not`], so "fits" and "why not" never disagree.
pub(super) fn template(spec: &FleetSpec, needs: &Needs<'_>) -> (HostView, crate::gpu::GpuRequirements) {
    let m = &spec.machine;
    let mut gpu = needs.gpu.clone();
    if m.compute_capability.is_none() {
        gpu.compute_capability = None;
    }
    gpu.driver = None;
    gpu.cuda = None;
    let gpus = (0..m.gpus)
        .map(|i| GpuSlot {
            info: GpuInfo {
                uuid: format!("template-{i}"),
                index: i,
                name: m.gpu_model.clone(),
                memory: m.gpu_memory,
                compute_capability: m
                    .compute_capability
                    .unwrap_or(crate::gpu::ComputeCapability { major: 0, minor: 0 }),
                driver_version: Version::new(vec![0]),
                cuda_driver_version: None,
                mig_enabled: None,
                mig_instances: Vec::new(),
                ecc_enabled: None,
                persistence_mode: None,
                pci_bus_id: String::new(),
                device_node: String::new(),
                simulated: true,
            },
            state: GpuSlotState::Free,
        })
        .collect();
    let host = HostView {
        agent_id: format!("template-{}", spec.name),
        name: spec.name.clone(),
        tags: m.tags.clone(),
        free_slots: m.gpus.max(1),
        total_slots: m.gpus.max(1),
        container_runtime: m.container_runtime,
        gpus,
        // A machine that lives `time_limit` (a Slurm allocation) is no use to a job that may
        // run longer: counted as demand, it would be made, take nothing and be deleted, over
        // and over.
        ends_at_ms: m.time_limit_s.map(|t| (t.saturating_sub(MACHINE_START_ALLOWANCE_S) * 1000) as i64),
        refuses: None,
    };
    (host, gpu)
}

/// Decide what to do now. See the module header for the rules.
pub fn decide(input: &AutoscaleInput<'_>) -> Decision {
    let now = input.now;
    let mut out = Decision::default();
    let fleet_index: BTreeMap<&str, usize> =
        input.fleets.iter().enumerate().map(|(i, f)| (f.name.as_str(), i)).collect();
    let mut order: Vec<usize> = (0..input.machines.len()).collect();
    order.sort_by(|&a, &b| input.machines[a].id.cmp(&input.machines[b].id));

    // A machine that did not boot in time makes its offer unavailable as a capacity error
    // does: the next one of that offer would likely not boot either (a broken image, a wrong
    // network), and booting it again in a loop pays for every try.
    let mut unavailable = input.unavailable.to_vec();
    for m in input.machines.iter().filter(|m| m.is_booting()) {
        let Some(&f) = fleet_index.get(m.fleet.as_str()) else { continue };
        if now >= m.since.saturating_add(input.fleets[f].boot_timeout_s) {
            // Worded as the coordinator words the skip it records when it carries out the
            // action, so the reason does not change between this pass and the next.
            let why = format!("machine {}: {}", m.id, boot_timeout_reason(&input.fleets[f], m, now));
            unavailable.push(
                offer_unavailable_after_error(&m.fleet, m.offer, m.capacity, now).because(SkipCause::BootFailed, why),
            );
        }
    }
    let input = &AutoscaleInput { unavailable: &unavailable, ..*input };
    // Upcoming jobs within one boot time of their fleet, as queued jobs that will be (their
    // `queued_since` is when they are expected): machines for them are asked for now.
    let (ahead, ahead_wake) = super::fanout::within_lead(input, &fleet_index);
    let ahead_ids: std::collections::BTreeSet<&str> = ahead.iter().map(|j| j.id.as_str()).collect();
    let mut fleets: Vec<FleetWork> = input.fleets.iter().map(|spec| FleetWork::new(spec, input)).collect();
    let mut wake = Wake(None);
    if let Some(t) = ahead_wake {
        wake.at(t);
    }

    // Boot timeouts, and the supply of GPUs on machines that exist.
    for &i in &order {
        let m = &input.machines[i];
        let Some(&f) = fleet_index.get(m.fleet.as_str()) else { continue };
        let w = &mut fleets[f];
        let spec = &input.fleets[f];
        if m.counts_toward_max() {
            w.counted += 1;
        }
        if m.is_booting() {
            let deadline = m.since.saturating_add(spec.boot_timeout_s);
            if now >= deadline {
                out.actions
                    .push(Action::BootFailed { machine: m.id.clone(), reason: boot_timeout_reason(spec, m, now) });
                w.counted -= 1;
                continue;
            }
            wake.at(deadline);
        }
        let free = spec.machine.gpus.saturating_sub(m.gpus_busy);
        match m.state {
            MachineState::Idle | MachineState::Busy if free > 0 => {
                w.slots.push(Slot { machine: i, free, claimed: false })
            }
            MachineState::Requested | MachineState::Booting if free > 0 => {
                w.booting.push(Slot { machine: i, free, claimed: false })
            }
            // A stopped machine is pinned to its offer (an EC2 instance to its zone and type): while
            // that offer is skipped (its start or a create was refused for want of capacity) it
            // is not started again every pass; the fleet creates on another offer instead.
            MachineState::Stopped if w.skips(m.offer, m.capacity) => w.held.push(i),
            MachineState::Stopped => w.stopped.push(i),
            _ => {}
        }
    }
    for w in &mut fleets {
        // Booting machines in the order they will likely connect.
        w.booting.sort_by_key(|s| (input.machines[s.machine].since, s.machine));
        for list in [&mut w.stopped, &mut w.held] {
            list.sort_by(|&a, &b| {
                let (ma, mb) = (&input.machines[a], &input.machines[b]);
                mb.since.cmp(&ma.since).then_with(|| ma.id.cmp(&mb.id))
            });
        }
        w.can_grow = w.blocked.is_none() && w.counted < w.max && (w.offer.is_some() || !w.stopped.is_empty());
    }

    // Match queued jobs to existing machines; the rest is demand.
    let mut pending: BTreeMap<String, (f64, usize)> = BTreeMap::new();
    let mut jobs: Vec<&QueuedJob> = input.queued.iter().collect();
    jobs.sort_by(|a, b| a.queued_since.cmp(&b.queued_since).then_with(|| a.id.cmp(&b.id)));
    for job in jobs {
        let candidates: Vec<usize> = job
            .fleets
            .iter()
            .filter_map(|n| fleet_index.get(n.as_str()).copied())
            .filter(|&f| input.fleets[f].machine.gpus >= job.gpus)
            .collect();
        if candidates.is_empty() {
            let reason = format!("no fleet has a machine that fits this job ({} GPUs)", job.gpus);
            out.waiting.insert(job.id.clone(), reason);
            continue;
        }
        // A repository past its budget runs on no fleet machine until midnight: it neither
        // takes free GPUs on one (the scheduler holds it off them too) nor makes one.
        if let Some(r) = job
            .repository
            .as_deref()
            .and_then(|repo| super::budget::reached(input.budgets, input.repo_spend_today, repo))
        {
            out.waiting.insert(job.id.clone(), r.reason());
            wake.at(next_utc_midnight(now));
            continue;
        }
        let mut placed = false;
        for &f in &candidates {
            if let Some(reason) = fleets[f].claim(job, input, now) {
                out.waiting.insert(job.id.clone(), reason);
                placed = true;
                break;
            }
        }
        if !placed {
            let f = candidates.iter().copied().find(|&f| fleets[f].can_grow).unwrap_or(candidates[0]);
            // A machine made for it would be paid by its repository's budget too: counted
            // with what this pass gave the repository's other jobs before it is asked for.
            if let Some(e) = repo_budget_would_pass(job, &input.fleets[f], input, &mut pending) {
                out.waiting.insert(job.id.clone(), e.reason());
                wake.at(next_utc_midnight(now));
                continue;
            }
            fleets[f].demand.push(job);
        }
    }
    // Then the jobs expected within a boot (after every queued one: they take what is left).
    for job in &ahead {
        let candidates: Vec<usize> = job
            .fleets
            .iter()
            .filter_map(|n| fleet_index.get(n.as_str()).copied())
            .filter(|&f| input.fleets[f].machine.gpus >= job.gpus)
            .collect();
        let Some(&first) = candidates.first() else { continue };
        if job
            .repository
            .as_deref()
            .and_then(|repo| super::budget::reached(input.budgets, input.repo_spend_today, repo))
            .is_some()
        {
            continue;
        }
        if let Some(f) = candidates.iter().copied().find(|&f| fleets[f].claim(job, input, now).is_some()) {
            fleets[f].ahead += 1;
            continue;
        }
        let f = candidates.iter().copied().find(|&f| fleets[f].can_grow).unwrap_or(first);
        if repo_budget_would_pass(job, &input.fleets[f], input, &mut pending).is_some() {
            continue;
        }
        fleets[f].ahead += 1;
        fleets[f].demand.push(job);
    }

    // Per fleet: grow, then shrink.
    for (f, spec) in input.fleets.iter().enumerate() {
        let w = &mut fleets[f];
        let summary = grow_and_shrink(spec, w, input, &ahead_ids, &mut out, &mut wake);
        out.fleets.push(summary);
    }
    out.wake_at = wake.0;
    out
}

/// A machine with free GPUs that queued jobs may claim.
struct Slot {
    machine: usize,
    free: u32,
    claimed: bool,
}

/// Why a fleet cannot create or start machines now.
enum Blocked {
    Budget { budget: f64, spent: f64 },
    SpotOnlyBreaker { until: UnixSecs },
}

struct FleetWork<'a> {
    counted: u32,
    max: u32,
    slots: Vec<Slot>,
    booting: Vec<Slot>,
    /// Stopped machines that may be started now, most recently stopped first.
    stopped: Vec<usize>,
    /// Stopped machines whose offer is skipped now: not started (see `decide`).
    held: Vec<usize>,
    demand: Vec<&'a QueuedJob>,
    blocked: Option<Blocked>,
    breaker_until: Option<UnixSecs>,
    /// The offer and capacity a create would use now, or why none.
    offer: Option<(usize, Capacity)>,
    no_offer_until: Option<UnixSecs>,
    /// Per offer and capacity type tried before `offer` (all of them when none), the skip that
    /// holds it back longest.
    skipped: Vec<UnavailableOffer>,
    /// Every offer and capacity type of the fleet skipped now.
    unavailable: Vec<(usize, Capacity)>,
    can_grow: bool,
    warm_target: u32,
    /// Upcoming jobs counted on this fleet (on a spare machine or as demand).
    ahead: u32,
    /// The warm pool the arrival profile asks for now (none under an active schedule).
    learned: Option<LearnedWarm>,
}

impl<'a> FleetWork<'a> {
    fn new(spec: &FleetSpec, input: &AutoscaleInput<'a>) -> FleetWork<'a> {
        let now = input.now;
        let times = input.interruptions.get(&spec.name).map_or(&[][..], Vec::as_slice);
        let breaker_until = breaker_open_until(spec, times, now);
        let spent = input.spend_today.get(&spec.name).copied().unwrap_or(0.0);
        let blocked = match spec.daily_budget {
            Some(budget) if spent >= budget => Some(Blocked::Budget { budget, spent }),
            _ => match breaker_until {
                Some(until) if spec.capacity.order(true).is_empty() => Some(Blocked::SpotOnlyBreaker { until }),
                _ => None,
            },
        };
        let mut offer = None;
        let mut no_offer_until: Option<UnixSecs> = None;
        let mut skipped = Vec::new();
        'outer: for &cap in spec.capacity.order(breaker_until.is_some()) {
            for o in 0..spec.offers.len() {
                // The latest of several skips of one offer holds it back (and is said).
                let longest = input
                    .unavailable
                    .iter()
                    .filter(|u| u.fleet == spec.name && u.offer == o && u.capacity == cap && u.until > now)
                    .fold(None::<&UnavailableOffer>, |best, u| match best {
                        Some(b) if b.until > u.until => Some(b),
                        _ => Some(u),
                    });
                match longest {
                    None => {
                        offer = Some((o, cap));
                        break 'outer;
                    }
                    Some(u) => {
                        no_offer_until = Some(no_offer_until.map_or(u.until, |n| n.min(u.until)));
                        skipped.push(u.clone());
                    }
                }
            }
        }
        // An active `[[fleet.warm]]` schedule is the operator's word; outside one the profile
        // learned from the fleet's arrivals may ask for more than `min_idle`.
        let history = input.history.get(&spec.name);
        let scheduled = spec.warm.iter().any(|w| w.active_at(now));
        let learned = match (scheduled, history.and_then(|h| h.profile.as_ref())) {
            (false, Some(p)) => {
                learned_warm(p, now, boot_s(history), super::idle::idle_buy_s(spec, history).0, spec.max)
            }
            _ => None,
        };
        let warm_target = if matches!(blocked, Some(Blocked::Budget { .. })) { 0 } else { spec.min_idle_at(now) };
        FleetWork {
            counted: 0,
            max: spec.max,
            slots: Vec::new(),
            booting: Vec::new(),
            stopped: Vec::new(),
            held: Vec::new(),
            demand: Vec::new(),
            blocked,
            breaker_until,
            offer,
            no_offer_until,
            skipped,
            unavailable: input
                .unavailable
                .iter()
                .filter(|u| u.fleet == spec.name && u.until > now)
                .map(|u| (u.offer, u.capacity))
                .collect(),
            can_grow: false,
            warm_target,
            ahead: 0,
            learned,
        }
    }

    /// Whether offer `o` at `cap` is skipped now (unavailable after an error).
    fn skips(&self, o: usize, cap: Capacity) -> bool {
        self.unavailable.iter().any(|&(uo, ucap)| uo == o && ucap == cap)
    }

    /// Give `job` free GPUs on a connected machine, else a booting one; the waiting reason.
    fn claim(&mut self, job: &QueuedJob, input: &AutoscaleInput<'_>, now: UnixSecs) -> Option<String> {
        for (list, connected) in [(&mut self.slots, true), (&mut self.booting, false)] {
            if let Some(s) = list.iter_mut().find(|s| s.free >= job.gpus) {
                s.free -= job.gpus;
                s.claimed = true;
                let m = &input.machines[s.machine];
                return Some(if connected {
                    format!("machine {} of fleet {} has free GPUs; waiting for the scheduler", m.id, m.fleet)
                } else {
                    format!(
                        "waiting for machine {} of fleet {} (booting, {}{})",
                        m.id,
                        m.fleet,
                        secs(now.saturating_sub(m.since)),
                        m.note.as_deref().map(|n| format!(": {n}")).unwrap_or_default()
                    )
                });
            }
        }
        None
    }
}

/// The fleet's boot time: what it has seen, else the default.
pub(super) fn boot_s(h: Option<&FleetHistory>) -> u64 {
    h.and_then(|h| h.boot_s).unwrap_or(super::idle::DEFAULT_BOOT_S)
}

/// How long `job` is expected to run on a machine of `spec`: its own expected run, else the
/// fleet's mean work per job (machine-seconds, as a whole machine's: scaled to the job's
/// share); `None`: nothing known, and then nothing is expected of it (a budget judges it by
/// spend alone, as before: the first run of a step is not held back on a guess).
fn expected_run_s(job: &QueuedJob, spec: &FleetSpec, history: Option<&FleetHistory>) -> Option<u64> {
    job.expected_run_s.or_else(|| {
        let work = history?.profile.as_ref()?.mean_work_s()?;
        let share = f64::from(job.gpus.max(1)) / f64::from(spec.machine.gpus.max(1));
        Some((work / share.min(1.0)).round() as u64)
    })
}

/// The price per hour a machine of `spec` is bought at now: the offer a create would use, else
/// the first offer on-demand.
fn price_now(spec: &FleetSpec, offer: Option<(usize, Capacity)>) -> f64 {
    match offer {
        Some((o, cap)) => spec.offers.get(o).map_or(0.0, |x| x.price(cap)),
        None => spec.offers.first().map_or(0.0, |x| x.price_per_hour),
    }
}

/// The repository budget `job`'s expected share on a new machine of `spec` would pass, if any;
/// else its cost is added to what this pass admitted for its repository (`pending`).
fn repo_budget_would_pass(
    job: &QueuedJob,
    spec: &FleetSpec,
    input: &AutoscaleInput<'_>,
    pending: &mut BTreeMap<String, (f64, usize)>,
) -> Option<super::budget::Expected> {
    let repo = job.repository.as_deref()?;
    if input.budgets.is_empty() {
        return None;
    }
    let run = expected_run_s(job, spec, input.history.get(&spec.name))?;
    let cost = super::budget::job_usd(price_now(spec, None), job.gpus, spec.machine.gpus, run);
    if let Some(e) = super::budget::would_pass(input.budgets, input.repo_spend_today, pending, repo, cost) {
        return Some(e);
    }
    let p = pending.entry(repo.to_string()).or_insert((0.0, 0));
    *p = (p.0 + cost, p.1 + 1);
    None
}

/// Why a booting machine is given up: its agent did not connect in time.
fn boot_timeout_reason(spec: &FleetSpec, m: &Machine, now: UnixSecs) -> String {
    format!(
        "agent did not connect within boot_timeout {} ({} booting)",
        secs(spec.boot_timeout_s),
        secs(now.saturating_sub(m.since))
    )
}

/// The earliest of the times offered that lies after now.
struct Wake(Option<UnixSecs>);

impl Wake {
    fn at(&mut self, t: UnixSecs) {
        self.0 = Some(self.0.map_or(t, |w| w.min(t)));
    }
}

fn next_utc_midnight(now: UnixSecs) -> UnixSecs {
    (now / 86_400 + 1) * 86_400
}
