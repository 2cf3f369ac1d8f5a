//! What holds a queued job back other than capacity: its step's gate over its dependencies'
//! latest attempts, and its concurrency group, scoped by repository and trust class.

use super::*;

impl Brain {
    /// Why a queued job cannot start yet, if something other than capacity holds it back:
    /// `Ok` while it waits, `Err` when it can never run.
    pub(super) fn blocked(&self, j: &JobRecord, groups: &GroupIndex) -> Option<Result<String, String>> {
        use gpuci_core::progress::{gate, Attempt, Gate};
        let latest = |dep: &str| {
            self.steps.get(&(j.pipeline_id, dep.to_string())).map(|(id, state, soft)| Attempt {
                step_key: "",
                job_id: *id,
                state: *state,
                soft_failed: *soft,
                // The gate skips after any skipped dependency; only the pipeline's state tells.
                skipped_by_condition: false,
            })
        };
        match gate(&j.step, latest) {
            Gate::Ready => {}
            Gate::Wait(why) => return Some(Ok(why)),
            Gate::Skip(why) => return Some(Err(why)),
        }
        if let Some(key) = self.group_of(j) {
            let (holder, first_queued) = groups.0.get(&key).copied().unwrap_or_default();
            if let Some(other) = holder.filter(|o| *o != j.id) {
                return Some(Ok(format!("waiting for job {other} in concurrency group {key}")));
            }
            if let Some(other) = first_queued.filter(|o| *o < j.id) {
                return Some(Ok(format!("waiting behind job {other} in concurrency group {key}")));
            }
        }
        None
    }

    /// Each concurrency group's first job (by id) that holds it (started, not queued) and its
    /// first queued job: read once a pass, so that each job's check is a look-up, not a walk
    /// over every active job (with thousands queued in groups, that walk per job was a pass
    /// quadratic in the queue).
    pub(super) fn group_index(&self) -> GroupIndex {
        let mut index: BTreeMap<gpuci_core::concurrency::GroupKey, (Option<JobId>, Option<JobId>)> = BTreeMap::new();
        for o in self.queue.grouped().filter_map(|id| self.active.get(&id)) {
            if let Some(key) = self.group_of(o) {
                let (holder, first_queued) = index.entry(key).or_default();
                match o.state {
                    JobState::Queued => first_queued.get_or_insert(o.id),
                    _ => holder.get_or_insert(o.id),
                };
            }
        }
        GroupIndex(index)
    }

    /// The concurrency group `j` is in, scoped (`gpuci_core::concurrency::group_key`). A
    /// pipeline whose scope could not be read counts as untrusted and of no repository: it
    /// never joins or cancels a trusted group.
    pub(super) fn group_of(&self, j: &JobRecord) -> Option<gpuci_core::concurrency::GroupKey> {
        use gpuci_core::concurrency::{group_key, TrustClass};
        let c = j.step.concurrency.as_ref()?;
        let (repo, trust) = match self.group_scopes.get(&j.pipeline_id) {
            Some((r, t)) => (r.as_ref(), *t),
            None => (None, TrustClass::Untrusted),
        };
        Some(group_key(&c.group, repo, trust, &self.shared_groups))
    }

    pub(super) fn group_scope(
        &self,
        repository: Option<&str>,
        origin: Option<&str>,
    ) -> (Option<gpuci_core::repo::RepoId>, gpuci_core::concurrency::TrustClass) {
        (
            crate::repos::of_pipeline(repository, origin, &self.github_host),
            gpuci_core::concurrency::TrustClass::of(Origin::cache_origin(origin).as_ref()),
        )
    }

    /// Reads the scope of every pipeline with unfinished jobs in concurrency groups (the only
    /// jobs a scope is asked for) that has none yet (after a restart), and now and then
    /// forgets those of pipelines that have finished. Linear in the grouped jobs, not in the
    /// queue: it runs at every pass and every submission.
    pub(super) async fn note_group_scopes(&mut self) {
        if self.group_scopes.len() > 2 * self.live_pipelines.len() + 1024 {
            self.group_scopes.retain(|p, _| self.live_pipelines.contains_key(p));
        }
        let wanted: BTreeSet<PipelineId> = self
            .queue
            .grouped()
            .filter_map(|id| self.active.get(&id))
            .map(|j| j.pipeline_id)
            .filter(|p| !self.group_scopes.contains_key(p))
            .collect();
        for p in wanted {
            match self.store.get_pipeline(p).await {
                Ok(Some(rec)) => {
                    let scope = self.group_scope(rec.repository.as_deref(), rec.origin.as_deref());
                    self.group_scopes.insert(p, scope);
                }
                Ok(None) => {}
                Err(e) => tracing::error!(pipeline = p, error = %e, "could not read the pipeline's repository"),
            }
        }
    }
}

/// Per concurrency group: its first holder and its first queued job ([`Brain::group_index`]).
pub(super) struct GroupIndex(BTreeMap<gpuci_core::concurrency::GroupKey, (Option<JobId>, Option<JobId>)>);
