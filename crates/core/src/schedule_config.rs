//! `[[schedule]]` in the server config: pipelines the coordinator submits on a cron schedule.
//!
//! Each entry names a git repository the coordinator can read (`repository`: a local path or
//! a URL `git clone` takes), a `branch` (default: the repository's default branch) and the
//! pipeline file in it (`pipeline`, default `.gpuci.yml`, as `gpuci submit`). Errors say
//! `file:line:column: schedule[i] (name): field: what`, all before the coordinator starts.
//! Other sections are ignored here (their own parsers are strict about them).

use crate::fleet::FleetConfigError;
use crate::repo::RepoId;
use crate::schedule::{time_zone, Cron};
use jiff::tz::TimeZone;
use serde::Deserialize;
use std::collections::{BTreeMap, BTreeSet};

/// The pipeline file a schedule submits when it names none: `gpuci submit`'s default.
pub const DEFAULT_PIPELINE: &str = ".gpuci.yml";

/// One schedule, checked.
#[derive(Clone, Debug)]
pub struct ScheduleSpec {
    /// Unique; letters, digits, `.`, `_` and `-` (it is in URLs and in `gpuci schedules run`).
    pub name: String,
    pub cron: Cron,
    /// The IANA name as configured (`UTC` by default).
    pub timezone: String,
    pub tz: TimeZone,
    /// Where the coordinator fetches the pipeline from: a local path or a git URL. The
    /// pipeline's repository is this too (caches, secret scopes, budgets).
    pub repository: String,
    /// `None`: the repository's default branch (its `HEAD`).
    pub branch: Option<String>,
    /// The pipeline file's path in the repository.
    pub pipeline: String,
    /// Added to every job's environment, as `gpuci submit --env`.
    pub env: BTreeMap<String, String>,
    /// A disabled schedule is listed but never fires by itself (`gpuci schedules run` still runs it).
    pub enabled: bool,
}

