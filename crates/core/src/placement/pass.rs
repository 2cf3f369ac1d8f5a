//! A placement pass: the queue, in order, against the cluster's free capacity. Pure: the
//! scheduler builds a [`Candidate`] per queued job from its state (what blocks it, which
//! concurrency group it is in, what it needs), hands them here with the cluster, and applies
//! the [`Decision`]s: stores the placements, sends the assignments, writes the reasons.
//!
//! Rules, besides [`Cluster`]'s for one job:
//! - a job that is blocked waits with its reason; of a concurrency group at most one job is
//!   placed per pass (the scheduler's view of the group's running jobs is in `blocked`);
//! - a pass only takes capacity, so once a job with given needs found no place, a later job
//!   with the same needs ([`Shape`]) is told the same without asking the cluster again: a
//!   queue of 100,000 jobs of a few shapes costs a few placements, not 100,000;
//! - a reason is given only when it differs from what the job was last told (a long queue is
//!   not rewritten pass after pass); the fleets' note on a job is added to placement's reason,
//!   and a job its repository's budget holds off fleet machines is told only the fleets' note;
//! - placement's reason for a job no host takes is given again when only its counts changed
//!   ("7 matching GPUs are leased" → "8 …") only in a pass that refreshes counts
//!   ([`Counts::Refresh`]): on a busy cluster the counts change at every placement and every
//!   end, and rewriting every queued job's reason at every pass was most of a pass's cost with
//!   100,000 queued (BENCHMARKS.md, "The coordinator under load"). A changed word is given at
//!   once.

use super::{Cluster, Needs, Placement};
use crate::concurrency::GroupKey;
use std::collections::{BTreeSet, HashMap};

/// One queued job as a pass sees it.
pub struct Candidate<'a> {
    pub id: i64,
    /// What it needs of a host (the scheduler's stand-in tags included).
    pub needs: Needs<'a>,
    /// Why it may not start now, decided before the pass (dependencies, a concurrency group's
    /// running job); `None`: it is ready.
    pub blocked: Option<String>,
    /// Its concurrency group, if it is in one.
    pub group: Option<GroupKey>,
    /// What it was last told (its stored reason).
    pub told: &'a str,
    /// The fleets' word on it (a machine on its way, a budget reached).
    pub fleet_note: Option<&'a str>,
    /// Its repository's budget holds it off fleet machines.
    pub held: bool,
}

/// What a pass decided for one job.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Decision {
    /// Not ready; its new reason, if it changed.
    Waits { id: i64, reason: Option<String> },
    /// Ready, and no host takes it now (the fleets may make one); its new reason, if it changed.
    Unplaced { id: i64, reason: Option<String> },
    /// Placed, and applied to the cluster (its GPUs leased to it, a slot taken).
    Placed { id: i64, placement: Placement },
    /// Of batch `batch` ([`Batch`]), the jobs from `ids[from]` on wait: no host takes their
    /// shape now, for `reason` (placement's, reworded by `explain`).
    BatchWaits { batch: usize, from: usize, reason: String },
}

/// Whether a pass gives a job no host takes its reason again when only the reason's counts
/// changed (the scheduler refreshes them now and then, [`Counts::Refresh`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Counts {
    /// Any change is given, counts included.
    Refresh,
    /// A reason whose words are what the job was told, its numbers aside, is not given again.
    Keep,
}

/// Queued jobs that differ in nothing a pass looks at but their ids: ready, in no
/// concurrency group, with no fleets' note, not held by a budget, all with the same needs.
/// A pass takes them in queue order among the other jobs, and once their shape finds no
/// place it decides the rest of them at once ([`Decision::BatchWaits`]): a queue of 100,000
/// such jobs costs a pass the jobs it places, not 100,000 visits.
pub struct Batch<'a> {
    pub needs: Needs<'a>,
    /// In queue order (ascending).
    pub ids: &'a [i64],
}

/// Run a pass over `jobs` (queue order). `explain` may reword placement's reason for a job's
/// needs (the scheduler names its stand-in tags in words); it is asked once per shape.
pub fn pass<'a>(
    cluster: &mut Cluster,
    jobs: impl IntoIterator<Item = Candidate<'a>>,
    explain: impl Fn(&Needs<'_>, String) -> String,
    counts: Counts,
) -> Vec<Decision> {
    pass_batched(cluster, jobs, &[], explain, counts)
}

