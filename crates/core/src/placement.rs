//! Placement: which host runs a job, and which GPU UUIDs it leases there.
//!
//! Rules (the product's, enforced here and nowhere else):
//! - a GPU is leased by UUID to at most one job; only `Free` GPUs that meet the requirement
//!   ([`mismatch`] is `None`) are candidates, `Quarantined` ones never;
//! - a multi-GPU job gets all its GPUs on one host; a job that needs no GPU only needs a free
//!   job slot and the tags;
//! - a host needs `free_slots > 0`, every tag the job asks for (exact `key=value`) and, for a
//!   container job, a container runtime.
//!
//! Choice among hosts that fit (best fit, so as few GPUs as possible are stranded):
//! - a GPU job goes to the host with the fewest free *matching* GPUs that still has enough,
//!   then the fewest free GPUs of any kind, then the lowest host index;
//! - a job that needs no GPU goes to the host with the fewest free GPUs (a CPU-only or fully
//!   leased host before one whose GPUs would be left without a job slot), then the fewest
//!   GPUs in total (CPU-only hosts first), then the most free job slots (spread CPU work), then
//!   the lowest host index.
//!
//! Within a host the job gets the lowest device indexes. Keeping multi-GPU jobs on one NVLink
//! island is future work: it needs topology in [`GpuInfo`].
//!
//! When nothing fits the answer is one line a person can act on, and it says *why*: no agent
//! has the tag, no GPU of that kind exists, they exist but are leased, quarantined, or spread
//! over several hosts, or every agent that would fit has no free job slot — or takes no jobs
//! at all ([`HostView::refuses`], named with its agent's reason, never called busy).
//!
//! Two implementations with one meaning: [`place`] scans a slice and is the reference;
//! [`Cluster`] keeps indexes so the scheduler can place thousands of jobs a second and applies
//! each placement. Both compute the same [`Key`] for a host and the same [`Tally`] for a reason,
//! so they choose the same host and GPUs and say the same thing; a property test holds them to it.

use crate::gpu::{mismatch, GpuInfo, GpuRequirements};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::hash::{BuildHasherDefault, Hash, Hasher};

/// Whether a GPU can take a lease.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(tag = "state", rename_all = "snake_case")]
pub enum GpuSlotState {
    Free,
    Leased { job_id: String },
    Quarantined { reason: String },
}

/// One GPU as placement sees it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuSlot {
    pub info: GpuInfo,
    pub state: GpuSlotState,
}

/// A connected host as placement sees it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostView {
    pub agent_id: String,
    pub name: String,
    pub tags: BTreeMap<String, String>,
    pub free_slots: u32,
    pub total_slots: u32,
    pub container_runtime: bool,
    pub gpus: Vec<GpuSlot>,
    /// When the host goes away by itself (unix ms): the end of its Slurm allocation or pod
    /// deadline. `None`: it stays until it is told to go.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ends_at_ms: Option<i64>,
    /// Why the host takes no jobs at all, in its agent's words (no working sandbox, no disk
    /// quota): it offers no job slot, and a job it would otherwise fit is told this, never
    /// that the host is "busy" — waiting does not free a slot that does not exist.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub refuses: Option<String>,
}

/// What a job needs from a host.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Needs<'a> {
    pub tags: &'a BTreeMap<String, String>,
    pub gpu: &'a GpuRequirements,
    pub container: bool,
    /// How long the job may run (its timeout), from when: a host that ends sooner
    /// ([`HostView::ends_at_ms`]) cannot take it. `None`: the job has no timeout and may
    /// start on any host (it is queued again if its host ends first).
    pub deadline: Option<Deadline>,
}

/// A job's time on a host: from `now_ms` for up to `runs_for_ms`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Deadline {
    pub now_ms: i64,
    pub runs_for_ms: u64,
}

impl Deadline {
    fn until_ms(&self) -> i64 {
        self.now_ms.saturating_add(self.runs_for_ms.min(i64::MAX as u64) as i64)
    }
}

/// Whether host `h` lasts as long as the job may run.
fn in_time(h: &HostView, needs: &Needs<'_>) -> bool {
    match (h.ends_at_ms, needs.deadline) {
        (Some(end), Some(d)) => d.until_ms() <= end,
        _ => true,
    }
}

/// The reason for a job that hosts could take now but that may run longer than they last;
/// `latest_end_ms` is the longest-lasting of them.
fn too_short_reason(needs: &Needs<'_>, latest_end_ms: i64) -> String {
    let d = needs.deadline.expect("only asked with a deadline");
    let left = (latest_end_ms - d.now_ms).max(0) as u64;
    format!(
        "may run for {} (its timeout); no agent that could take it now lasts that long (the most left is {}: the end of its allocation)",
        human_ms(d.runs_for_ms),
        human_ms(left)
    )
}

