//! Where a secret may be used: the whole coordinator, one repository, or a repository's refs
//! matching a pattern (`refs/heads/main`, `refs/tags/v*`), and which of a name's scoped values
//! a job gets. Pure: the coordinator asks [`choose`] with what it stored and where the job came
//! from, and applies the answer.
//!
//! The rule: among the scopes that cover the job, the narrowest wins (a ref pattern over its
//! repository over the whole coordinator; an exact ref over a pattern; a longer pattern over a
//! shorter one). A name that exists only in scopes that do not cover the job is refused with
//! the scopes it does have, never silently treated as unset.
//!
//! A scope is stored as part of the secret's storage name ([`SecretScope::storage_name`]), so
//! the value's seal (which covers that name) binds it to its scope: a value copied into
//! another scope's row does not open.
//!
//! Repositories are named with their host where it matters: a bare `owner/name` (every scope
//! stored before hosts were kept, and what `--repo owner/name` still means) is that
//! repository on the configured GitHub host — `github.com` unless GitHub Enterprise is
//! configured; a repository elsewhere is `host/path` (`gitlab.com/acme/x`). A work tree of
//! `gitlab.com/acme/x` is not `acme/x` and gets none of its secrets ([`crate::repo`]).

use std::fmt;

/// Where a secret may be used.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum SecretScope {
    /// Every job that names it (set by the coordinator's admin).
    Global,
    /// Jobs from this repository (`owner/name` on the configured GitHub host, or
    /// `host/path`: [`valid_repository`]).
    Repository(String),
    /// Jobs from this repository whose git ref matches the pattern (`*` matches any run of
    /// characters, `/` included).
    Ref { repository: String, pattern: String },
    /// Steps of this repository that declare `environment: NAME`, and, with a pattern, only
    /// on matching refs (a deployment environment's branch rule).
    Environment { repository: String, environment: String, pattern: Option<String> },
    /// Pull requests from forks of this repository whose head commit a maintainer approved:
    /// the only scope such a job may get anything from (the approval policy). No other job
    /// gets it.
    ApprovedForks(String),
}

/// Where a job came from, as far as secrets are concerned.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct JobSource {
    /// `owner/name` on the configured GitHub host, `host/path` elsewhere
    /// ([`crate::repo::RepoId::short_on`]), when known.
    pub repository: Option<String>,
    /// The full ref (`refs/heads/main`, `refs/pull/7/merge`), when known.
    pub git_ref: Option<String>,
    /// The environment the step declares (`environment: production`).
    pub environment: Option<String>,
    /// False for origins that never get secrets (pull requests from forks).
    pub may_have_secrets: bool,
    /// A pull request from a fork whose head commit a maintainer approved: it gets only
    /// [`SecretScope::ApprovedForks`] values (with `may_have_secrets` false).
    pub approved_fork: bool,
    /// For messages: "a push to octo/kernels refs/heads/dev", "a pull request from a fork".
    pub description: String,
}

/// Why a job does not get a secret it names.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// No value in any scope (that the job's repository may know of).
    NotSet { name: String, repository: Option<String> },
    /// Values exist, none for this job.
    OutOfScope { name: String, scopes: Vec<SecretScope>, job: String },
    /// The job's origin gets no secrets at all.
    NoSecrets { name: String, job: String },
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Refusal::NotSet { name, repository: None } => {
                write!(f, "secret `{name}` is not set (gpuci secret set {name})")
            }
            Refusal::NotSet { name, repository: Some(r) } => {
                write!(f, "secret `{name}` is not set for {r} (gpuci secret set {name} --repo {r})")
            }
            Refusal::OutOfScope { name, scopes, job } => {
                let list: Vec<String> = scopes.iter().map(ToString::to_string).collect();
                write!(f, "secret `{name}` is scoped to {}; this job is from {job}", list.join(" and "))
            }
            Refusal::NoSecrets { name, job } => {
                write!(f, "secret `{name}` is not given to this job: it is from {job}, which gets no secrets")
            }
        }
    }
}

