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
//! **Room on the agent** ([`plan_save`], [`CacheQuota`]). Caches live on the agent's disk
//! after their job is gone, so they are bounded there, not by the job's disk quota: a
//! job's quota bounds what one job holds while it runs, and a thousand pull requests each
//! under their quota would still fill the host. Instead the agent holds each trust class in a
//! budget of its own: every repository's caches of one class together stay under a
//! per-repository quota (over it, that repository's own least recently used caches of that
//! class go; a save over it alone is refused, with the reason in the job's log), untrusted
//! caches of all repositories together stay under a share of their own, and when the agent as
//! a whole is full a trusted save may push out untrusted caches (then trusted ones) while an
//! untrusted save may only push out untrusted caches, or is refused. Nothing an untrusted job
//! saves ever removes or replaces a trusted cache.
//!
//! Keys are plain data here; the agent turns a key into a file name by hashing it, so no
//! repository URL, branch name or path ever becomes part of a path on the agent's host.

use crate::quantity::Bytes;
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

/// Room for caches on one agent, by trust class and repository (see [`plan_save`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CacheQuota {
    /// All caches together.
    pub total: Bytes,
    /// One repository's caches of one trust class.
    pub per_repository: Bytes,
    /// All untrusted caches together, of every repository.
    pub untrusted: Bytes,
}

impl CacheQuota {
    /// The default split of `total`: two fifths per repository and trust class, one fifth for
    /// every untrusted cache together (50 GiB: 20 GiB and 10 GiB). Trusted caches may use the
    /// rest, the untrusted fifth included where untrusted caches leave it free.
    pub fn for_total(total: Bytes) -> CacheQuota {
        CacheQuota { total, per_repository: Bytes(total.0 / 5 * 2), untrusted: Bytes(total.0 / 5) }
    }

    /// What one repository's caches of class `trust` may hold together.
    pub fn repository(&self, trust: Trust) -> Bytes {
        match trust {
            Trust::Trusted => Bytes(self.per_repository.0.min(self.total.0)),
            Trust::Untrusted => Bytes(self.per_repository.0.min(self.untrusted.0).min(self.total.0)),
        }
    }
}

/// A saved cache as the quota sees it. `repository` is any stable name of the key's
/// repository (the agent uses a hash of it); `id` names the cache to evict.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoredCache<Id> {
    pub id: Id,
    pub repository: String,
    pub trust: Trust,
    pub bytes: u64,
    /// Restored or saved last; the least recently used go first.
    pub last_used: std::time::SystemTime,
}

/// A save about to happen: the cache `id` of `repository` and class `trust` will hold
/// `bytes` (its old copy, if any, is replaced, so it is not counted twice). `job_trusted`:
/// the job that saves is of a trusted origin (`crate::trust`, as the assignment says).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SaveRequest<Id> {
    pub id: Id,
    pub repository: String,
    pub trust: Trust,
    pub job_trusted: bool,
    pub bytes: u64,
}

/// Why a cache is not saved. Shown in the job's log after `cache: not saved: `.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SaveRefused {
    #[error("a job of an untrusted origin never writes a trusted cache")]
    TrustedKeyFromUntrustedJob,
    #[error("{bytes} is over this agent's quota of {quota} for one repository's {} caches", class(*.trust))]
    OverRepositoryQuota { trust: Trust, bytes: Bytes, quota: Bytes },
    #[error("{bytes} is over this agent's room of {quota} for untrusted caches")]
    OverUntrustedQuota { bytes: Bytes, quota: Bytes },
    #[error("{bytes} does not fit beside this agent's trusted caches ({kept} kept in all, room for {total}); untrusted caches never push them out")]
    NoRoomBesideTrusted { bytes: Bytes, kept: Bytes, total: Bytes },
    #[error("{bytes} is over this agent's room of {total} for all caches")]
    OverTotal { bytes: Bytes, total: Bytes },
}

fn class(t: Trust) -> &'static str {
    match t {
        Trust::Trusted => "trusted",
        Trust::Untrusted => "untrusted",
    }
}