/// `2h 5m`, `37m`, `45s`.
fn human_ms(ms: u64) -> String {
    let s = ms / 1000;
    match (s / 3600, s % 3600 / 60, s % 60) {
        (0, 0, s) => format!("{s}s"),
        (0, m, _) => format!("{m}m"),
        (h, 0, _) => format!("{h}h"),
        (h, m, _) => format!("{h}h {m}m"),
    }
}

/// Where a job goes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Placement {
    /// Index into the `hosts` slice given to [`place`] (or [`Cluster::hosts`]).
    pub host: usize,
    /// Leased GPU UUIDs, in device index order.
    pub gpus: Vec<String>,
}

/// Why a job cannot be placed now, in words for a person.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Unplaceable {
    pub reason: String,
}

/// Place one job on `hosts`. Pure: the caller applies the placement (marks the GPUs leased
/// and takes a slot) before placing the next job. This is the reference implementation: it
/// looks at every host and GPU, so it costs O(hosts × GPUs) string-free comparisons plus one
/// [`mismatch`] per GPU; a scheduler with many hosts uses [`Cluster`].
pub fn place(needs: &Needs<'_>, hosts: &[HostView]) -> Result<Placement, Unplaceable> {
    let want = needs.gpu.count;
    let mut tally = Tally { connected: hosts.len(), ..Tally::default() };
    let mut best: Option<Key> = None;
    let mut short: Option<i64> = None;
    for (i, h) in hosts.iter().enumerate() {
        if !has_tags(h, needs.tags) {
            continue;
        }
        tally.tag_ok += 1;
        if needs.container && !h.container_runtime {
            continue;
        }
        tally.runtime_ok += 1;
        let slot = h.free_slots > 0;
        let key = if want == 0 {
            tally.add_slotless(h, slot, true);
            cpu_key(i, h.free_slots, count_free(h), count_usable(h))
        } else {
            let mut c = HostCount::default();
            for g in &h.gpus {
                match mismatch(needs.gpu, &g.info) {
                    None => c.add(&g.state),
                    Some(why) => {
                        tally.mismatch.get_or_insert(why);
                    }
                }
            }
            tally.add_gpu_host(h.gpus.len(), c);
            tally.add_slotless(h, slot, c.free >= want);
            gpu_key(i, h.free_slots, count_free(h), c.free).filter(|k| k.0 >= want)
        };
        if let Some(k) = key {
            if !in_time(h, needs) {
                short = short.max(h.ends_at_ms);
            } else if best.is_none_or(|b| k < b) {
                best = Some(k);
            }
        }
    }
    if let Some(k) = best {
        let host = k.3 as usize;
        let h = &hosts[host];
        let picked = pick(h, want, |g| mismatch(needs.gpu, &h.gpus[g].info).is_none());
        let gpus = picked.iter().map(|&g| h.gpus[g].info.uuid.clone()).collect();
        return Ok(Placement { host, gpus });
    }
    if let Some(end) = short {
        return Err(Unplaceable { reason: too_short_reason(needs, end) });
    }
    if tally.connected > 0 && tally.tag_ok == 0 {
        tally.missing_tag = Some(missing_tag(needs.tags, hosts));
    }
    Err(Unplaceable { reason: tally.reason(needs) })
}

/// How a host ranks for a job; smaller is better. The last field is the host index, so keys
/// are unique and the order is total: ties break by host order.
///
/// GPU job: (free matching GPUs, free GPUs, 0, host). CPU job: (free GPUs, GPUs not
/// quarantined, `u32::MAX - free_slots`, host).
type Key = (u32, u32, u32, u32);

fn gpu_key(host: usize, free_slots: u32, host_free: u32, matching_free: u32) -> Option<Key> {
    (free_slots > 0 && matching_free > 0).then_some((matching_free, host_free, 0, host as u32))
}

fn cpu_key(host: usize, free_slots: u32, host_free: u32, host_usable: u32) -> Option<Key> {
    (free_slots > 0).then_some((host_free, host_usable, u32::MAX - free_slots, host as u32))
}

fn has_tags(h: &HostView, tags: &BTreeMap<String, String>) -> bool {
    tags.iter().all(|(k, v)| h.tags.get(k) == Some(v))
}

fn count_free(h: &HostView) -> u32 {
    h.gpus.iter().filter(|g| g.state == GpuSlotState::Free).count() as u32
}

fn count_usable(h: &HostView) -> u32 {
    h.gpus.iter().filter(|g| !matches!(g.state, GpuSlotState::Quarantined { .. })).count() as u32
}

/// The positions (in `h.gpus`) of the `want` free matching GPUs with the lowest device
/// index. The caller has checked that there are enough.
fn pick(h: &HostView, want: u32, matches: impl Fn(usize) -> bool) -> Vec<usize> {
    let mut free: Vec<usize> =
        (0..h.gpus.len()).filter(|&g| h.gpus[g].state == GpuSlotState::Free && matches(g)).collect();
    free.sort_by_key(|&g| (h.gpus[g].info.index, g));
    free.truncate(want as usize);
    free
}

