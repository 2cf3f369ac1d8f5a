//! A repository's identity: which repository a pipeline is from, with its host
//! (`github.com/acme/x`, `gitlab.com/acme/group/x`), parsed here and nowhere else.
//!
//! Everything that keeps repositories apart compares these: the dashboard's public view,
//! metrics labels, cost attribution and budgets, secret scopes, cache keys and concurrency
//! groups. Naming a repository by `owner/name` alone made `gitlab.com/acme/x` and
//! `github.com/acme/x` one repository, and a parser that dropped everything up to the last
//! `@` took `https://other.host/team/x@github.com/rt/public.git` for `github.com/rt/public`
//! (issue 27).
//!
//! The rules:
//! - A remote URL is read by its **authority** (`scheme://[userinfo@]host[:port]/path`): the
//!   authority ends at the first `/`, the userinfo at the first `@` of the authority; an `@`
//!   after that first `/` is part of the path. A second `@` in the authority, `%`, `?`, `#`,
//!   `\`, whitespace, an empty or dot segment are refused: they are ambiguous, and an
//!   identity must never be a guess.
//! - scp-like remotes (`git@github.com:acme/x.git`) are `[user@]host:path`. Written without a
//!   user, `host:PORT/path` is a host and port (that is how an identity with a port prints);
//!   with a user and a path that starts with digits it is refused as ambiguous.
//! - Normalised: host and path lowercase (GitHub and GitLab compare repository names without
//!   regard to case; two spellings of one repository must not be two repositories, or a
//!   budget would not cover one of them), no credentials, no `.git`, no trailing `/`, no port
//!   when it is the scheme's default. Printed as `host/path`, nested groups kept.
//! - **Backward compatibility**: a bare `owner/name` (configs, secret scopes, budgets,
//!   records written before hosts were kept) is that repository on the configured GitHub
//!   host — `github.com` unless GitHub Enterprise is configured ([`github_host_of_api_url`]).
//! - A local path (`/srv/git/x`, `file:///srv/git/x`) is a local repository: its own
//!   identity, printed `local:/srv/git/x`, never equal to a hosted one. Relative paths are
//!   refused (relative to what?).
//!
//! Pure: no I/O. Callers hand in the configured GitHub host.

use std::fmt;

/// GitHub's host when no GitHub Enterprise Server is configured.
pub const DEFAULT_GITHUB_HOST: &str = "github.com";

/// One repository: a path on a host, or a local path.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RepoId {
    /// Lowercase host, with `:port` when not the scheme's default; `None`: a local path.
    host: Option<String>,
    /// Hosted: lowercase segments joined by `/`, without `.git`. Local: the absolute path as
    /// given (file systems tell case apart), without a trailing `/`.
    path: String,
}

/// Why a text names no repository. The text is carried without any password it held.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("repository {text:?}: {what}")]
pub struct RepoIdError {
    pub text: String,
    pub what: String,
}

impl RepoId {
    /// A repository from how a pipeline, a config or an API call names it: a remote URL, an
    /// scp-like remote, a printed identity (`host/path`), a bare `owner/name` (on
    /// `github_host`), or an absolute local path.
    pub fn parse(text: &str, github_host: &str) -> Result<RepoId, RepoIdError> {
        RepoId::parse_with(text, Some(github_host))
    }

    /// As [`RepoId::parse`], refusing a bare `owner/name`: for a remote as git reports it,
    /// where `acme/x` is a relative path as much as a repository (what may make a pipeline
    /// public must not rest on a guess).
    pub fn parse_remote(text: &str) -> Result<RepoId, RepoIdError> {
        RepoId::parse_with(text, None)
    }

