//! The event-driven simulation of one policy over one trace.
//!
//! A binary heap of timed events (job submitted, finished, cancelled; machine ready, stopped,
//! interrupted; autoscaler wake-up) drives a simulated clock in whole seconds. After every
//! instant's events the coordinator's part is played: queued jobs are placed first-in
//! first-out on connected machines with free GPUs (best fit), then the autoscaler
//! ([`gpuci_core::fleet::decide`]) is asked what to do, and its actions are applied to the
//! simulated provider. `decide` says when it wants to look again (`wake_at`), so nothing ticks;
//! after a request the provider refused, the next look is one reconcile interval later
//! ([`RECONCILE_S`]), as the coordinator's loop would retry.
//!
//! Billing: a machine is billed per second from its create (or start) to its delete (or the
//! end of its stop) at its offer's price for its capacity type. Its disk is billed from its
//! create to its delete, running or stopped, at its offer's disk price; the stopped part is
//! counted apart. The run ends when the last job has ended; machines still billed then are
//! billed up to that moment.
//!
//! Capacity: each offer and capacity type has outages in time ([`crate::profile`]); a create or
//! a start during one fails with a capacity error, and so does one that draws the offer's
//! `capacity_error_rate`. Either way the autoscaler sees what the coordinator records after a
//! failed create: the offer skipped for as long as its back-off says
//! ([`gpuci_core::fleet::backoff`]: from 15 s, doubling per refusal in a row, reset by a
//! success), kept per run as the coordinator keeps it; a stopped machine that could not start
//! stays stopped.
//!
//! Layout: this file holds the event loop and the jobs' side; `autoscaling` plays the fleets
//! loop (ask `decide`, apply its actions).

use crate::bounds::cancel_times;
use crate::profile::{Dist, OfferSim, SimProfile};
use crate::rng::Rng;
use crate::trace::TraceJob;
use gpuci_core::fleet::{
    idle, ArrivalProfile, Backoffs, Capacity, FleetHistory, FleetSpec, Machine, MachineState, QueuedJob,
    UnavailableOffer, UnixSecs,
};
use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap};

mod autoscaling;

/// How machines are managed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Policy {
    /// gpuci's autoscaler with each fleet's own settings (warm pool, schedules, idle action).
    Gpuci,
    /// Enough on-demand machines for the trace's peak (at most the fleet's `max`), running
    /// from start to end.
    AlwaysOn,
    /// Scale from demand, delete after 5 minutes idle, no warm pool, no schedules, no stop:
    /// what the AWS github-runner module and ARC do.
    #[serde(rename = "fixed-idle-5m")]
    FixedIdle5m,
    /// Per fleet, the best fixed idle timeout in hindsight: every timeout of a grid is run
    /// (delete after idle, no warm pool), and each fleet takes the cheapest that meets the wait
    /// goal (else the one with the lowest p95 wait). What a user could tune, knowing the trace.
    BestFixedIdle,
    /// Per fleet, the best fixed pair of timeouts in hindsight for the stopped tier: stop after
    /// an idle timeout, delete after a stopped timeout (every pair of a grid, no warm pool;
    /// fleets that cannot stop delete after the idle timeout). Chosen as best-fixed-idle is.
    /// What a user who knows the stopped tier could tune, knowing the trace.
    BestFixedStop,
}

impl Policy {
    pub const ALL: [Policy; 5] =
        [Policy::Gpuci, Policy::AlwaysOn, Policy::FixedIdle5m, Policy::BestFixedIdle, Policy::BestFixedStop];

    pub fn as_str(self) -> &'static str {
        match self {
            Policy::Gpuci => "gpuci",
            Policy::AlwaysOn => "always-on",
            Policy::FixedIdle5m => "fixed-idle-5m",
            Policy::BestFixedIdle => "best-fixed-idle",
            Policy::BestFixedStop => "best-fixed-stop",
        }
    }

    pub fn parse(s: &str) -> Option<Policy> {
        Policy::ALL.into_iter().find(|p| p.as_str() == s)
    }
}

/// What one engine run does with machines.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// `decide` with each fleet's settings.
    Decide,
    /// The peak number of machines (at most `max`), on-demand, from start to end.
    AlwaysOn,
    /// `decide` with no warm pool, no schedules, delete after this many seconds idle.
    FixedIdle(u64),
    /// `decide` with no warm pool and no schedules: stop after `idle_s` idle and delete after
    /// `stopped_s` stopped, on fleets whose provider can stop (else delete after `idle_s`).
    FixedStop { idle_s: u64, stopped_s: u64 },
}

/// A run stops this long after the trace's last job would have ended with no wait, whatever
/// is still queued: a policy that never gets a machine (a stopped machine whose start always
/// fails) would otherwise retry for ever.
pub const GIVE_UP_AFTER_S: u64 = 7 * 86_400;