impl fmt::Display for SecretScope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SecretScope::Global => write!(f, "every pipeline"),
            SecretScope::Repository(r) => write!(f, "{r}"),
            SecretScope::Ref { repository, pattern } => write!(f, "{repository} {pattern}"),
            SecretScope::Environment { repository, environment, pattern: None } => {
                write!(f, "{repository} environment {environment}")
            }
            SecretScope::Environment { repository, environment, pattern: Some(p) } => {
                write!(f, "{repository} environment {environment} on {p}")
            }
            SecretScope::ApprovedForks(r) => write!(f, "approved pull requests from forks of {r}"),
        }
    }
}

/// The prefix of a value encrypted with `gpuci secret encrypt` (see the `gpuci-repo-secrets`
/// crate for the format).
pub const SEALED_PREFIX: &str = "gpuci:v1:";

/// Whether `text` has the shape of such a value: `gpuci:v1:<12 hex digits>:<base64>`.
pub fn is_sealed_text(text: &str) -> bool {
    let Some((id, b64)) = text.strip_prefix(SEALED_PREFIX).and_then(|t| t.split_once(':')) else {
        return false;
    };
    id.len() == 12
        && id.bytes().all(|b| b.is_ascii_hexdigit())
        && !b64.is_empty()
        && b64.bytes().all(|b| b.is_ascii_alphanumeric() || b"+/=".contains(&b))
}

/// A scope's repository: `owner/name` as GitHub spells them (letters, digits, `.`, `_`, `-`),
/// which is that repository on the configured GitHub host (what stored scopes always meant),
/// or a repository on another host as its identity prints (`gitlab.com/acme/x`, see
/// [`crate::repo`]). The coordinator turns other spellings (a remote URL, `github.com/…`
/// for its own GitHub host) into one of these before a scope is made
/// ([`crate::repo::RepoId::short_on`]), so that one repository is one scope.
pub fn valid_repository(r: &str) -> Result<(), String> {
    let part = |p: &str| {
        !p.is_empty() && p != "." && p != ".." && p.chars().all(|c| c.is_ascii_alphanumeric() || "._-".contains(c))
    };
    match r.split_once('/') {
        // GitHub's limits: 39 characters of owner, 100 of name.
        Some((o, n)) if part(o) && part(n) && o.len() <= 39 && n.len() <= 100 => Ok(()),
        // Another host's repository, printed as its identity; no port, as storage names
        // separate their parts with `:`.
        Some((host, _))
            if host.contains('.')
                && !r.contains(':')
                && r.parse::<crate::repo::RepoId>().is_ok_and(|id| id.to_string() == r) =>
        {
            Ok(())
        }
        _ => Err(format!(
            "repository {r:?}: expected owner/name, or host/path for another host (gitlab.com/acme/x), lowercase, no port"
        )),
    }
}

/// Whether the job is from repository `r` of a scope. Compared without regard to case, as
/// GitHub compares names: stored scopes keep the case they were set with.
fn same_repo(job: &JobSource, r: &str) -> bool {
    job.repository.as_deref().is_some_and(|j| j.eq_ignore_ascii_case(r))
}

/// How scopes name the repository of a remote URL as `gpuci submit` reports it: `owner/name`
/// on the GitHub host `github_host`, `host/path` elsewhere; `None` for anything that names
/// no repository unambiguously (a look-alike such as `https://other.host/x@github.com/o/r`
/// is `other.host/x@github.com/o/r`, never `o/r`; see [`crate::repo`]).
pub fn repository_of_remote(url: &str, github_host: &str) -> Option<String> {
    let id = crate::repo::RepoId::parse(url.trim(), github_host).ok()?;
    let short = id.short_on(github_host);
    valid_repository(&short).is_ok().then_some(short)
}

/// An environment name: letters, digits, `.`, `_`, `-`, at most 64.
pub fn valid_environment(e: &str) -> Result<(), String> {
    if e.is_empty() || e.len() > 64 || !e.chars().all(|c| c.is_ascii_alphanumeric() || "._-".contains(c)) {
        return Err(format!("environment {e:?}: letters, digits, '.', '_' and '-', at most 64 characters"));
    }
    Ok(())
}