/// Matching GPUs on one host, by state.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct HostCount {
    free: u32,
    leased: u32,
    quarantined: u32,
}

impl HostCount {
    fn add(&mut self, s: &GpuSlotState) {
        match s {
            GpuSlotState::Free => self.free += 1,
            GpuSlotState::Leased { .. } => self.leased += 1,
            GpuSlotState::Quarantined { .. } => self.quarantined += 1,
        }
    }
}

/// What the hosts look like from one job's point of view: everything a reason needs.
#[derive(Debug, Default)]
struct Tally {
    connected: usize,
    /// Hosts with every tag.
    tag_ok: usize,
    /// Hosts with every tag and, if the job wants one, a container runtime.
    runtime_ok: usize,
    /// GPUs of any kind on `runtime_ok` hosts.
    gpus: usize,
    /// Matching GPUs on `runtime_ok` hosts, by state.
    free: usize,
    leased: usize,
    quarantined: usize,
    /// Most free / free-or-leased / any matching GPUs on one host.
    best_free: u32,
    best_usable: u32,
    best_any: u32,
    /// Hosts that would take the job but have no free job slot (refusing ones not counted).
    busy: usize,
    /// Hosts that would take the job but take no jobs at all ([`HostView::refuses`]), and the
    /// first of them (host order): its name and why.
    refusing: usize,
    refusing_example: Option<(String, String)>,
    /// Why the first non-matching GPU (host order) does not match.
    mismatch: Option<String>,
    /// Set when no host has the tags: which tag is missing.
    missing_tag: Option<String>,
}

impl Tally {
    /// Count `h` as busy or as refusing, if it has no free slot and `would_fit`.
    fn add_slotless(&mut self, h: &HostView, slot: bool, would_fit: bool) {
        if slot || !would_fit {
            return;
        }
        match &h.refuses {
            Some(why) => {
                self.refusing += 1;
                self.refusing_example.get_or_insert_with(|| (h.name.clone(), why.clone()));
            }
            None => self.busy += 1,
        }
    }

    fn add_gpu_host(&mut self, gpus: usize, c: HostCount) {
        self.gpus += gpus;
        self.free += c.free as usize;
        self.leased += c.leased as usize;
        self.quarantined += c.quarantined as usize;
        self.best_free = self.best_free.max(c.free);
        self.best_usable = self.best_usable.max(c.free + c.leased);
        self.best_any = self.best_any.max(c.free + c.leased + c.quarantined);
    }

    /// The one-line reason. The order of the checks is the order in which a person would fix
    /// things: connect an agent, tag it, install a runtime, get that kind of GPU, wait for it.
    fn reason(&self, needs: &Needs<'_>) -> String {
        let want = needs.gpu.count;
        if self.connected == 0 {
            return "no agent is connected".into();
        }
        if self.tag_ok == 0 {
            return self.missing_tag.clone().unwrap_or_else(|| "no connected agent has the tags".into());
        }
        let scope = if needs.tags.is_empty() {
            "connected agent".to_string()
        } else {
            format!("agent with tag{} {}", plural(needs.tags.len()), tag_list(needs.tags))
        };
        if self.runtime_ok == 0 {
            return format!("needs a container runtime; no {scope} has podman or docker");
        }
        let busy = || {
            let refusal = self.refusing_example.as_ref().map(|(name, why)| match self.refusing {
                1 => format!("agent {name} takes no jobs: {why}"),
                n => format!("{n} matching agents take no jobs (agent {name}: {why})"),
            });
            match (self.busy, refusal) {
                (1, None) => "the only matching agent is busy (no free job slot)".to_string(),
                (n, None) => format!("all {n} matching agents are busy (no free job slot)"),
                (0, Some(r)) => r,
                (1, Some(r)) => format!("{r}; the other matching agent is busy (no free job slot)"),
                (n, Some(r)) => format!("{r}; the other {n} matching agents are busy (no free job slot)"),
            }
        };
        if want == 0 {
            return busy();
        }
        let short = format!("needs {want} GPU{}", plural(want as usize));
        let what = with_constraints(&short, needs.gpu);
        if self.gpus == 0 {
            return format!("{short}; no {scope} has a GPU");
        }
        let matching = self.free + self.leased + self.quarantined;
        if matching == 0 {
            let why = self.mismatch.as_deref().unwrap_or("none meets the requirement");
            let on = if needs.tags.is_empty() {
                String::new()
            } else {
                format!(" on agents with tag{} {}", plural(needs.tags.len()), tag_list(needs.tags))
            };
            return format!("{short}; no GPU matches{on}: {why}");
        }
        if self.best_free >= want {
            return busy();
        }
        let are = |n: usize| if n == 1 { "GPU is" } else { "GPUs are" };
        let (l, q) = (self.leased, self.quarantined);
        if self.free + l == 0 {
            return format!("{what}; {q} matching {} quarantined", are(q));
        }
        let best = self.best_free;
        if self.best_usable >= want {
            let leases = format!("{l} matching {} leased to other jobs", are(l));
            return match best {
                0 => format!("{what}; {leases}"),
                _ => format!("{what}; best host has {best} free, {leases}"),
            };
        }
        if self.best_any >= want {
            return format!("{what}; best host has {best} free, {q} matching {} quarantined", are(q));
        }
        let spread = if matching >= want as usize { " (a job's GPUs must be on one host)" } else { "" };
        if self.best_any == best {
            format!("{what}; best host has {best} free{spread}")
        } else {
            format!("{what}; best host has {} matching, {best} free{spread}", self.best_any)
        }
    }
}

