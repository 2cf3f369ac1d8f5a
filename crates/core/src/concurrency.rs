//! Concurrency groups: which jobs a step's `concurrency: {group: G}` waits for and cancels.
//! The rule lives here and nowhere else; the scheduler compares the keys this module gives
//! and applies the answer.
//!
//! A group name is the pipeline author's word, and authors do not know each other: a group is
//! therefore **scoped to the job's repository and trust class**. `G` of `github.com/acme/x`
//! is another group than `G` of `gitlab.com/acme/x` (before issue 27 one repository's
//! `cancel_in_progress: true` cancelled another's running job, and one repository's long job
//! held every other repository's jobs of the group). Trust classes:
//!
//! - trusted: pushes, pipelines submitted with an API token, pull requests by owners, members
//!   and collaborators from a branch of the repository itself;
//! - a pull request from a fork or an outsider (approved or not): a class of its own **per
//!   pull request**, so it can neither join nor cancel a trusted group, nor another pull
//!   request's (the name it chose stays its own, whatever it chose);
//! - anything else untrusted (an Actions runner job, an origin that cannot be read): a class
//!   of its own, never mixed with the trusted one.
//!
//! An operator may share a group between repositories in the server config:
//!
//! ```toml
//! [[concurrency.shared]]
//! group = "deploy-gpu"
//! repositories = ["acme/x", "gitlab.com/acme/*"]   # bare owner/name: on the GitHub host
//! ```
//!
//! Trusted jobs of the listed repositories then form one group `deploy-gpu`; untrusted jobs
//! of them never join it (their group of that name stays their own).

use crate::cache::CacheOrigin;
use crate::fleet::FleetConfigError;
use crate::repo::{RepoId, RepoPattern};
use serde::Deserialize;
use std::fmt;

/// How far the code of a job is trusted, as far as concurrency groups care.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum TrustClass {
    Trusted,
    /// A pull request from a fork or an outsider: its number.
    PullRequest(u64),
    /// Any other untrusted origin (Actions runner jobs, unreadable origins).
    Untrusted,
}

impl TrustClass {
    /// The class of a pipeline from `origin` (`None`: an origin that cannot be read). The
    /// same line as caches and unsandboxed runs draw ([`crate::cache`], [`crate::trust`]).
    pub fn of(origin: Option<&CacheOrigin>) -> TrustClass {
        match origin {
            Some(CacheOrigin::Direct) | Some(CacheOrigin::Push { .. }) => TrustClass::Trusted,
            Some(CacheOrigin::PullRequest { trusted: true, .. }) => TrustClass::Trusted,
            Some(CacheOrigin::PullRequest { number, trusted: false, .. }) => TrustClass::PullRequest(*number),
            Some(CacheOrigin::ActionsRunner) | None => TrustClass::Untrusted,
        }
    }
}

/// `[[concurrency.shared]]`: a group the operator shares between repositories.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SharedGroup {
    pub group: String,
    pub repositories: Vec<RepoPattern>,
}

/// What two jobs must have in common to be in one concurrency group.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct GroupKey {
    /// The group as the user wrote it.
    group: String,
    scope: Scope,
}

#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
enum Scope {
    /// Shared by the server config.
    Shared,
    /// One repository (`None`: pipelines submitted without one) and trust class.
    Own { repository: Option<RepoId>, trust: TrustClass },
}

impl GroupKey {
    /// The group as the user wrote it.
    pub fn group(&self) -> &str {
        &self.group
    }
}

/// The key of group `group` for a job of `repository` and `trust`, given the operator's
/// shared groups. Jobs are in one group exactly when their keys are equal.
pub fn group_key(group: &str, repository: Option<&RepoId>, trust: TrustClass, shared: &[SharedGroup]) -> GroupKey {
    let listed = trust == TrustClass::Trusted
        && repository
            .is_some_and(|r| shared.iter().any(|s| s.group == group && s.repositories.iter().any(|p| p.covers(r))));
    let scope = if listed { Scope::Shared } else { Scope::Own { repository: repository.cloned(), trust } };
    GroupKey { group: group.to_string(), scope }
}

/// `"G" of github.com/acme/x`: what a waiting job's reason says.
impl fmt::Display for GroupKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let g = &self.group;
        match &self.scope {
            Scope::Shared => write!(f, "{g:?} (shared by the server config)"),
            Scope::Own { repository, trust } => {
                match repository {
                    Some(r) => write!(f, "{g:?} of {r}")?,
                    None => write!(f, "{g:?} of pipelines without a repository")?,
                }
                match trust {
                    TrustClass::Trusted => Ok(()),
                    TrustClass::PullRequest(n) => write!(f, ", pull request #{n}"),
                    TrustClass::Untrusted => write!(f, ", untrusted jobs"),
                }
            }
        }
    }
}