/// The coordinator's fleet reconcile interval (`fleet_interval`, 5 s by default): how soon
/// it asks again after the provider refused a create or a start.
pub const RECONCILE_S: u64 = 5;

/// Counters of one fleet in one run.
#[derive(Clone, Debug, Default)]
pub struct Tally {
    pub jobs: u32,
    pub cancelled: u32,
    pub reruns: u32,
    pub paid_gpu_s: f64,
    pub cost_usd: f64,
    pub ran_gpu_s: f64,
    /// Disks, running and stopped.
    pub disk_usd: f64,
    /// The part of `disk_usd` while stopped.
    pub stopped_disk_usd: f64,
    /// `stopped_disk_usd` in GPU-seconds at the fleet's price per GPU-second (its first
    /// offer, on-demand): what the same money buys of the fleet's GPUs.
    pub stopped_disk_gpu_s: f64,
    /// Machine-seconds stopped.
    pub stopped_s: f64,
    /// Seconds each start of a job waited in the queue (a rerun waits from its interruption).
    pub waits: Vec<u64>,
    /// The same waits less the seconds every machine the fleet's `max` allows was busy with
    /// other jobs (a wait the config causes, which always-on within `max` pays too).
    pub waits_own: Vec<u64>,
    pub launched: u32,
    pub boots: u32,
    pub starts: u32,
    pub boot_failures: u32,
    pub interruptions: u32,
    /// Creates refused for want of capacity.
    pub capacity_errors: u32,
    /// Starts of stopped machines refused for want of capacity.
    pub start_capacity_errors: u32,
    /// Jobs still queued or running when the run ended (see [`GIVE_UP_AFTER_S`]).
    pub unfinished: u32,
}

pub struct Outcome {
    pub tallies: Vec<Tally>,
    /// Seconds from the trace's start to the end of its last job.
    pub horizon_s: u64,
    pub unserved: usize,
}

/// Events, in the order they apply within one second: a job that ends frees its GPUs before
/// a cancel or an interruption looks at it, and before new jobs arrive.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Ev {
    Finish { job: usize, attempt: u32 },
    Cancel { job: usize },
    Interrupt { machine: u64, epoch: u32 },
    Stopped { machine: u64, epoch: u32 },
    Ready { machine: u64, epoch: u32 },
    Submit { job: usize },
    Wake,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum JobState {
    Pending,
    /// Submitted, waiting on other jobs ([`crate::pipelines`]).
    Blocked,
    Queued,
    /// A job that needs no GPU, running off the fleets.
    Off {
        start: UnixSecs,
    },
    Running {
        machine: u64,
        start: UnixSecs,
    },
    Done,
}

struct Job {
    state: JobState,
    attempt: u32,
    queued_at: UnixSecs,
    /// Of its wait so far, the seconds its fleet was at `max` with every machine busy.
    at_max_s: u64,
}

/// What the simulator knows of a machine beyond what `decide` sees.
struct Extra {
    num: u64,
    fleet: usize,
    /// Bumped on each state change that makes pending events about it stale.
    epoch: u32,
    billed_from: Option<UnixSecs>,
    price_per_hour: f64,
    gpus: u32,
    /// Its disk: billed from here to its delete.
    exists_from: UnixSecs,
    stopped_from: Option<UnixSecs>,
    disk_usd_per_hour: f64,
    /// Its current boot is the start of a stopped machine (not a fresh create).
    starting: bool,
}

/// Capacity outages of one offer and capacity type, drawn in time from their own random
/// stream, so every policy run with one seed meets the same ones.
struct Outages {
    rng: Rng,
    per_s: f64,
    length: Dist,
    /// The current or next outage, `[from, to)`.
    next: (UnixSecs, UnixSecs),
    /// Known outages, `[from, to)`, unix seconds.
    windows: Vec<(UnixSecs, UnixSecs)>,
}

impl Outages {
    fn new(rng: Rng, per_day: f64, length: Dist, start: UnixSecs, windows: Vec<(UnixSecs, UnixSecs)>) -> Outages {
        let mut o = Outages { rng, per_s: per_day / 86_400.0, length, next: (0, 0), windows };
        o.next = o.draw(start);
        o
    }

    fn draw(&mut self, after: UnixSecs) -> (UnixSecs, UnixSecs) {
        let gap = self.rng.exp(self.per_s);
        if !(gap.is_finite() && gap < 1e15) {
            return (UnixSecs::MAX, UnixSecs::MAX);
        }
        let from = after.saturating_add(gap.ceil() as u64);
        (from, from.saturating_add(self.length.sample(&mut self.rng)))
    }

