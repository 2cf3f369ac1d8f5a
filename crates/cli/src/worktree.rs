//! The work tree a pipeline file lies in, as `gpuci submit` sees it: its top, its `origin`
//! remote and its files (tracked, and untracked but not ignored), for the workspace upload and
//! the repository a pipeline is submitted for.
//!
//! This is on the path a user waits on (`gpuci bench client`), and each `git` process costs a
//! process start, so the top and the `origin` URL are read from the repository's files the
//! way git finds them, and `git ls-files` is the one process asked. Whatever this reading does
//! not understand for certain (an `include` in the config, a `GIT_DIR` in the environment, a
//! continued line) is asked of git instead. It never writes to the work tree.

use crate::{CliError, CliResult};
use anyhow::Context;
use gpuci_core::condition::{BuildEvent, BuildFacts, MAX_CHANGED_PATHS};
use std::path::{Path, PathBuf};

/// What git says about the directory a pipeline file lies in.
#[derive(Debug, Default)]
pub struct WorkTree {
    /// The directory the pipeline file lies in.
    pub dir: PathBuf,
    /// Its git work tree's top, if it is in one.
    pub top: Option<PathBuf>,
    /// The work tree's `origin` URL.
    pub origin: Option<String>,
    /// What git lists of the whole work tree (tracked, and untracked but not ignored),
    /// relative to `top`; asked only when the upload is made of it.
    files: Option<Vec<u8>>,
}

impl WorkTree {
    pub fn probe(pipeline_file: &Path, list_files: bool) -> WorkTree {
        let dir = match pipeline_file.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        };
        match Repo::find(&dir) {
            Found::Repo(repo) => {
                let origin = match config_value(&repo.config, "remote", "origin", "url") {
                    Ok(v) => v,
                    Err(Unsure) => git_output(&repo.top, &["config", "--get", "remote.origin.url"]).and_then(text),
                };
                if !list_files {
                    return WorkTree { dir, top: Some(repo.top), origin, files: None };
                }
                // git may still refuse the repository (another user's, `safe.directory`): then
                // it is not one, as every git command would say.
                match git_output(&repo.top, &["ls-files", "-z", "--cached", "--others", "--exclude-standard"]) {
                    Some(files) => WorkTree { dir, top: Some(repo.top), origin, files: Some(files) },
                    None => WorkTree { dir, top: None, origin: None, files: None },
                }
            }
            Found::None => WorkTree { dir, top: None, origin: None, files: None },
            Found::AskGit => Self::probe_with_git(dir, list_files),
        }
    }

    /// Ask git itself, three processes at once: where the environment changes how git finds
    /// its repository.
    fn probe_with_git(dir: PathBuf, list_files: bool) -> WorkTree {
        let git = |args: &[&str]| {
            std::process::Command::new("git")
                .arg("-C")
                .arg(&dir)
                .args(args)
                .stdin(std::process::Stdio::null())
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::null())
                .spawn()
                .ok()
        };
        let top = git(&["rev-parse", "--show-toplevel"]);
        let origin = git(&["config", "--get", "remote.origin.url"]);
        let files = list_files
            .then(|| git(&["ls-files", "-z", "--cached", "--others", "--exclude-standard", "--full-name", "--", ":/"]))
            .flatten();
        let output = |c: Option<std::process::Child>| {
            c.and_then(|c| c.wait_with_output().ok()).filter(|o| o.status.success()).map(|o| o.stdout)
        };
        let top = output(top).and_then(text).map(PathBuf::from);
        let origin = output(origin).and_then(text);
        let files = output(files).filter(|_| top.is_some());
        WorkTree { dir, top, origin, files }
    }

    /// The repository the pipeline belongs to, as caches are keyed: the `origin` URL, else
    /// the work tree's path; none outside git. Each must name a repository as the coordinator
    /// reads one (`gpuci_core::repo`; it refuses a submission whose `repository` does not):
    /// one that does not (`%20` in an Azure DevOps URL, a relative remote, a path with a
    /// space) is passed over, and the second value says so, for stderr.
    pub fn repository(&self) -> (Option<String>, Option<String>) {
        let origin = self.origin.as_deref().map(without_credentials);
        let top = self.top.as_ref().map(|t| t.display().to_string());
        let mut passed_over = Vec::new();
        for (what, candidate) in [("origin", origin), ("work tree", top)] {
            let Some(candidate) = candidate else { continue };
            // Strict: a remote git reports as `acme/x` is a relative path, not a repository.
            match gpuci_core::repo::RepoId::parse_remote(candidate.trim()) {
                Ok(_) => {
                    let note = (!passed_over.is_empty())
                        .then(|| format!("{}; submitting for the {what} {candidate}", passed_over.join("; ")));
                    return (Some(candidate), note);
                }
                Err(e) => passed_over.push(format!("the {what} {:?} names no repository ({})", e.text, e.what)),
            }
        }
        let note = (!passed_over.is_empty()).then(|| {
            format!("{}; submitting for no repository (steps' cache: paths are not kept)", passed_over.join("; "))
        });
        (None, note)
    }

    /// Which directory the workspace is made of, and its files: `upload` if given, else the
    /// git work tree, else the pipeline file's directory. `None` with `--no-upload`.
    pub fn upload_root(&self, a: &crate::cli::UploadArgs) -> CliResult<Option<(PathBuf, Vec<PathBuf>)>> {
        if a.no_upload {
            return Ok(None);
        }
        if let Some(dir) = &a.upload {
            let meta =
                std::fs::metadata(dir).map_err(|e| CliError::Input(format!("cannot upload {}: {e}", dir.display())))?;
            if !meta.is_dir() {
                return Err(CliError::Input(format!("cannot upload {}: not a directory", dir.display())));
            }
            return Ok(Some((dir.clone(), workspace_files(dir)?)));
        }
        match (&self.top, &self.files) {
            (Some(top), Some(listed)) => Ok(Some((top.clone(), existing_files(top, listed)))),
            _ => Ok(Some((self.dir.clone(), workspace_files(&self.dir)?))),
        }
    }
}