fn plural(n: usize) -> &'static str {
    if n == 1 {
        ""
    } else {
        "s"
    }
}

fn tag_list(tags: &BTreeMap<String, String>) -> String {
    tags.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(", ")
}

/// "needs 2 GPUs with >=40 GiB, model H100*".
fn with_constraints(short: &str, r: &GpuRequirements) -> String {
    let GpuRequirements { count: _, memory, compute_capability, model, driver, cuda, mig_profile } = r;
    let mut parts = Vec::new();
    if let Some(c) = memory {
        parts.push(c.to_string());
    }
    if let Some(m) = model {
        parts.push(format!("model {m}"));
    }
    if let Some(c) = compute_capability {
        parts.push(format!("compute capability {c}"));
    }
    if let Some(c) = driver {
        parts.push(format!("driver {c}"));
    }
    if let Some(c) = cuda {
        parts.push(format!("CUDA {c}"));
    }
    if let Some(p) = mig_profile {
        parts.push(format!("MIG {p}"));
    }
    if parts.is_empty() {
        short.to_string()
    } else {
        format!("{short} with {}", parts.join(", "))
    }
}

/// No host has all the tags: name one that no host has at all if there is one, since that is
/// the likelier typo; otherwise say that no host has them together.
fn missing_tag(tags: &BTreeMap<String, String>, hosts: &[HostView]) -> String {
    for (k, v) in tags {
        if !hosts.iter().any(|h| h.tags.get(k) == Some(v)) {
            return format!("no connected agent has tag {k}={v}");
        }
    }
    format!("no connected agent has all of the tags {}", tag_list(tags))
}

/// A GPU requirement without its count: what decides whether one GPU matches. Destructured
/// in full so that a new field in [`GpuRequirements`] fails to compile here instead of being
/// silently ignored by the index.
fn same_gpu_class(a: &GpuRequirements, b: &GpuRequirements) -> bool {
    let GpuRequirements { count: _, memory, compute_capability, model, driver, cuda, mig_profile } = a;
    *memory == b.memory
        && *compute_capability == b.compute_capability
        && *model == b.model
        && *driver == b.driver
        && *cuda == b.cuda
        && *mig_profile == b.mig_profile
}

/// The multiply-rotate hash of rustc's FxHash. The profile lookup runs on every placement
/// attempt, unplaceable ones included, and SipHash was a visible share of that. Flooding is
/// no concern: a collision costs one more equality check, and each distinct profile costs its
/// creator a pass over the hosts anyway.
#[derive(Default)]
struct FxHasher(u64);

impl FxHasher {
    fn add(&mut self, word: u64) {
        self.0 = (self.0.rotate_left(5) ^ word).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
    }
}

impl Hasher for FxHasher {
    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut word = [0u8; 8];
            word[..chunk.len()].copy_from_slice(chunk);
            self.add(u64::from_le_bytes(word));
        }
    }
    fn write_u8(&mut self, n: u8) {
        self.add(u64::from(n));
    }
    fn write_u32(&mut self, n: u32) {
        self.add(u64::from(n));
    }
    fn write_u64(&mut self, n: u64) {
        self.add(n);
    }
    fn write_usize(&mut self, n: usize) {
        self.add(n as u64);
    }
    fn finish(&self) -> u64 {
        self.0
    }
}

fn profile_hash(tags: &BTreeMap<String, String>, container: bool, gpu: Option<&GpuRequirements>) -> u64 {
    let mut s = FxHasher::default();
    tags.hash(&mut s);
    container.hash(&mut s);
    match gpu {
        None => 0u8.hash(&mut s),
        Some(r) => {
            let GpuRequirements { count: _, memory, compute_capability, model, driver, cuda, mig_profile } = r;
            (1u8, memory, compute_capability, model, driver, cuda, mig_profile).hash(&mut s);
        }
    }
    s.finish()
}