/// A ref pattern: a full ref (`refs/...`), printable, no spaces; `*` is the only wildcard.
pub fn valid_ref_pattern(p: &str) -> Result<(), String> {
    if !p.starts_with("refs/") {
        return Err(format!("ref pattern {p:?}: give a full ref, e.g. refs/heads/main or refs/tags/v*"));
    }
    if p.len() > 255 || !p.chars().all(|c| c.is_ascii_graphic()) || p.contains("..") {
        return Err(format!("ref pattern {p:?}: printable ASCII without spaces or '..', at most 255 characters"));
    }
    Ok(())
}

impl SecretScope {
    /// A scope from the API's optional fields; `ref` and `environment` need `repository`.
    pub fn from_parts(repository: Option<&str>, pattern: Option<&str>) -> Result<SecretScope, String> {
        Self::from_all_parts(repository, pattern, None)
    }

    /// As [`SecretScope::from_parts`], with an environment.
    pub fn from_all_parts(
        repository: Option<&str>,
        pattern: Option<&str>,
        environment: Option<&str>,
    ) -> Result<SecretScope, String> {
        Self::from_query(repository, pattern, environment, false)
    }

    /// Every form: `approved_forks` makes the value the one approved pull requests from forks
    /// of `repository` get (and nothing else does).
    pub fn from_query(
        repository: Option<&str>,
        pattern: Option<&str>,
        environment: Option<&str>,
        approved_forks: bool,
    ) -> Result<SecretScope, String> {
        if approved_forks {
            let r = repository.ok_or("a value for approved forks needs a repository (--repo owner/name)")?;
            if pattern.is_some() || environment.is_some() {
                return Err(
                    "a value for approved forks takes no ref or environment (a fork's ref is its pull request)".into(),
                );
            }
            valid_repository(r)?;
            return Ok(SecretScope::ApprovedForks(r.to_string()));
        }
        if let Some(e) = environment {
            let r = repository.ok_or("an environment needs a repository (--repo owner/name)")?;
            valid_repository(r)?;
            valid_environment(e)?;
            if let Some(p) = pattern {
                valid_ref_pattern(p)?;
            }
            return Ok(SecretScope::Environment {
                repository: r.to_string(),
                environment: e.to_string(),
                pattern: pattern.map(str::to_string),
            });
        }
        match (repository, pattern) {
            (None, None) => Ok(SecretScope::Global),
            (Some(r), None) => {
                valid_repository(r)?;
                Ok(SecretScope::Repository(r.to_string()))
            }
            (Some(r), Some(p)) => {
                valid_repository(r)?;
                valid_ref_pattern(p)?;
                Ok(SecretScope::Ref { repository: r.to_string(), pattern: p.to_string() })
            }
            (None, Some(_)) => Err("a ref pattern needs a repository (--repo owner/name)".to_string()),
        }
    }

    /// The row name a value of secret `name` in this scope is stored (and sealed) under:
    /// `NAME`, `NAME@repo:owner/name`, `NAME@ref:owner/name:PATTERN`. Secret names have no
    /// `@` and repositories no `:`, so [`SecretScope::parse_storage_name`] reads it back.
    pub fn storage_name(&self, name: &str) -> String {
        match self {
            SecretScope::Global => name.to_string(),
            SecretScope::Repository(r) => format!("{name}@repo:{r}"),
            SecretScope::Ref { repository, pattern } => format!("{name}@ref:{repository}:{pattern}"),
            SecretScope::Environment { repository, environment, pattern: None } => {
                format!("{name}@env:{repository}:{environment}")
            }
            SecretScope::Environment { repository, environment, pattern: Some(p) } => {
                format!("{name}@env:{repository}:{environment}:{p}")
            }
            SecretScope::ApprovedForks(r) => format!("{name}@forks:{r}"),
        }
    }