fn git_toplevel(dir: &Path) -> Option<PathBuf> {
    let out = std::process::Command::new("git")
        .arg("-C")
        .arg(dir)
        .args(["rev-parse", "--show-toplevel"])
        .stderr(std::process::Stdio::null())
        .output()
        .ok()?;
    let top = String::from_utf8(out.stdout).ok()?;
    (out.status.success() && !top.trim().is_empty()).then(|| PathBuf::from(top.trim_end_matches('\n')))
}

/// The files of `git ls-files -z` output (relative to `root`) that are there to upload:
/// deleted but still in the index, or a submodule (a directory), is not.
fn existing_files(root: &Path, listed: &[u8]) -> Vec<PathBuf> {
    use std::os::unix::ffi::OsStrExt;
    let mut files: Vec<PathBuf> = listed
        .split(|b| *b == 0)
        .filter(|n| !n.is_empty())
        .map(|name| PathBuf::from(std::ffi::OsStr::from_bytes(name)))
        .filter(|rel| std::fs::symlink_metadata(root.join(rel)).is_ok_and(|m| !m.is_dir()))
        .collect();
    files.sort();
    files.dedup();
    files
}

/// The files under `root` to upload, relative to it: what git lists (tracked, and untracked but
/// not ignored) in a git work tree, else every file, skipping `.git`.
fn workspace_files(root: &Path) -> CliResult<Vec<PathBuf>> {
    use PathBuf;
    if git_toplevel(root).is_some() {
        let out = std::process::Command::new("git")
            .arg("-C")
            .arg(root)
            .args(["ls-files", "-z", "--cached", "--others", "--exclude-standard"])
            .output()
            .with_context(|| format!("running git ls-files in {}", root.display()))?;
        if !out.status.success() {
            return Err(CliError::Other(anyhow::anyhow!(
                "git ls-files in {}: {}",
                root.display(),
                String::from_utf8_lossy(&out.stderr).trim()
            )));
        }
        return Ok(existing_files(root, &out.stdout));
    }
    let mut files = Vec::new();
    let mut stack = vec![PathBuf::new()];
    while let Some(rel) = stack.pop() {
        let dir = root.join(&rel);
        let entries = std::fs::read_dir(&dir).with_context(|| format!("reading {}", dir.display()))?;
        for e in entries {
            let e = e.with_context(|| format!("reading {}", dir.display()))?;
            let name = rel.join(e.file_name());
            let kind = e.file_type().with_context(|| format!("reading {}", root.join(&name).display()))?;
            if kind.is_dir() {
                if e.file_name() != ".git" {
                    stack.push(name);
                }
            } else if kind.is_file() || kind.is_symlink() {
                files.push(name);
            }
        }
    }
    files.sort();
    Ok(files)
}