/// The facts of a GPU that matching may look at: its identity (UUID, index, bus id, device
/// node, MIG instance UUIDs) blanked, so identical cards share one entry and a requirement is
/// checked once per kind of card, not once per card.
fn gpu_kind_key(g: &GpuInfo) -> GpuInfo {
    let mut k = g.clone();
    k.uuid.clear();
    k.index = 0;
    k.pci_bus_id.clear();
    k.device_node.clear();
    for m in &mut k.mig_instances {
        m.uuid.clear();
    }
    k
}

/// The hosts, with indexes for placing many jobs fast, applying each placement.
///
/// Jobs are grouped into *profiles*: (tags, container, GPU requirement without its count), or
/// (tags, container, no GPU) for CPU jobs. Requirements repeat, so profiles are few. A profile
/// is created the first time a job needs it (one pass over the hosts) and then kept up to
/// date on every change of a member host. Per profile:
/// - its member hosts (tags and runtime fit) and which kinds of GPU match;
/// - `ready`: the [`Key`]s of members that could take a job now, ordered, so the best fit for
///   `n` GPUs is one range query;
/// - histograms of members by matching GPUs free / free or leased / any, so a reason for an
///   unplaceable job costs O(GPUs per host), not a scan of the cluster.
///
/// - the last reason given per GPU count, reused until a member host changes in a way the
///   profile can see, so a full cluster turns away a long queue cheaply.
///
/// A change to a host (lease, release, quarantine) updates every profile the host is a member
/// of: O(profiles × log hosts). Profiles are never dropped; their number is the number of
/// distinct needs seen, which real queues keep small.
#[derive(Debug, Default)]
pub struct Cluster {
    hosts: Vec<HostView>,
    /// Per host, per GPU position: index into `kinds`.
    gpu_kind: Vec<Vec<u32>>,
    kinds: Vec<GpuInfo>,
    kind_ids: HashMap<GpuInfo, u32>,
    profiles: Vec<Profile>,
    profile_ids: HashMap<u64, Vec<u32>, BuildHasherDefault<FxHasher>>,
    /// Per host: the profiles it is a member of, with what it last contributed to each.
    member_of: Vec<Vec<Membership>>,
}

#[derive(Debug)]
struct Profile {
    tags: BTreeMap<String, String>,
    container: bool,
    /// `None`: the job needs no GPU.
    gpu: Option<GpuRequirements>,
    /// Per GPU kind: whether it meets `gpu`.
    kind_ok: Vec<bool>,
    tag_ok: usize,
    /// Hosts with the tags and the runtime, ascending.
    members: Vec<usize>,
    gpus: usize,
    free: usize,
    leased: usize,
    quarantined: usize,
    /// Members by number of matching GPUs that are free / free or leased / in any state.
    hist_free: Vec<u32>,
    hist_usable: Vec<u32>,
    hist_any: Vec<u32>,
    /// Members without a free job slot, by number of free matching GPUs: those that could
    /// have one, and those that take no jobs at all ([`HostView::refuses`]).
    hist_busy: Vec<u32>,
    hist_refusing: Vec<u32>,
    ready: BTreeSet<Key>,
    mismatch: Option<String>,
    missing_tag: Option<String>,
    /// Bumped whenever anything a reason depends on changes.
    version: u64,
    /// Last reason given, per GPU count: (count, version, reason). A queue holds many jobs
    /// with the same needs, and a full cluster turns most of them away on every pass; the
    /// reason is the same until a member host changes in a way this profile can see.
    reasons: Vec<(u32, u64, String)>,
}

#[derive(Debug, Clone, Copy)]
struct Membership {
    profile: u32,
    counts: HostCount,
    slot: bool,
    refuses: bool,
    key: Option<Key>,
}

fn bump(hist: &mut Vec<u32>, at: u32, add: bool) {
    let at = at as usize;
    if hist.len() <= at {
        hist.resize(at + 1, 0);
    }
    if add {
        hist[at] += 1;
    } else {
        hist[at] -= 1;
    }
}

fn top(hist: &[u32]) -> u32 {
    hist.iter().rposition(|&n| n > 0).unwrap_or(0) as u32
}

impl Profile {
    fn account(&mut self, c: HostCount, slot: bool, refuses: bool, add: bool) {
        self.version += 1;
        let (f, l, q) = (c.free as usize, c.leased as usize, c.quarantined as usize);
        if add {
            self.free += f;
            self.leased += l;
            self.quarantined += q;
        } else {
            self.free -= f;
            self.leased -= l;
            self.quarantined -= q;
        }
        bump(&mut self.hist_free, c.free, add);
        bump(&mut self.hist_usable, c.free + c.leased, add);
        bump(&mut self.hist_any, c.free + c.leased + c.quarantined, add);
        match (slot, refuses) {
            (true, _) => {}
            (false, false) => bump(&mut self.hist_busy, c.free, add),
            (false, true) => bump(&mut self.hist_refusing, c.free, add),
        }
    }