    /// The secret's name and scope from a storage name; `None` for one this version does not
    /// know (it is then never given out).
    pub fn parse_storage_name(stored: &str) -> Option<(String, SecretScope)> {
        let Some((name, scope)) = stored.split_once('@') else {
            return Some((stored.to_string(), SecretScope::Global));
        };
        let scope = if let Some(r) = scope.strip_prefix("repo:") {
            SecretScope::Repository(r.to_string())
        } else if let Some(r) = scope.strip_prefix("forks:") {
            SecretScope::ApprovedForks(r.to_string())
        } else if let Some(rest) = scope.strip_prefix("env:") {
            // Repositories and environment names have no `:`; a pattern may.
            let (repository, rest) = rest.split_once(':')?;
            let (environment, pattern) = match rest.split_once(':') {
                Some((e, p)) => (e, Some(p.to_string())),
                None => (rest, None),
            };
            SecretScope::Environment {
                repository: repository.to_string(),
                environment: environment.to_string(),
                pattern,
            }
        } else {
            let (r, p) = scope.strip_prefix("ref:")?.split_once(':')?;
            SecretScope::Ref { repository: r.to_string(), pattern: p.to_string() }
        };
        Some((name.to_string(), scope))
    }

    /// How narrow the scope is when it covers `job` (higher wins); `None` when it does not.
    fn rank(&self, job: &JobSource) -> Option<(u8, usize)> {
        if let SecretScope::ApprovedForks(r) = self {
            return (job.approved_fork && same_repo(job, r)).then_some((1, 0));
        }
        if !job.may_have_secrets {
            return None;
        }
        match self {
            SecretScope::Global => Some((0, 0)),
            SecretScope::Repository(r) => (same_repo(job, r)).then_some((1, 0)),
            SecretScope::Ref { repository, pattern } => {
                if !same_repo(job, repository) {
                    return None;
                }
                let git_ref = job.git_ref.as_deref()?;
                if !glob_match(pattern, git_ref) {
                    return None;
                }
                // An exact ref beats any pattern; among patterns, the longer literal part.
                let exact = !pattern.contains('*');
                Some((if exact { 3 } else { 2 }, pattern.chars().filter(|c| *c != '*').count()))
            }
            SecretScope::ApprovedForks(_) => None,
            SecretScope::Environment { repository, environment, pattern } => {
                if !same_repo(job, repository) || job.environment.as_deref() != Some(environment) {
                    return None;
                }
                match pattern {
                    None => Some((4, 0)),
                    Some(p) => {
                        let git_ref = job.git_ref.as_deref()?;
                        glob_match(p, git_ref).then(|| (5, p.chars().filter(|c| *c != '*').count()))
                    }
                }
            }
        }
    }
}

/// Which of `name`'s scopes gives the job its value.
pub fn choose<'a>(name: &str, scopes: &'a [SecretScope], job: &JobSource) -> Result<&'a SecretScope, Refusal> {
    // A fork's pull request gets nothing, unless approved and the secret has a value for
    // approved forks of its repository.
    let for_approved = |s: &SecretScope| matches!(s, SecretScope::ApprovedForks(r) if same_repo(job, r));
    let allowed = job.may_have_secrets || (job.approved_fork && scopes.iter().any(for_approved));
    if !allowed {
        return Err(Refusal::NoSecrets { name: name.to_string(), job: job.description.clone() });
    }
    if scopes.is_empty() {
        return Err(Refusal::NotSet { name: name.to_string(), repository: None });
    }
    // Refused: the scopes of the job's own repository are named; other repositories' never
    // are (a job's reason is shown on its check run, to anyone).
    let own = |s: &SecretScope| match s {
        SecretScope::Global => true,
        SecretScope::Repository(r) | SecretScope::ApprovedForks(r) => same_repo(job, r),
        SecretScope::Ref { repository, .. } | SecretScope::Environment { repository, .. } => same_repo(job, repository),
    };
    if !scopes.iter().any(own) {
        return Err(Refusal::NotSet { name: name.to_string(), repository: job.repository.clone() });
    }
    scopes.iter().filter_map(|s| Some((s.rank(job)?, s))).max_by_key(|(rank, _)| *rank).map(|(_, s)| s).ok_or_else(
        || {
            let mut scopes: Vec<SecretScope> = scopes.iter().filter(|s| own(s)).cloned().collect();
            scopes.sort();
            Refusal::OutOfScope { name: name.to_string(), scopes, job: job.description.clone() }
        },
    )
}

