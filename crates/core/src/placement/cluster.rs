//! [`Cluster`]: the indexed implementation of placement, for a scheduler placing thousands of
//! jobs a second. It keeps per-profile indexes up to date as placements apply, and must decide
//! exactly as [`place`](super::place) does: same [`Key`] for a host, same [`Tally`] for a
//! reason (a property test holds the two to one meaning). The rules themselves live in
//! `placement.rs`; nothing here may add one.

use super::*;

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
