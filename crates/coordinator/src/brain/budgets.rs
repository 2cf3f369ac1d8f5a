//! Repository budgets in the placement pass: whether a queued job's repository is past its
//! budget today, so that it runs on no fleet machine. The budgets reached come from the
//! fleets' loop ([`Command::FleetNotes`]); the decision is gpuci-core's
//! (`budget_hold::held`); this reads the job's repository when that decision needs it, and
//! remembers it.

use super::*;
use gpuci_core::budget_hold::{self, Repository};

impl Brain {
    /// Whether `job`'s repository is past its budget today (then it runs on no fleet machine).
    pub(super) async fn budget_held(&mut self, job: &JobRecord) -> bool {
        if !budget_hold::needs_repository(&self.budgets_reached) {
            return budget_hold::held(&self.budgets_reached, Repository::Absent);
        }
        let repository = match self.repository_of.get(&job.pipeline_id) {
            Some(r) => r.clone(),
            None => match self.store.get_pipeline(job.pipeline_id).await {
                Ok(p) => {
                    let r = p.and_then(|p| {
                        crate::repos::name_of_pipeline(p.repository.as_deref(), p.origin.as_deref(), &self.github_host)
                    });
                    self.repository_of.insert(job.pipeline_id, r.clone());
                    r
                }
                // Not remembered: read again at the next pass.
                Err(_) => return budget_hold::held(&self.budgets_reached, Repository::Unread),
            },
        };
        let known = repository.as_deref().map_or(Repository::Absent, Repository::Named);
        budget_hold::held(&self.budgets_reached, known)
    }
}