    fn tally(&self, connected: usize, want: u32) -> Tally {
        Tally {
            connected,
            tag_ok: self.tag_ok,
            runtime_ok: self.members.len(),
            gpus: self.gpus,
            free: self.free,
            leased: self.leased,
            quarantined: self.quarantined,
            best_free: top(&self.hist_free),
            best_usable: top(&self.hist_usable),
            best_any: top(&self.hist_any),
            busy: self.hist_busy.iter().skip(want as usize).map(|&n| n as usize).sum(),
            refusing: self.hist_refusing.iter().skip(want as usize).map(|&n| n as usize).sum(),
            // Filled in by the caller, which sees the hosts ([`Cluster::refusing_example`]).
            refusing_example: None,
            mismatch: self.mismatch.clone(),
            missing_tag: self.missing_tag.clone(),
        }
    }

    fn matches(&self, needs: &Needs<'_>) -> bool {
        self.container == needs.container
            && self.tags == *needs.tags
            && match (&self.gpu, needs.gpu.count) {
                (None, 0) => true,
                (Some(r), n) if n > 0 => same_gpu_class(r, needs.gpu),
                _ => false,
            }
    }
}

impl Cluster {
    pub fn new(hosts: Vec<HostView>) -> Cluster {
        let mut c = Cluster::default();
        for h in hosts {
            c.push_host(h);
        }
        c
    }

    pub fn hosts(&self) -> &[HostView] {
        &self.hosts
    }

    pub fn into_hosts(self) -> Vec<HostView> {
        self.hosts
    }

    /// Add a host (an agent connected). Returns its index.
    pub fn push_host(&mut self, view: HostView) -> usize {
        let h = self.hosts.len();
        let kinds = view.gpus.iter().map(|g| self.intern_kind(&g.info)).collect();
        self.hosts.push(view);
        self.gpu_kind.push(kinds);
        self.member_of.push(Vec::new());
        for p in 0..self.profiles.len() {
            self.attach(p, h);
            self.refresh_examples(p);
        }
        h
    }

    /// Replace what is known of host `h` (an agent re-registered, its inventory or tags
    /// changed). Leases in `view` are taken as they are.
    pub fn replace_host(&mut self, h: usize, view: HostView) {
        for p in 0..self.profiles.len() {
            self.detach(p, h);
        }
        self.gpu_kind[h] = view.gpus.iter().map(|g| self.intern_kind(&g.info)).collect();
        self.hosts[h] = view;
        for p in 0..self.profiles.len() {
            self.attach(p, h);
            self.refresh_examples(p);
        }
    }

    /// Set the state of one GPU (quarantine it, bring it back). False if host `h` has no GPU
    /// with that UUID.
    pub fn set_gpu_state(&mut self, h: usize, uuid: &str, state: GpuSlotState) -> bool {
        let Some(g) = self.hosts.get_mut(h).and_then(|v| v.gpus.iter_mut().find(|g| g.info.uuid == uuid)) else {
            return false;
        };
        g.state = state;
        self.refresh(h);
        true
    }

    /// Where the job would go now, without applying it.
    pub fn place(&mut self, needs: &Needs<'_>) -> Result<Placement, Unplaceable> {
        let (host, picked) = self.find(needs)?;
        let gpus = picked.iter().map(|&g| self.hosts[host].gpus[g].info.uuid.clone()).collect();
        Ok(Placement { host, gpus })
    }

    /// Place the job and apply it: its GPUs become `Leased { job_id }` and it takes a job
    /// slot on the host. The caller gives both back with [`Cluster::release`].
    pub fn place_and_apply(&mut self, job_id: &str, needs: &Needs<'_>) -> Result<Placement, Unplaceable> {
        let (host, picked) = self.find(needs)?;
        let view = &mut self.hosts[host];
        let mut gpus = Vec::with_capacity(picked.len());
        for g in picked {
            let slot = &mut view.gpus[g];
            slot.state = GpuSlotState::Leased { job_id: job_id.to_string() };
            gpus.push(slot.info.uuid.clone());
        }
        view.free_slots -= 1;
        self.refresh(host);
        Ok(Placement { host, gpus })
    }

    /// A job ended: its GPUs among `gpus` that are still leased to `job_id` become free (a GPU
    /// quarantined meanwhile stays quarantined; one leased to another job is left alone) and
    /// its job slot comes back. Returns how many GPUs were freed. The caller, who owns job
    /// state, releases each placement once; the slot count never exceeds `total_slots`.
    pub fn release(&mut self, h: usize, job_id: &str, gpus: &[String]) -> usize {
        let Some(view) = self.hosts.get_mut(h) else {
            return 0;
        };
        let mut freed = 0;
        for g in &mut view.gpus {
            if gpus.contains(&g.info.uuid) && matches!(&g.state, GpuSlotState::Leased { job_id: j } if j == job_id) {
                g.state = GpuSlotState::Free;
                freed += 1;
            }
        }
        if view.free_slots < view.total_slots {
            view.free_slots += 1;
        }
        self.refresh(h);
        freed
    }

