//! Which origins may run outside the sandbox. The rule lives here and nowhere else; the
//! coordinator passes the answer to the agent with each assignment, and the agent refuses an
//! unsandboxed run without it (defence in depth: a stale or hostile coordinator message
//! cannot widen it).
//!
//! Only code that a token holder or a repository writer put there may run unsandboxed, and
//! then only on an agent started with `--allow-unsandboxed`: pipelines submitted through the
//! API, pushes, and pull requests from a branch of the repository by an owner, member or
//! collaborator. Never a pull request from a fork or an outside contributor (approved or not:
//! an approval lets such code use GPUs, not leave the sandbox), never an Actions runner job
//! (whose workflow may come from a fork; gpuci cannot tell before the runner takes it), and
//! never an origin gpuci cannot read.

use crate::cache::CacheOrigin;

/// Whether a job from `origin` (`None`: unreadable) may run without the sandbox.
pub fn may_run_unsandboxed(origin: Option<&CacheOrigin>) -> bool {
    match origin {
        Some(CacheOrigin::Direct) | Some(CacheOrigin::Push { .. }) => true,
        Some(CacheOrigin::PullRequest { trusted, .. }) => *trusted,
        Some(CacheOrigin::ActionsRunner) | None => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn forks_outsiders_runners_and_unknown_origins_never_run_unsandboxed() {
        let pr = |trusted| CacheOrigin::PullRequest { number: 1, base_branch: None, default_branch: None, trusted };
        assert!(may_run_unsandboxed(Some(&CacheOrigin::Direct)));
        assert!(may_run_unsandboxed(Some(&CacheOrigin::Push { git_ref: None, default_branch: None })));
        assert!(may_run_unsandboxed(Some(&pr(true))));
        assert!(!may_run_unsandboxed(Some(&pr(false))));
        assert!(!may_run_unsandboxed(Some(&CacheOrigin::ActionsRunner)));
        assert!(!may_run_unsandboxed(None));
    }
}
