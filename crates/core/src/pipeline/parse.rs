//! `.gpuci.yml` text → validated [`Pipeline`], or every error found, each with a position.
//!
//! Why not serde: serde stops at the first error and forgets where values came from, and the
//! product promise is "every error names `file:line:column`, the field, and what was expected,
//! all of them in one go". So this runs in two stages:
//!
//! 1. yaml-rust2's event parser (which marks every event with a position) feeds a small
//!    spanned tree ([`Node`]). Syntax errors, a second document, unknown tags, runaway nesting
//!    and alias bombs stop here, with one error.
//! 2. A walk over that tree that knows the format ([`Ctx`]). It never stops early: each field
//!    is checked on its own, a bad field is recorded and replaced by its default so that the
//!    rest of the file is still checked. Cross-step rules (unique keys, `depends_on` targets,
//!    cycles) run after all steps are read.
//!
//! Anchors and aliases are supported (an alias is a copy of the anchored node, errors inside
//! it point at the anchor), as are merge keys (`<<: *defaults`). Tags other than `!!str` are
//! rejected. Nothing here panics on any input; `tests/pipeline_fuzz.rs` holds it to that.
//!
//! The accepted keys are the `*_KEYS` lists below; `schema.rs` has a test that keeps the JSON
//! Schema and these lists equal.
//!
//! Layout: stage 1 is `tree`; stage 2 is `read` (typed readers of one node), `steps` (the
//! format: top level and a step's fields), `conditions` (`if:`, `soft_fail:`, `retry:`,
//! `concurrency:`), `resources` (`gpu:`, `resources:`), `matrix`, `artifacts`, and `graph`
//! (cross-step rules). This file holds the entry points, the error types and the limits.

use super::{Pipeline, Step};
use std::collections::HashSet;

mod artifacts;
mod conditions;
mod graph;
mod matrix;
mod read;
mod resources;
mod steps;
mod tree;

use tree::{build_tree, int_value, quoted, resolve_plain, Kind, Node, Pos, Value};

#[cfg(test)]
pub(crate) use artifacts::ARTIFACTS_KEYS;
#[cfg(test)]
pub(crate) use matrix::MATRIX_KEYS;
pub use matrix::{MAX_MATRIX_JOBS, MAX_PIPELINE_JOBS};

/// One problem in a pipeline file. Displays as `file:line:column: field: message`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, thiserror::Error)]
#[error("{file}:{line}:{column}: {field}: {message}")]
pub struct PipelineError {
    pub file: String,
    /// 1-based.
    pub line: usize,
    /// 1-based, in characters.
    pub column: usize,
    /// Path of the offending field, e.g. `steps[2].gpu.memory`; `(syntax)` for YAML syntax
    /// errors and `(root)` for the document as a whole.
    pub field: String,
    pub message: String,
}

/// Every problem found in one file, sorted by position; one per line when displayed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}", .0.iter().map(|e| e.to_string()).collect::<Vec<_>>().join("\n"))]
pub struct PipelineErrors(pub Vec<PipelineError>);

impl PipelineErrors {
    pub fn len(&self) -> usize {
        self.0.len()
    }
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
    pub fn iter(&self) -> std::slice::Iter<'_, PipelineError> {
        self.0.iter()
    }
}

/// Keys of the top-level map.
pub(crate) const TOP_KEYS: &[&str] = &["env", "steps"];
/// Keys of a step.
pub(crate) const STEP_KEYS: &[&str] = &[
    "key",
    "label",
    "command",
    "env",
    "timeout",
    "queue_timeout",
    "agents",
    "depends_on",
    "retry",
    "concurrency",
    "gpus",
    "gpu",
    "resources",
    "network",
    "sandbox",
    "image",
    "secrets",
    "environment",
    "cache",
    "artifacts",
    "artifacts_from",
    "test_reports",
    "matrix",
    "soft_fail",
    "allow_dependency_failure",
    "if",
];
pub(crate) const RETRY_KEYS: &[&str] = &["count", "on"];
pub(crate) const CONCURRENCY_KEYS: &[&str] = &["group", "cancel_in_progress"];
pub(crate) const GPU_KEYS: &[&str] = &["memory", "compute_capability", "model", "driver", "cuda", "mig"];
pub(crate) const RESOURCES_KEYS: &[&str] = &["memory", "cpus", "pids"];
/// Keys of an item of `soft_fail:` in its Buildkite form, `- exit_status: 1`.
pub(crate) const SOFT_FAIL_KEYS: &[&str] = &["exit_status"];

