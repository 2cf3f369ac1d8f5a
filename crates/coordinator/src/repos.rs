//! Which repository a stored pipeline is from, as a [`RepoId`] with its host: what the
//! dashboard's public view, metrics labels, cost attribution, budgets, caches and
//! concurrency groups compare (`gpuci_core::repo` has the rules).
//!
//! A GitHub pipeline (push, pull request, Actions runner job) is named by GitHub's own word,
//! the origin's `owner/name`, on the configured GitHub host; its stored `repository` column
//! is not read for it. Any other pipeline names the remote URL (or path) `gpuci submit`
//! reported, read strictly: what does not parse names no repository, and so is never public,
//! counts toward no repository's budget and gets no cache.

use crate::origin::Origin;
use gpuci_core::repo::RepoId;

/// The pipeline's repository, from its stored `repository` and `origin` (JSON).
pub fn of_pipeline(repository: Option<&str>, origin: Option<&str>, github_host: &str) -> Option<RepoId> {
    match origin {
        Some(json) => match Origin::parse(Some(json))? {
            Origin::Github(g) => RepoId::github(github_host, &g.repository).ok(),
            Origin::ActionsRunner(r) => RepoId::github(github_host, &r.repository).ok(),
        },
        None => RepoId::parse(repository?.trim(), github_host).ok(),
    }
}

/// As [`of_pipeline`], for deciding what anonymous visitors see: a submitted remote must name
/// its host (`acme/x` from `gpuci submit` is as much a relative path as a repository).
pub fn public_identity(repository: Option<&str>, origin: Option<&str>, github_host: &str) -> Option<RepoId> {
    match origin {
        Some(_) => of_pipeline(repository, origin, github_host),
        None => RepoId::parse_remote(repository?.trim()).ok(),
    }
}

/// As [`of_pipeline`], printed (`github.com/acme/x`): the label and column value.
pub fn name_of_pipeline(repository: Option<&str>, origin: Option<&str>, github_host: &str) -> Option<String> {
    of_pipeline(repository, origin, github_host).map(|r| r.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn github_pipelines_are_named_by_their_origin_others_by_their_remote() {
        let gh = r#"{"kind":"github","repository":"Acme/X","sha":"abc","event":"push","pr":null,"secrets":true}"#;
        // The stored column said github.com even on GitHub Enterprise; the origin is GitHub's word.
        assert_eq!(
            name_of_pipeline(Some("github.com/acme/x"), Some(gh), "ghe.example.com").as_deref(),
            Some("ghe.example.com/acme/x")
        );
        assert_eq!(
            name_of_pipeline(Some("https://gitlab.com/acme/x.git"), None, "github.com").as_deref(),
            Some("gitlab.com/acme/x")
        );
        assert_eq!(
            name_of_pipeline(Some("https://other.host/team/x@github.com/rt/public.git"), None, "github.com").as_deref(),
            Some("other.host/team/x@github.com/rt/public")
        );
        assert_eq!(name_of_pipeline(Some("https://a@b@github.com/rt/public"), None, "github.com"), None);
        assert_eq!(name_of_pipeline(None, None, "github.com"), None);
        assert_eq!(name_of_pipeline(Some("acme/x"), None, "github.com").as_deref(), Some("github.com/acme/x"));
        assert_eq!(public_identity(Some("acme/x"), None, "github.com"), None, "public only with its host");
        assert_eq!(name_of_pipeline(Some("x"), Some("{not json"), "github.com"), None);
    }
}