#[derive(Deserialize)]
struct Document {
    #[serde(default)]
    schedule: Vec<ScheduleFile>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ScheduleFile {
    name: toml::Spanned<String>,
    cron: toml::Spanned<String>,
    #[serde(default)]
    timezone: Option<toml::Spanned<String>>,
    repository: toml::Spanned<String>,
    #[serde(default)]
    branch: Option<toml::Spanned<String>>,
    #[serde(default)]
    pipeline: Option<toml::Spanned<String>>,
    #[serde(default)]
    env: Option<toml::Spanned<BTreeMap<String, String>>>,
    #[serde(default = "yes")]
    enabled: bool,
}

fn yes() -> bool {
    true
}

/// The `[[schedule]]`s of a server config's text; a bare `owner/name` repository is on
/// `github_host` (as a URL must be given to fetch it, that is only its identity).
pub fn parse_schedules(file_name: &str, text: &str, github_host: &str) -> Result<Vec<ScheduleSpec>, FleetConfigError> {
    let err = |offset: Option<usize>, what: String| FleetConfigError {
        file: file_name.to_string(),
        at: offset.map(|o| crate::fleet::line_col(text, o)),
        what,
    };
    let doc: Document = serde_path_to_error::deserialize(toml::Deserializer::new(text)).map_err(|e| {
        let offset = e.inner().span().map(|s| s.start);
        let message = e.inner().message().trim_end().to_string();
        err(offset, crate::fleet::describe_path(e.path(), &message))
    })?;
    let mut names = BTreeSet::new();
    let mut out = Vec::with_capacity(doc.schedule.len());
    for (i, s) in doc.schedule.into_iter().enumerate() {
        let name = s.name.get_ref().clone();
        let fail =
            |at: usize, field: &str, what: String| err(Some(at), format!("schedule[{i}] ({name}): {field}: {what}"));
        let name_ok = !name.is_empty()
            && name.len() <= 64
            && name.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
            && !name.starts_with(['.', '-']);
        if !name_ok {
            return Err(fail(
                s.name.span().start,
                "name",
                "expected 1-64 letters, digits, `.`, `_` or `-`, not starting with `.` or `-`".into(),
            ));
        }
        if !names.insert(name.clone()) {
            return Err(fail(s.name.span().start, "name", "another schedule has this name".into()));
        }
        let cron = Cron::parse(s.cron.get_ref())
            .map_err(|e| fail(s.cron.span().start, "cron", format!("{:?}: {e}", s.cron.get_ref())))?;
        let (timezone, tz) = match &s.timezone {
            None => ("UTC".to_string(), TimeZone::UTC),
            Some(t) => (t.get_ref().clone(), time_zone(t.get_ref()).map_err(|e| fail(t.span().start, "timezone", e))?),
        };
        let repository = s.repository.get_ref().trim().to_string();
        let repo_at = s.repository.span().start;
        if repository.is_empty() || repository.len() > 1024 || repository.chars().any(char::is_control) {
            return Err(fail(
                repo_at,
                "repository",
                "expected a local path or a git URL of 1-1024 printable characters".into(),
            ));
        }
        // Handed to `git` as an argument: one that reads as an option is never one.
        if repository.starts_with('-') {
            return Err(fail(repo_at, "repository", "must not start with `-`".into()));
        }
        if let Err(e) = RepoId::parse(&repository, github_host) {
            return Err(fail(
                repo_at,
                "repository",
                format!("{:?} names no repository ({}); expected an absolute local path or a git URL", e.text, e.what),
            ));
        }
        let branch = match &s.branch {
            None => None,
            Some(b) => {
                let v = b.get_ref();
                let ok = !v.is_empty()
                    && v.len() <= 255
                    && !v.starts_with(['-', '/'])
                    && !v.ends_with(['/', '.'])
                    && !v.contains("..")
                    && !v.contains("@{")
                    && !v.chars().any(|c| c.is_control() || c.is_whitespace() || "~^:?*[\\".contains(c));
                if !ok {
                    return Err(fail(b.span().start, "branch", format!("{v:?} is not a valid branch name")));
                }
                Some(v.clone())
            }
        };
        let pipeline = match &s.pipeline {
            None => DEFAULT_PIPELINE.to_string(),
            Some(p) => {
                let v = p.get_ref();
                let ok = !v.is_empty()
                    && v.len() <= 1024
                    && !v.starts_with('/')
                    && !v.chars().any(char::is_control)
                    && v.split('/').all(|c| c != ".." && !c.is_empty());
                if !ok {
                    return Err(fail(
                        p.span().start,
                        "pipeline",
                        format!("{v:?}: expected a relative path inside the repository, without `..`"),
                    ));
                }
                v.clone()
            }
        };
        let env = match &s.env {
            None => BTreeMap::new(),
            Some(e) => {
                for (k, v) in e.get_ref() {
                    let mut chars = k.chars();
                    let valid = chars.next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
                        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_');
                    if !valid {
                        return Err(fail(
                            e.span().start,
                            "env",
                            format!("invalid variable name {k:?}: expected letters, digits and `_`, not starting with a digit"),
                        ));
                    }
                    if v.contains('\0') {
                        return Err(fail(e.span().start, "env", format!("{k} contains a NUL character")));
                    }
                }
                e.get_ref().clone()
            }
        };
        out.push(ScheduleSpec { name, cron, timezone, tz, repository, branch, pipeline, env, enabled: s.enabled });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(t: &str) -> Result<Vec<ScheduleSpec>, String> {
        parse_schedules("server.toml", t, "github.com").map_err(|e| e.to_string())
    }

    #[test]
    fn a_full_schedule_and_its_defaults() {
        let s = parse(
            "[github]\nx = 1\n\n[[schedule]]\nname = \"nightly\"\ncron = \"0 3 * * *\"\ntimezone = \"Europe/Berlin\"\n\
             repository = \"https://github.com/acme/x\"\nbranch = \"main\"\npipeline = \".gpuci/nightly.yml\"\n\
             env = { SUITE = \"full\" }\n\n[[schedule]]\nname = \"weekly\"\ncron = \"@weekly\"\nrepository = \"/srv/repo\"\nenabled = false\n",
        )
        .unwrap();
        assert_eq!(s.len(), 2);
        assert_eq!(
            (s[0].name.as_str(), s[0].cron.as_str(), s[0].timezone.as_str()),
            ("nightly", "0 3 * * *", "Europe/Berlin")
        );
        assert_eq!(s[0].branch.as_deref(), Some("main"));
        assert_eq!(s[0].pipeline, ".gpuci/nightly.yml");
        assert_eq!(s[0].env.get("SUITE").map(String::as_str), Some("full"));
        assert!(s[0].enabled);
        assert_eq!(
            (s[1].timezone.as_str(), s[1].branch.as_deref(), s[1].pipeline.as_str()),
            ("UTC", None, ".gpuci.yml")
        );
        assert!(!s[1].enabled);
        assert_eq!(parse("[github]\nx = 1\n").unwrap().len(), 0);
    }

    #[test]
    fn errors_name_file_line_column_and_field() {
        let base = "[[schedule]]\nname = \"n\"\nrepository = \"/srv/r\"\n";
        let e = parse(&format!("{base}cron = \"0 25 * * *\"\n")).unwrap_err();
        assert!(e.starts_with("server.toml:4:8: schedule[0] (n): cron: \"0 25 * * *\""), "{e}");
        let e = parse(&format!("{base}cron = \"@daily\"\ntimezone = \"Europe/Berln\"\n")).unwrap_err();
        assert!(
            e.starts_with("server.toml:5:12: schedule[0] (n): timezone: \"Europe/Berln\" is not a time zone"),
            "{e}"
        );
        let e = parse(&format!("{base}cron = \"@daily\"\ncorn = 1\n")).unwrap_err();
        assert!(e.starts_with("server.toml:5:1: schedule[0]: unknown field `corn`"), "{e}");
        let e = parse(&format!("{base}cron = \"@daily\"\nbranch = \"--upload-pack=x\"\n")).unwrap_err();
        assert!(e.contains("schedule[0] (n): branch: \"--upload-pack=x\" is not a valid branch name"), "{e}");
        let e = parse(&format!("{base}cron = \"@daily\"\npipeline = \"../etc/passwd\"\n")).unwrap_err();
        assert!(e.contains("schedule[0] (n): pipeline: \"../etc/passwd\""), "{e}");
        let e = parse(&format!("{base}cron = \"@daily\"\nenv = {{ \"1X\" = \"v\" }}\n")).unwrap_err();
        assert!(e.contains("schedule[0] (n): env: invalid variable name \"1X\""), "{e}");
        let e =
            parse("[[schedule]]\nname = \"n\"\ncron = \"@daily\"\nrepository = \"-oProxyCommand=x\"\n").unwrap_err();
        assert!(e.starts_with("server.toml:4:14: schedule[0] (n): repository: must not start with `-`"), "{e}");
        let e = parse("[[schedule]]\nname = \"a b\"\ncron = \"@daily\"\nrepository = \"/r\"\n").unwrap_err();
        assert!(e.starts_with("server.toml:2:8: schedule[0] (a b): name: expected 1-64"), "{e}");
        let two = "[[schedule]]\nname = \"n\"\ncron = \"@daily\"\nrepository = \"/r\"\n";
        let e = parse(&format!("{two}{two}")).unwrap_err();
        assert!(e.starts_with("server.toml:6:8: schedule[1] (n): name: another schedule has this name"), "{e}");
        let e = parse("[[schedule]]\nname = \"n\"\nrepository = \"/r\"\n").unwrap_err();
        assert!(e.contains("missing field `cron`"), "{e}");
    }
}
