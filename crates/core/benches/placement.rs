//! Placement throughput on one core: 2,500 simulated hosts × 4 GPUs, 100,000 queued jobs of
//! mixed needs. A scheduling pass walks the queue and places what fits; between passes a
//! simulated clock advances one tick and the jobs due to end then release their GPUs, so the
//! queue keeps draining until only the jobs that can never run are left.
//!
//! Run: `cargo bench -p gpuci-core --bench placement` (release profile). Everything is
//! deterministic (fixed seed); only the timings vary. The inventory is simulated.

use gpuci_core::gpu::{CmpOp, ComputeCapability, Constraint, GpuInfo, GpuRequirements, Version};
use gpuci_core::placement::{place, Cluster, GpuSlot, GpuSlotState, HostView, Needs};
use gpuci_core::quantity::Bytes;
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

const HOSTS: usize = 2_500;
const GPUS_PER_HOST: u32 = 4;
const SLOTS_PER_HOST: u32 = 8;
const JOBS: usize = 100_000;
const MAX_TICKS: usize = 100_000;

/// splitmix64: small, fast, good enough for a workload generator.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in 0..n.
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

fn tags(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
}

fn ge<T>(value: T) -> Option<Constraint<T>> {
    Some(Constraint { op: CmpOp::Ge, value })
}

fn hosts(rng: &mut Rng) -> Vec<HostView> {
    (0..HOSTS)
        .map(|h| {
            // 25% H100 80GB, 20% A100 80GB, 20% A100 40GB, 35% L4.
            let (model, gib, cc, queue) = match rng.below(20) {
                0..=4 => ("NVIDIA H100 80GB HBM3", 80, (9, 0), "big"),
                5..=8 => ("NVIDIA A100-SXM4-80GB", 80, (8, 0), "big"),
                9..=12 => ("NVIDIA A100-SXM4-40GB", 40, (8, 0), "cuda"),
                _ => ("NVIDIA L4", 24, (8, 9), "cuda"),
            };
            let mut t = tags(&[("queue", queue)]);
            if rng.below(10) < 3 {
                t.insert("os".into(), "ubuntu-22.04".into());
            }
            let gpus = (0..GPUS_PER_HOST)
                .map(|i| GpuSlot {
                    info: GpuInfo {
                        uuid: format!("GPU-{h:05}-{i}"),
                        index: i,
                        name: model.into(),
                        memory: Bytes(gib << 30),
                        compute_capability: ComputeCapability { major: cc.0, minor: cc.1 },
                        driver_version: Version::new(vec![550, 54, 15]),
                        cuda_driver_version: Some(Version::new(vec![12, 4])),
                        mig_enabled: Some(false),
                        mig_instances: vec![],
                        ecc_enabled: Some(true),
                        persistence_mode: Some(true),
                        pci_bus_id: format!("0000:{:02x}:00.0", i + 1),
                        device_node: format!("/dev/nvidia{i}"),
                        simulated: true,
                    },
                    state: GpuSlotState::Free,
                })
                .collect();
            HostView {
                agent_id: format!("agent-{h:05}"),
                name: format!("sim-{h:05}"),
                tags: t,
                free_slots: SLOTS_PER_HOST,
                total_slots: SLOTS_PER_HOST,
                container_runtime: rng.below(10) < 8,
                gpus,
                ends_at_ms: None,
                refuses: None,
            }
        })
        .collect()
}

struct Job {
    id: String,
    tags: BTreeMap<String, String>,
    gpu: GpuRequirements,
    container: bool,
    /// How many ticks it runs once placed.
    ticks: usize,
}

impl Job {
    fn needs(&self) -> Needs<'_> {
        Needs { tags: &self.tags, gpu: &self.gpu, container: self.container, deadline: None }
    }
}