/// `*` matches any run of characters (`/` included); everything else is literal.
fn glob_match(pattern: &str, text: &str) -> bool {
    let parts: Vec<&str> = pattern.split('*').collect();
    if parts.len() == 1 {
        return pattern == text;
    }
    let (first, last) = (parts[0], parts[parts.len() - 1]);
    if !text.starts_with(first) || text.len() < first.len() + last.len() || !text.ends_with(last) {
        return false;
    }
    let mut rest = &text[first.len()..text.len() - last.len()];
    for mid in &parts[1..parts.len() - 1] {
        match rest.find(mid) {
            Some(i) => rest = &rest[i + mid.len()..],
            None => return false,
        }
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job(repo: &str, git_ref: Option<&str>) -> JobSource {
        JobSource {
            repository: Some(repo.to_string()),
            git_ref: git_ref.map(str::to_string),
            environment: None,
            may_have_secrets: true,
            approved_fork: false,
            description: format!("{repo} {}", git_ref.unwrap_or("(no ref)")),
        }
    }
    fn repo(r: &str) -> SecretScope {
        SecretScope::Repository(r.to_string())
    }
    fn refp(r: &str, p: &str) -> SecretScope {
        SecretScope::Ref { repository: r.to_string(), pattern: p.to_string() }
    }

    #[test]
    fn the_narrowest_covering_scope_wins() {
        let scopes = vec![
            SecretScope::Global,
            repo("octo/kernels"),
            refp("octo/kernels", "refs/tags/v*"),
            refp("octo/kernels", "refs/heads/main"),
        ];
        let pick = |j: &JobSource| choose("TOKEN", &scopes, j).cloned();
        assert_eq!(pick(&job("octo/kernels", Some("refs/heads/main"))), Ok(refp("octo/kernels", "refs/heads/main")));
        assert_eq!(pick(&job("octo/kernels", Some("refs/tags/v1.2"))), Ok(refp("octo/kernels", "refs/tags/v*")));
        assert_eq!(pick(&job("octo/kernels", Some("refs/heads/dev"))), Ok(repo("octo/kernels")));
        assert_eq!(pick(&job("octo/kernels", None)), Ok(repo("octo/kernels")));
        assert_eq!(pick(&job("other/repo", Some("refs/heads/main"))), Ok(SecretScope::Global));
        let both = vec![refp("o/r", "refs/tags/*"), refp("o/r", "refs/tags/v1*")];
        assert_eq!(choose("T", &both, &job("o/r", Some("refs/tags/v1.0"))), Ok(&both[1]), "the longer pattern");
    }

    #[test]
    fn another_repository_or_ref_is_refused_with_the_scopes_it_has() {
        let scopes = vec![refp("octo/kernels", "refs/heads/main")];
        let e = choose("CODECOV_TOKEN", &scopes, &job("octo/kernels", Some("refs/heads/feature"))).unwrap_err();
        assert_eq!(
            e.to_string(),
            "secret `CODECOV_TOKEN` is scoped to octo/kernels refs/heads/main; this job is from octo/kernels refs/heads/feature"
        );
        // Another repository is not told which repositories have it.
        let e = choose("CODECOV_TOKEN", &scopes, &job("evil/fork", Some("refs/heads/main"))).unwrap_err();
        assert_eq!(
            e.to_string(),
            "secret `CODECOV_TOKEN` is not set for evil/fork (gpuci secret set CODECOV_TOKEN --repo evil/fork)"
        );
        let scopes = vec![repo("a/one")];
        assert!(choose("T", &scopes, &job("a/one-more", None)).is_err(), "no prefix matching of names");
        assert_eq!(
            choose("T", &[], &job("a/b", None)).unwrap_err().to_string(),
            "secret `T` is not set (gpuci secret set T)"
        );
        let mut fork = job("octo/kernels", Some("refs/pull/3/merge"));
        fork.may_have_secrets = false;
        assert!(matches!(choose("T", &[SecretScope::Global], &fork), Err(Refusal::NoSecrets { .. })));
    }

    #[test]
    fn storage_names_round_trip_and_unknown_forms_are_not_read() {
        for s in [SecretScope::Global, repo("octo/kernels"), refp("octo/kernels", "refs/tags/v*")] {
            let stored = s.storage_name("HF_TOKEN");
            assert_eq!(SecretScope::parse_storage_name(&stored), Some(("HF_TOKEN".to_string(), s)), "{stored}");
        }
        assert_eq!(SecretScope::parse_storage_name("X@env:prod"), None);
    }

    #[test]
    fn scopes_are_checked_when_made() {
        assert!(SecretScope::from_parts(Some("octo/kernels"), Some("refs/heads/main")).is_ok());
        for (r, p) in [
            (Some("octo"), None),
            (Some("a/b/c"), None),
            (Some("a/.."), None),
            (None, Some("refs/heads/x")),
            (Some("a/b"), Some("main")),
            (Some("a/b"), Some("refs/heads/a b")),
        ] {
            assert!(SecretScope::from_parts(r, p).is_err(), "{r:?} {p:?}");
        }
    }

    #[test]
    fn globs() {
        assert!(glob_match("refs/tags/v*", "refs/tags/v1.2.3"));
        assert!(glob_match("refs/heads/*", "refs/heads/feature/x"));
        assert!(glob_match("refs/*/main", "refs/heads/main"));
        assert!(!glob_match("refs/tags/v*", "refs/tags/x1"));
        assert!(!glob_match("refs/heads/main", "refs/heads/main2"));
        assert!(!glob_match("refs/*x*y", "refs/y"));
    }

    #[test]
    fn an_environments_secret_goes_only_to_steps_that_declare_it_and_its_branch_rule_holds() {
        let env = |e: &str, p: Option<&str>| SecretScope::Environment {
            repository: "octo/kernels".into(),
            environment: e.into(),
            pattern: p.map(str::to_string),
        };
        let scopes = vec![repo("octo/kernels"), env("production", Some("refs/heads/main")), env("staging", None)];
        let mut j = job("octo/kernels", Some("refs/heads/main"));
        assert_eq!(choose("K", &scopes, &j), Ok(&scopes[0]), "no environment declared: the repository's");
        j.environment = Some("production".into());
        assert_eq!(choose("K", &scopes, &j), Ok(&scopes[1]));
        j.git_ref = Some("refs/heads/feature".into());
        assert_eq!(choose("K", &scopes, &j), Ok(&scopes[0]), "production's branch rule keeps it from feature");
        j.environment = Some("staging".into());
        assert_eq!(choose("K", &scopes, &j), Ok(&scopes[2]));
        let only_prod = vec![env("production", None)];
        let e = choose("K", &only_prod, &job("octo/kernels", None)).unwrap_err().to_string();
        assert_eq!(
            e,
            "secret `K` is scoped to octo/kernels environment production; this job is from octo/kernels (no ref)"
        );
        for s in [env("production", None), env("production", Some("refs/tags/v*"))] {
            assert_eq!(SecretScope::parse_storage_name(&s.storage_name("K")), Some(("K".to_string(), s)));
        }
        assert!(SecretScope::from_all_parts(None, None, Some("prod")).is_err());
        assert!(SecretScope::from_all_parts(Some("a/b"), None, Some("pro:d")).is_err());
    }

    #[test]
    fn an_approved_fork_gets_only_what_the_approval_policy_allows() {
        let forks = SecretScope::ApprovedForks("octo/kernels".into());
        let scopes = vec![SecretScope::Global, repo("octo/kernels"), forks.clone()];
        let mut fork = job("octo/kernels", Some("refs/pull/9/merge"));
        fork.may_have_secrets = false;
        assert!(matches!(choose("T", &scopes, &fork), Err(Refusal::NoSecrets { .. })), "not approved: nothing");
        fork.approved_fork = true;
        assert_eq!(choose("T", &scopes, &fork), Ok(&forks), "approved: the value for approved forks only");
        assert!(
            matches!(choose("T", &scopes[..2], &fork), Err(Refusal::NoSecrets { .. })),
            "nothing else, approved or not"
        );
        let other = vec![SecretScope::ApprovedForks("other/repo".into())];
        assert!(choose("T", &other, &fork).is_err(), "another repository's approved-forks value");
        // And no other job ever gets the approved-forks value.
        let push = job("octo/kernels", Some("refs/heads/main"));
        assert_eq!(choose("T", &scopes, &push), Ok(&scopes[1]));
        assert!(choose("T", std::slice::from_ref(&forks), &push).is_err());
        assert_eq!(SecretScope::parse_storage_name(&forks.storage_name("T")), Some(("T".to_string(), forks)));
    }

    #[test]
    fn a_submitted_work_trees_origin_url_names_its_repository() {
        for url in [
            "https://github.com/octo/kernels.git",
            "https://github.com/octo/kernels",
            "git@github.com:octo/kernels.git",
            "octo/kernels",
        ] {
            assert_eq!(repository_of_remote(url, "github.com").as_deref(), Some("octo/kernels"), "{url}");
        }
        assert_eq!(
            repository_of_remote("ssh://git@github.example.com:2222/octo/kernels.git", "github.example.com:2222")
                .as_deref(),
            Some("octo/kernels"),
            "GitHub Enterprise over ssh on its own port"
        );
        for not in ["/home/me/src/kernels", "kernels", "", "https://github.com/", "a/b/c"] {
            assert_eq!(repository_of_remote(not, "github.com"), None, "{not}");
        }
    }

    /// Regression (issue 27): secret scopes named repositories by `owner/name` alone, so a
    /// work tree of `gitlab.com/acme/x`, or of a look-alike remote with `@github.com/acme/x`
    /// in its path, got `github.com/acme/x`'s secrets.
    #[test]
    fn another_hosts_repository_of_the_same_name_gets_no_secret() {
        let scopes = vec![repo("acme/x")];
        for remote in ["https://gitlab.com/acme/x.git", "https://other.host/team/y@github.com/acme/x.git"] {
            let r = repository_of_remote(remote, "github.com");
            assert_ne!(r.as_deref(), Some("acme/x"), "{remote}");
            let j = JobSource { repository: r, ..job("acme/x", None) };
            assert!(choose("T", &scopes, &j).is_err(), "{remote}");
        }
        let r = repository_of_remote("https://gitlab.com/acme/x.git", "github.com");
        assert_eq!(r.as_deref(), Some("gitlab.com/acme/x"));
        let gl = vec![repo("gitlab.com/acme/x")];
        assert!(choose("T", &gl, &JobSource { repository: r, ..job("x/y", None) }).is_ok());
        assert!(choose("T", &gl, &job("acme/x", None)).is_err());
        // Stored before hosts were kept, in another case: still the GitHub repository's.
        assert!(choose("T", &[repo("Acme/X")], &job("acme/x", None)).is_ok());
        assert!(SecretScope::from_parts(Some("gitlab.com/acme/x"), None).is_ok());
        for bad in ["gitlab.com:2222/acme/x", "GitLab.com/acme/x", "https://gitlab.com/acme/x"] {
            assert!(SecretScope::from_parts(Some(bad), None).is_err(), "{bad}");
        }
        let s = SecretScope::Environment {
            repository: "gitlab.com/acme/x".into(),
            environment: "prod".into(),
            pattern: Some("refs/heads/*".into()),
        };
        assert_eq!(SecretScope::parse_storage_name(&s.storage_name("K")), Some(("K".to_string(), s)));
    }
}
