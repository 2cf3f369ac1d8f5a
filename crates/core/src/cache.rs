//! Cache scopes: which saved `cache:` trees a job may start from, and where its own is kept.
//!
//! Every job is hostile, and a cache is how one job's files reach a later job. So the rule,
//! here and nowhere else: **a job only restores what jobs at least as trusted as itself
//! saved**. The scoping is the one users know from GitHub Actions' cache:
//!
//! | pipeline from | restores, first found wins | saves to |
//! |---|---|---|
//! | `gpuci submit` / `gpuci run` (API token holder) | the repository's | the repository's |
//! | a push to a ref | that ref's, then the default branch's | that ref's |
//! | a pull request | its own (by number), then its base branch's, then the default branch's | its own |
//! | an Actions runner job | nothing | nothing |
//!
//! Every key also carries the trust class of the jobs that may write it. A pull request
//! from a fork or from someone who is not an owner, member or collaborator is
//! [`Trust::Untrusted`] — approval lets it run on GPUs, it does not make its code ours — so
//! its own cache is a key no trusted job ever lists. A pull request whose author's standing
//! changes later (added as a collaborator) therefore starts from a clean cache of its own.
//! Pull requests may *read* their base branch's cache (trusted), as on GitHub; their writes
//! land under `pull/<n>` only, which no push and no other pull request restores.
//!
//! Runner jobs run a GitHub Actions workflow; it caches through GitHub's cache service, and
//! their step (made by gpuci) has no `cache:`. They get no scope, so whatever their origin,
//! they never write a gpuci cache.
//!
//! Keys are plain data here; the agent turns a key into a file name by hashing it, so no
//! repository URL, branch name or path ever becomes part of a path on the agent's host.

use serde::{Deserialize, Serialize};
use std::fmt;

/// Who may write a cache key: only jobs of this class save to it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Trust {
    /// Pushes, pipelines submitted with an API token, pull requests by collaborators from a
    /// branch of the repository itself.
    Trusted,
    /// Pull requests from forks or from outside contributors (approved or not).
    Untrusted,
}

/// One cache: a repository, the trust class that writes it, and the scope inside it.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct CacheKey {
    /// As the pipeline names it (a GitHub `github.com/owner/name`, a git remote URL, a path).
    pub repository: String,
    pub trust: Trust,
    /// `repository` (pipelines submitted directly), a full git ref (`refs/heads/main`), or
    /// `pull/<number>`.
    pub scope: String,
}

impl CacheKey {
    fn new(repository: &str, trust: Trust, scope: impl Into<String>) -> Self {
        CacheKey { repository: repository.to_string(), trust, scope: scope.into() }
    }

    /// One unambiguous string per key (JSON of the three fields); what the agent hashes
    /// into a directory name. Two keys differ exactly when their identities differ.
    pub fn identity(&self) -> String {
        serde_json::to_string(&(&self.repository, self.trust, &self.scope)).unwrap_or_default()
    }
}

impl fmt::Display for CacheKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let trust = match self.trust {
            Trust::Trusted => "trusted",
            Trust::Untrusted => "untrusted",
        };
        write!(f, "{} ({trust})", self.scope)
    }
}

/// What a job may do with caches.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CacheScope {
    /// Keys in order of preference; each cached path comes from the first key that has it.
    #[serde(default)]
    pub restore: Vec<CacheKey>,
    /// Where the job's cached paths are kept afterwards; `None`: the job only reads.
    #[serde(default)]
    pub save: Option<CacheKey>,
}

impl CacheScope {
    /// No cache at all.
    pub fn none() -> Self {
        CacheScope::default()
    }

    pub fn is_none(&self) -> bool {
        self.restore.is_empty() && self.save.is_none()
    }
}