fn jobs(rng: &mut Rng) -> Vec<Job> {
    (0..JOBS)
        .map(|j| {
            let count = match rng.below(20) {
                0..=4 => 0,
                5..=12 => 1,
                13..=16 => 2,
                _ => 4,
            };
            let mut gpu = GpuRequirements { count, ..Default::default() };
            if count > 0 {
                match rng.below(20) {
                    0..=2 => gpu.memory = ge(Bytes(40 << 30)),
                    3..=4 => gpu.compute_capability = ge(ComputeCapability { major: 8, minor: 9 }),
                    5..=6 => gpu.model = Some("H100*".into()),
                    7..=8 => gpu.model = Some("*A100*".into()),
                    9 => {
                        gpu.memory = ge(Bytes(80 << 30));
                        gpu.compute_capability = ge(ComputeCapability { major: 9, minor: 0 });
                    }
                    10 => gpu.cuda = ge(Version::new(vec![12, 2])),
                    _ => {}
                }
            }
            let mut t = match rng.below(10) {
                0..=4 => BTreeMap::new(),
                5..=7 => tags(&[("queue", "cuda")]),
                _ => tags(&[("queue", "big")]),
            };
            if rng.below(20) == 0 {
                t.insert("os".into(), "ubuntu-22.04".into());
            }
            // About 0.6% can never run: a queue nobody serves, a GPU model nobody has, more
            // GPUs than any host has. They must still get a reason, cheaply, on every pass.
            match rng.below(500) {
                0 => {
                    t = tags(&[("queue", "rocm")]);
                }
                1 => gpu = GpuRequirements { count: 1, model: Some("B200*".into()), ..Default::default() },
                2 => gpu.count = 8,
                _ => {}
            }
            Job {
                id: format!("job-{j:06}"),
                tags: t,
                gpu,
                container: rng.below(2) == 0,
                ticks: 1 + rng.below(20) as usize,
            }
        })
        .collect()
}

/// This thread's time on a CPU so far (Linux: first field of `/proc/thread-self/schedstat`),
/// so the one-core figure holds on a shared machine, where wall time includes waiting for
/// the CPU. `None` where unavailable.
fn on_cpu() -> Option<Duration> {
    let s = std::fs::read_to_string("/proc/thread-self/schedstat").ok()?;
    s.split_whitespace().next()?.parse().ok().map(Duration::from_nanos)
}

fn percentile(sorted: &[u32], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let i = ((sorted.len() - 1) as f64 * p).round() as usize;
    Duration::from_nanos(u64::from(sorted[i]))
}

fn ns(d: Duration) -> u32 {
    d.as_nanos().min(u128::from(u32::MAX)) as u32
}

fn main() {
    let mut rng = Rng(0x0067_7075_6369);
    let hosts = hosts(&mut rng);
    let jobs = jobs(&mut rng);

    // The reference implementation, for scale: one `place` over the whole slice per job.
    let sample = 2_000;
    let t = Instant::now();
    let mut fit = 0usize;
    for job in jobs.iter().take(sample) {
        fit += usize::from(place(&job.needs(), &hosts).is_ok());
    }
    let reference = t.elapsed();
    println!(
        "reference place() on {HOSTS} hosts: {sample} calls ({fit} placeable, not applied) in {reference:.2?} = {:.0}/s",
        sample as f64 / reference.as_secs_f64()
    );

    // Run 1 times every call (latency percentiles); run 2 times only whole passes, so the
    // throughput figure carries no per-call timer cost. The workload is identical.
    let timed = simulate(hosts.clone(), &jobs, true);
    let untimed = simulate(hosts, &jobs, false);
    let r = &timed;
    println!("Cluster::new({HOSTS} hosts × {GPUS_PER_HOST} GPUs): {:.2?}", r.build);
    println!(
        "simulation: {} passes, {} placed, {} released, {} never placeable, peak {} running",
        r.passes,
        r.placed_ns.len(),
        r.releases,
        r.left.len(),
        r.peak_running
    );
    let sum = |v: &[u32]| Duration::from_nanos(v.iter().map(|&n| u64::from(n)).sum());
    let (in_placed, in_unplaced) = (sum(&r.placed_ns), sum(&r.unplaced_ns));
    println!(
        "placements (timed run): {} in {in_placed:.2?} = {:.0}/s; latency p50 {:.2?}, p99 {:.2?}, max {:.2?}",
        r.placed_ns.len(),
        r.placed_ns.len() as f64 / in_placed.as_secs_f64(),
        percentile(&r.placed_ns, 0.50),
        percentile(&r.placed_ns, 0.99),
        percentile(&r.placed_ns, 1.0),
    );
    println!(
        "unplaceable attempts with reason (timed run): {} in {in_unplaced:.2?} = {:.0}/s; latency p50 {:.2?}, p99 {:.2?}; {:.0} bytes of reason each",
        r.unplaced_ns.len(),
        r.unplaced_ns.len() as f64 / in_unplaced.as_secs_f64(),
        percentile(&r.unplaced_ns, 0.50),
        percentile(&r.unplaced_ns, 0.99),
        r.reason_bytes as f64 / r.unplaced_ns.len().max(1) as f64,
    );
    for (name, r) in [("timed", &timed), ("untimed", &untimed)] {
        let total = r.pass_time + r.release_time;
        println!(
            "scheduler throughput ({name} run; passes incl. unplaceable attempts, plus releases): {} placements in {total:.2?} wall = {:.0} placements/s (goal >= 10000/s); releases alone {:.2?}",
            r.placements,
            r.placements as f64 / total.as_secs_f64(),
            r.release_time,
        );
        if let Some(cpu) = r.on_cpu {
            println!(
                "  same run, whole simulation on-CPU time {cpu:.2?} ({:.0}% of its wall time) = {:.0} placements per CPU-second",
                100.0 * cpu.as_secs_f64() / r.wall.as_secs_f64(),
                r.placements as f64 / cpu.as_secs_f64()
            );
        }
    }
    let mut cluster = untimed.cluster;
    for j in untimed.left.iter().take(4) {
        if let Err(u) = cluster.place(&jobs[*j].needs()) {
            println!("  e.g. {}: {}", jobs[*j].id, u.reason);
        }
    }
}