    /// Whether the offer has no capacity at `t` (asked with `t` never going back).
    fn out_at(&mut self, t: UnixSecs) -> bool {
        while self.next.1 <= t {
            self.next = self.draw(self.next.1);
        }
        self.next.0 <= t || self.windows.iter().any(|&(a, b)| a <= t && t < b)
    }
}

pub struct Engine<'a> {
    fleets: Vec<FleetSpec>,
    profiles: Vec<SimProfile>,
    trace: &'a [TraceJob],
    job_fleet: Vec<Option<usize>>,
    jobs: Vec<Job>,
    heap: BinaryHeap<Reverse<(UnixSecs, Ev)>>,
    wakes: BTreeSet<UnixSecs>,
    live: Vec<Machine>,
    extra: Vec<Extra>,
    queue: Vec<QueuedJob>,
    queue_jobs: Vec<usize>,
    /// Per fleet: every machine `max` allows busy, as of the last event ([`Engine::note_at_max`]).
    at_max: Vec<bool>,
    unavailable: Vec<UnavailableOffer>,
    /// Each offer's refusals in a row: how long the next skip is.
    backoffs: Backoffs,
    interruptions: BTreeMap<String, Vec<UnixSecs>>,
    /// What the idle rules remember, as the coordinator keeps it: arrivals, boot and start
    /// times seen (sums and counts by fleet, `[boot, start]`).
    history: BTreeMap<String, FleetHistory>,
    seen_boots: Vec<[(u64, u64); 2]>,
    spend: BTreeMap<String, f64>,
    closed_today: Vec<f64>,
    day: u64,
    any_budget: bool,
    rng_boot: Vec<Rng>,
    rng_spot: Vec<Rng>,
    rng_capacity: Vec<Rng>,
    /// By fleet, offer: each offer's behaviour, and its outages by capacity type
    /// (`[on-demand, spot]`).
    offers: Vec<Vec<OfferSim>>,
    outages: Vec<Vec<[Outages; 2]>>,
    /// By fleet: GPU-seconds per USD at the fleet's first offer's on-demand price (0 when free).
    gpu_s_per_usd: Vec<f64>,
    tally: Vec<Tally>,
    next_machine: u64,
    now: UnixSecs,
    remaining: usize,
    /// By fleet: its jobs not yet done. A fleet whose jobs are all done has its machines
    /// closed then (billed to its own last job's end, as the floor is) and makes no more:
    /// one fleet's figures do not depend on another fleet's jobs.
    left: Vec<usize>,
    /// By fleet: closed, as `left` says.
    closed: Vec<bool>,
    mode: Mode,
    /// Jobs that wait on others, and the steps' run times.
    pipelines: crate::pipelines::Deps,
    /// Jobs no fleet can serve (counted when they would have been queued).
    unserved: usize,
}