    fn find(&mut self, needs: &Needs<'_>) -> Result<(usize, Vec<usize>), Unplaceable> {
        let p = self.profile(needs);
        let want = needs.gpu.count;
        let profile = &self.profiles[p];
        // Ready hosts in order of fit; one that ends before the job may is passed over (rare:
        // only hosts with an end, such as Slurm allocations, are ever skipped).
        let mut short: Option<i64> = None;
        let mut best = None;
        let from = if want == 0 { (0, 0, 0, 0) } else { (want, 0, 0, 0) };
        for k in profile.ready.range(from..) {
            let h = &self.hosts[k.3 as usize];
            if in_time(h, needs) {
                best = Some(*k);
                break;
            }
            short = short.max(h.ends_at_ms);
        }
        if let (None, Some(end)) = (best, short) {
            return Err(Unplaceable { reason: too_short_reason(needs, end) });
        }
        if let Some(k) = best {
            let h = k.3 as usize;
            let kinds = &self.gpu_kind[h];
            return Ok((h, pick(&self.hosts[h], want, |g| profile.kind_ok[kinds[g] as usize])));
        }
        let version = profile.version;
        if let Some((_, _, reason)) = profile.reasons.iter().find(|r| r.0 == want && r.1 == version) {
            return Err(Unplaceable { reason: reason.clone() });
        }
        let mut tally = profile.tally(self.hosts.len(), want);
        if tally.refusing > 0 {
            tally.refusing_example = self.refusing_example(p, want);
        }
        let reason = tally.reason(needs);
        let cache = &mut self.profiles[p].reasons;
        match cache.iter_mut().find(|r| r.0 == want) {
            Some(r) => *r = (want, version, reason.clone()),
            None => cache.push((want, version, reason.clone())),
        }
        Err(Unplaceable { reason })
    }

    /// The first member of profile `p` (host order, as [`place`] finds it) that would take a
    /// job wanting `want` GPUs but takes no jobs at all: its name and why.
    fn refusing_example(&self, p: usize, want: u32) -> Option<(String, String)> {
        self.profiles[p].members.iter().find_map(|&h| {
            let m = self.member_of[h].iter().find(|m| m.profile as usize == p)?;
            let why = self.hosts[h].refuses.as_ref()?;
            (!m.slot && m.counts.free >= want).then(|| (self.hosts[h].name.clone(), why.clone()))
        })
    }

    /// The profile for these needs, created (one pass over the hosts) if new.
    fn profile(&mut self, needs: &Needs<'_>) -> usize {
        let gpu = (needs.gpu.count > 0).then_some(needs.gpu);
        let hash = profile_hash(needs.tags, needs.container, gpu);
        if let Some(ids) = self.profile_ids.get(&hash) {
            if let Some(&p) = ids.iter().find(|&&p| self.profiles[p as usize].matches(needs)) {
                return p as usize;
            }
        }
        let gpu = gpu.map(|r| GpuRequirements { count: 0, ..r.clone() });
        let kind_ok = self.kinds.iter().map(|k| gpu.as_ref().is_none_or(|r| mismatch(r, k).is_none())).collect();
        let p = self.profiles.len();
        self.profiles.push(Profile {
            tags: needs.tags.clone(),
            container: needs.container,
            gpu,
            kind_ok,
            tag_ok: 0,
            members: Vec::new(),
            gpus: 0,
            free: 0,
            leased: 0,
            quarantined: 0,
            hist_free: Vec::new(),
            hist_usable: Vec::new(),
            hist_any: Vec::new(),
            hist_busy: Vec::new(),
            hist_refusing: Vec::new(),
            ready: BTreeSet::new(),
            mismatch: None,
            missing_tag: None,
            version: 0,
            reasons: Vec::new(),
        });
        self.profile_ids.entry(hash).or_default().push(p as u32);
        for h in 0..self.hosts.len() {
            self.attach(p, h);
        }
        self.refresh_examples(p);
        p
    }

    fn intern_kind(&mut self, info: &GpuInfo) -> u32 {
        let key = gpu_kind_key(info);
        if let Some(&k) = self.kind_ids.get(&key) {
            return k;
        }
        let k = self.kinds.len() as u32;
        for p in &mut self.profiles {
            p.kind_ok.push(p.gpu.as_ref().is_none_or(|r| mismatch(r, &key).is_none()));
        }
        self.kinds.push(key.clone());
        self.kind_ids.insert(key, k);
        k
    }

