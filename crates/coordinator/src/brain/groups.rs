//! What holds a queued job back other than capacity: its step's gate over its dependencies'
//! latest attempts, and its concurrency group, scoped by repository and trust class.

use super::*;

impl Brain {
    /// Why a queued job cannot start yet, if something other than capacity holds it back:
    /// `Ok` while it waits, `Err` when it can never run.
    pub(super) fn blocked(&self, j: &JobRecord) -> Option<Result<String, String>> {
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
            if let Some(other) = self
                .active
                .values()
                .find(|o| o.id != j.id && o.state != JobState::Queued && self.group_of(o).as_ref() == Some(&key))
            {
                return Some(Ok(format!("waiting for job {} in concurrency group {key}", other.id)));
            }
            if let Some(other) = self
                .active
                .values()
                .find(|o| o.id < j.id && o.state == JobState::Queued && self.group_of(o).as_ref() == Some(&key))
            {
                return Some(Ok(format!("waiting behind job {} in concurrency group {key}", other.id)));
            }
        }
        None
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

    /// Reads the scope of every pipeline with unfinished jobs that has none yet (after a
    /// restart), and forgets those of pipelines that have finished.
    pub(super) async fn note_group_scopes(&mut self) {
        let live: BTreeSet<PipelineId> = self.active.values().map(|j| j.pipeline_id).collect();
        self.group_scopes.retain(|p, _| live.contains(p));
        for p in live {
            if self.group_scopes.contains_key(&p) {
                continue;
            }
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
