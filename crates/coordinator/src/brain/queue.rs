//! The queued jobs as a placement pass takes them, kept with `Brain::active` (only
//! `Brain::publish`, `Brain::load` and `Brain::told` change it).
//!
//! A queued job with no dependencies, no concurrency group and no secrets needs nothing of a
//! pass but a place: such jobs wait in a bucket per shape (what they need of a host), and a
//! pass takes each bucket as one batch (`gpuci_core::placement::pass::Batch`). Once a shape
//! finds no place, the rest of its bucket is decided at once, and only its jobs not yet told
//! the bucket's reason are visited. With 100,000 queued, a pass costs the jobs it places and
//! the jobs it must tell something new, not 100,000 visits (BENCHMARKS.md, "The coordinator
//! under load"). Every other queued job is looked at one by one, as before.

use gpuci_core::job::JobState;
use gpuci_core::placement::pass::same_but_numbers;
use gpuci_protocol::JobId;
use gpuci_store::JobRecord;
use std::collections::{BTreeMap, BTreeSet, HashMap};

/// What a bucket's jobs need of a host: the job's tags with the scheduler's stand-ins (as a
/// job no budget holds), its GPUs, whether it runs a container, its timeout.
#[derive(Clone, PartialEq, Eq, Hash)]
pub(super) struct Shape {
    pub tags: BTreeMap<String, String>,
    pub gpu: gpuci_core::gpu::GpuRequirements,
    pub container: bool,
    pub timeout: Option<gpuci_core::duration::Duration>,
}

/// Queued jobs of one shape that need only a place.
pub(super) struct Bucket {
    pub shape: Shape,
    pub jobs: BTreeSet<JobId>,
    /// Its jobs not known to have been told `said` (in words; their counts may be older).
    pub fresh: BTreeSet<JobId>,
    /// What a pass last told this bucket's waiting jobs.
    pub said: Option<String>,
    /// Jobs ever added: the fleets are woken when a bucket's waiting jobs grow.
    pub added: u64,
}

/// The queue, split as a pass takes it, and the active jobs in concurrency groups.
#[derive(Default)]
pub(super) struct Queue {
    /// Queued jobs a pass looks at one by one.
    each: BTreeSet<JobId>,
    buckets: HashMap<u64, Bucket>,
    shapes: HashMap<Shape, u64>,
    /// Each bucketed job's bucket.
    of: HashMap<JobId, u64>,
    next_bucket: u64,
    /// Active jobs (queued or not) in a concurrency group.
    grouped: BTreeSet<JobId>,
}

impl Queue {
    /// `j` as it is now: where it belongs, if it is queued, and whether it is grouped.
    pub fn note(&mut self, j: &JobRecord) {
        self.remove(j.id);
        if j.state.is_terminal() {
            return;
        }
        if j.step.concurrency.is_some() {
            self.grouped.insert(j.id);
        }
        if j.state != JobState::Queued {
            return;
        }
        if !(j.step.depends_on.is_empty() && j.step.concurrency.is_none() && !super::scheduling::names_secrets(j)) {
            self.each.insert(j.id);
            return;
        }
        let shape = Shape {
            tags: super::scheduling::stand_in_tags(j, false).unwrap_or_else(|| j.step.agents.clone()),
            gpu: j.step.gpu.clone(),
            container: j.step.image.is_some(),
            timeout: j.step.timeout,
        };
        let b = match self.shapes.get(&shape) {
            Some(b) => *b,
            None => {
                let b = self.next_bucket;
                self.next_bucket += 1;
                self.shapes.insert(shape.clone(), b);
                let bucket = Bucket { shape, jobs: BTreeSet::new(), fresh: BTreeSet::new(), said: None, added: 0 };
                self.buckets.insert(b, bucket);
                b
            }
        };
        let Some(bucket) = self.buckets.get_mut(&b) else { return };
        bucket.jobs.insert(j.id);
        bucket.added += 1;
        if !bucket.said.as_deref().is_some_and(|s| same_but_numbers(s, &j.reason)) {
            bucket.fresh.insert(j.id);
        }
        self.of.insert(j.id, b);
    }

    /// A queued job was told `reason` (its record changed in place).
    pub fn told(&mut self, id: JobId, reason: &str) {
        let Some(bucket) = self.of.get(&id).and_then(|b| self.buckets.get_mut(b)) else { return };
        match bucket.said.as_deref().is_some_and(|s| same_but_numbers(s, reason)) {
            true => bucket.fresh.remove(&id),
            false => bucket.fresh.insert(id),
        };
    }

    fn remove(&mut self, id: JobId) {
        self.grouped.remove(&id);
        if self.each.remove(&id) {
            return;
        }
        let Some(b) = self.of.remove(&id) else { return };
        let Some(bucket) = self.buckets.get_mut(&b) else { return };
        bucket.jobs.remove(&id);
        bucket.fresh.remove(&id);
        if bucket.jobs.is_empty() {
            self.shapes.remove(&bucket.shape);
            self.buckets.remove(&b);
        }
    }

    /// Queued jobs a pass looks at one by one, by id.
    pub fn each(&self) -> impl Iterator<Item = JobId> + '_ {
        self.each.iter().copied()
    }

    /// Every bucket, by its number.
    pub fn buckets(&self) -> impl Iterator<Item = (u64, &Bucket)> {
        self.buckets.iter().map(|(b, bucket)| (*b, bucket))
    }

    pub fn bucket(&self, b: u64) -> Option<&Bucket> {
        self.buckets.get(&b)
    }

    pub fn bucket_mut(&mut self, b: u64) -> Option<&mut Bucket> {
        self.buckets.get_mut(&b)
    }

    /// Whether `id` waits in a bucket.
    pub fn bucketed(&self, id: JobId) -> bool {
        self.of.contains_key(&id)
    }

    /// How many jobs are queued.
    pub fn len(&self) -> usize {
        self.each.len() + self.of.len()
    }

    /// Active jobs in a concurrency group, by id.
    pub fn grouped(&self) -> impl Iterator<Item = JobId> + '_ {
        self.grouped.iter().copied()
    }
}

/// The queued jobs the last pass found no place for (not blocked by a dependency or a
/// concurrency group): what fleets may create machines for.
#[derive(Default)]
pub(super) struct Waiting {
    /// Jobs looked at one by one.
    pub each: BTreeSet<JobId>,
    /// Buckets whose jobs from the given id on wait: (bucket, first waiting job, the
    /// bucket's `added` then).
    pub batches: Vec<(u64, JobId, u64)>,
}

impl Waiting {
    /// Whether jobs wait now that did not before: a job, or a bucket's jobs from an earlier
    /// one or newly added.
    pub fn grew_from(&self, before: &Waiting) -> bool {
        !self.each.is_subset(&before.each)
            || self.batches.iter().any(|(b, from, added)| {
                !before.batches.iter().any(|(b0, from0, added0)| b0 == b && from0 <= from && added0 >= added)
            })
    }

    /// Every waiting job, by id within each part (jobs looked at one by one first).
    pub fn ids<'a>(&'a self, queue: &'a Queue) -> impl Iterator<Item = JobId> + 'a {
        let batched = self.batches.iter().flat_map(move |(b, from, _)| {
            queue.bucket(*b).into_iter().flat_map(move |bucket| bucket.jobs.range(*from..).copied())
        });
        self.each.iter().copied().chain(batched.filter(move |id| !self.each.contains(id)))
    }
}