/// [`pass`] over `jobs` and `batches` together, in queue order (each job's id is its place):
/// decides what [`pass`] decides for the same jobs one by one, a batch's waiting jobs as one
/// [`Decision::BatchWaits`] (whose reasons to give are the caller's to work out with
/// [`tell`], as it keeps what each was told).
pub fn pass_batched<'a>(
    cluster: &mut Cluster,
    jobs: impl IntoIterator<Item = Candidate<'a>>,
    batches: &[Batch<'_>],
    explain: impl Fn(&Needs<'_>, String) -> String,
    counts: Counts,
) -> Vec<Decision> {
    use std::cmp::Reverse;
    let mut p = Pass {
        cluster,
        explain,
        counts,
        decisions: Vec::new(),
        placed_groups: BTreeSet::new(),
        full: FullShapes::default(),
    };
    let mut jobs = jobs.into_iter().peekable();
    // Each batch's next job, first in queue order first.
    let mut heads: std::collections::BinaryHeap<Reverse<(i64, usize)>> =
        batches.iter().enumerate().filter_map(|(b, batch)| Some(Reverse((*batch.ids.first()?, b)))).collect();
    let mut next = vec![0usize; batches.len()];
    loop {
        let head = heads.peek().map(|Reverse(h)| *h);
        match (jobs.peek(), head) {
            (Some(job), Some((id, _))) if job.id < id => {}
            (Some(_), None) => {}
            (_, Some((id, b))) => {
                heads.pop();
                if p.batch_head(id, &batches[b].needs) {
                    next[b] += 1;
                    if let Some(id) = batches[b].ids.get(next[b]) {
                        heads.push(Reverse((*id, b)));
                    }
                } else {
                    let reason = p.full.reason(&Shape::of(&batches[b].needs)).unwrap_or_default().to_string();
                    p.decisions.push(Decision::BatchWaits { batch: b, from: next[b], reason });
                }
                continue;
            }
            (None, None) => break,
        }
        if let Some(job) = jobs.next() {
            p.one(job);
        }
    }
    p.decisions
}

/// Whether a job no host takes is given `why` when it was last told `told`: not when it is
/// what it was told, nor, unless counts are refreshed, when only the numbers differ.
pub fn tell(told: &str, why: &str, counts: Counts) -> bool {
    match counts {
        Counts::Keep if same_but_numbers(told, why) => false,
        _ => told != why,
    }
}

/// A pass under way.
struct Pass<'c, E> {
    cluster: &'c mut Cluster,
    explain: E,
    counts: Counts,
    decisions: Vec<Decision>,
    placed_groups: BTreeSet<GroupKey>,
    full: FullShapes,
}