/// A remote URL without the user name and password some put in it
/// (`https://user:token@host/o/r.git` → `https://host/o/r.git`): they never leave this machine.
/// The scp-like form (`git@host:o/r.git`) names a user only and stays as it is.
fn without_credentials(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else { return url.to_string() };
    let authority_end = rest.find('/').unwrap_or(rest.len());
    match rest[..authority_end].rfind('@') {
        Some(at) => format!("{scheme}://{}", &rest[at + 1..]),
        None => url.to_string(),
    }
}

/// A command's output as one line of text; `None` if empty.
fn text(out: Vec<u8>) -> Option<String> {
    Some(String::from_utf8_lossy(&out).trim_end_matches('\n').to_string()).filter(|s| !s.is_empty())
}

/// `git -C dir ARGS`'s standard output, if it succeeded.
fn git_output(dir: &Path, args: &[&str]) -> Option<Vec<u8>> {
    let out = std::process::Command::new("git")
        .arg("-C")
        .arg(dir)
        .args(args)
        .stdin(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .output()
        .ok()?;
    out.status.success().then_some(out.stdout)
}

/// A work tree found from its files.
#[derive(Debug, PartialEq, Eq)]
struct Repo {
    /// The work tree's top (symbolic links resolved, as git prints it).
    top: PathBuf,
    /// The repository's own config file.
    config: PathBuf,
}

#[derive(Debug, PartialEq, Eq)]
enum Found {
    Repo(Repo),
    /// Not in a work tree.
    None,
    /// The environment tells git where to look (`GIT_DIR`, ...): ask git.
    AskGit,
}

/// Variables that change how git finds a repository.
const DISCOVERY_ENV: &[&str] = &[
    "GIT_DIR",
    "GIT_WORK_TREE",
    "GIT_COMMON_DIR",
    "GIT_CEILING_DIRECTORIES",
    "GIT_DISCOVERY_ACROSS_FILESYSTEM",
    "GIT_CONFIG",
    "GIT_CONFIG_COUNT",
    "GIT_CONFIG_PARAMETERS",
];

impl Repo {
    /// Find the work tree `dir` is in as git does: the nearest directory, from `dir` up, with
    /// a `.git` directory (holding `HEAD`) or a `.git` file (`gitdir: PATH`, as in linked work
    /// trees and submodules). A linked work tree's config is its main repository's
    /// (`commondir`).
    fn find(dir: &Path) -> Found {
        if DISCOVERY_ENV.iter().any(|v| std::env::var_os(v).is_some()) {
            return Found::AskGit;
        }
        let Ok(start) = dir.canonicalize() else { return Found::AskGit };
        for top in start.ancestors() {
            let dot_git = top.join(".git");
            let Ok(meta) = std::fs::metadata(&dot_git) else { continue };
            let git_dir = if meta.is_dir() {
                if !dot_git.join("HEAD").is_file() {
                    continue;
                }
                dot_git
            } else {
                let Ok(link) = std::fs::read_to_string(&dot_git) else { return Found::AskGit };
                let Some(path) = link.strip_prefix("gitdir:").map(str::trim) else { return Found::AskGit };
                top.join(path)
            };
            // `config.worktree` (per-work-tree settings) is read by git only with an extension
            // turned on: leave that to git.
            if git_dir.join("config.worktree").exists() {
                return Found::AskGit;
            }
            let common = match std::fs::read_to_string(git_dir.join("commondir")) {
                Ok(c) => git_dir.join(c.trim_end_matches('\n')),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => git_dir,
                Err(_) => return Found::AskGit,
            };
            if common.join("config.worktree").exists() {
                return Found::AskGit;
            }
            return Found::Repo(Repo { top: top.to_path_buf(), config: common.join("config") });
        }
        Found::None
    }
}

/// This reading of a config file cannot be sure of its answer.
#[derive(Debug, PartialEq, Eq)]
struct Unsure;

/// The last value of `section.subsection.key` in the config file at `path` (what
/// `git config --get` answers, for the repository's own file), or [`Unsure`].
fn config_value(path: &Path, section: &str, subsection: &str, key: &str) -> Result<Option<String>, Unsure> {
    match std::fs::read(path) {
        Ok(bytes) => {
            let text = String::from_utf8(bytes).map_err(|_| Unsure)?;
            parse_config_value(&text, section, subsection, key)
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(_) => Err(Unsure),
    }
}

/// Git's config syntax, as far as a remote's URL needs it: `[section "subsection"]` headers
/// (section and key names case-insensitive, subsection case-sensitive), `key = value` lines,
/// `#` and `;` comments, double quotes and the escapes `\\ \" \n \t \b`. An `[include]` or
/// `[includeIf ...]` section, a continued line (`\` at the end), the old `[section.sub]` form or
/// anything not understood is [`Unsure`].
fn parse_config_value(text: &str, section: &str, subsection: &str, key: &str) -> Result<Option<String>, Unsure> {
    let mut in_section = false;
    let mut found = None;
    for raw in text.lines() {
        let line = raw.trim_start();
        if line.is_empty() || line.starts_with('#') || line.starts_with(';') {
            continue;
        }
        if let Some(header) = line.strip_prefix('[') {
            let end = header.find(']').ok_or(Unsure)?;
            let rest = header[end + 1..].trim_start();
            if !(rest.is_empty() || rest.starts_with('#') || rest.starts_with(';')) {
                return Err(Unsure);
            }
            let header = &header[..end];
            let (name, sub) = match header.find(|c: char| c.is_ascii_whitespace()) {
                Some(i) => {
                    let sub = header[i..].trim();
                    let sub = sub.strip_prefix('"').and_then(|s| s.strip_suffix('"')).ok_or(Unsure)?;
                    if sub.contains('\\') {
                        return Err(Unsure);
                    }
                    (&header[..i], Some(sub))
                }
                None => (header, None),
            };
            if name.eq_ignore_ascii_case("include") || name.eq_ignore_ascii_case("includeif") || name.contains('.') {
                return Err(Unsure);
            }
            if !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '-') {
                return Err(Unsure);
            }
            in_section = name.eq_ignore_ascii_case(section) && sub == Some(subsection);
            continue;
        }
        let (name, value) = match line.find('=') {
            Some(i) => (line[..i].trim_end(), Some(&line[i + 1..])),
            None => (line.trim_end(), None),
        };
        if !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '-') || name.is_empty() {
            return Err(Unsure);
        }
        if in_section && name.eq_ignore_ascii_case(key) {
            // A key with no `=` is boolean true, not a URL.
            found = Some(match value {
                Some(v) => unquote(v)?,
                None => return Err(Unsure),
            });
        } else if let Some(v) = value {
            // Another key's value: still checked, so a continued line is not read as keys.
            unquote(v)?;
        }
    }
    Ok(found)
}