impl<'a> Engine<'a> {
    /// `epoch` is the unix time of the trace's second 0 (warm schedules and budget days are
    /// read from it).
    pub fn new(
        fleets: &[FleetSpec],
        profiles: Vec<SimProfile>,
        trace: &'a [TraceJob],
        mode: Mode,
        seed: u64,
        epoch: UnixSecs,
    ) -> Engine<'a> {
        let fleets: Vec<FleetSpec> = fleets.iter().map(|f| adjust(f, mode)).collect();
        let by_name: BTreeMap<&str, usize> = fleets.iter().enumerate().map(|(i, f)| (f.name.as_str(), i)).collect();
        let job_fleet: Vec<Option<usize>> = trace
            .iter()
            .map(|j| by_name.get(j.pool.as_str()).copied().filter(|&f| j.gpus > 0 && fleets[f].machine.gpus >= j.gpus))
            .collect();
        let root = Rng::new(seed);
        let n = fleets.len() as u64;
        let offers: Vec<Vec<OfferSim>> =
            fleets.iter().zip(&profiles).map(|(f, p)| (0..f.offers.len()).map(|o| p.offer(f, o)).collect()).collect();
        // Streams of their own, numbered apart from the others', so outages do not shift the
        // boot, spot and capacity draws (nor those of another offer).
        let outages = offers
            .iter()
            .zip(&profiles)
            .enumerate()
            .map(|(f, (sims, p))| {
                sims.iter()
                    .enumerate()
                    .map(|(o, sim)| {
                        let windows: Vec<(UnixSecs, UnixSecs)> =
                            sim.outage_windows.iter().map(|&(a, b)| (epoch + a, epoch + b)).collect();
                        let stream = |cap: u64| root.fork((1 << 32) | ((f as u64) << 16) | ((o as u64) << 1) | cap);
                        [
                            Outages::new(stream(0), sim.outages_per_day[0], p.capacity_outage, epoch, windows.clone()),
                            Outages::new(stream(1), sim.outages_per_day[1], p.capacity_outage, epoch, windows),
                        ]
                    })
                    .collect()
            })
            .collect();
        let gpu_s_per_usd = fleets
            .iter()
            .map(|f| {
                let per_gpu_s =
                    f.offers.first().map_or(0.0, |o| o.price_per_hour) / 3600.0 / f64::from(f.machine.gpus.max(1));
                if per_gpu_s > 0.0 {
                    1.0 / per_gpu_s
                } else {
                    0.0
                }
            })
            .collect();
        // The gpuci policy learns its arrival profile from the trace as it goes (never ahead);
        // the baselines learn nothing.
        let history = fleets
            .iter()
            .map(|f| {
                let profile = (mode == Mode::Decide).then(|| ArrivalProfile::new(epoch));
                (f.name.clone(), FleetHistory { profile, ..FleetHistory::default() })
            })
            .collect();
        let mut e = Engine {
            offers,
            outages,
            gpu_s_per_usd,
            any_budget: fleets.iter().any(|f| f.daily_budget.is_some()),
            closed_today: vec![0.0; fleets.len()],
            rng_boot: (0..n).map(|i| root.fork(3 * i + 1)).collect(),
            rng_spot: (0..n).map(|i| root.fork(3 * i + 2)).collect(),
            rng_capacity: (0..n).map(|i| root.fork(3 * i + 3)).collect(),
            tally: vec![Tally::default(); fleets.len()],
            fleets,
            profiles,
            trace,
            job_fleet,
            jobs: trace
                .iter()
                .map(|_| Job { state: JobState::Pending, attempt: 0, queued_at: 0, at_max_s: 0 })
                .collect(),
            heap: BinaryHeap::with_capacity(trace.len() * 2),
            wakes: BTreeSet::new(),
            live: Vec::new(),
            extra: Vec::new(),
            queue: Vec::new(),
            queue_jobs: Vec::new(),
            at_max: Vec::new(),
            unavailable: Vec::new(),
            backoffs: Backoffs::default(),
            interruptions: BTreeMap::new(),
            history,
            seen_boots: vec![[(0, 0); 2]; n as usize],
            spend: BTreeMap::new(),
            day: epoch / 86_400,
            next_machine: 1,
            now: epoch,
            remaining: trace.len(),
            left: vec![0; n as usize],
            closed: vec![false; n as usize],
            mode,
            pipelines: crate::pipelines::Deps::new(trace),
            unserved: 0,
        };
        for f in e.job_fleet.iter().flatten() {
            e.left[*f] += 1;
        }
        for (i, (j, cancel)) in trace.iter().zip(cancel_times(trace)).enumerate() {
            e.push(epoch + j.submit_s, Ev::Submit { job: i });
            if let Some(c) = cancel {
                e.push(epoch + c, Ev::Cancel { job: i });
            }
        }
        e
    }

    fn push(&mut self, t: UnixSecs, ev: Ev) {
        self.heap.push(Reverse((t, ev)));
    }

    /// Run to the end of the last job.
    pub fn run(mut self, peak_machines: &[u32]) -> Outcome {
        let start = self.now;
        if self.mode == Mode::AlwaysOn {
            self.launch_always_on(peak_machines);
        }
        let last_end = self.trace.iter().map(|j| j.submit_s + j.duration_s).max().unwrap_or(0);
        let give_up = start.saturating_add(last_end).saturating_add(GIVE_UP_AFTER_S);
        while self.remaining > 0 {
            let Some(&Reverse((t, _))) = self.heap.peek() else { break };
            if t > give_up {
                break;
            }
            self.count_at_max(t);
            self.now = t;
            while let Some(&Reverse((t2, ev))) = self.heap.peek() {
                if t2 != t {
                    break;
                }
                self.heap.pop();
                self.handle(ev);
            }
            self.schedule();
            if self.mode != Mode::AlwaysOn && self.remaining > 0 {
                self.autoscale();
            }
            self.close_done_fleets();
            self.note_at_max();
        }
        // Jobs a policy never ran (it got no machine before the events ran out or it gave up):
        // their wait so far counts, so a stuck policy cannot look fast.
        for (job, j) in self.jobs.iter().enumerate() {
            let Some(f) = self.job_fleet[job] else { continue };
            match j.state {
                JobState::Queued => {
                    self.tally[f].waits.push(self.now.saturating_sub(j.queued_at));
                    self.tally[f].waits_own.push(self.now.saturating_sub(j.queued_at).saturating_sub(j.at_max_s));
                    self.tally[f].unfinished += 1;
                }
                JobState::Running { .. } => self.tally[f].unfinished += 1,
                JobState::Pending | JobState::Blocked | JobState::Off { .. } | JobState::Done => {}
            }
        }
        for k in 0..self.live.len() {
            self.close_billing(k);
            self.close_disk(k);
        }
        Outcome { tallies: self.tally, horizon_s: self.now - start, unserved: self.unserved }
    }

    /// Close every machine of a fleet whose jobs are all done (see `left`).
    fn close_done_fleets(&mut self) {
        for f in 0..self.fleets.len() {
            if self.left[f] > 0 || self.closed[f] {
                continue;
            }
            self.closed[f] = true;
            while let Some(k) = self.extra.iter().position(|x| x.fleet == f) {
                self.close_billing(k);
                self.close_disk(k);
                self.remove(k);
            }
        }
    }

    /// One of a fleet's jobs is done (ended, cancelled, given up on).
    fn fleet_job_done(&mut self, job: usize) {
        if let Some(f) = self.job_fleet[job] {
            self.left[f] = self.left[f].saturating_sub(1);
        }
    }

    /// Which fleets have every machine their `max` allows busy with jobs now (state holds until
    /// the next event): a job queued for one waits for the config, not the policy.
    fn note_at_max(&mut self) {
        let mut busy = vec![0u32; self.fleets.len()];
        for (m, x) in self.live.iter().zip(&self.extra) {
            if m.state == MachineState::Busy {
                busy[x.fleet] += 1;
            }
        }
        self.at_max = self.fleets.iter().zip(busy).map(|(spec, b)| spec.max > 0 && b >= spec.max).collect();
    }

    /// The seconds until `t` (the next event) at `max` go to the queued jobs of those fleets.
    fn count_at_max(&mut self, t: UnixSecs) {
        let dt = t.saturating_sub(self.now);
        if dt == 0 || !self.at_max.iter().any(|&a| a) {
            return;
        }
        for &job in &self.queue_jobs {
            if self.job_fleet[job].is_some_and(|f| self.at_max.get(f) == Some(&true)) {
                self.jobs[job].at_max_s += dt;
            }
        }
    }

    /// A job is queued (at its submit, or when the jobs it waits on have ended): on its
    /// fleet, off the fleets when it needs no GPU, or nowhere when no fleet can serve it.
    fn release(&mut self, job: usize) {
        if self.trace[job].gpus == 0 {
            self.jobs[job].state = JobState::Off { start: self.now };
            let attempt = self.jobs[job].attempt;
            self.push(self.now + self.trace[job].duration_s, Ev::Finish { job, attempt });
            return;
        }
        let Some(f) = self.job_fleet[job] else {
            self.unserved += 1;
            self.jobs[job].state = JobState::Done;
            self.remaining -= 1;
            self.ended(job, false);
            return;
        };
        let now = self.now;
        if let Some(h) = self.history.get_mut(&self.fleets[f].name) {
            h.arrivals.push(now);
            h.trim(now, idle::STOPPED_WINDOW_S);
            if let Some(p) = h.profile.as_mut() {
                p.record(now);
            }
        }
        self.enqueue(job, f);
    }

    /// `job` ended for good (`ok`: it finished): the jobs waiting on it go on, or are
    /// cancelled when it did not finish.
    fn ended(&mut self, job: usize, ok: bool) {
        let mut work = vec![(job, ok)];
        while let Some((j, ok)) = work.pop() {
            for (d, runs) in self.pipelines.ended(j, ok) {
                if runs {
                    self.release(d);
                } else {
                    self.cancelled(d);
                    work.push((d, false));
                }
            }
        }
    }

    fn handle(&mut self, ev: Ev) {
        match ev {
            Ev::Submit { job } => {
                if let Some(f) = self.job_fleet[job] {
                    self.tally[f].jobs += 1;
                }
                if self.pipelines.must_wait(job) {
                    self.jobs[job].state = JobState::Blocked;
                } else {
                    self.release(job);
                }
            }
            Ev::Finish { job, attempt } => match self.jobs[job].state {
                JobState::Running { machine, start } if self.jobs[job].attempt == attempt => {
                    self.end_job(job, machine, start);
                    if let Some(f) = self.job_fleet[job] {
                        // Its work, for the arrival profile: run time × its share of a machine.
                        let share = f64::from(self.trace[job].gpus) / f64::from(self.fleets[f].machine.gpus.max(1));
                        let (at, ran) = (self.jobs[job].queued_at, (self.now - start) as f64);
                        if let Some(p) = self.history.get_mut(&self.fleets[f].name).and_then(|h| h.profile.as_mut()) {
                            p.record_work(at, ran * share);
                        }
                    }
                    self.pipelines.durations.record(self.trace[job].step_name(), self.now - start);
                    self.ended(job, true);
                }
                JobState::Off { start } if self.jobs[job].attempt == attempt => {
                    self.jobs[job].state = JobState::Done;
                    self.remaining -= 1;
                    self.pipelines.durations.record(self.trace[job].step_name(), self.now - start);
                    self.ended(job, true);
                }
                _ => {}
            },
            Ev::Cancel { job } => match self.jobs[job].state {
                JobState::Queued => {
                    if let Some(pos) = self.queue_jobs.iter().position(|&j| j == job) {
                        self.queue_jobs.remove(pos);
                        self.queue.remove(pos);
                    }
                    self.left_fleet(job);
                    self.cancelled(job);
                    self.ended(job, false);
                }
                JobState::Running { machine, start } => {
                    self.end_job(job, machine, start);
                    self.cancelled(job);
                    self.ended(job, false);
                }
                JobState::Blocked => {
                    self.pipelines.blocked.remove(&job);
                    self.cancelled(job);
                    self.ended(job, false);
                }
                JobState::Off { .. } => {
                    self.jobs[job].attempt += 1;
                    self.cancelled(job);
                    self.ended(job, false);
                }
                JobState::Pending | JobState::Done => {}
            },
            Ev::Ready { machine, epoch } => {
                if let Some(k) = self.find(machine, epoch) {
                    if self.live[k].state == MachineState::Booting {
                        let (f, took) = (self.extra[k].fleet, self.now.saturating_sub(self.live[k].since));
                        let which = usize::from(self.extra[k].starting);
                        let seen = &mut self.seen_boots[f][which];
                        *seen = (seen.0 + took, seen.1 + 1);
                        let mean = Some(seen.0 / seen.1);
                        if let Some(h) = self.history.get_mut(&self.fleets[f].name) {
                            if which == 1 {
                                h.start_s = mean;
                            } else {
                                h.boot_s = mean;
                            }
                        }
                        self.live[k].state = MachineState::Idle;
                        self.live[k].since = self.now;
                        self.tally[self.extra[k].fleet].boots += 1;
                    }
                }
            }
            Ev::Stopped { machine, epoch } => {
                if let Some(k) = self.find(machine, epoch) {
                    if self.live[k].state == MachineState::Stopping {
                        self.close_billing(k);
                        self.live[k].state = MachineState::Stopped;
                        self.live[k].since = self.now;
                        self.extra[k].stopped_from = Some(self.now);
                    }
                }
            }
            Ev::Interrupt { machine, epoch } => {
                if let Some(k) = self.find(machine, epoch) {
                    if !matches!(self.live[k].state, MachineState::Stopped | MachineState::Stopping) {
                        self.interrupt(k);
                    }
                }
            }
            Ev::Wake => {
                self.wakes.remove(&self.now);
            }
        }
    }

    fn enqueue(&mut self, job: usize, fleet: usize) {
        let j = &self.trace[job];
        self.jobs[job].state = JobState::Queued;
        self.jobs[job].queued_at = self.now;
        self.jobs[job].at_max_s = 0;
        self.queue.push(QueuedJob {
            id: j.id.clone(),
            queued_since: self.now,
            gpus: j.gpus,
            fleets: vec![self.fleets[fleet].name.clone()],
            repository: None,
            expected_run_s: self.pipelines.durations.expected(j.step_name()),
        });
        self.queue_jobs.push(job);
    }

    /// A cancelled job: it ends, and the GPU time it had counts as run.
    fn cancelled(&mut self, job: usize) {
        if let Some(f) = self.job_fleet[job] {
            self.tally[f].cancelled += 1;
        }
        if self.jobs[job].state != JobState::Done {
            self.jobs[job].state = JobState::Done;
            self.remaining -= 1;
            self.fleet_job_done(job);
        }
    }

    /// The job's run ends now (finished or cancelled): count its GPU time, free its GPUs.
    /// A job that arrived left its fleet's demand (ended, or cancelled before it ran): the
    /// idle rule's history, as the coordinator keeps it.
    fn left_fleet(&mut self, job: usize) {
        let now = self.now;
        if let Some(h) = self.job_fleet[job].and_then(|f| self.history.get_mut(&self.fleets[f].name)) {
            h.ends.push(now);
        }
    }

    fn end_job(&mut self, job: usize, machine: u64, start: UnixSecs) {
        self.left_fleet(job);
        let gpus = self.trace[job].gpus;
        self.jobs[job].state = JobState::Done;
        self.jobs[job].attempt += 1;
        self.remaining -= 1;
        self.fleet_job_done(job);
        if let Some(f) = self.job_fleet[job] {
            self.tally[f].ran_gpu_s += ((self.now - start) * u64::from(gpus)) as f64;
        }
        if let Some(k) = self.extra.iter().position(|x| x.num == machine) {
            let m = &mut self.live[k];
            m.gpus_busy = m.gpus_busy.saturating_sub(gpus);
            if let Some(p) = m.jobs.iter().position(|id| *id == self.trace[job].id) {
                m.jobs.swap_remove(p);
            }
            if m.gpus_busy == 0 && m.state == MachineState::Busy {
                m.state = MachineState::Idle;
                m.since = self.now;
            }
        }
    }

    fn find(&self, machine: u64, epoch: u32) -> Option<usize> {
        self.extra.iter().position(|x| x.num == machine && x.epoch == epoch)
    }

    /// The cloud takes a spot machine back: its jobs run again from scratch.
    fn interrupt(&mut self, k: usize) {
        let f = self.extra[k].fleet;
        self.close_billing(k);
        let running: Vec<usize> = self
            .jobs
            .iter()
            .enumerate()
            .filter(|(_, j)| matches!(j.state, JobState::Running { machine, .. } if machine == self.extra[k].num))
            .map(|(i, _)| i)
            .collect();
        for job in running {
            if let JobState::Running { start, .. } = self.jobs[job].state {
                self.tally[f].ran_gpu_s += ((self.now - start) * u64::from(self.trace[job].gpus)) as f64;
            }
            self.jobs[job].attempt += 1;
            self.tally[f].reruns += 1;
            self.enqueue(job, f);
        }
        self.tally[f].interruptions += 1;
        let name = self.fleets[f].name.clone();
        self.interruptions.entry(name).or_default().push(self.now);
        self.close_disk(k);
        self.remove(k);
    }

    fn remove(&mut self, k: usize) {
        self.live.swap_remove(k);
        self.extra.swap_remove(k);
    }

    fn close_billing(&mut self, k: usize) {
        let x = &mut self.extra[k];
        if let Some(from) = x.billed_from.take() {
            let secs = self.now.saturating_sub(from) as f64;
            let t = &mut self.tally[x.fleet];
            t.paid_gpu_s += secs * f64::from(x.gpus);
            t.cost_usd += secs * x.price_per_hour / 3600.0;
            let day_start = self.day * 86_400;
            if self.now / 86_400 == self.day {
                self.closed_today[x.fleet] +=
                    self.now.saturating_sub(from.max(day_start)) as f64 * x.price_per_hour / 3600.0;
            }
        }
    }

    /// A stopped stretch ends (a start, a delete, the end of the run): its disk counts apart.
    fn end_stopped(&mut self, k: usize) {
        let x = &mut self.extra[k];
        if let Some(from) = x.stopped_from.take() {
            let secs = self.now.saturating_sub(from) as f64;
            let usd = secs * x.disk_usd_per_hour / 3600.0;
            let t = &mut self.tally[x.fleet];
            t.stopped_s += secs;
            t.stopped_disk_usd += usd;
            t.stopped_disk_gpu_s += usd * self.gpu_s_per_usd[x.fleet];
        }
    }

    /// The machine is gone (or the run ends): its disk is billed for its whole life.
    fn close_disk(&mut self, k: usize) {
        self.end_stopped(k);
        let x = &self.extra[k];
        let secs = self.now.saturating_sub(x.exists_from) as f64;
        self.tally[x.fleet].disk_usd += secs * x.disk_usd_per_hour / 3600.0;
    }

    /// Whether the provider refuses a create (`start` false) or a start of offer `o` at
    /// `capacity` now: an outage, or the offer's own error rate.
    fn refused(&mut self, f: usize, o: usize, capacity: Capacity, start: bool) -> bool {
        let Some(sim) = self.offers[f].get(o) else { return false };
        let rate = if start { sim.start_capacity_error_rate } else { sim.capacity_error_rate };
        let cap = usize::from(capacity == Capacity::Spot);
        let out = self.outages[f][o][cap].out_at(self.now);
        // Drawn whether or not an outage refuses it, so an outage does not shift later draws.
        let coin = self.rng_capacity[f].f64() < rate;
        out || coin
    }

    /// Ask `decide` again one reconcile interval from now, as the coordinator's loop does.
    fn wake_after_refusal(&mut self) {
        let w = self.now + RECONCILE_S;
        if self.wakes.insert(w) {
            self.push(w, Ev::Wake);
        }
    }

    /// The coordinator's scheduler: queued jobs, oldest first, onto connected machines of
    /// their fleet with free GPUs (fewest free that suffice, then lowest id).
    fn schedule(&mut self) {
        if self.queue.is_empty() {
            return;
        }
        let mut max_free = vec![0u32; self.fleets.len()];
        for (m, x) in self.live.iter().zip(&self.extra) {
            if matches!(m.state, MachineState::Idle | MachineState::Busy) {
                max_free[x.fleet] = max_free[x.fleet].max(x.gpus - m.gpus_busy);
            }
        }
        if max_free.iter().all(|&f| f == 0) {
            return;
        }
        let mut keep = vec![true; self.queue.len()];
        for (q, keep_q) in keep.iter_mut().enumerate() {
            let job = self.queue_jobs[q];
            let Some(f) = self.job_fleet[job] else { continue };
            let gpus = self.trace[job].gpus;
            if max_free[f] < gpus {
                continue;
            }
            let best = (0..self.live.len())
                .filter(|&k| {
                    self.extra[k].fleet == f && matches!(self.live[k].state, MachineState::Idle | MachineState::Busy)
                })
                .map(|k| (self.extra[k].gpus - self.live[k].gpus_busy, k))
                .filter(|&(free, _)| free >= gpus)
                .min_by(|a, b| a.0.cmp(&b.0).then_with(|| self.live[a.1].id.cmp(&self.live[b.1].id)));
            let Some((_, k)) = best else { continue };
            *keep_q = false;
            let wait = self.now - self.jobs[job].queued_at;
            self.tally[f].waits.push(wait);
            self.tally[f].waits_own.push(wait.saturating_sub(self.jobs[job].at_max_s));
            self.jobs[job].state = JobState::Running { machine: self.extra[k].num, start: self.now };
            let m = &mut self.live[k];
            m.gpus_busy += gpus;
            m.jobs.push(self.trace[job].id.clone());
            m.state = MachineState::Busy;
            let attempt = self.jobs[job].attempt;
            self.push(self.now + self.trace[job].duration_s, Ev::Finish { job, attempt });
            max_free[f] = 0;
            for (m, x) in self.live.iter().zip(&self.extra) {
                if x.fleet == f && matches!(m.state, MachineState::Idle | MachineState::Busy) {
                    max_free[f] = max_free[f].max(x.gpus - m.gpus_busy);
                }
            }
        }
        let mut it = keep.iter();
        self.queue.retain(|_| *it.next().unwrap_or(&true));
        let mut it = keep.iter();
        self.queue_jobs.retain(|_| *it.next().unwrap_or(&true));
    }

    /// Always-on: the peak number of machines per fleet, never more than its `max`, on-demand,
    /// connected from the start (bought ahead: no capacity error, no boot counted in waits).
    fn launch_always_on(&mut self, peak_machines: &[u32]) {
        for f in 0..self.fleets.len() {
            // A fleet with no job gets no machine; one with jobs at least one.
            if self.left[f] == 0 {
                continue;
            }
            let n = peak_machines.get(f).copied().unwrap_or(0).min(self.fleets[f].max).max(1);
            for _ in 0..n {
                let num = self.next_machine;
                self.next_machine += 1;
                let spec = &self.fleets[f];
                let price = spec.offers.first().map_or(0.0, |o| o.price(Capacity::OnDemand));
                self.live.push(Machine {
                    id: format!("m-{num:07}"),
                    fleet: spec.name.clone(),
                    offer: 0,
                    capacity: Capacity::OnDemand,
                    state: MachineState::Idle,
                    created_at: self.now,
                    since: self.now,
                    gpus_busy: 0,
                    jobs: Vec::new(),
                    note: None,
                });
                self.extra.push(Extra {
                    num,
                    fleet: f,
                    epoch: 0,
                    billed_from: Some(self.now),
                    price_per_hour: price,
                    gpus: spec.machine.gpus,
                    exists_from: self.now,
                    stopped_from: None,
                    disk_usd_per_hour: self.offers[f].first().map_or(0.0, |o| o.disk_usd_per_hour),
                    starting: false,
                });
                self.tally[f].launched += 1;
                self.tally[f].boots += 1;
            }
        }
    }
}