struct Run {
    cluster: Cluster,
    build: Duration,
    passes: usize,
    placements: usize,
    releases: usize,
    peak_running: usize,
    reason_bytes: usize,
    placed_ns: Vec<u32>,
    unplaced_ns: Vec<u32>,
    pass_time: Duration,
    release_time: Duration,
    /// Jobs still queued at the end: the ones that can never run.
    left: Vec<usize>,
    /// The whole simulation (passes, releases, bookkeeping): wall and on-CPU time.
    wall: Duration,
    on_cpu: Option<Duration>,
}

fn simulate(hosts: Vec<HostView>, jobs: &[Job], time_each_call: bool) -> Run {
    const RING: usize = 32;
    let (start, cpu_start) = (Instant::now(), on_cpu());
    let t = Instant::now();
    let mut cluster = Cluster::new(hosts);
    let build = t.elapsed();
    let mut queue: Vec<usize> = (0..jobs.len()).collect();
    let mut ending: Vec<Vec<(usize, usize, Vec<String>)>> = vec![Vec::new(); RING];
    let (mut running, mut peak_running) = (0usize, 0usize);
    let (mut placed_ns, mut unplaced_ns) = (Vec::with_capacity(jobs.len()), Vec::new());
    let (mut pass_time, mut release_time) = (Duration::ZERO, Duration::ZERO);
    let (mut passes, mut placements, mut releases, mut reason_bytes) = (0usize, 0usize, 0usize, 0usize);
    for tick in 0..MAX_TICKS {
        let due = std::mem::take(&mut ending[tick % RING]);
        let t = Instant::now();
        for (job, host, gpus) in &due {
            cluster.release(*host, &jobs[*job].id, gpus);
        }
        release_time += t.elapsed();
        releases += due.len();
        running -= due.len();

        let pass = Instant::now();
        let mut still = Vec::with_capacity(queue.len());
        let mut placed_now = 0;
        for &j in &queue {
            let job = &jobs[j];
            let t = time_each_call.then(Instant::now);
            let got = cluster.place_and_apply(&job.id, &job.needs());
            let dt = t.map(|t| ns(t.elapsed()));
            match got {
                Ok(p) => {
                    placed_ns.extend(dt);
                    placed_now += 1;
                    ending[(tick + job.ticks) % RING].push((j, p.host, p.gpus));
                }
                Err(u) => {
                    unplaced_ns.extend(dt);
                    reason_bytes += u.reason.len();
                    still.push(j);
                }
            }
        }
        pass_time += pass.elapsed();
        passes += 1;
        placements += placed_now;
        queue = still;
        running += placed_now;
        peak_running = peak_running.max(running);
        if running == 0 && placed_now == 0 {
            break;
        }
    }
    let wall = start.elapsed();
    let on_cpu = on_cpu().zip(cpu_start).map(|(end, start)| end.saturating_sub(start));
    placed_ns.sort_unstable();
    unplaced_ns.sort_unstable();
    Run {
        cluster,
        build,
        passes,
        placements,
        releases,
        peak_running,
        reason_bytes,
        placed_ns,
        unplaced_ns,
        pass_time,
        release_time,
        left: queue,
        wall,
        on_cpu,
    }
}
