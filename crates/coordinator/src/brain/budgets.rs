//! Repository budgets in the placement pass: whether a queued job's repository is past its
//! budget today, so that it runs on no fleet machine. The budgets reached come from the
//! fleets' loop ([`Command::FleetNotes`]); this only applies them.

use super::*;

impl Brain {
    /// Whether `job`'s repository is past its budget today (then it runs on no fleet machine).
    pub(super) async fn budget_held(&mut self, job: &JobRecord) -> bool {
        if self.budgets_reached.is_empty() {
            return false;
        }
        let repository = match self.repository_of.get(&job.pipeline_id) {
            Some(r) => r.clone(),
            None => {
                let r = match self.store.get_pipeline(job.pipeline_id).await {
                    Ok(p) => p.and_then(|p| {
                        crate::repos::name_of_pipeline(p.repository.as_deref(), p.origin.as_deref(), &self.github_host)
                    }),
                    // Unknown for now: held, as a budget must not lift for want of a read.
                    Err(_) => return true,
                };
                self.repository_of.insert(job.pipeline_id, r.clone());
                r
            }
        };
        repository.is_some_and(|r| self.budgets_reached.iter().any(|b| b.covers(&r)))
    }
}