/// A config value: trimmed outside quotes, comments cut, quotes removed, escapes applied.
fn unquote(v: &str) -> Result<String, Unsure> {
    let mut out = String::new();
    let mut pending_space = String::new();
    let mut quoted = false;
    let mut chars = v.trim_start().chars();
    while let Some(c) = chars.next() {
        match c {
            '"' => {
                out.push_str(&std::mem::take(&mut pending_space));
                quoted = !quoted;
            }
            '\\' => {
                out.push_str(&std::mem::take(&mut pending_space));
                match chars.next() {
                    Some('\\') => out.push('\\'),
                    Some('"') => out.push('"'),
                    Some('n') => out.push('\n'),
                    Some('t') => out.push('\t'),
                    Some('b') => {
                        out.pop();
                    }
                    // A continued line, or an escape git refuses.
                    _ => return Err(Unsure),
                }
            }
            '#' | ';' if !quoted => break,
            c if c.is_whitespace() && !quoted => pending_space.push(c),
            c => {
                out.push_str(&std::mem::take(&mut pending_space));
                out.push(c);
            }
        }
    }
    if quoted {
        return Err(Unsure);
    }
    Ok(out)
}

/// The build's commit as the builds list shows it, from the work tree at `top`: the event
/// (`manual`), HEAD's commit, subject and author, and the branch (unknown when detached). Two
/// quick git calls: every `gpuci submit` sends these, conditions or not.
pub fn commit_facts(top: Option<&Path>) -> BuildFacts {
    let mut facts = BuildFacts { event: Some(BuildEvent::Manual), ..BuildFacts::default() };
    let Some(top) = top else { return facts };
    let Some(out) = git_output(top, &["log", "-1", "--no-show-signature", "--format=%H%x00%s%x00%an"]) else {
        return facts;
    };
    let out = String::from_utf8_lossy(&out);
    let mut parts = out.trim_end_matches('\n').splitn(3, '\0');
    let mut next = || parts.next().map(str::to_string).filter(|s| !s.is_empty());
    facts.commit = next();
    facts.subject = next();
    facts.author = next();
    if facts.commit.is_some() {
        facts.branch = git_output(top, &["symbolic-ref", "-q", "--short", "HEAD"]).and_then(text);
    }
    facts
}

