//! Artifacts: files a step leaves for later steps and for people (`artifacts:` and
//! `artifacts_from:` on a step). The rules, here and nowhere else:
//!
//! - **Patterns** are globs relative to the workspace (`dist/*.whl`, `reports/**`). A
//!   pattern is refused when it is empty, absolute, starts with `~`, has a `..` or `.`
//!   component, or holds a control character ([`check_pattern`]). `*` and `?` stay inside one
//!   path component; `**` crosses directories ([`Patterns`]). A pattern's leading literal
//!   components are its *base*: the agent walks only below the bases, so an artifact pattern
//!   never makes it read the rest of the workspace.
//! - **Paths** of stored artifacts are plain relative paths: `/`-separated UTF-8 components,
//!   none empty, `.` or `..`, no control characters (a newline in a name would forge lines in
//!   listings and logs), at most [`MAX_PATH_LEN`] bytes ([`check_path`]). The coordinator
//!   refuses any other on upload; the agent and the CLI check again before writing one.
//! - **When**: `always` (the default), `on_success` or `on_failure` ([`ArtifactWhen::applies`]).
//! - **Caps** per file, per job and per repository ([`Limits`], [`admit`]): an artifact over a
//!   cap is refused with the cap in the reason; the others are still stored.
//! - **Retention** ([`collect`]): an artifact goes once it is older than `retention`; with
//!   `max_total`, the oldest go first until the rest fit (ties: lower job, then path).

use globset::{GlobBuilder, GlobSet, GlobSetBuilder};
use serde::{Deserialize, Serialize};

/// Longest artifact path, in bytes.
pub const MAX_PATH_LEN: usize = 1024;
/// Most patterns one step may name.
pub const MAX_PATTERNS: usize = 64;

/// When a step's artifacts are uploaded.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum ArtifactWhen {
    /// Whatever the step's outcome (the default: a failing step's logs and core dumps are
    /// what people want most).
    #[default]
    Always,
    OnSuccess,
    OnFailure,
}

impl ArtifactWhen {
    /// Whether artifacts are collected for a step that `succeeded` (or not).
    pub fn applies(self, succeeded: bool) -> bool {
        match self {
            ArtifactWhen::Always => true,
            ArtifactWhen::OnSuccess => succeeded,
            ArtifactWhen::OnFailure => !succeeded,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            ArtifactWhen::Always => "always",
            ArtifactWhen::OnSuccess => "on_success",
            ArtifactWhen::OnFailure => "on_failure",
        }
    }
}

/// `artifacts:` on a step.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ArtifactSpec {
    /// Globs relative to the workspace.
    #[serde(default)]
    pub paths: Vec<String>,
    #[serde(default)]
    pub when: ArtifactWhen,
}

impl ArtifactSpec {
    pub fn is_empty(&self) -> bool {
        self.paths.is_empty()
    }
}

/// Why a pattern cannot be used, or `None` when it can.
pub fn check_pattern(p: &str) -> Option<&'static str> {
    if p.trim().is_empty() {
        Some("an artifact path must not be empty")
    } else if p.starts_with('/') {
        Some("artifact paths are relative to the workspace; absolute paths are not allowed")
    } else if p.starts_with('~') {
        Some("artifact paths are relative to the workspace; `~` is not expanded")
    } else if p.split(['/', '\\']).any(|c| c == "..") {
        Some("artifact paths must stay inside the workspace; `..` is not allowed")
    } else if p.split('/').any(|c| c == ".") {
        Some("write artifact paths without `.` components")
    } else if p.chars().any(char::is_control) {
        Some("artifact paths must not contain control characters (newlines, tabs, NUL)")
    } else if p.len() > MAX_PATH_LEN {
        Some("an artifact path is at most 1024 bytes")
    } else if glob(p).is_err() {
        Some("not a valid glob (check `[`, `{` and `\\`)")
    } else {
        None
    }
}