impl<E: Fn(&Needs<'_>, String) -> String> Pass<'_, E> {
    /// One job, on its own.
    fn one(&mut self, job: Candidate<'_>) {
        let changed = |told: &str, why: String| (told != why).then_some(why);
        let counts = self.counts;
        // Placement's reason for a job no host takes: its counts are given again only when asked.
        let unplaced = |told: &str, why: String| tell(told, &why, counts).then_some(why);
        let why = match (job.blocked, &job.group) {
            (Some(why), _) => Some(why),
            (None, Some(key)) if self.placed_groups.contains(key) => {
                Some(format!("waiting for another job in concurrency group {key}"))
            }
            _ => None,
        };
        if let Some(why) = why {
            self.decisions.push(Decision::Waits { id: job.id, reason: changed(job.told, why) });
            return;
        }
        let shape = Shape::of(&job.needs);
        if let Some(reason) = self.full.reason(&shape) {
            let reason = match job.fleet_note {
                // Told already (most of a long queue, pass after pass): nothing to write.
                None if job.told == reason => None,
                note => unplaced(job.told, with_fleet_note(reason, job.held, note)),
            };
            self.decisions.push(Decision::Unplaced { id: job.id, reason });
            return;
        }
        match self.cluster.place_and_apply(&job.id.to_string(), &job.needs) {
            Ok(placement) => {
                if let Some(key) = job.group {
                    self.placed_groups.insert(key);
                }
                self.decisions.push(Decision::Placed { id: job.id, placement });
            }
            Err(u) => {
                let reason = (self.explain)(&job.needs, u.reason);
                self.full.note(&shape, &reason);
                let reason = unplaced(job.told, with_fleet_note(&reason, job.held, job.fleet_note));
                self.decisions.push(Decision::Unplaced { id: job.id, reason });
            }
        }
    }

    /// A batch's next job: placed (true), or its shape has no place (false; noted in `full`).
    fn batch_head(&mut self, id: i64, needs: &Needs<'_>) -> bool {
        let shape = Shape::of(needs);
        if self.full.reason(&shape).is_some() {
            return false;
        }
        match self.cluster.place_and_apply(&id.to_string(), needs) {
            Ok(placement) => {
                self.decisions.push(Decision::Placed { id, placement });
                true
            }
            Err(u) => {
                let reason = (self.explain)(needs, u.reason);
                self.full.note(&shape, &reason);
                false
            }
        }
    }
}

/// Whether `a` and `b` say the same in words: equal once every run of digits is taken as one
/// and the same number.
pub fn same_but_numbers(a: &str, b: &str) -> bool {
    let (mut a, mut b) = (a.chars().peekable(), b.chars().peekable());
    loop {
        match (a.next(), b.next()) {
            (None, None) => return true,
            (Some(x), Some(y)) if x.is_ascii_digit() && y.is_ascii_digit() => {
                while a.next_if(char::is_ascii_digit).is_some() {}
                while b.next_if(char::is_ascii_digit).is_some() {}
            }
            (Some(x), Some(y)) if x == y => {}
            _ => return false,
        }
    }
}

/// A waiting job's reason with the fleets' word on it; a job held off fleet machines by its
/// repository's budget is told only that (placement's reason names the stand-in tag).
pub fn with_fleet_note(reason: &str, held: bool, note: Option<&str>) -> String {
    match note {
        Some(note) if held => note.to_string(),
        Some(note) => format!("{reason}; {note}"),
        None => reason.to_string(),
    }
}

/// What placement sees of a job: two jobs of one shape fit the same places. Borrowed from
/// the job's needs: looking one up allocates nothing.
#[derive(Hash, PartialEq, Eq, Clone, Copy)]
struct Shape<'a> {
    tags: &'a std::collections::BTreeMap<String, String>,
    gpu: &'a crate::gpu::GpuRequirements,
    container: bool,
    runs_for_ms: Option<u64>,
}

impl<'a> Shape<'a> {
    fn of(needs: &Needs<'a>) -> Shape<'a> {
        Shape {
            tags: needs.tags,
            gpu: needs.gpu,
            container: needs.container,
            runs_for_ms: needs.deadline.map(|d| d.runs_for_ms),
        }
    }

    fn key(&self) -> u64 {
        use std::hash::{BuildHasher, BuildHasherDefault, DefaultHasher};
        BuildHasherDefault::<DefaultHasher>::default().hash_one(self)
    }
}

/// A [`Shape`] kept past its job's borrow.
struct OwnedShape {
    tags: std::collections::BTreeMap<String, String>,
    gpu: crate::gpu::GpuRequirements,
    container: bool,
    runs_for_ms: Option<u64>,
}

impl OwnedShape {
    fn is(&self, s: &Shape<'_>) -> bool {
        (self.container, self.runs_for_ms) == (s.container, s.runs_for_ms) && &self.tags == s.tags && &self.gpu == s.gpu
    }
}

/// The shapes this pass found no place for, with the reason (before the fleets' note).
#[derive(Default)]
struct FullShapes(HashMap<u64, Vec<(OwnedShape, String)>>);

impl FullShapes {
    fn reason(&self, shape: &Shape<'_>) -> Option<&str> {
        self.0.get(&shape.key())?.iter().find(|(s, _)| s.is(shape)).map(|(_, r)| r.as_str())
    }

    fn note(&mut self, shape: &Shape<'_>, reason: &str) {
        if self.reason(shape).is_none() {
            let owned = OwnedShape {
                tags: shape.tags.clone(),
                gpu: shape.gpu.clone(),
                container: shape.container,
                runs_for_ms: shape.runs_for_ms,
            };
            self.0.entry(shape.key()).or_default().push((owned, reason.to_string()));
        }
    }
}