/// Where a pipeline came from, as far as caches care.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CacheOrigin {
    /// Submitted through the API (`gpuci submit`, `gpuci run`) by a token holder.
    Direct,
    /// A push. `git_ref` is the full ref (`refs/heads/feature`); `default_branch` the
    /// repository's default branch name (`main`). Either may be unknown (older records).
    Push { git_ref: Option<String>, default_branch: Option<String> },
    /// A pull request into `base_branch` (a branch name). `trusted`: from a branch of the
    /// repository itself by an owner, member or collaborator.
    PullRequest { number: u64, base_branch: Option<String>, default_branch: Option<String>, trusted: bool },
    /// One ephemeral GitHub Actions runner.
    ActionsRunner,
}

/// The caches a job of `repository` from `origin` restores and saves. See the module header
/// for the rules.
pub fn scope(repository: &str, origin: &CacheOrigin) -> CacheScope {
    let branch = |name: &Option<String>| {
        name.as_deref().filter(|n| !n.is_empty()).map(|n| CacheKey::new(repository, Trust::Trusted, branch_ref(n)))
    };
    let (own, fallbacks) = match origin {
        CacheOrigin::Direct => (Some(CacheKey::new(repository, Trust::Trusted, "repository")), vec![]),
        CacheOrigin::Push { git_ref, default_branch } => {
            let own =
                git_ref.as_deref().filter(|r| !r.is_empty()).map(|r| CacheKey::new(repository, Trust::Trusted, r));
            (own, vec![branch(default_branch)])
        }
        CacheOrigin::PullRequest { number, base_branch, default_branch, trusted } => {
            let trust = if *trusted { Trust::Trusted } else { Trust::Untrusted };
            let own = CacheKey::new(repository, trust, format!("pull/{number}"));
            (Some(own), vec![branch(base_branch), branch(default_branch)])
        }
        CacheOrigin::ActionsRunner => return CacheScope::none(),
    };
    let mut restore: Vec<CacheKey> = Vec::new();
    for key in own.iter().cloned().chain(fallbacks.into_iter().flatten()) {
        if !restore.contains(&key) {
            restore.push(key);
        }
    }
    CacheScope { restore, save: own }
}