/// Why `path` cannot be an artifact's path, or `Ok`.
pub fn check_path(path: &str) -> Result<(), String> {
    if path.is_empty() {
        return Err("the path is empty".into());
    }
    if path.len() > MAX_PATH_LEN {
        return Err(format!("the path is longer than {MAX_PATH_LEN} bytes"));
    }
    if path.starts_with('/') {
        return Err("the path is absolute; artifact paths are relative to the workspace".into());
    }
    if path.chars().any(char::is_control) {
        return Err("the path contains a control character (newline, tab, NUL)".into());
    }
    if let Some(c) = path.chars().find(|c| invisible(*c)) {
        return Err(format!(
            "the path contains U+{:04X}, an invisible formatting character (a direction override shows \
             `gpj.exe` as `exe.jpg`)",
            c as u32
        ));
    }
    for c in path.split('/') {
        match c {
            "" => return Err("the path has an empty component (`//` or a trailing `/`)".into()),
            "." | ".." => return Err(format!("the path has a `{c}` component: it would leave its place")),
            _ if c.contains('\\') => return Err("the path contains a backslash".into()),
            _ => {}
        }
    }
    Ok(())
}

/// Unicode format characters that change how a name is shown without showing themselves:
/// direction marks, embeddings, overrides and isolates, zero-width characters, the BOM.
fn invisible(c: char) -> bool {
    matches!(c as u32, 0x061C | 0x200B..=0x200F | 0x202A..=0x202E | 0x2060..=0x2064 | 0x2066..=0x206F | 0xFEFF)
}

fn glob(p: &str) -> Result<globset::Glob, globset::Error> {
    GlobBuilder::new(p).literal_separator(true).backslash_escape(true).build()
}

/// A step's patterns, compiled. Built only from patterns [`check_pattern`] accepted.
#[derive(Clone, Debug)]
pub struct Patterns {
    set: GlobSet,
    bases: Vec<String>,
}

impl Patterns {
    /// The patterns compiled; `Err` names the first bad one and why.
    pub fn new(patterns: &[String]) -> Result<Patterns, String> {
        let mut b = GlobSetBuilder::new();
        let mut bases: Vec<String> = Vec::new();
        for p in patterns {
            if let Some(why) = check_pattern(p) {
                return Err(format!("artifact pattern {p:?}: {why}"));
            }
            let g = glob(p).map_err(|e| format!("artifact pattern {p:?}: {e}"))?;
            b.add(g);
            bases.push(base(p));
        }
        // A base below another base is walked already.
        bases.sort();
        bases.dedup();
        let all = bases.clone();
        bases.retain(|b| !all.iter().any(|o| o != b && (o.is_empty() || b.starts_with(&format!("{o}/")))));
        let set = b.build().map_err(|e| format!("artifact patterns: {e}"))?;
        Ok(Patterns { set, bases })
    }

    /// Whether the relative path `rel` is an artifact.
    pub fn matches(&self, rel: &str) -> bool {
        self.set.is_match(rel)
    }

    /// Where a walk starts: the leading literal directories of each pattern (`""`: the
    /// workspace itself), none below another.
    pub fn bases(&self) -> &[String] {
        &self.bases
    }
}

/// The leading components of `p` without glob characters, except the last component (a
/// literal pattern `a/b.txt` has base `a`: the walk lists `a` and finds `b.txt`).
fn base(p: &str) -> String {
    let comps: Vec<&str> = p.split('/').collect();
    let mut out: Vec<&str> = Vec::new();
    for c in &comps[..comps.len().saturating_sub(1)] {
        if c.contains(['*', '?', '[', '{', '\\']) {
            break;
        }
        out.push(c);
    }
    out.join("/")
}

/// Size caps on artifacts. Defaults: 1 GiB a file, 5 GiB a job, 50 GiB a repository, 10,000
/// files a job.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Limits {
    pub max_file: u64,
    pub max_job: u64,
    pub max_repository: u64,
    pub max_files_per_job: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Limits { max_file: 1 << 30, max_job: 5 << 30, max_repository: 50 << 30, max_files_per_job: 10_000 }
    }
}

/// What is stored already, against the caps.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    /// Bytes and files of this job's artifacts.
    pub job_bytes: u64,
    pub job_files: u64,
    /// Bytes of all artifacts of the job's repository (jobs with no repository: of every such
    /// job) on the job's side: its trusted jobs', or its untrusted jobs' when `untrusted`.
    pub repository_bytes: u64,
    /// The job is untrusted (a pull request from a fork, an Actions runner job): its
    /// repository's untrusted jobs share a budget of [`UNTRUSTED_SHARE`] of the repository
    /// cap, apart from the trusted jobs', so they can never keep the trusted jobs' out.
    pub untrusted: bool,
}

