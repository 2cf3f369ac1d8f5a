//! `artifacts:` and `artifacts_from:` on a step. The rules of patterns are
//! [`crate::artifacts`]'s; this reads them from the file with positions.
//!
//! - `artifacts: "dist/*.whl"`, `artifacts: [a, b]`, or `artifacts: {paths: [...], when:
//!   always|on_success|on_failure}` (default `always`).
//! - `artifacts_from: KEY` or a list of keys; each must also be in the step's `depends_on`
//!   (checked in `read_step`, where both are known).

use super::{join, Ctx, Kind, Node, Value};
use crate::artifacts::{check_pattern, ArtifactSpec, ArtifactWhen, MAX_PATTERNS};

/// Keys of `artifacts:` in its map form.
pub(crate) const ARTIFACTS_KEYS: &[&str] = &["paths", "when"];

impl Ctx<'_> {
    pub(super) fn artifacts(&mut self, node: &Node, path: &str) -> Option<ArtifactSpec> {
        match &node.value {
            Value::Map(_) => {
                let fields = self.record(node, path, "a map with `paths:` and `when:`", ARTIFACTS_KEYS)?;
                let mut spec = ArtifactSpec::default();
                let mut ok = true;
                let mut saw_paths = false;
                for (name, _, v) in fields {
                    let p = join(path, name);
                    match name {
                        "paths" => {
                            saw_paths = true;
                            match self.artifact_patterns(v, &p) {
                                Some(paths) => spec.paths = paths,
                                None => ok = false,
                            }
                        }
                        "when" => match self.choice(v, &p, &["always", "on_success", "on_failure"]) {
                            Some("on_success") => spec.when = ArtifactWhen::OnSuccess,
                            Some("on_failure") => spec.when = ArtifactWhen::OnFailure,
                            Some(_) => spec.when = ArtifactWhen::Always,
                            None => ok = false,
                        },
                        _ => {}
                    }
                }
                if !saw_paths {
                    self.err(node.pos, join(path, "paths"), "missing: `artifacts:` as a map needs `paths:`");
                    ok = false;
                }
                ok.then_some(spec)
            }
            _ => self.artifact_patterns(node, path).map(|paths| ArtifactSpec { paths, when: ArtifactWhen::Always }),
        }
    }

    fn artifact_patterns(&mut self, node: &Node, path: &str) -> Option<Vec<String>> {
        if let Value::Seq(items) = &node.value {
            if items.is_empty() {
                self.err(node.pos, path, "an empty list uploads nothing; name paths or globs, or leave the field out");
                return None;
            }
            if items.len() > MAX_PATTERNS {
                self.err(node.pos, path, format!("at most {MAX_PATTERNS} artifact patterns per step"));
                return None;
            }
        } else if !matches!(node.value, Value::Scalar(Kind::Str, _)) {
            self.type_err(node, path, "a path or glob, or a list of them");
            return None;
        }
        let items = self.strings(node, path)?;
        let mut out = Vec::with_capacity(items.len());
        let mut ok = true;
        for (s, pos, p) in items {
            match check_pattern(&s) {
                Some(why) => {
                    self.err(pos, p, why);
                    ok = false;
                }
                None if out.contains(&s) => {
                    self.err(pos, p, format!("`{s}` is listed twice"));
                    ok = false;
                }
                None => out.push(s),
            }
        }
        ok.then_some(out)
    }

    /// `test_reports:`: globs like `artifacts:` (no map form: reports are read whatever the
    /// step's outcome).
    pub(super) fn test_reports(&mut self, node: &Node, path: &str) -> Option<Vec<String>> {
        self.artifact_patterns(node, path)
    }

    /// The keys named, with positions; checked against `depends_on` by the caller.
    pub(super) fn artifacts_from(&mut self, node: &Node, path: &str) -> Option<Vec<(String, super::Pos, String)>> {
        let items = self.strings(node, path)?;
        let mut seen: Vec<String> = Vec::new();
        let mut ok = true;
        for (s, pos, p) in &items {
            if seen.contains(s) {
                self.err(*pos, p, format!("`{s}` is listed twice"));
                ok = false;
            }
            seen.push(s.clone());
        }
        ok.then_some(items)
    }
}