    fn parse_with(text: &str, github_host: Option<&str>) -> Result<RepoId, RepoIdError> {
        let fail = |what: &str| RepoIdError { text: redacted(text), what: what.to_string() };
        if text.is_empty() {
            return Err(fail("empty"));
        }
        if text.chars().any(|c| c.is_whitespace() || c.is_control()) {
            return Err(fail("whitespace or control characters"));
        }
        if text.contains(['?', '#', '\\', '%']) {
            return Err(fail("'?', '#', '\\' and '%' are refused: they make a remote ambiguous"));
        }
        // A printed local identity (`local:/srv/x`) reads back as itself.
        if let Some(local) =
            text.strip_prefix("file://").or_else(|| text.strip_prefix("local:").filter(|l| l.starts_with('/')))
        {
            return RepoId::local(local).map_err(|w| fail(&w));
        }
        if text.starts_with('/') {
            return RepoId::local(text).map_err(|w| fail(&w));
        }
        if text.starts_with('.') || text.starts_with('~') {
            return Err(fail("a relative local path; give an absolute path or a remote URL"));
        }
        if let Some((scheme, rest)) = text.split_once("://") {
            let default_port = match scheme.to_ascii_lowercase().as_str() {
                "https" => 443,
                "http" => 80,
                "ssh" | "git+ssh" | "ssh+git" => 22,
                "git" => 9418,
                _ => return Err(fail("unknown scheme; expected https, http, ssh or git")),
            };
            // The authority ends at the first `/`: whatever follows, `@` included, is path.
            let (authority, path) = rest.split_once('/').ok_or_else(|| fail("no path after the host"))?;
            // The userinfo ends at the first `@` of the authority; another one is ambiguous
            // (a password with an unescaped `@`, or a host trying to look like another).
            let hostport = match authority.split_once('@') {
                Some((_, h)) if h.contains('@') => return Err(fail("more than one '@' before the path")),
                Some((_, h)) => h,
                None => authority,
            };
            let host = host_port(hostport, Some(default_port)).map_err(|w| fail(&w))?;
            return RepoId::hosted(&host, path).map_err(|w| fail(&w));
        }
        if let Some((before, after)) = text.split_once(':') {
            if before.contains('/') {
                return Err(fail("a ':' inside a path; give a remote URL"));
            }
            return match before.split_once('@') {
                // scp-like `user@host:path`.
                Some((_, host)) => {
                    if host.contains('@') {
                        return Err(fail("more than one '@' before the path"));
                    }
                    let first = after.trim_start_matches('/').split('/').next().unwrap_or("");
                    if !first.is_empty() && first.bytes().all(|b| b.is_ascii_digit()) {
                        return Err(fail("is that a port or a path? Write ssh://user@host:port/path"));
                    }
                    let host = host_port(host, None).map_err(|w| fail(&w))?;
                    // `git@host:/path` and `git@host:path` are read alike.
                    RepoId::hosted(&host, after.strip_prefix('/').unwrap_or(after)).map_err(|w| fail(&w))
                }
                None => {
                    // `host:PORT/path` (a printed identity), else scp-like `host:path`.
                    if let Some((port, path)) = after.split_once('/') {
                        if !port.is_empty() && port.bytes().all(|b| b.is_ascii_digit()) {
                            let host = host_port(&format!("{before}:{port}"), None).map_err(|w| fail(&w))?;
                            return RepoId::hosted(&host, path).map_err(|w| fail(&w));
                        }
                    }
                    if before.len() == 1 {
                        return Err(fail("a drive letter, not a host"));
                    }
                    let host = host_port(before, None).map_err(|w| fail(&w))?;
                    RepoId::hosted(&host, after.strip_prefix('/').unwrap_or(after)).map_err(|w| fail(&w))
                }
            };
        }
        if text.contains('@') && text.split('/').next().is_some_and(|h| h.contains('@')) {
            return Err(fail("a user without a scheme; give a remote URL"));
        }
        let (first, rest) = text.split_once('/').unwrap_or((text, ""));
        if looks_like_host(first) {
            // A printed identity, `host/path`. (GitHub owners have no dots, so a bare
            // `owner/name` never reads as this.)
            let host = host_port(first, None).map_err(|w| fail(&w))?;
            return RepoId::hosted(&host, rest).map_err(|w| fail(&w));
        }
        match text.trim_end_matches('/').split('/').count() {
            // Backward compatibility: `owner/name` is on the configured GitHub host.
            2 => match github_host {
                Some(h) => RepoId::hosted(h, text).map_err(|w| fail(&w)),
                None => Err(fail("a bare owner/name (or a relative path): give the remote URL")),
            },
            _ => Err(fail("expected owner/name, host/path, a remote URL or an absolute local path")),
        }
    }