/// Most GPUs one step may ask for; no host has more, and a typo like `gpus: 100` should fail
/// here rather than queue forever.
pub(crate) const MAX_GPUS: i64 = 64;
/// Most retries; more hides a broken step or a broken machine.
pub(crate) const MAX_RETRIES: i64 = 10;
pub(crate) const MAX_KEY_LEN: usize = 64;
/// Nesting deeper than this is certainly not a pipeline; bounding it bounds every recursion below.
const MAX_DEPTH: usize = 64;
/// Nodes after alias expansion; stops "billion laughs" documents.
const MAX_NODES: usize = 200_000;

/// Bytes (names and values) one `env:` map may hold, the pipeline's or a step's.
pub const MAX_ENV_BYTES: usize = 32 * 1024;

/// Parse and validate a pipeline file. `file` is only used in error messages.
pub fn parse(file: &str, text: &str) -> Result<Pipeline, PipelineErrors> {
    parse_in(file, text, None)
}

/// [`parse`], for steps added to a running pipeline (`super::upload`) when `existing` is given:
/// its keys may be named by `depends_on` and not taken again, its jobs count towards the cap.
pub(crate) fn parse_in(
    file: &str,
    text: &str,
    existing: Option<&super::upload::Existing>,
) -> Result<Pipeline, PipelineErrors> {
    let jobs = existing.map_or(0, |e| e.jobs);
    let mut cx = Ctx { file, text, errors: Vec::new(), jobs, expanded_nodes: 0, existing };
    // A raw NUL ends the YAML reader's input early: what follows it would be dropped unseen.
    if let Some(at) = text.find('\0') {
        let line = text[..at].matches('\n').count() + 1;
        let column = text[..at].rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
        cx.err(Pos { line, column }, "(syntax)", "the file contains a NUL byte; a pipeline file is text");
        return Err(PipelineErrors(cx.errors));
    }
    let pipeline = match build_tree(text) {
        Ok(root) => cx.pipeline(root.as_ref()),
        Err(e) => {
            cx.err(e.pos, e.field, e.message);
            None
        }
    };
    // A matrix step is read once per combination: the same error in a field without
    // `{{matrix.…}}` would otherwise be reported once per job.
    let mut seen = HashSet::new();
    cx.errors.retain(|e| seen.insert(e.clone()));
    cx.errors.sort_by_key(|e| (e.line, e.column));
    match pipeline {
        Some(p) if cx.errors.is_empty() => Ok(p),
        _ => Err(PipelineErrors(cx.errors)),
    }
}

// ---------------------------------------------------------------------------------------------
// Stage 2: tree → Pipeline

/// `path.key`, or `key` at the top.
fn join(path: &str, key: &str) -> String {
    if path.is_empty() {
        key.to_string()
    } else {
        format!("{path}.{key}")
    }
}

fn index(path: &str, i: usize) -> String {
    format!("{path}[{i}]")
}

/// The closest candidate, if it is close enough to be what was meant.
fn suggest<'a>(word: &str, candidates: impl IntoIterator<Item = &'a str>) -> Option<&'a str> {
    let word = word.to_lowercase();
    let mut best: Option<(f64, &str)> = None;
    for c in candidates {
        let score = strsim::jaro_winkler(&word, &c.to_lowercase());
        if score >= 0.8 && best.is_none_or(|(s, _)| score > s) {
            best = Some((score, c));
        }
    }
    best.map(|(_, c)| c)
}

fn one_of(options: &[&str]) -> String {
    options.join(", ")
}

/// An environment variable name: letters, digits and `_`, not starting with a digit.
pub fn is_env_name(s: &str) -> bool {
    let mut chars = s.chars();
    chars.next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

fn is_step_key(s: &str) -> bool {
    !s.is_empty() && s.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
}

/// A map's entries after key checks: `(name, key position, value)`.
type Fields<'n> = Vec<(&'n str, Pos, &'n Node)>;

/// A step as read, before the cross-step checks.
struct Draft {
    /// Position in the list of steps.
    index: usize,
    step: Step,
    pos: Pos,
    /// Position of `key:`'s value when the key was given.
    key_pos: Option<Pos>,
    /// `depends_on` entries: name, position, field path.
    deps: Vec<(String, Pos, String)>,
    /// The jobs a `matrix:` step expands to, in order; empty for a plain step (it is `step`).
    expanded: Vec<Step>,
}

struct Ctx<'f> {
    file: &'f str,
    /// The file's text, to place errors inside a value (`if:`).
    text: &'f str,
    errors: Vec<PipelineError>,
    /// Jobs the steps read so far expand to (see [`MAX_PIPELINE_JOBS`]).
    jobs: usize,
    /// Nodes read for matrix combinations so far: bounds the work a small file can ask for.
    expanded_nodes: usize,
    /// The running pipeline steps are added to (`gpuci pipeline upload`); `None` for a file.
    existing: Option<&'f super::upload::Existing>,
}