/// `main` → `refs/heads/main`; a name that already is a full ref stays as it is.
fn branch_ref(name: &str) -> String {
    if name.starts_with("refs/") {
        name.to_string()
    } else {
        format!("refs/heads/{name}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const REPO: &str = "github.com/octo/gpu";

    fn key(trust: Trust, scope: &str) -> CacheKey {
        CacheKey::new(REPO, trust, scope)
    }

    fn push(r: &str) -> CacheOrigin {
        CacheOrigin::Push { git_ref: Some(r.into()), default_branch: Some("main".into()) }
    }

    fn pr(number: u64, trusted: bool) -> CacheOrigin {
        CacheOrigin::PullRequest {
            number,
            base_branch: Some("release".into()),
            default_branch: Some("main".into()),
            trusted,
        }
    }

    #[test]
    fn a_direct_submission_has_one_trusted_cache_per_repository() {
        let s = scope(REPO, &CacheOrigin::Direct);
        assert_eq!(s.restore, vec![key(Trust::Trusted, "repository")]);
        assert_eq!(s.save, Some(key(Trust::Trusted, "repository")));
    }

    #[test]
    fn a_push_restores_its_branch_then_the_default_branch_and_saves_its_branch() {
        let s = scope(REPO, &push("refs/heads/feature"));
        assert_eq!(s.restore, vec![key(Trust::Trusted, "refs/heads/feature"), key(Trust::Trusted, "refs/heads/main")]);
        assert_eq!(s.save, Some(key(Trust::Trusted, "refs/heads/feature")));
        let s = scope(REPO, &push("refs/heads/main"));
        assert_eq!(s.restore, vec![key(Trust::Trusted, "refs/heads/main")], "no duplicate fallback");
    }

    #[test]
    fn a_push_of_unknown_ref_only_reads_the_default_branch() {
        let s = scope(REPO, &CacheOrigin::Push { git_ref: None, default_branch: Some("main".into()) });
        assert_eq!(s.restore, vec![key(Trust::Trusted, "refs/heads/main")]);
        assert_eq!(s.save, None);
        assert!(scope(REPO, &CacheOrigin::Push { git_ref: None, default_branch: None }).is_none());
    }

    #[test]
    fn a_fork_pull_request_reads_its_base_and_writes_only_its_own_untrusted_cache() {
        let s = scope(REPO, &pr(7, false));
        assert_eq!(
            s.restore,
            vec![
                key(Trust::Untrusted, "pull/7"),
                key(Trust::Trusted, "refs/heads/release"),
                key(Trust::Trusted, "refs/heads/main")
            ]
        );
        assert_eq!(s.save, Some(key(Trust::Untrusted, "pull/7")));
    }

    #[test]
    fn a_collaborators_pull_request_keeps_its_own_trusted_cache() {
        let s = scope(REPO, &pr(8, true));
        assert_eq!(s.restore[0], key(Trust::Trusted, "pull/8"));
        assert_eq!(s.save, Some(key(Trust::Trusted, "pull/8")));
        assert_ne!(scope(REPO, &pr(8, false)).save, s.save, "a change of standing starts a clean cache");
    }

    #[test]
    fn actions_runner_jobs_get_no_cache() {
        assert!(scope(REPO, &CacheOrigin::ActionsRunner).is_none());
    }

    #[test]
    fn repositories_never_share_a_key_and_identities_are_unambiguous() {
        let a = scope("github.com/a/b", &CacheOrigin::Direct);
        let b = scope("github.com/a/c", &CacheOrigin::Direct);
        assert_ne!(a.save, b.save);
        let x = CacheKey::new("a\",\"trusted", Trust::Trusted, "b");
        let y = CacheKey::new("a", Trust::Trusted, "\",\"trusted\",\"b");
        assert_ne!(x.identity(), y.identity());
    }

    fn any_origin() -> impl Strategy<Value = CacheOrigin> {
        let name = prop::option::of(prop::sample::select(vec!["main", "release", "feature", "", "refs/heads/main"]));
        let name = name.prop_map(|n| n.map(str::to_string));
        prop_oneof![
            Just(CacheOrigin::Direct),
            Just(CacheOrigin::ActionsRunner),
            (name.clone(), name.clone()).prop_map(|(r, d)| CacheOrigin::Push {
                git_ref: r.map(|r| if r.starts_with("refs/") || r.is_empty() { r } else { format!("refs/heads/{r}") }),
                default_branch: d
            }),
            (1u64..4, name.clone(), name, any::<bool>()).prop_map(|(number, b, d, trusted)| CacheOrigin::PullRequest {
                number,
                base_branch: b,
                default_branch: d,
                trusted
            }),
        ]
    }

    fn trusted(o: &CacheOrigin) -> bool {
        !matches!(o, CacheOrigin::PullRequest { trusted: false, .. })
    }

    proptest! {
        /// What an untrusted job saves, no trusted job restores; what a pull request saves,
        /// no push, direct submission or other pull request restores.
        #[test]
        fn writes_never_reach_a_more_trusted_or_unrelated_reader(writer in any_origin(), reader in any_origin()) {
            let Some(saved) = scope(REPO, &writer).save else { return Ok(()) };
            let restored = scope(REPO, &reader).restore;
            if !trusted(&writer) && trusted(&reader) {
                prop_assert!(!restored.contains(&saved), "{writer:?} wrote {saved} which {reader:?} restores");
            }
            if let CacheOrigin::PullRequest { number, .. } = writer {
                let same_pr = matches!(reader, CacheOrigin::PullRequest { number: n, .. } if n == number);
                prop_assert!(same_pr || !restored.contains(&saved), "{writer:?} wrote {saved} which {reader:?} restores");
            }
            prop_assert_eq!(saved.trust == Trust::Trusted, trusted(&writer));
        }

        /// A job restores its own save key first, so it continues where it left off.
        #[test]
        fn the_save_key_is_restored_first(o in any_origin()) {
            let s = scope(REPO, &o);
            if let Some(saved) = &s.save {
                prop_assert_eq!(s.restore.first(), Some(saved));
            }
        }
    }
}