/// The part of `max_repository` a repository's untrusted jobs share: one fifth.
pub const UNTRUSTED_SHARE: u64 = 5;

/// Whether an artifact of `size` bytes may be stored given `usage`; `Err` says which cap.
pub fn admit(limits: &Limits, usage: &Usage, size: u64) -> Result<(), String> {
    let gib = |b: u64| crate::quantity::Bytes(b).to_string();
    if size > limits.max_file {
        return Err(format!("{} is over the per-file cap of {}", gib(size), gib(limits.max_file)));
    }
    if usage.job_files >= limits.max_files_per_job {
        return Err(format!("the job has stored {} artifacts already, the cap", limits.max_files_per_job));
    }
    if usage.job_bytes.saturating_add(size) > limits.max_job {
        return Err(format!(
            "the job's artifacts would reach {}, over the per-job cap of {}",
            gib(usage.job_bytes.saturating_add(size)),
            gib(limits.max_job)
        ));
    }
    if usage.untrusted {
        let cap = limits.max_repository / UNTRUSTED_SHARE;
        if usage.repository_bytes.saturating_add(size) > cap {
            return Err(format!(
                "the repository's untrusted jobs' artifacts (pull requests from forks and the like) would reach {}, \
                 over their share of the per-repository cap, {} (a fifth of {}; the trusted jobs' room is apart)",
                gib(usage.repository_bytes.saturating_add(size)),
                gib(cap),
                gib(limits.max_repository)
            ));
        }
    } else if usage.repository_bytes.saturating_add(size) > limits.max_repository {
        return Err(format!(
            "the repository's artifacts would reach {}, over the per-repository cap of {}",
            gib(usage.repository_bytes.saturating_add(size)),
            gib(limits.max_repository)
        ));
    }
    Ok(())
}

/// One stored artifact, as retention sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Stored {
    pub job: i64,
    pub path: String,
    pub bytes: u64,
    pub created_ms: i64,
}

