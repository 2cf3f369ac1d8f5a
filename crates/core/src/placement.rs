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

// The indexed implementation; the rules, the keys and the reasons it must agree with are here.
mod cluster;
pub use cluster::Cluster;
// A pass over the queue, on a cluster: what the scheduler applies.
pub mod pass;

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