/// What the build is, for steps' `if:`, from the work tree at `top` (docs/pipelines.md,
/// "Conditions"): the event is `manual`; the branch is HEAD's (unknown when detached); the
/// tag is one pointing at HEAD (the first by name; `""` when none); the commit is HEAD's.
/// The changed paths are those that differ between the work tree (committed, staged or not,
/// and untracked files that are not ignored: what is uploaded) and the merge-base of HEAD
/// with the default branch (`origin/HEAD`, else `origin/main`, `origin/master`, `main`,
/// `master`), or with `HEAD^` when HEAD is on the default branch itself; unknown when there
/// is no such commit or more than `MAX_CHANGED_PATHS` paths changed.
pub fn build_facts(top: Option<&Path>) -> BuildFacts {
    let mut facts = commit_facts(top);
    let Some(top) = top else { return facts };
    let line = |args: &[&str]| git_output(top, args).and_then(text);
    if facts.commit.is_none() {
        return facts;
    }
    facts.tag = git_output(top, &["tag", "--points-at", "HEAD", "--sort=refname"])
        .map(|out| String::from_utf8_lossy(&out).lines().next().unwrap_or_default().to_string());
    let base = ["origin/HEAD", "origin/main", "origin/master", "main", "master"]
        .iter()
        .find_map(|b| line(&["merge-base", "HEAD", b]))
        .and_then(|mb| {
            if Some(&mb) == facts.commit.as_ref() {
                line(&["rev-parse", "--verify", "-q", "HEAD^"])
            } else {
                Some(mb)
            }
        });
    let Some(base) = base else { return facts };
    let (Some(diff), Some(untracked)) = (
        git_output(top, &["diff", "--name-only", "-z", "--no-renames", &base, "--"]),
        git_output(top, &["ls-files", "-z", "--others", "--exclude-standard"]),
    ) else {
        return facts;
    };
    let mut paths: Vec<String> = diff
        .split(|b| *b == 0)
        .chain(untracked.split(|b| *b == 0))
        .filter(|p| !p.is_empty())
        .map(|p| String::from_utf8_lossy(p).into_owned())
        .collect();
    paths.sort();
    paths.dedup();
    if paths.len() <= MAX_CHANGED_PATHS {
        facts.changed = Some(paths);
    }
    facts
}

#[cfg(test)]
mod tests {
    use super::*;