    /// What host `h` contributes to profile `p` now.
    fn contribution(&self, p: usize, h: usize) -> (HostCount, bool, Option<Key>) {
        let profile = &self.profiles[p];
        let view = &self.hosts[h];
        let slot = view.free_slots > 0;
        match &profile.gpu {
            None => (HostCount::default(), slot, cpu_key(h, view.free_slots, count_free(view), count_usable(view))),
            Some(_) => {
                let mut c = HostCount::default();
                for (g, &k) in view.gpus.iter().zip(&self.gpu_kind[h]) {
                    if profile.kind_ok[k as usize] {
                        c.add(&g.state);
                    }
                }
                (c, slot, gpu_key(h, view.free_slots, count_free(view), c.free))
            }
        }
    }

    /// Make host `h` count in profile `p` if it has the tags (and runtime).
    fn attach(&mut self, p: usize, h: usize) {
        let profile = &self.profiles[p];
        if !has_tags(&self.hosts[h], &profile.tags) {
            return;
        }
        let runtime_ok = !profile.container || self.hosts[h].container_runtime;
        let (counts, slot, key) = self.contribution(p, h);
        let gpus = self.hosts[h].gpus.len();
        let profile = &mut self.profiles[p];
        profile.tag_ok += 1;
        profile.version += 1;
        if !runtime_ok {
            return;
        }
        if let Err(at) = profile.members.binary_search(&h) {
            profile.members.insert(at, h);
        }
        profile.gpus += gpus;
        let refuses = self.hosts[h].refuses.is_some();
        profile.account(counts, slot, refuses, true);
        if let Some(k) = key {
            profile.ready.insert(k);
        }
        self.member_of[h].push(Membership { profile: p as u32, counts, slot, refuses, key });
    }

    /// Undo [`Cluster::attach`]: host `h` as last accounted.
    fn detach(&mut self, p: usize, h: usize) {
        let profile = &mut self.profiles[p];
        if !has_tags(&self.hosts[h], &profile.tags) {
            return;
        }
        profile.tag_ok -= 1;
        profile.version += 1;
        let Some(at) = self.member_of[h].iter().position(|m| m.profile as usize == p) else {
            return;
        };
        let m = self.member_of[h].swap_remove(at);
        if let Ok(i) = profile.members.binary_search(&h) {
            profile.members.remove(i);
        }
        profile.gpus -= self.hosts[h].gpus.len();
        profile.account(m.counts, m.slot, m.refuses, false);
        if let Some(k) = m.key {
            profile.ready.remove(&k);
        }
    }

    /// Host `h` changed state (leases, slots, quarantine): bring every profile it is a member
    /// of up to date.
    fn refresh(&mut self, h: usize) {
        let view = &self.hosts[h];
        let (host_free, host_usable) = (count_free(view), count_usable(view));
        let kinds = &self.gpu_kind[h];
        for m in &mut self.member_of[h] {
            let profile = &mut self.profiles[m.profile as usize];
            let slot = view.free_slots > 0;
            let refuses = view.refuses.is_some();
            let (counts, key) = match &profile.gpu {
                None => (HostCount::default(), cpu_key(h, view.free_slots, host_free, host_usable)),
                Some(_) => {
                    let mut c = HostCount::default();
                    for (g, &k) in view.gpus.iter().zip(kinds) {
                        if profile.kind_ok[k as usize] {
                            c.add(&g.state);
                        }
                    }
                    (c, gpu_key(h, view.free_slots, host_free, c.free))
                }
            };
            if counts != m.counts || slot != m.slot || refuses != m.refuses {
                profile.account(m.counts, m.slot, m.refuses, false);
                profile.account(counts, slot, refuses, true);
            }
            if key != m.key {
                if let Some(k) = m.key {
                    profile.ready.remove(&k);
                }
                if let Some(k) = key {
                    profile.ready.insert(k);
                }
            }
            *m = Membership { profile: m.profile, counts, slot, refuses, key };
        }
    }

    /// Recompute the parts of a reason that depend on which hosts exist, not on their state:
    /// the first non-matching GPU and the missing tag. Runs when a profile is made or the host
    /// list changes.
    fn refresh_examples(&mut self, p: usize) {
        let profile = &self.profiles[p];
        let mut example = None;
        if let Some(r) = &profile.gpu {
            'hosts: for &h in &profile.members {
                for (g, &k) in self.hosts[h].gpus.iter().zip(&self.gpu_kind[h]) {
                    if !profile.kind_ok[k as usize] {
                        example = mismatch(r, &g.info);
                        break 'hosts;
                    }
                }
            }
        }
        let missing = (profile.tag_ok == 0 && !self.hosts.is_empty()).then(|| missing_tag(&profile.tags, &self.hosts));
        let profile = &mut self.profiles[p];
        profile.mismatch = example;
        profile.missing_tag = missing;
        profile.version += 1;
    }
}