    /// A GitHub repository from GitHub's own word (a webhook's `full_name`, `owner/name`) on
    /// `github_host`.
    pub fn github(github_host: &str, full_name: &str) -> Result<RepoId, RepoIdError> {
        let fail = |what: String| RepoIdError { text: full_name.to_string(), what };
        match full_name.split('/').collect::<Vec<_>>().as_slice() {
            [_, _] => {
                let host = host_port(github_host, None).map_err(fail)?;
                RepoId::hosted(&host, full_name).map_err(fail)
            }
            _ => Err(fail("expected owner/name".into())),
        }
    }

    /// The host (with `:port` when not the default); `None` for a local repository.
    pub fn host(&self) -> Option<&str> {
        self.host.as_deref()
    }

    /// The path on the host (`acme/x`, `acme/group/x`), or the local path.
    pub fn path(&self) -> &str {
        &self.path
    }

    pub fn is_local(&self) -> bool {
        self.host.is_none()
    }

    /// How configs and stored secret scopes name it: `owner/name` for a repository of two
    /// segments on `github_host` (what they always meant), the full identity otherwise.
    pub fn short_on(&self, github_host: &str) -> String {
        match &self.host {
            Some(h) if h.eq_ignore_ascii_case(github_host) && self.path.split('/').count() == 2 => self.path.clone(),
            _ => self.to_string(),
        }
    }

    fn hosted(host: &str, path: &str) -> Result<RepoId, String> {
        // Only trailing slashes go: a leading one here is an empty segment (`host//x`).
        // Lowercase first: `x.GIT` is `x` as `x.git` is (outsider finding: it was a second
        // repository, and its printed form did not parse back to itself).
        let lower = path.trim_end_matches('/').to_ascii_lowercase();
        let path = lower.strip_suffix(".git").unwrap_or(&lower).to_string();
        if path.is_empty() {
            return Err("no repository path".into());
        }
        for s in path.split('/') {
            if s.is_empty() || s == "." || s == ".." {
                return Err("an empty, '.' or '..' path segment".into());
            }
            // `@` is allowed: after the authority it is an ordinary path character, and
            // refusing it would not make a look-alike safer than reading it as path does.
            if !s.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_.~@+".contains(&b)) {
                return Err(format!("path segment {s:?}: letters, digits and '-_.~@+' only"));
            }
        }
        Ok(RepoId { host: Some(host.to_ascii_lowercase()), path })
    }

    fn local(path: &str) -> Result<RepoId, String> {
        if !path.starts_with('/') {
            return Err("a file URL needs an absolute path".into());
        }
        let trimmed = path.trim_end_matches('/');
        let trimmed = if trimmed.is_empty() { "/" } else { trimmed };
        if trimmed.split('/').any(|s| s == "." || s == "..") {
            return Err("'.' or '..' in a local path".into());
        }
        Ok(RepoId { host: None, path: trimmed.to_string() })
    }
}

impl fmt::Display for RepoId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.host {
            Some(h) => write!(f, "{h}/{}", self.path),
            // `local:` keeps a local path from ever printing like a hosted repository.
            None => write!(f, "local:{}", self.path),
        }
    }
}