    fn git(dir: &Path, args: &[&str]) -> String {
        let out = std::process::Command::new("git").arg("-C").arg(dir).args(args).output().expect("git runs");
        assert!(out.status.success(), "git {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).trim_end_matches('\n').to_string()
    }

    fn repo() -> tempfile::TempDir {
        let d = tempfile::tempdir().expect("tempdir");
        git(d.path(), &["init", "-q"]);
        git(d.path(), &["-c", "user.name=t", "-c", "user.email=t@e", "commit", "-q", "--allow-empty", "-m", "c"]);
        d
    }

    /// A work tree's top and `origin` URL.
    type Answer = (Option<PathBuf>, Option<String>);

    /// What git itself answers for the top and `origin`, beside what [`WorkTree::probe`] reads.
    fn both(dir: &Path) -> (Answer, Answer) {
        let fast = WorkTree::probe(&dir.join("p.yml"), true);
        let slow = WorkTree::probe_with_git(dir.to_path_buf(), true);
        ((fast.top, fast.origin), (slow.top, slow.origin))
    }

    #[test]
    fn top_and_origin_are_what_git_says_in_a_repository_a_subdirectory_and_a_linked_work_tree() {
        let r = repo();
        git(r.path(), &["remote", "add", "origin", "git@github.com:octo/kernels.git"]);
        let sub = r.path().join("a/b");
        std::fs::create_dir_all(&sub).expect("mkdir");
        let (fast, slow) = both(&sub);
        assert_eq!(fast, slow);
        assert_eq!(fast.1.as_deref(), Some("git@github.com:octo/kernels.git"));

        let linked = tempfile::tempdir().expect("tempdir");
        let wt = linked.path().join("wt");
        git(r.path(), &["worktree", "add", "-q", wt.to_str().expect("utf-8"), "-b", "other"]);
        let (fast, slow) = both(&wt);
        assert_eq!(fast, slow);
        assert_eq!(fast.0, Some(wt.canonicalize().expect("exists")));
        assert_eq!(fast.1.as_deref(), Some("git@github.com:octo/kernels.git"));
    }

    #[test]
    fn credentials_in_the_origin_url_never_leave_the_machine() {
        assert_eq!(without_credentials("https://user:s3cret@github.com/o/r.git"), "https://github.com/o/r.git");
        assert_eq!(without_credentials("https://tok@github.com/o/r.git"), "https://github.com/o/r.git");
        assert_eq!(without_credentials("ssh://git@host:22/o/r.git"), "ssh://host:22/o/r.git");
        assert_eq!(without_credentials("https://github.com/o/r@v1.git"), "https://github.com/o/r@v1.git");
        assert_eq!(without_credentials("git@github.com:o/r.git"), "git@github.com:o/r.git");
        let t = WorkTree { origin: Some("https://user:s3cret@github.com/o/r.git".into()), ..WorkTree::default() };
        assert_eq!(t.repository(), (Some("https://github.com/o/r.git".into()), None));
    }

    /// The coordinator refuses a `repository` that names none: an origin (or a work tree
    /// path) that does not is passed over and said, never sent, so `gpuci submit` works in such
    /// a work tree as it did.
    #[test]
    fn an_origin_or_path_that_names_no_repository_is_passed_over_and_said() {
        let azure = "https://dev.azure.com/org/My%20Project/_git/repo";
        let t = WorkTree { origin: Some(azure.into()), top: Some("/srv/work/repo".into()), ..WorkTree::default() };
        let (repository, note) = t.repository();
        assert_eq!(repository.as_deref(), Some("/srv/work/repo"));
        let note = note.unwrap_or_default();
        assert!(note.contains(azure) && note.contains("names no repository"), "{note}");
        assert!(note.ends_with("submitting for the work tree /srv/work/repo"), "{note}");
        // A relative remote, and a work tree whose path has a space: nothing to send.
        let t = WorkTree {
            origin: Some("../upstream".into()),
            top: Some("/home/me/My Work".into()),
            ..WorkTree::default()
        };
        let (repository, note) = t.repository();
        assert_eq!(repository, None);
        let note = note.unwrap_or_default();
        assert!(note.contains("\"../upstream\"") && note.contains("\"/home/me/My Work\""), "{note}");
        assert!(note.ends_with("submitting for no repository (steps' cache: paths are not kept)"), "{note}");
        // What names one is sent as it is, with nothing to say.
        let t = WorkTree { origin: None, top: Some("/srv/work/repo".into()), ..WorkTree::default() };
        assert_eq!(t.repository(), (Some("/srv/work/repo".into()), None));
        assert_eq!(WorkTree::default().repository(), (None, None));
    }

    #[test]
    fn no_repository_and_no_origin() {
        let plain = tempfile::tempdir().expect("tempdir");
        // A temporary directory may itself lie in a work tree; only compare with git.
        let (fast, slow) = both(plain.path());
        assert_eq!(fast, slow);
        let r = repo();
        let (fast, slow) = both(r.path());
        assert_eq!(fast, slow);
        assert_eq!(fast.1, None);
    }

    #[test]
    fn config_forms_read_as_git_reads_them() {
        let r = repo();
        let cfg = r.path().join(".git/config");
        let base = std::fs::read_to_string(&cfg).expect("config");
        let cases = [
            "[remote \"origin\"]\n\turl = https://github.com/octo/a.git\n",
            "[Remote \"origin\"]\n\tURL=https://github.com/octo/b.git # a comment\n",
            "[remote \"origin\"]\n\turl = \"https://github.com/octo/c d.git\" ; quoted\n",
            "[remote \"origin\"]\n\turl = first\n\turl = second\n",
            "[remote \"Origin\"]\n\turl = not-this-one\n",
            "[remote \"origin\"]\n\tfetch = +refs/heads/*:refs/remotes/origin/*\n[remote \"upstream\"]\n\turl = not-this\n",
            "[remote \"origin\"] # trailing comment\n\turl = x\\\\y\n",
            "[remote \"origin\"]\n\turl = a\\tb\n",
        ];
        for case in cases {
            std::fs::write(&cfg, format!("{base}{case}")).expect("write");
            let (fast, slow) = both(r.path());
            assert_eq!(fast, slow, "config:\n{case}");
        }
    }

    #[test]
    fn what_is_not_understood_is_asked_of_git() {
        let unsure = [
            "[include]\n\tpath = other\n",
            "[includeIf \"gitdir:/x/\"]\n\tpath = other\n",
            "[remote \"origin\"]\n\turl = https://github.com/\\\n\tocto/cont.git\n",
            "[remote.origin]\n\turl = old-form\n",
            "[remote \"origin\"]\n\turl = \"unterminated\n",
        ];
        for case in unsure {
            assert_eq!(parse_config_value(case, "remote", "origin", "url"), Err(Unsure), "{case}");
        }
        // And the probe's answer is still git's.
        let r = repo();
        let cfg = r.path().join(".git/config");
        let other = r.path().join(".git/other");
        std::fs::write(&other, "[remote \"origin\"]\n\turl = from-include\n").expect("write");
        let base = std::fs::read_to_string(&cfg).expect("config");
        std::fs::write(&cfg, format!("{base}[include]\n\tpath = other\n")).expect("write");
        let (fast, slow) = both(r.path());
        assert_eq!(fast, slow);
        assert_eq!(fast.1.as_deref(), Some("from-include"));
    }

    #[test]
    fn files_are_listed_from_the_top_wherever_the_pipeline_lies() {
        let r = repo();
        std::fs::create_dir_all(r.path().join("ci")).expect("mkdir");
        std::fs::write(r.path().join("ci/p.yml"), "steps: []\n").expect("write");
        std::fs::write(r.path().join("README.md"), "x\n").expect("write");
        std::fs::write(r.path().join(".gitignore"), "ignored\n").expect("write");
        std::fs::write(r.path().join("ignored"), "x\n").expect("write");
        let t = WorkTree::probe(&r.path().join("ci/p.yml"), true);
        let (root, files) = t.upload_root(&crate::cli::UploadArgs::default()).expect("listed").expect("an upload");
        assert_eq!(root, r.path().canonicalize().expect("exists"));
        let names: Vec<String> = files.iter().map(|f| f.display().to_string()).collect();
        assert_eq!(names, [".gitignore", "README.md", "ci/p.yml"]);
    }
}