/// The fleet settings a run uses.
fn adjust(f: &FleetSpec, mode: Mode) -> FleetSpec {
    use gpuci_core::fleet::IdleAction;
    let mut f = f.clone();
    match mode {
        Mode::FixedIdle(idle_s) => {
            f.min_idle = 0;
            f.warm.clear();
            f.idle_timeout_s = Some(idle_s);
            f.idle_action = IdleAction::Delete;
        }
        Mode::FixedStop { idle_s, stopped_s } => {
            f.min_idle = 0;
            f.warm.clear();
            f.idle_timeout_s = Some(idle_s);
            f.idle_action = if can_stop(&f) { IdleAction::Stop } else { IdleAction::Delete };
            f.stopped_timeout_s = Some(stopped_s);
        }
        Mode::Decide | Mode::AlwaysOn => {}
    }
    f
}

/// Whether a fleet's provider can stop its machines and start them again, as the config's
/// default idle action says: what best-fixed-stop stops (it deletes the others' idle machines).
pub(crate) fn can_stop(f: &FleetSpec) -> bool {
    use gpuci_core::fleet::{idle::default_idle_action, CapacityPolicy, IdleAction};
    default_idle_action(f.provider, f.capacity == CapacityPolicy::OnDemand, &f.settings) == IdleAction::Stop
}

#[cfg(test)]
mod tests;