#[derive(Deserialize)]
struct Document {
    #[serde(default)]
    concurrency: Option<ConcurrencyFile>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ConcurrencyFile {
    #[serde(default)]
    shared: Vec<SharedFile>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SharedFile {
    group: toml::Spanned<String>,
    repositories: Vec<toml::Spanned<String>>,
}

/// The `[concurrency]` section of a server config's text (`[[concurrency.shared]]`); bare
/// `owner/name` entries are on `github_host`. Errors say `file:line:column:
/// concurrency.shared[i]: field: what`. Other sections are ignored here.
pub fn parse_shared_groups(
    file_name: &str,
    text: &str,
    github_host: &str,
) -> Result<Vec<SharedGroup>, FleetConfigError> {
    let err = |offset: Option<usize>, what: String| FleetConfigError {
        file: file_name.to_string(),
        at: offset.map(|o| crate::fleet::line_col(text, o)),
        what,
    };
    let doc: Document = serde_path_to_error::deserialize(toml::Deserializer::new(text)).map_err(|e| {
        let offset = e.inner().span().map(|s| s.start);
        let message = e.inner().message().trim_end().to_string();
        // `concurrency.shared[0]: …`, as the file writes the table's name.
        err(
            offset,
            crate::fleet::describe_path(e.path(), &message).replacen("concurrency: shared", "concurrency.shared", 1),
        )
    })?;
    let Some(c) = doc.concurrency else { return Ok(Vec::new()) };
    let mut out: Vec<SharedGroup> = Vec::new();
    for (i, s) in c.shared.into_iter().enumerate() {
        let fail =
            |at: usize, field: &str, what: String| err(Some(at), format!("concurrency.shared[{i}]: {field}: {what}"));
        let (group_at, group) = (s.group.span().start, s.group.into_inner());
        if group.is_empty() || group.len() > 200 || group.chars().any(char::is_control) {
            return Err(fail(group_at, "group", "expected a group name as pipelines write it".into()));
        }
        if out.iter().any(|o| o.group == group) {
            return Err(fail(group_at, "group", format!("{group:?} is shared already; list its repositories once")));
        }
        if s.repositories.is_empty() {
            return Err(fail(group_at, "repositories", "name at least one repository".into()));
        }
        let mut repositories = Vec::new();
        for r in s.repositories {
            let at = r.span().start;
            let p =
                RepoPattern::parse(r.get_ref(), github_host).map_err(|e| fail(at, "repositories", e.to_string()))?;
            repositories.push(p);
        }
        out.push(SharedGroup { group, repositories });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn id(s: &str) -> RepoId {
        RepoId::parse(s, "github.com").unwrap()
    }

    #[test]
    fn forks_and_outsiders_pull_requests_are_untrusted_each_on_its_own() {
        let pr = |trusted| CacheOrigin::PullRequest { number: 4, base_branch: None, default_branch: None, trusted };
        assert_eq!(TrustClass::of(Some(&CacheOrigin::Direct)), TrustClass::Trusted);
        assert_eq!(
            TrustClass::of(Some(&CacheOrigin::Push { git_ref: None, default_branch: None })),
            TrustClass::Trusted
        );
        assert_eq!(TrustClass::of(Some(&pr(true))), TrustClass::Trusted);
        assert_eq!(TrustClass::of(Some(&pr(false))), TrustClass::PullRequest(4));
        assert_eq!(TrustClass::of(Some(&CacheOrigin::ActionsRunner)), TrustClass::Untrusted);
        assert_eq!(TrustClass::of(None), TrustClass::Untrusted);
    }

    #[test]
    fn one_group_name_in_two_repositories_is_two_groups() {
        let a = group_key("G", Some(&id("github.com/acme/x")), TrustClass::Trusted, &[]);
        let b = group_key("G", Some(&id("gitlab.com/acme/x")), TrustClass::Trusted, &[]);
        let c = group_key("G", Some(&id("https://github.com/Acme/X.git")), TrustClass::Trusted, &[]);
        assert_ne!(a, b);
        assert_eq!(a, c, "one repository however its remote is spelled");
        assert_eq!(a.to_string(), "\"G\" of github.com/acme/x");
        assert_ne!(a, group_key("G", None, TrustClass::Trusted, &[]));
    }

    #[test]
    fn a_forks_pull_request_joins_no_trusted_group_and_no_other_pull_requests() {
        let repo = id("acme/x");
        let trusted = group_key("deploy", Some(&repo), TrustClass::Trusted, &[]);
        let pr = group_key("deploy", Some(&repo), TrustClass::PullRequest(7), &[]);
        assert_ne!(trusted, pr);
        assert_ne!(pr, group_key("deploy", Some(&repo), TrustClass::PullRequest(8), &[]));
        assert_eq!(pr, group_key("deploy", Some(&repo), TrustClass::PullRequest(7), &[]));
        assert_ne!(trusted, group_key("deploy", Some(&repo), TrustClass::Untrusted, &[]));
        assert_eq!(pr.to_string(), "\"deploy\" of github.com/acme/x, pull request #7");
    }

    #[test]
    fn a_shared_group_joins_the_listed_repositories_trusted_jobs_only() {
        let shared = parse_shared_groups(
            "server.toml",
            "[[concurrency.shared]]\ngroup = \"deploy-gpu\"\nrepositories = [\"acme/x\", \"gitlab.com/acme/*\"]\n",
            "github.com",
        )
        .unwrap();
        let key = |r: &str, t| group_key("deploy-gpu", Some(&id(r)), t, &shared);
        let a = key("github.com/acme/x", TrustClass::Trusted);
        assert_eq!(a, key("gitlab.com/acme/sub/y", TrustClass::Trusted));
        assert_eq!(a.to_string(), "\"deploy-gpu\" (shared by the server config)");
        assert_ne!(a, key("github.com/acme/y", TrustClass::Trusted), "not listed");
        assert_ne!(a, key("github.com/acme/x", TrustClass::PullRequest(1)), "untrusted never joins");
        assert_ne!(a, key("github.com/acme/x", TrustClass::Untrusted));
        let other = group_key("other", Some(&id("acme/x")), TrustClass::Trusted, &shared);
        assert_ne!(other, group_key("other", Some(&id("gitlab.com/acme/x")), TrustClass::Trusted, &shared));
    }

    #[test]
    fn shared_groups_are_checked_and_errors_say_where() {
        let parse = |t: &str| parse_shared_groups("server.toml", t, "github.com").map_err(|e| e.to_string());
        assert_eq!(parse("[github]\nx = 1\n").unwrap(), []);
        let e = parse("[[concurrency.shared]]\ngroup = \"g\"\nrepositories = [\"acme\"]\n").unwrap_err();
        assert!(e.starts_with("server.toml:3:17: concurrency.shared[0]: repositories: repository \"acme\""), "{e}");
        let e = parse("[[concurrency.shared]]\ngroup = \"g\"\nrepositories = [\"a/b\"]\nmode = 1\n").unwrap_err();
        assert!(e.starts_with("server.toml:4:1: concurrency.shared[0]: unknown field `mode`"), "{e}");
        let e = parse("[concurrency]\nshard = []\n").unwrap_err();
        assert!(e.contains("unknown field `shard`"), "{e}");
        let e = parse("[[concurrency.shared]]\ngroup = \"g\"\nrepositories = []\n").unwrap_err();
        assert!(e.contains("concurrency.shared[0]: repositories: name at least one"), "{e}");
        let two = "[[concurrency.shared]]\ngroup = \"g\"\nrepositories = [\"a/b\"]\n";
        let e = parse(&format!("{two}{two}")).unwrap_err();
        assert!(e.starts_with("server.toml:5:9: concurrency.shared[1]: group: \"g\" is shared already"), "{e}");
        // GitHub Enterprise: a bare name is on its host.
        let ghe = parse_shared_groups("s", two, "ghe.example.com").unwrap();
        assert!(ghe[0].repositories[0].covers(&id("ghe.example.com/a/b")));
        assert!(!ghe[0].repositories[0].covers(&id("github.com/a/b")));
    }

    proptest! {
        /// Keys are equal only when group, repository and trust class are (nothing shared).
        #[test]
        fn keys_differ_whenever_repository_or_trust_differ(
            g in "[a-z]{1,3}", o1 in "[a-c]{1,2}", o2 in "[a-c]{1,2}", h1 in prop::bool::ANY, h2 in prop::bool::ANY,
            t1 in 0u64..3, t2 in 0u64..3,
        ) {
            let host = |b: bool| if b { "github.com" } else { "gitlab.com" };
            let trust = |t: u64| if t == 0 { TrustClass::Trusted } else { TrustClass::PullRequest(t) };
            let (r1, r2) = (id(&format!("{}/{o1}/x", host(h1))), id(&format!("{}/{o2}/x", host(h2))));
            let (k1, k2) = (group_key(&g, Some(&r1), trust(t1), &[]), group_key(&g, Some(&r2), trust(t2), &[]));
            prop_assert_eq!(k1 == k2, r1 == r2 && t1 == t2);
        }
    }
}