/// Which artifacts go: older than `retention_ms`, then the oldest while the rest exceed
/// `max_total`. Returns indexes into `stored`, in the order decided.
pub fn collect(stored: &[Stored], now_ms: i64, retention_ms: i64, max_total: Option<u64>) -> Vec<usize> {
    let mut order: Vec<usize> = (0..stored.len()).collect();
    order.sort_by(|&a, &b| {
        let (x, y) = (&stored[a], &stored[b]);
        (x.created_ms, x.job, &x.path).cmp(&(y.created_ms, y.job, &y.path))
    });
    let mut gone = Vec::new();
    let mut total: u64 = stored.iter().map(|s| s.bytes).sum();
    for i in order {
        let s = &stored[i];
        let expired = now_ms.saturating_sub(s.created_ms) > retention_ms;
        let over = max_total.is_some_and(|m| total > m);
        if expired || over {
            total -= s.bytes;
            gone.push(i);
        } else {
            // Sorted oldest first: nothing after this is expired, and the total fits.
            break;
        }
    }
    gone
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pats(p: &[&str]) -> Patterns {
        Patterns::new(&p.iter().map(|s| s.to_string()).collect::<Vec<_>>()).expect("valid")
    }

    #[test]
    fn hostile_patterns_are_refused_with_the_reason() {
        for (p, word) in [
            ("", "empty"),
            ("/etc/passwd", "absolute"),
            ("~/x", "~"),
            ("out/../../etc", ".."),
            ("..", ".."),
            ("./x", "`.`"),
            ("a\nb", "control"),
            ("a[", "glob"),
        ] {
            let why = check_pattern(p).unwrap_or_else(|| panic!("{p:?} accepted"));
            assert!(why.contains(word), "{p:?}: {why}");
        }
        assert_eq!(check_pattern("dist/*.whl"), None);
        assert_eq!(check_pattern("reports/**/*.xml"), None);
    }

    #[test]
    fn globs_stay_in_one_component_unless_double_star() {
        let p = pats(&["out/*.txt", "logs/**"]);
        assert!(p.matches("out/a.txt"));
        assert!(!p.matches("out/sub/a.txt"));
        assert!(p.matches("logs/a"));
        assert!(p.matches("logs/x/y/z"));
        assert!(!p.matches("other/a.txt"));
        assert_eq!(p.bases(), ["logs", "out"]);
        let p = pats(&["a/b/c.txt", "a/**/*.log", "*.md"]);
        assert_eq!(p.bases(), [""], "the workspace itself holds every other base");
        assert_eq!(pats(&["a/b/c.txt", "a/x/*.log"]).bases(), ["a/b", "a/x"]);
    }

    #[test]
    fn paths_that_could_land_outside_are_refused() {
        for p in ["", "/etc/passwd", "../x", "a/../../x", "a//b", "a/", "a/./b", "a\nb", "a\\b", "a\0b"] {
            assert!(check_path(p).is_err(), "{p:?} accepted");
        }
        assert!(check_path("dist/gpuci-1.0.whl").is_ok());
        assert!(check_path(&"a".repeat(MAX_PATH_LEN + 1)).is_err());
    }

    /// Outsider finding: `out/\u{202E}gpj.exe` listed as `out/exe.jpg`.
    #[test]
    fn names_that_show_as_something_else_are_refused() {
        for p in ["out/\u{202E}gpj.exe", "a\u{200B}b", "\u{2066}x", "x\u{FEFF}"] {
            assert!(check_path(p).unwrap_err().contains("invisible"), "{p:?}");
        }
        assert!(check_path("résumé/ünïcode-名前.txt").is_ok());
    }

    #[test]
    fn when_decides_by_outcome() {
        assert!(ArtifactWhen::Always.applies(true) && ArtifactWhen::Always.applies(false));
        assert!(ArtifactWhen::OnSuccess.applies(true) && !ArtifactWhen::OnSuccess.applies(false));
        assert!(!ArtifactWhen::OnFailure.applies(true) && ArtifactWhen::OnFailure.applies(false));
    }

    #[test]
    fn each_cap_is_named_when_it_refuses() {
        let l = Limits { max_file: 100, max_job: 150, max_repository: 1000, max_files_per_job: 3 };
        assert!(admit(&l, &Usage::default(), 100).is_ok());
        assert!(admit(&l, &Usage::default(), 101).unwrap_err().contains("per-file"));
        let u = Usage { job_bytes: 100, job_files: 1, repository_bytes: 100, untrusted: false };
        assert!(admit(&l, &u, 51).unwrap_err().contains("per-job"));
        let u = Usage { job_bytes: 0, job_files: 3, repository_bytes: 0, untrusted: false };
        assert!(admit(&l, &u, 1).unwrap_err().contains("3 artifacts"));
        let u = Usage { job_bytes: 0, job_files: 0, repository_bytes: 950, untrusted: false };
        assert!(admit(&l, &u, 51).unwrap_err().contains("per-repository"));
    }

    #[test]
    fn untrusted_jobs_share_a_fifth_of_the_repository_cap_apart_from_trusted_ones() {
        let l = Limits { max_file: 1000, max_job: 1000, max_repository: 1000, max_files_per_job: 100 };
        // Untrusted jobs (their own bytes counted) stop at 200 of the 1000.
        let fork = |bytes| Usage { repository_bytes: bytes, untrusted: true, ..Usage::default() };
        assert!(admit(&l, &fork(150), 50).is_ok());
        let e = admit(&l, &fork(150), 51).unwrap_err();
        assert!(e.contains("untrusted") && e.contains("a fifth"), "{e}");
        // Trusted jobs count only trusted bytes: a fork that filled its share takes none of theirs.
        let trusted = |bytes| Usage { repository_bytes: bytes, untrusted: false, ..Usage::default() };
        assert!(admit(&l, &trusted(0), 1000).is_ok());
    }

    #[test]
    fn retention_then_the_cap_oldest_first() {
        let s = |job, path: &str, bytes, created_ms| Stored { job, path: path.into(), bytes, created_ms };
        let stored = vec![s(2, "b", 10, 500), s(1, "a", 10, 100), s(3, "c", 10, 900), s(1, "z", 10, 100)];
        // Retention 450 at 1000: created before 550 go (job 1's two, job 2's).
        assert_eq!(collect(&stored, 1000, 450, None), vec![1, 3, 0]);
        // Nothing expired; a cap of 15 keeps only the newest.
        assert_eq!(collect(&stored, 1000, 10_000, Some(15)), vec![1, 3, 0]);
        assert_eq!(collect(&stored, 1000, 10_000, Some(40)), Vec::<usize>::new());
        assert_eq!(collect(&stored, 1000, 10_000, Some(30)), vec![1]);
    }
}