/// Which caches to remove so that `save` fits, or why it must not be saved. The rules, here
/// and nowhere else:
///
/// 1. A job of an untrusted origin never writes a trusted key (defence in depth: the key
///    comes from the coordinator, the job's class from the same assignment).
/// 2. A repository's caches of one class hold at most [`CacheQuota::repository`]; a save over
///    that is refused, else that repository's own caches *of the same class*, least recently
///    used first, make room.
/// 3. Untrusted caches of every repository together hold at most [`CacheQuota::untrusted`];
///    only untrusted caches make room for them.
/// 4. All caches together hold at most [`CacheQuota::total`]. A trusted save makes room by
///    removing untrusted caches first, then trusted ones; an untrusted save may only remove
///    untrusted caches, and is refused where that is not enough.
///
/// So nothing an untrusted job saves ever removes or replaces a trusted cache, and one
/// repository's saves only push out another repository's caches where the agent as a whole
/// is full (never its untrusted saves a trusted cache of another). The cache being replaced
/// (`save.id`) is never in the plan: its old copy is replaced, not evicted. The plan is all or
/// nothing: a refused save removes nothing.
pub fn plan_save<Id: Clone + PartialEq>(
    stored: &[StoredCache<Id>],
    save: &SaveRequest<Id>,
    quota: &CacheQuota,
) -> Result<Vec<Id>, SaveRefused> {
    if save.trust == Trust::Trusted && !save.job_trusted {
        return Err(SaveRefused::TrustedKeyFromUntrustedJob);
    }
    let bytes = save.bytes;
    let limit = quota.repository(save.trust);
    if bytes > limit.0 {
        return Err(SaveRefused::OverRepositoryQuota { trust: save.trust, bytes: Bytes(bytes), quota: limit });
    }
    if save.trust == Trust::Untrusted && bytes > quota.untrusted.0 {
        return Err(SaveRefused::OverUntrustedQuota { bytes: Bytes(bytes), quota: quota.untrusted });
    }
    if bytes > quota.total.0 {
        return Err(SaveRefused::OverTotal { bytes: Bytes(bytes), total: quota.total });
    }
    // Everything else, least recently used first; what the plan removes leaves `kept`.
    let mut kept: Vec<&StoredCache<Id>> = stored.iter().filter(|c| c.id != save.id).collect();
    kept.sort_by_key(|c| c.last_used);
    let mut evict: Vec<Id> = Vec::new();
    let sum = |kept: &[&StoredCache<Id>], f: &dyn Fn(&StoredCache<Id>) -> bool| {
        kept.iter().filter(|c| f(c)).fold(0u64, |s, c| s.saturating_add(c.bytes))
    };
    // Remove the least recently used of those `may_go`, while `over` says there is too little room.
    let mut make_room = |kept: &mut Vec<&StoredCache<Id>>,
                         may_go: &dyn Fn(&StoredCache<Id>) -> bool,
                         counts: &dyn Fn(&StoredCache<Id>) -> bool,
                         limit: u64| {
        while sum(kept, counts).saturating_add(bytes) > limit {
            let Some(at) = kept.iter().position(|c| may_go(c)) else { return false };
            evict.push(kept.remove(at).id.clone());
        }
        true
    };
    let own = |c: &StoredCache<Id>| c.repository == save.repository && c.trust == save.trust;
    let untrusted = |c: &StoredCache<Id>| c.trust == Trust::Untrusted;
    let any = |_: &StoredCache<Id>| true;
    // Rule 2: always possible (the save alone fits, and all of its own may go).
    make_room(&mut kept, &own, &own, limit.0);
    if save.trust == Trust::Untrusted {
        make_room(&mut kept, &untrusted, &untrusted, quota.untrusted.0);
        if !make_room(&mut kept, &untrusted, &any, quota.total.0) {
            let kept = Bytes(sum(&kept, &any));
            return Err(SaveRefused::NoRoomBesideTrusted { bytes: Bytes(bytes), kept, total: quota.total });
        }
    } else if !make_room(&mut kept, &untrusted, &any, quota.total.0) {
        make_room(&mut kept, &any, &any, quota.total.0);
    }
    Ok(evict)
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

    fn at(secs: u64) -> std::time::SystemTime {
        std::time::UNIX_EPOCH + std::time::Duration::from_secs(secs)
    }

    fn stored(id: u32, repository: &str, trust: Trust, bytes: u64, used: u64) -> StoredCache<u32> {
        StoredCache { id, repository: repository.into(), trust, bytes, last_used: at(used) }
    }

    fn request(id: u32, repository: &str, trust: Trust, bytes: u64) -> SaveRequest<u32> {
        SaveRequest { id, repository: repository.into(), trust, job_trusted: trust == Trust::Trusted, bytes }
    }

    const QUOTA: CacheQuota = CacheQuota { total: Bytes(100), per_repository: Bytes(40), untrusted: Bytes(20) };

    #[test]
    fn untrusted_saves_never_push_out_trusted_caches() {
        // The agent is full of trusted caches (older than anything): an untrusted save is refused.
        let full: Vec<_> = (0..5).map(|i| stored(i, &format!("r{i}"), Trust::Trusted, 20, i as u64)).collect();
        let e = plan_save(&full, &request(9, "fork", Trust::Untrusted, 10), &QUOTA).unwrap_err();
        assert!(matches!(e, SaveRefused::NoRoomBesideTrusted { .. }), "{e}");
        assert!(e.to_string().contains("never push them out"), "{e}");
        // With untrusted caches there, only they make room.
        let mut some = full[..4].to_vec();
        some.push(stored(5, "r0", Trust::Untrusted, 10, 100));
        some.push(stored(6, "r1", Trust::Untrusted, 10, 200));
        assert_eq!(plan_save(&some, &request(9, "r0", Trust::Untrusted, 15), &QUOTA), Ok(vec![5, 6]));
    }

    #[test]
    fn a_trusted_save_removes_untrusted_caches_before_trusted_ones() {
        let s = vec![
            stored(1, "a", Trust::Trusted, 30, 1),
            stored(2, "b", Trust::Trusted, 30, 2),
            stored(3, "c", Trust::Untrusted, 20, 50),
            stored(4, "d", Trust::Trusted, 10, 3),
        ];
        assert_eq!(plan_save(&s, &request(9, "e", Trust::Trusted, 15), &QUOTA), Ok(vec![3]));
        assert_eq!(plan_save(&s, &request(9, "e", Trust::Trusted, 35), &QUOTA), Ok(vec![3, 1]));
    }

    #[test]
    fn a_repository_over_its_quota_loses_its_own_oldest_caches_of_its_class() {
        let s = vec![
            stored(1, "a", Trust::Trusted, 15, 1),
            stored(2, "a", Trust::Untrusted, 15, 0),
            stored(3, "b", Trust::Trusted, 15, 0),
            stored(4, "a", Trust::Trusted, 15, 5),
            stored(5, "a", Trust::Trusted, 5, 9),
        ];
        // 35 of a's trusted + 10 is over 40: a's oldest trusted cache goes, nothing else.
        assert_eq!(plan_save(&s, &request(9, "a", Trust::Trusted, 10), &QUOTA), Ok(vec![1]));
        // Its own old copy is replaced, not counted and not evicted.
        assert_eq!(plan_save(&s, &request(4, "a", Trust::Trusted, 20), &QUOTA), Ok(vec![]));
        // A save over the quota by itself is refused, and removes nothing.
        let e = plan_save(&s, &request(9, "a", Trust::Trusted, 41), &QUOTA).unwrap_err();
        assert_eq!(e, SaveRefused::OverRepositoryQuota { trust: Trust::Trusted, bytes: Bytes(41), quota: Bytes(40) });
        assert!(e.to_string().contains("quota of 40 B for one repository's trusted caches"), "{e}");
        // An untrusted cache has the smaller of the two quotas.
        let e = plan_save(&s, &request(9, "a", Trust::Untrusted, 21), &QUOTA).unwrap_err();
        assert!(matches!(e, SaveRefused::OverRepositoryQuota { trust: Trust::Untrusted, .. }), "{e}");
    }

    #[test]
    fn a_job_of_an_untrusted_origin_never_writes_a_trusted_key() {
        let mut r = request(1, "a", Trust::Trusted, 1);
        r.job_trusted = false;
        assert_eq!(plan_save::<u32>(&[], &r, &QUOTA), Err(SaveRefused::TrustedKeyFromUntrustedJob));
    }

    #[test]
    fn the_default_split_leaves_trusted_caches_most_of_the_room() {
        let q = CacheQuota::for_total(Bytes(50 * Bytes::GIB));
        assert_eq!((q.per_repository, q.untrusted), (Bytes(20 * Bytes::GIB), Bytes(10 * Bytes::GIB)));
        assert_eq!(q.repository(Trust::Untrusted), Bytes(10 * Bytes::GIB));
    }

    fn any_stored() -> impl Strategy<Value = Vec<StoredCache<u32>>> {
        let one = (prop::sample::select(vec!["a", "b", "c"]), any::<bool>(), 0u64..40, 0u64..100);
        prop::collection::vec(one, 0..12).prop_map(|v| {
            v.into_iter()
                .enumerate()
                .map(|(i, (r, t, b, u))| stored(i as u32, r, if t { Trust::Trusted } else { Trust::Untrusted }, b, u))
                .collect()
        })
    }

    proptest! {
        /// Whatever is stored: an untrusted save never removes a trusted cache; a planned save
        /// leaves every budget kept; a refused save removes nothing (there is nothing to apply).
        #[test]
        fn plans_keep_every_budget_and_trusted_caches_are_safe_from_untrusted_saves(
            s in any_stored(),
            id in 0u32..16,
            repo in prop::sample::select(vec!["a", "b", "c"]),
            trusted in any::<bool>(),
            bytes in 0u64..60,
        ) {
            let trust = if trusted { Trust::Trusted } else { Trust::Untrusted };
            // A save replaces a cache of its own key only: same repository and class.
            let s: Vec<_> = s.into_iter().filter(|c| c.id != id || (c.repository == repo && c.trust == trust)).collect();
            let req = request(id, repo, trust, bytes);
            let Ok(evict) = plan_save(&s, &req, &QUOTA) else { return Ok(()) };
            prop_assert!(!evict.contains(&id));
            for e in &evict {
                let c = s.iter().find(|c| c.id == *e).unwrap();
                prop_assert!(trusted || c.trust == Trust::Untrusted, "untrusted save evicts {c:?}");
            }
            let after: Vec<_> = s.iter().filter(|c| c.id != id && !evict.contains(&c.id)).collect();
            let used = |f: &dyn Fn(&StoredCache<u32>) -> bool| after.iter().filter(|c| f(c)).map(|c| c.bytes).sum::<u64>();
            prop_assert!(used(&|c| c.repository == repo && c.trust == trust) + bytes <= QUOTA.repository(trust).0);
            if !trusted {
                prop_assert!(used(&|c| c.trust == Trust::Untrusted) + bytes <= QUOTA.untrusted.0);
            }
            prop_assert!(used(&|_| true) + bytes <= QUOTA.total.0);
        }
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