impl serde::Serialize for RepoId {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

/// A printed identity read back (`github.com/acme/x`, `local:/srv/x`); a bare `owner/name`
/// is refused here, as no configured GitHub host is at hand.
impl std::str::FromStr for RepoId {
    type Err = RepoIdError;
    fn from_str(s: &str) -> Result<RepoId, RepoIdError> {
        if let Some(local) = s.strip_prefix("local:") {
            return RepoId::local(local).map_err(|what| RepoIdError { text: s.to_string(), what });
        }
        let fail = |what: String| RepoIdError { text: s.to_string(), what };
        let (host, path) = s.split_once('/').ok_or_else(|| fail("expected host/path".into()))?;
        let host = host_port(host, None).map_err(fail)?;
        RepoId::hosted(&host, path).map_err(fail)
    }
}

/// Repositories named in a server config: one (`owner/name`, `host/path`) or every one under
/// an owner or group (`owner/*`, `gitlab.com/acme/*`, all on the host given or, bare, on the
/// configured GitHub host).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum RepoPattern {
    One(RepoId),
    /// Every repository on `host` whose path starts with `prefix/` (an empty prefix: the
    /// whole host). Nested groups count: `gitlab.com/acme/*` covers `gitlab.com/acme/sub/x`.
    Under {
        host: String,
        prefix: String,
    },
}

impl RepoPattern {
    pub fn parse(text: &str, github_host: &str) -> Result<RepoPattern, RepoIdError> {
        let Some(base) = text.strip_suffix("/*") else {
            let id = RepoId::parse(text, github_host)?;
            if id.is_local() {
                return Err(RepoIdError { text: text.into(), what: "a local path cannot be named here".into() });
            }
            return Ok(RepoPattern::One(id));
        };
        let fail = |what: String| RepoIdError { text: text.to_string(), what };
        match base.split_once('/') {
            // `host/*`: the whole host.
            None if looks_like_host(base) => {
                Ok(RepoPattern::Under { host: host_port(base, None).map_err(fail)?, prefix: String::new() })
            }
            // `owner/*`: an owner on the GitHub host (what a bare name always meant).
            None => {
                let id = RepoId::parse(&format!("{base}/x"), github_host)?;
                Ok(RepoPattern::Under { host: id.host.unwrap_or_default(), prefix: base.to_ascii_lowercase() })
            }
            // `host/group/*`; a nested bare path (`acme/sub/*`) has no host and is refused.
            Some((first, _)) if looks_like_host(first) => {
                let id = RepoId::parse(&format!("{base}/x"), github_host)?;
                let prefix = id.path.strip_suffix("/x").unwrap_or_default().to_string();
                Ok(RepoPattern::Under { host: id.host.unwrap_or_default(), prefix })
            }
            Some(_) => Err(fail("expected owner/*, or host/group/* naming the host".into())),
        }
    }

    /// Whether `repo` is one of the repositories named.
    pub fn covers(&self, repo: &RepoId) -> bool {
        match self {
            RepoPattern::One(id) => id == repo,
            RepoPattern::Under { host, prefix } => {
                repo.host.as_deref() == Some(host.as_str())
                    && (prefix.is_empty()
                        || repo.path.strip_prefix(prefix.as_str()).is_some_and(|r| r.starts_with('/')))
            }
        }
    }

    /// One repository it covers: where a caller that must treat every covered repository
    /// alike (a budget held while spend cannot be read) can book it.
    pub fn sample(&self) -> RepoId {
        match self {
            RepoPattern::One(id) => id.clone(),
            RepoPattern::Under { host, prefix } => RepoId {
                host: Some(host.clone()),
                path: if prefix.is_empty() { "-".into() } else { format!("{prefix}/-") },
            },
        }
    }

    /// As [`RepoPattern::covers`], for a printed identity (`github.com/acme/x`): spend and
    /// cost tables are keyed by it. Anything that does not read back covers nothing.
    pub fn covers_printed(&self, printed: &str) -> bool {
        printed.parse::<RepoId>().is_ok_and(|id| self.covers(&id))
    }
}

impl fmt::Display for RepoPattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RepoPattern::One(id) => write!(f, "{id}"),
            RepoPattern::Under { host, prefix } if prefix.is_empty() => write!(f, "{host}/*"),
            RepoPattern::Under { host, prefix } => write!(f, "{host}/{prefix}/*"),
        }
    }
}

impl serde::Serialize for RepoPattern {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

/// The GitHub host behind an API address: `https://api.github.com` is `github.com`,
/// GitHub Enterprise Server's `https://HOST/api/v3` is `HOST`; no API configured
/// (`None`) is `github.com`.
pub fn github_host_of_api_url(api_url: Option<&str>) -> String {
    let Some(url) = api_url.map(|u| u.trim().trim_end_matches('/')) else { return DEFAULT_GITHUB_HOST.into() };
    let Some((scheme, rest)) = url.split_once("://") else { return DEFAULT_GITHUB_HOST.into() };
    let authority = rest.split('/').next().unwrap_or("");
    let authority = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
    if authority.eq_ignore_ascii_case("api.github.com") {
        return DEFAULT_GITHUB_HOST.into();
    }
    let default_port = if scheme.eq_ignore_ascii_case("http") { 80 } else { 443 };
    host_port(authority, Some(default_port)).unwrap_or_else(|_| authority.to_ascii_lowercase())
}

/// `host[:port]`, lowercase, without the default port; a DNS name, an IPv4 address or a
/// bracketed IPv6 address.
fn host_port(text: &str, default_port: Option<u16>) -> Result<String, String> {
    let text = text.to_ascii_lowercase();
    let (host, port) = if text.starts_with('[') {
        let end = text.find(']').ok_or("an unclosed '[' in the host")?;
        let (h, rest) = text.split_at(end + 1);
        match rest.strip_prefix(':') {
            Some(p) => (h.to_string(), Some(p.to_string())),
            None if rest.is_empty() => (h.to_string(), None),
            None => return Err("characters after ']' in the host".into()),
        }
    } else {
        match text.split_once(':') {
            Some((h, p)) => (h.to_string(), Some(p.to_string())),
            None => (text.clone(), None),
        }
    };
    let ok_host = if let Some(inner) = host.strip_prefix('[').and_then(|h| h.strip_suffix(']')) {
        !inner.is_empty() && inner.bytes().all(|b| b.is_ascii_hexdigit() || b == b':' || b == b'.')
    } else {
        !host.is_empty()
            && host.len() <= 253
            && host.split('.').all(|l| {
                !l.is_empty()
                    && !l.starts_with('-')
                    && !l.ends_with('-')
                    && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
            })
    };
    if !ok_host {
        return Err(format!("host {host:?}: expected a DNS name or an IP address"));
    }
    match port {
        None => Ok(host),
        Some(p) => {
            let n: u16 = p.parse().ok().filter(|n| *n > 0).ok_or_else(|| format!("port {p:?}: expected 1 to 65535"))?;
            // `:0443` and `:443` are one port: printed from the number.
            Ok(if Some(n) == default_port { host } else { format!("{host}:{n}") })
        }
    }
}

/// A first segment that names a host rather than an owner: it has a dot (`github.com`), or
/// is `localhost`.
fn looks_like_host(s: &str) -> bool {
    s.contains('.') || s.eq_ignore_ascii_case("localhost") || s.starts_with('[')
}

/// `text` without the password an URL's userinfo may hold, for error messages.
fn redacted(text: &str) -> String {
    match text.split_once("://") {
        Some((scheme, rest)) => {
            let authority = rest.split('/').next().unwrap_or("");
            match authority.rfind('@') {
                Some(at) => format!("{scheme}://***{}", &rest[at..]),
                None => text.to_string(),
            }
        }
        None => text.to_string(),
    }
}

#[cfg(test)]
mod tests;
