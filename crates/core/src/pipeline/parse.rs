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

use super::{Concurrency, NetworkMode, Pipeline, Resources, RetryPolicy, SandboxMode, SoftFail, Step};
use crate::duration::Duration;
use crate::gpu::{CmpOp, ComputeCapability, Constraint, GpuRequirements, Version};
use crate::job::RetryOn;
use crate::quantity::Bytes;
use std::collections::{BTreeMap, HashMap, HashSet};
use yaml_rust2::parser::{Event, Parser, Tag};
use yaml_rust2::scanner::{Marker, TScalarStyle};

mod artifacts;
mod matrix;

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
// Stage 1: events → spanned tree

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Pos {
    line: usize,
    column: usize,
}

impl Pos {
    const START: Pos = Pos { line: 1, column: 1 };

    fn of(m: &Marker) -> Pos {
        // yaml-rust2 lines are 1-based, columns 0-based.
        Pos { line: m.line().max(1), column: m.col() + 1 }
    }
}

impl std::fmt::Display for Pos {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{}", self.line, self.column)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Null,
    Bool,
    Int,
    Float,
    Str,
}

#[derive(Clone, Debug)]
enum Value {
    Scalar(Kind, String),
    Seq(Vec<Node>),
    Map(Vec<(Node, Node)>),
}

#[derive(Clone, Debug)]
struct Node {
    pos: Pos,
    value: Value,
}

impl Node {
    /// What the node is, for "expected X, got Y".
    fn describe(&self) -> String {
        match &self.value {
            Value::Scalar(Kind::Null, _) => "null".into(),
            Value::Scalar(Kind::Bool, t) => format!("a boolean ({t})"),
            Value::Scalar(Kind::Int | Kind::Float, t) => format!("a number ({t})"),
            Value::Scalar(Kind::Str, t) => format!("a string ({})", quoted(t)),
            Value::Seq(_) => "a list".into(),
            Value::Map(_) => "a map".into(),
        }
    }

    /// The scalar's text, whatever its kind (null has none).
    fn scalar_text(&self) -> Option<&str> {
        match &self.value {
            Value::Scalar(Kind::Null, _) => None,
            Value::Scalar(_, t) => Some(t),
            _ => None,
        }
    }

    fn str(&self) -> Option<&str> {
        match &self.value {
            Value::Scalar(Kind::Str, t) => Some(t),
            _ => None,
        }
    }

    fn size(&self) -> usize {
        match &self.value {
            Value::Scalar(..) => 1,
            Value::Seq(items) => 1 + items.iter().map(Node::size).sum::<usize>(),
            Value::Map(entries) => 1 + entries.iter().map(|(k, v)| k.size() + v.size()).sum::<usize>(),
        }
    }
}

/// `"text"`, shortened so that a pasted blob does not flood the terminal.
fn quoted(s: &str) -> String {
    const MAX: usize = 60;
    if s.chars().count() <= MAX {
        format!("{s:?}")
    } else {
        let head: String = s.chars().take(MAX).collect();
        format!("{:?}…", head)
    }
}

/// YAML 1.2 core schema resolution of a plain scalar. Quoted and block scalars are strings.
fn resolve_plain(t: &str) -> Kind {
    match t {
        "" | "~" | "null" | "Null" | "NULL" => return Kind::Null,
        "true" | "True" | "TRUE" | "false" | "False" | "FALSE" => return Kind::Bool,
        ".inf" | ".Inf" | ".INF" | "+.inf" | "-.inf" | "+.Inf" | "-.Inf" | ".nan" | ".NaN" | ".NAN" => {
            return Kind::Float
        }
        _ => {}
    }
    let unsigned = t.strip_prefix(['-', '+']).unwrap_or(t);
    if !unsigned.is_empty() && unsigned.bytes().all(|b| b.is_ascii_digit()) {
        return Kind::Int;
    }
    if let Some(hex) = t.strip_prefix("0x") {
        if !hex.is_empty() && hex.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Kind::Int;
        }
    }
    if let Some(oct) = t.strip_prefix("0o") {
        if !oct.is_empty() && oct.bytes().all(|b| (b'0'..=b'7').contains(&b)) {
            return Kind::Int;
        }
    }
    let numeric_chars = t.bytes().all(|b| b.is_ascii_digit() || b"+-.eE".contains(&b));
    if numeric_chars && t.bytes().any(|b| b.is_ascii_digit()) && t.parse::<f64>().is_ok() {
        return Kind::Float;
    }
    Kind::Str
}

/// An integer scalar's value; `None` when it is not one or does not fit.
fn int_value(node: &Node) -> Option<i64> {
    match &node.value {
        Value::Scalar(Kind::Int, t) => {
            if let Some(hex) = t.strip_prefix("0x") {
                i64::from_str_radix(hex, 16).ok()
            } else if let Some(oct) = t.strip_prefix("0o") {
                i64::from_str_radix(oct, 8).ok()
            } else {
                t.parse().ok()
            }
        }
        _ => None,
    }
}

/// An error that stops stage 1.
struct Fatal {
    pos: Pos,
    field: &'static str,
    message: String,
}

fn fatal(pos: Pos, message: impl Into<String>) -> Fatal {
    Fatal { pos, field: "(syntax)", message: message.into() }
}

enum Frame {
    Seq { pos: Pos, anchor: usize, items: Vec<Node> },
    Map { pos: Pos, anchor: usize, entries: Vec<(Node, Node)>, key: Option<Node> },
}

#[derive(Default)]
struct Builder {
    stack: Vec<Frame>,
    /// Completed anchored nodes by the parser's anchor id.
    anchors: HashMap<usize, Node>,
    nodes: usize,
    root: Option<Node>,
}

impl Builder {
    fn open(&mut self, frame: Frame, pos: Pos) -> Result<(), Fatal> {
        if self.stack.len() >= MAX_DEPTH {
            return Err(fatal(pos, format!("nested more than {MAX_DEPTH} levels deep")));
        }
        self.stack.push(frame);
        Ok(())
    }

    fn complete(&mut self, node: Node, anchor: usize) -> Result<(), Fatal> {
        self.count(node.pos, 1)?;
        if anchor != 0 {
            self.anchors.insert(anchor, node.clone());
        }
        self.push(node);
        Ok(())
    }

    fn count(&mut self, pos: Pos, n: usize) -> Result<(), Fatal> {
        self.nodes = self.nodes.saturating_add(n);
        if self.nodes > MAX_NODES {
            return Err(fatal(pos, format!("the document has more than {MAX_NODES} nodes (after expanding aliases)")));
        }
        Ok(())
    }

    fn alias(&mut self, id: usize, pos: Pos) -> Result<(), Fatal> {
        let Some(node) = self.anchors.get(&id).cloned() else {
            return Err(fatal(
                pos,
                "this alias refers to a node that contains it; recursive aliases are not supported",
            ));
        };
        self.count(pos, node.size())?;
        self.push(node);
        Ok(())
    }

    fn push(&mut self, node: Node) {
        match self.stack.last_mut() {
            None => self.root = Some(node),
            Some(Frame::Seq { items, .. }) => items.push(node),
            Some(Frame::Map { entries, key, .. }) => match key.take() {
                None => *key = Some(node),
                Some(k) => entries.push((k, node)),
            },
        }
    }

    fn close(&mut self, pos: Pos) -> Result<(), Fatal> {
        let (node, anchor) = match self.stack.pop() {
            Some(Frame::Seq { pos, anchor, items }) => (Node { pos, value: Value::Seq(items) }, anchor),
            Some(Frame::Map { pos, anchor, mut entries, .. }) => {
                // A block mapping's start event is marked at its first `:`; people look for
                // the first key.
                let pos = entries.first().map_or(pos, |(k, _)| pos.min(k.pos));
                // `key:` with nothing after it is an empty scalar marked where the next token
                // starts, often the next line; point at the key instead.
                for (k, v) in &mut entries {
                    if matches!(&v.value, Value::Scalar(Kind::Null, t) if t.is_empty()) {
                        v.pos = k.pos;
                    }
                }
                (Node { pos, value: Value::Map(merge_keys(entries)) }, anchor)
            }
            None => return Err(fatal(pos, "unbalanced YAML structure")),
        };
        // The node was counted when its frame was opened.
        if anchor != 0 {
            self.anchors.insert(anchor, node.clone());
        }
        self.push(node);
        Ok(())
    }
}

fn is_merge_key(k: &Node) -> bool {
    matches!(&k.value, Value::Scalar(Kind::Str, t) if t == "<<")
}

/// Apply YAML merge keys: `<<: *defaults` (or a list of aliases) adds the entries of the
/// merged maps that the map does not set itself. A `<<` whose value is not a map (or list of
/// maps) is left in place, and validation reports it.
fn merge_keys(entries: Vec<(Node, Node)>) -> Vec<(Node, Node)> {
    let mergeable = |v: &Node| match &v.value {
        Value::Map(_) => true,
        Value::Seq(items) => items.iter().all(|i| matches!(i.value, Value::Map(_))),
        _ => false,
    };
    if !entries.iter().any(|(k, v)| is_merge_key(k) && mergeable(v)) {
        return entries;
    }
    let (merges, mut own): (Vec<_>, Vec<_>) = entries.into_iter().partition(|(k, v)| is_merge_key(k) && mergeable(v));
    let mut present: Vec<String> = own.iter().filter_map(|(k, _)| k.scalar_text().map(str::to_string)).collect();
    for (_, v) in merges {
        let maps = match v.value {
            Value::Map(m) => vec![m],
            Value::Seq(items) => items
                .into_iter()
                .filter_map(|i| match i.value {
                    Value::Map(m) => Some(m),
                    _ => None,
                })
                .collect(),
            Value::Scalar(..) => Vec::new(),
        };
        for (k, v) in maps.into_iter().flatten() {
            let name = k.scalar_text().map(str::to_string);
            if let Some(name) = name {
                if !present.contains(&name) {
                    present.push(name);
                    own.push((k, v));
                }
            }
        }
    }
    own
}

fn check_tag(tag: &Option<Tag>, allowed: &str, pos: Pos) -> Result<bool, Fatal> {
    match tag {
        None => Ok(false),
        Some(t) if (t.handle == "tag:yaml.org,2002:" || t.handle == "!!") && t.suffix == allowed => Ok(true),
        Some(t) => Err(fatal(pos, format!("YAML tags are not supported here (found `{}{}`)", t.handle, t.suffix))),
    }
}

fn build_tree(text: &str) -> Result<Option<Node>, Fatal> {
    let mut parser = Parser::new_from_str(text);
    let mut b = Builder::default();
    let mut documents = 0;
    loop {
        let (event, mark) = parser.next_token().map_err(|e| fatal(Pos::of(e.marker()), e.info()))?;
        let pos = Pos::of(&mark);
        match event {
            Event::StreamEnd => break,
            Event::Nothing | Event::StreamStart | Event::DocumentEnd => {}
            Event::DocumentStart => {
                documents += 1;
                if documents > 1 {
                    return Err(Fatal {
                        pos,
                        field: "(root)",
                        message: "found a second YAML document; a pipeline file holds exactly one".into(),
                    });
                }
            }
            Event::Alias(id) => b.alias(id, pos)?,
            Event::Scalar(text, style, anchor, tag) => {
                let forced_str = check_tag(&tag, "str", pos)?;
                let kind = if forced_str || style != TScalarStyle::Plain { Kind::Str } else { resolve_plain(&text) };
                b.complete(Node { pos, value: Value::Scalar(kind, text) }, anchor)?;
            }
            Event::SequenceStart(anchor, tag) => {
                check_tag(&tag, "seq", pos)?;
                b.count(pos, 1)?;
                b.open(Frame::Seq { pos, anchor, items: Vec::new() }, pos)?;
            }
            Event::MappingStart(anchor, tag) => {
                check_tag(&tag, "map", pos)?;
                b.count(pos, 1)?;
                b.open(Frame::Map { pos, anchor, entries: Vec::new(), key: None }, pos)?;
            }
            Event::SequenceEnd | Event::MappingEnd => b.close(pos)?,
        }
    }
    Ok(b.root)
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

impl Ctx<'_> {
    fn err(&mut self, pos: Pos, field: impl Into<String>, message: impl Into<String>) {
        self.errors.push(PipelineError {
            file: self.file.to_string(),
            line: pos.line,
            column: pos.column,
            field: field.into(),
            message: message.into(),
        });
    }

    fn type_err(&mut self, node: &Node, path: &str, expected: &str) {
        let got = node.describe();
        self.err(node.pos, path, format!("expected {expected}, got {got}"));
    }

    /// The entries of a map, with non-string and repeated keys reported (the first of a
    /// repeated key is kept).
    fn map<'n>(&mut self, node: &'n Node, path: &str, expected: &str) -> Option<Fields<'n>> {
        let Value::Map(entries) = &node.value else {
            self.type_err(node, path, expected);
            return None;
        };
        let mut fields: Fields<'n> = Vec::with_capacity(entries.len());
        for (k, v) in entries {
            let Some(name) = k.scalar_text() else {
                let got = k.describe();
                self.err(k.pos, path, format!("expected a plain key, got {got}"));
                continue;
            };
            if let Some((_, first, _)) = fields.iter().find(|(n, _, _)| *n == name) {
                let first = *first;
                self.err(k.pos, join(path, name), format!("duplicate key `{name}` (first set at {first})"));
                continue;
            }
            fields.push((name, k.pos, v));
        }
        Some(fields)
    }

    /// `map` plus a check that every key is one of `allowed`.
    fn record<'n>(&mut self, node: &'n Node, path: &str, expected: &str, allowed: &[&str]) -> Option<Fields<'n>> {
        let fields = self.map(node, path, expected)?;
        let mut known = Vec::with_capacity(fields.len());
        for (name, pos, v) in fields {
            if allowed.contains(&name) {
                known.push((name, pos, v));
            } else if name == "<<" {
                self.err(
                    pos,
                    join(path, name),
                    format!("a merge key takes a map or a list of maps (`<<: *defaults`), got {}", v.describe()),
                );
            } else if let Some(s) = suggest(name, allowed.iter().copied()) {
                self.err(pos, join(path, name), format!("unknown key `{name}`, did you mean `{s}`?"));
            } else {
                self.err(pos, join(path, name), format!("unknown key `{name}`; expected one of: {}", one_of(allowed)));
            }
        }
        Some(known)
    }

    /// `s`, unless it holds a NUL byte: nothing in a pipeline may (see [`Parser::text`]).
    fn no_nul(&mut self, node: &Node, path: &str, s: &str) -> Option<String> {
        if s.contains('\0') {
            self.err(
                node.pos,
                path,
                "contains a NUL byte (\\0), which no command line or environment variable can hold",
            );
            return None;
        }
        Some(s.to_string())
    }

    fn string(&mut self, node: &Node, path: &str) -> Option<String> {
        match node.str() {
            Some(s) => self.no_nul(node, path, s),
            None => {
                self.type_err(node, path, "a string");
                None
            }
        }
    }

    /// A non-empty string without whitespace at the ends.
    fn word(&mut self, node: &Node, path: &str, what: &str) -> Option<String> {
        let s = self.string(node, path)?;
        if s.trim().is_empty() {
            self.err(node.pos, path, format!("{what} must not be empty"));
            None
        } else {
            Some(s.trim().to_string())
        }
    }

    /// A string, number or boolean as text (env values and agent tags are strings to the
    /// process, and `PORT: 8080` should not need quotes).
    /// Refuses a NUL byte: a job's environment and command line end at one, and the sandbox
    /// hands bubblewrap its arguments NUL-separated (an `env:` value with NULs in it became
    /// arguments of its own: outsider finding).
    fn text(&mut self, node: &Node, path: &str) -> Option<String> {
        match (&node.value, node.scalar_text()) {
            (Value::Scalar(..), Some(t)) => self.no_nul(node, path, t),
            _ => {
                self.type_err(node, path, "a string, number or boolean");
                None
            }
        }
    }

    fn bool(&mut self, node: &Node, path: &str) -> Option<bool> {
        match &node.value {
            Value::Scalar(Kind::Bool, t) => Some(t.eq_ignore_ascii_case("true")),
            _ => {
                self.type_err(node, path, "true or false");
                None
            }
        }
    }

    /// An integer in `lo..=hi`, described as `what` in the error.
    fn int_in(&mut self, node: &Node, path: &str, lo: i64, hi: i64, what: &str) -> Option<i64> {
        match (&node.value, int_value(node)) {
            (_, Some(n)) if (lo..=hi).contains(&n) => Some(n),
            (Value::Scalar(Kind::Int, t), _) => {
                self.err(node.pos, path, format!("expected {what} from {lo} to {hi}, got {t}"));
                None
            }
            _ => {
                self.type_err(node, path, &format!("{what} from {lo} to {hi}"));
                None
            }
        }
    }

    /// One string or a list of strings; each item with its position and path.
    fn strings(&mut self, node: &Node, path: &str) -> Option<Vec<(String, Pos, String)>> {
        match &node.value {
            Value::Scalar(Kind::Str, s) => Some(vec![(self.no_nul(node, path, s)?, node.pos, path.to_string())]),
            Value::Seq(items) => Some(self.string_items(items, path)),
            _ => {
                self.type_err(node, path, "a string or a list of strings");
                None
            }
        }
    }

    /// A list of strings (not a single string).
    fn string_list(&mut self, node: &Node, path: &str) -> Option<Vec<(String, Pos, String)>> {
        match &node.value {
            Value::Seq(items) => Some(self.string_items(items, path)),
            _ => {
                self.type_err(node, path, "a list of strings");
                None
            }
        }
    }

    fn string_items(&mut self, items: &[Node], path: &str) -> Vec<(String, Pos, String)> {
        let mut out = Vec::with_capacity(items.len());
        for (i, item) in items.iter().enumerate() {
            let p = index(path, i);
            if let Some(s) = self.string(item, &p) {
                out.push((s, item.pos, p));
            }
        }
        out
    }

    fn duration(&mut self, node: &Node, path: &str) -> Option<Duration> {
        const EXPECTED: &str = "expected a duration like 90s, 30m, 1h30m";
        let parsed = match &node.value {
            Value::Scalar(Kind::Str, t) => t.parse::<Duration>().map_err(|_| format!("{EXPECTED}, got {}", quoted(t))),
            Value::Scalar(Kind::Int, t) => Err(format!("{EXPECTED}, got {t} (add a unit: ms, s, m, h or d)")),
            _ => Err(format!("{EXPECTED}, got {}", node.describe())),
        };
        match parsed {
            Ok(d) if d.as_millis() == 0 => {
                self.err(node.pos, path, "must be longer than 0s");
                None
            }
            Ok(d) => Some(d),
            Err(message) => {
                self.err(node.pos, path, message);
                None
            }
        }
    }

    /// A size with a unit. A bare number is refused: `memory: 8` is 8 bytes, never what was meant.
    fn size(&mut self, text: &str, node: &Node, path: &str, expected: &str) -> Option<Bytes> {
        let bare = !text.is_empty() && text.trim().bytes().all(|b| b.is_ascii_digit() || b == b'.');
        match text.parse::<Bytes>() {
            Ok(b) if !bare && b.0 > 0 => Some(b),
            Ok(_) if !bare => {
                self.err(node.pos, path, "must be more than 0 bytes");
                None
            }
            _ => {
                self.err(node.pos, path, format!("{expected}, got {}", quoted(text)));
                None
            }
        }
    }

    // --- the format ---------------------------------------------------------------------

    fn pipeline(&mut self, root: Option<&Node>) -> Option<Pipeline> {
        const EXPECTED: &str = "a map with `steps:` or a list of steps";
        let Some(root) = root else {
            self.err(Pos::START, "(root)", format!("the file is empty; expected {EXPECTED}"));
            return None;
        };
        match &root.value {
            Value::Seq(_) => {
                let steps = self.steps(root, "steps")?;
                Some(Pipeline { env: BTreeMap::new(), steps })
            }
            Value::Map(_) => {
                let fields = self.record(root, "", EXPECTED, TOP_KEYS)?;
                let mut env = Some(BTreeMap::new());
                let mut steps = None;
                let mut saw_steps = false;
                for (name, _, v) in fields {
                    match name {
                        "env" => env = self.env(v, "env"),
                        "steps" => {
                            saw_steps = true;
                            steps = self.steps(v, "steps");
                        }
                        _ => {}
                    }
                }
                if !saw_steps {
                    self.err(root.pos, "steps", "missing: a pipeline needs `steps:`, a list of steps");
                }
                Some(Pipeline { env: env?, steps: steps? })
            }
            Value::Scalar(Kind::Null, _) => {
                self.err(root.pos, "(root)", format!("the file is empty; expected {EXPECTED}"));
                None
            }
            _ => {
                self.type_err(root, "(root)", EXPECTED);
                None
            }
        }
    }

    fn env(&mut self, node: &Node, path: &str) -> Option<BTreeMap<String, String>> {
        let fields = self.map(node, path, "a map of environment variables")?;
        let mut env = BTreeMap::new();
        for (name, pos, v) in fields {
            let p = join(path, name);
            if !is_env_name(name) {
                self.err(
                    pos,
                    &p,
                    format!(
                        "invalid variable name {}: expected letters, digits and `_`, not starting with a digit",
                        quoted(name)
                    ),
                );
                continue;
            }
            if let Some(value) = self.text(v, &p) {
                env.insert(name.to_string(), value);
            }
        }
        // Every job of the pipeline carries its environment: a large one, times 1,024 jobs, was
        // a quarter of a gigabyte in the database from one upload (outsider finding).
        let bytes: usize = env.iter().map(|(k, v)| k.len() + v.len()).sum();
        if bytes > MAX_ENV_BYTES {
            self.err(
                node.pos,
                path,
                format!("{bytes} bytes of variables, more than the {MAX_ENV_BYTES} one `env:` may hold"),
            );
            return None;
        }
        Some(env)
    }

    fn steps(&mut self, node: &Node, path: &str) -> Option<Vec<Step>> {
        let Value::Seq(items) = &node.value else {
            self.type_err(node, path, "a list of steps");
            return None;
        };
        if items.is_empty() {
            self.err(node.pos, path, "expected at least one step, got an empty list");
            return None;
        }
        // Steps with errors still take part in the cross-step checks, so that one run reports
        // a bad `depends_on` next to a bad `timeout`.
        let mut all_read = true;
        let mut drafts = Vec::with_capacity(items.len());
        for (i, item) in items.iter().enumerate() {
            match self.step(item, &index(path, i), i) {
                Some((draft, ok)) => {
                    all_read &= ok;
                    drafts.push(draft);
                }
                None => all_read = false,
            }
        }
        self.check_graph(&drafts, path);
        if self.jobs > MAX_PIPELINE_JOBS {
            let with = match self.existing {
                Some(e) => format!(" with the pipeline's {} jobs", e.jobs),
                None => String::new(),
            };
            self.err(
                node.pos,
                path,
                format!(
                    "the steps expand to {} jobs{with} (matrices included), more than the {MAX_PIPELINE_JOBS} a pipeline may have",
                    self.jobs
                ),
            );
            return None;
        }
        all_read.then(|| matrix::flatten(drafts))
    }

    /// The step as read (a matrix step: each of its jobs), and whether it was read without
    /// errors; `None` when it is not a map.
    fn step(&mut self, node: &Node, path: &str, i: usize) -> Option<(Draft, bool)> {
        let fields = self.record(node, path, "a map of step settings", STEP_KEYS)?;
        self.matrix_step(node, path, i, fields)
    }

    /// One reading of a step's fields. `unread` names fields that were given but left out of
    /// `fields` (their errors are already reported), so that they do not count as missing.
    fn read_step(
        &mut self,
        pos: Pos,
        path: &str,
        i: usize,
        fields: &[(&str, Pos, &Node)],
        unread: &[&str],
    ) -> (Draft, bool) {
        let mut step = Step::new(format!("step-{}", i + 1), String::new());
        step.command.clear();
        let mut draft =
            Draft { index: i, step: Step::new("", ""), pos, key_pos: None, deps: Vec::new(), expanded: Vec::new() };
        let mut ok = true;
        let mut have_command = unread.contains(&"command");
        let mut gpus_field: Option<(&Node, Option<u32>)> = None;
        let mut gpu_field: Option<(Pos, GpuRequirements, bool)> = None;
        let mut artifacts_from: Vec<(String, Pos, String)> = Vec::new();

        // Each arm records its own errors; `ok` only tracks whether the step is usable.
        for &(name, _, v) in fields {
            let p = join(path, name);
            let p = p.as_str();
            let good = match name {
                "key" => self.step_key(v, p).map(|k| {
                    step.key = k;
                    draft.key_pos = Some(v.pos);
                }),
                "label" => self.string(v, p).map(|l| step.label = Some(l)),
                "command" => {
                    have_command = true;
                    self.command(v, p).map(|c| step.command = c)
                }
                "env" => self.env(v, p).map(|e| step.env = e),
                "timeout" => self.duration(v, p).map(|d| step.timeout = Some(d)),
                "queue_timeout" => self.duration(v, p).map(|d| step.queue_timeout = Some(d)),
                "agents" => self.agents(v, p).map(|a| step.agents = a),
                "depends_on" => self.strings(v, p).map(|deps| draft.deps = deps),
                "retry" => self.retry(v, p).map(|r| step.retry = r),
                "concurrency" => self.concurrency(v, p).map(|c| step.concurrency = Some(c)),
                "gpus" => {
                    let n = self.int_in(v, p, 0, MAX_GPUS, "a GPU count").and_then(|n| u32::try_from(n).ok());
                    gpus_field = Some((v, n));
                    n.map(|_| ())
                }
                "gpu" => self.gpu(v, p).map(|(g, any)| gpu_field = Some((v.pos, g, any))),
                "resources" => self.resources(v, p).map(|r| step.resources = r),
                "network" => self.choice(v, p, &["default", "none"]).map(|n| {
                    step.network = if n == "none" { NetworkMode::None } else { NetworkMode::Default };
                }),
                "sandbox" => self.choice(v, p, &["default", "none"]).and_then(|n| {
                    // Trust is the pipeline's origin's, never the uploaded file's.
                    if n == "none" && self.existing.is_some_and(|e| !e.may_run_unsandboxed) {
                        self.err(
                            v.pos,
                            p,
                            "a step added by a job of an untrusted origin cannot run outside the sandbox",
                        );
                        return None;
                    }
                    step.sandbox = if n == "none" { SandboxMode::None } else { SandboxMode::Default };
                    Some(())
                }),
                "image" => self.image(v, p).map(|img| step.image = Some(img)),
                "environment" => self.word(v, p, "an environment name").and_then(|e| {
                    match crate::secret_scope::valid_environment(&e) {
                        Ok(()) => {
                            step.environment = Some(e);
                            Some(())
                        }
                        Err(why) => {
                            self.err(v.pos, p, why);
                            None
                        }
                    }
                }),
                "secrets" => self.secrets(v, p).map(|(names, sealed)| {
                    step.secrets = names;
                    step.encrypted_secrets = sealed;
                }),
                "cache" => self.cache(v, p).map(|c| step.cache = c),
                "artifacts" => self.artifacts(v, p).map(|a| step.artifacts = a),
                "artifacts_from" => self.artifacts_from(v, p).map(|a| artifacts_from = a),
                "test_reports" => self.test_reports(v, p).map(|t| step.test_reports = t),
                "soft_fail" => self.soft_fail(v, p).map(|s| step.soft_fail = s),
                "allow_dependency_failure" => self.bool(v, p).map(|b| step.allow_dependency_failure = b),
                "if" => self.condition(v, p).map(|c| step.condition = Some(c)),
                // Read by `matrix_step` before the fields.
                _ => Some(()),
            };
            ok &= good.is_some();
        }

        if !have_command {
            self.err(pos, join(path, "command"), "missing: every step needs a `command`");
            ok = false;
        }
        // `gpu:` alone means one GPU with those properties; `gpus: 0` with properties is a contradiction.
        let mut gpu = gpu_field.as_ref().map(|(_, g, _)| g.clone()).unwrap_or_default();
        let any_property = gpu_field.as_ref().is_some_and(|(_, _, any)| *any);
        match gpus_field {
            Some((gpus_node, Some(0))) if any_property => {
                self.err(
                    gpus_node.pos,
                    join(path, "gpus"),
                    "is 0, but `gpu:` asks for GPU properties; remove one of them",
                );
                ok = false;
            }
            Some((_, Some(n))) => gpu.count = n,
            None if gpu_field.is_some() => gpu.count = 1,
            _ => {}
        }
        step.gpu = gpu;
        step.depends_on = draft.deps.iter().map(|(d, _, _)| d.clone()).collect();
        // Artifacts come from steps that have ended before this one starts: its dependencies.
        for (key, at, p) in &artifacts_from {
            if !step.depends_on.contains(key) && !unread.contains(&"depends_on") {
                self.err(
                    *at,
                    p,
                    format!("`{key}` is not in this step's `depends_on`; artifacts come only from steps it waits for"),
                );
                ok = false;
            }
        }
        step.artifacts_from = artifacts_from.into_iter().map(|(k, _, _)| k).collect();

        draft.step = step;
        (draft, ok)
    }

    /// `soft_fail: true`, or a list of exit codes: `[1, 42]`, or Buildkite's
    /// `[{exit_status: 1}, {exit_status: "*"}]`.
    fn soft_fail(&mut self, node: &Node, path: &str) -> Option<SoftFail> {
        const EXPECTED: &str = "true, false, or a list of exit codes like [1, 42]";
        const CODE: &str = "an exit code";
        let items = match &node.value {
            Value::Scalar(Kind::Bool, _) => {
                return self.bool(node, path).map(|b| if b { SoftFail::Always } else { SoftFail::Never })
            }
            Value::Seq(items) if items.is_empty() => {
                self.err(
                    node.pos,
                    path,
                    "an empty list soft-fails nothing; write `true`, or list exit codes like [1, 42]",
                );
                return None;
            }
            Value::Seq(items) => items,
            _ => {
                self.type_err(node, path, EXPECTED);
                return None;
            }
        };
        let mut codes: Vec<i32> = Vec::new();
        let mut all = false;
        let mut ok = true;
        for (i, item) in items.iter().enumerate() {
            let p = index(path, i);
            // `{exit_status: N}` or `{exit_status: "*"}`, as Buildkite writes it.
            let (code_node, code_path) = if let Value::Map(_) = item.value {
                let Some(fields) = self.record(item, &p, "an exit code, or {exit_status: N}", SOFT_FAIL_KEYS) else {
                    ok = false;
                    continue;
                };
                let Some(&(_, _, v)) = fields.first() else {
                    // An unknown key in its place is reported already.
                    if matches!(&item.value, Value::Map(entries) if entries.is_empty()) {
                        self.err(
                            item.pos,
                            join(&p, "exit_status"),
                            "missing: name the exit code, e.g. `exit_status: 1`",
                        );
                    }
                    ok = false;
                    continue;
                };
                if v.str() == Some("*") {
                    all = true;
                    continue;
                }
                (v, join(&p, "exit_status"))
            } else {
                (item, p)
            };
            if int_value(code_node) == Some(0) {
                self.err(
                    code_node.pos,
                    &code_path,
                    "0 is success; list the non-zero exit codes that should not fail the pipeline",
                );
                ok = false;
                continue;
            }
            let Some(code) = self.int_in(code_node, &code_path, 1, 255, CODE).and_then(|n| i32::try_from(n).ok())
            else {
                ok = false;
                continue;
            };
            if codes.contains(&code) {
                self.err(code_node.pos, &code_path, format!("`{code}` is listed twice"));
                ok = false;
            } else {
                codes.push(code);
            }
        }
        if !ok {
            return None;
        }
        Some(if all { SoftFail::Always } else { SoftFail::ExitCodes(codes) })
    }

    /// `if:`: a condition ([`crate::condition`]), checked now so that a typo fails the
    /// submission rather than skipping a step. An error points at the token inside the value.
    fn condition(&mut self, node: &Node, path: &str) -> Option<String> {
        let text = match &node.value {
            Value::Scalar(Kind::Bool, t) => t.clone(),
            _ => self.string(node, path)?,
        };
        match crate::condition::Condition::parse(&text) {
            Ok(_) => Some(text),
            Err(e) => {
                let pos = self.position_in(node, &text, e.offset);
                self.err(pos, path, format!("{} (in `if: {}`)", e.message, quoted(&text)));
                None
            }
        }
    }

    /// Where character `offset` of a scalar's text `value` lies in the file: exact when the
    /// value is written on one line as it reads (plain, or quoted without escapes), else the
    /// value's own position (a block scalar or an escape shifts characters; the message
    /// quotes the condition).
    fn position_in(&self, node: &Node, value: &str, offset: usize) -> Pos {
        let Some(line) = self.text.lines().nth(node.pos.line.saturating_sub(1)) else { return node.pos };
        let rest: String = line.chars().skip(node.pos.column.saturating_sub(1)).collect();
        let skip = usize::from(rest.starts_with(['"', '\'']));
        let written: String = rest.chars().skip(skip).collect();
        if !value.contains('\n') && written.starts_with(value) {
            Pos { line: node.pos.line, column: node.pos.column + skip + offset }
        } else {
            node.pos
        }
    }

    fn step_key(&mut self, node: &Node, path: &str) -> Option<String> {
        let key = self.word(node, path, "a step key")?;
        if !is_step_key(&key) {
            self.err(node.pos, path, format!("invalid step key {}: use letters, digits, `-` and `_`", quoted(&key)));
            return None;
        }
        if key.len() > MAX_KEY_LEN {
            self.err(node.pos, path, format!("step key is longer than {MAX_KEY_LEN} characters"));
            return None;
        }
        Some(key)
    }

    fn command(&mut self, node: &Node, path: &str) -> Option<Vec<String>> {
        let lines = self.strings(node, path)?;
        if matches!(node.value, Value::Seq(ref items) if items.is_empty()) {
            self.err(node.pos, path, "expected at least one command, got an empty list");
            return None;
        }
        let mut ok = true;
        for (line, pos, p) in &lines {
            if line.trim().is_empty() {
                self.err(*pos, p, "a command must not be empty");
                ok = false;
            }
        }
        // Items that were not strings were reported and dropped by `strings`.
        let expected = match &node.value {
            Value::Seq(items) => items.len(),
            _ => 1,
        };
        (ok && lines.len() == expected).then(|| lines.into_iter().map(|(l, _, _)| l).collect())
    }

    fn agents(&mut self, node: &Node, path: &str) -> Option<BTreeMap<String, String>> {
        let fields = self.map(node, path, "a map of agent tags, like {queue: cuda}")?;
        let mut tags = BTreeMap::new();
        let mut ok = true;
        for (name, pos, v) in fields {
            let p = join(path, name);
            if name.trim().is_empty() {
                self.err(pos, &p, "an agent tag name must not be empty");
                ok = false;
                continue;
            }
            if name.contains('\0') {
                self.err(pos, &p, "contains a NUL byte (\\0), which no command line or environment variable can hold");
                ok = false;
                continue;
            }
            match self.text(v, &p) {
                Some(value) => {
                    tags.insert(name.to_string(), value);
                }
                None => ok = false,
            }
        }
        ok.then_some(tags)
    }

    fn retry(&mut self, node: &Node, path: &str) -> Option<RetryPolicy> {
        let count_of = |cx: &mut Self, v: &Node, p: &str| {
            cx.int_in(v, p, 0, MAX_RETRIES, "a retry count").and_then(|n| u32::try_from(n).ok())
        };
        if matches!(node.value, Value::Scalar(Kind::Int, _)) {
            let count = count_of(self, node, path)?;
            return Some(RetryPolicy { count, on: vec![RetryOn::Lost] });
        }
        let fields = self.record(node, path, "a retry count or a map like {count: 2, on: [lost]}", RETRY_KEYS)?;
        let mut count = None;
        let mut on = Some(vec![RetryOn::Lost]);
        let mut saw_count = false;
        for (name, _, v) in fields {
            let p = join(path, name);
            match name {
                "count" => {
                    saw_count = true;
                    count = count_of(self, v, &p);
                }
                "on" => on = self.retry_on(v, &p),
                _ => {}
            }
        }
        if !saw_count {
            self.err(node.pos, join(path, "count"), "missing: say how many times to retry, e.g. `count: 2`");
        }
        Some(RetryPolicy { count: count?, on: on? })
    }

    fn retry_on(&mut self, node: &Node, path: &str) -> Option<Vec<RetryOn>> {
        const NAMES: &[&str] = &["failed", "timed_out", "lost"];
        let items = self.strings(node, path)?;
        if items.is_empty() && matches!(node.value, Value::Seq(_)) {
            self.err(node.pos, path, format!("expected at least one of {}, got an empty list", one_of(NAMES)));
            return None;
        }
        let mut out = Vec::new();
        let mut ok = true;
        for (s, pos, p) in items {
            let v = match s.as_str() {
                "failed" => RetryOn::Failed,
                "timed_out" => RetryOn::TimedOut,
                "lost" => RetryOn::Lost,
                _ => {
                    let hint = suggest(&s, NAMES.iter().copied())
                        .map(|h| format!(", did you mean `{h}`?"))
                        .unwrap_or_default();
                    self.err(pos, p, format!("expected one of {}, got {}{hint}", one_of(NAMES), quoted(&s)));
                    ok = false;
                    continue;
                }
            };
            if out.contains(&v) {
                self.err(pos, p, format!("`{s}` is listed twice"));
                ok = false;
            } else {
                out.push(v);
            }
        }
        ok.then_some(out)
    }

    fn concurrency(&mut self, node: &Node, path: &str) -> Option<Concurrency> {
        if node.str().is_some() {
            let group = self.word(node, path, "a concurrency group")?;
            return Some(Concurrency { group, cancel_in_progress: false });
        }
        let fields = self.record(
            node,
            path,
            "a group name or a map like {group: deploy, cancel_in_progress: true}",
            CONCURRENCY_KEYS,
        )?;
        let mut group = None;
        let mut saw_group = false;
        let mut cancel = Some(false);
        for (name, _, v) in fields {
            let p = join(path, name);
            match name {
                "group" => {
                    saw_group = true;
                    group = self.word(v, &p, "a concurrency group");
                }
                "cancel_in_progress" => cancel = self.bool(v, &p),
                _ => {}
            }
        }
        if !saw_group {
            self.err(node.pos, join(path, "group"), "missing: name the concurrency group, e.g. `group: deploy`");
        }
        Some(Concurrency { group: group?, cancel_in_progress: cancel? })
    }

    /// `gpu:`; the bool says whether any property was set.
    fn gpu(&mut self, node: &Node, path: &str) -> Option<(GpuRequirements, bool)> {
        if int_value(node).is_some() {
            let n = node.scalar_text().unwrap_or_default();
            self.err(
                node.pos,
                path,
                format!("expected a map of GPU properties, got a number ({n}); for a GPU count write `gpus: {n}`"),
            );
            return None;
        }
        let fields = self.record(node, path, "a map of GPU properties, like {memory: \">=40GiB\"}", GPU_KEYS)?;
        let mut g = GpuRequirements::default();
        let mut ok = true;
        let any = !fields.is_empty();
        for (name, _, v) in fields {
            let p = join(path, name);
            let p = p.as_str();
            let good = match name {
                "memory" => self
                    .constraint(v, p, "a memory constraint like \">=40GiB\"", |s| {
                        s.parse::<Bytes>()
                            .ok()
                            .filter(|b| b.0 > 0 && !s.bytes().all(|c| c.is_ascii_digit() || c == b'.'))
                    })
                    .map(|c| g.memory = Some(c)),
                "compute_capability" => self
                    .constraint(v, p, "a compute capability constraint like \">=8.0\"", parse_compute_capability)
                    .map(|c| g.compute_capability = Some(c)),
                "driver" => self
                    .constraint(v, p, "a driver version constraint like \">=535\" or \">=535.104\"", Version::parse)
                    .map(|c| g.driver = Some(c)),
                "cuda" => self
                    .constraint(v, p, "a CUDA version constraint like \">=12.1\"", Version::parse)
                    .map(|c| g.cuda = Some(c)),
                "model" => self.word(v, p, "a model pattern").map(|m| g.model = Some(m)),
                "mig" => self.word(v, p, "a MIG profile").and_then(|m| {
                    if m.chars().any(char::is_whitespace) {
                        self.err(v.pos, p, format!("expected a MIG profile like \"1g.10gb\", got {}", quoted(&m)));
                        None
                    } else {
                        g.mig_profile = Some(m);
                        Some(())
                    }
                }),
                _ => Some(()),
            };
            ok &= good.is_some();
        }
        ok.then_some((g, any))
    }

    /// `op value`, where a missing operator means `>=`. Numbers are taken as text, so that
    /// `cuda: 12.1` and `driver: 535` work unquoted.
    fn constraint<T>(
        &mut self,
        node: &Node,
        path: &str,
        expected: &str,
        parse_value: impl Fn(&str) -> Option<T>,
    ) -> Option<Constraint<T>> {
        let text = match &node.value {
            Value::Scalar(Kind::Str | Kind::Int | Kind::Float, t) => t.as_str(),
            _ => {
                self.type_err(node, path, expected);
                return None;
            }
        };
        let (op, rest) = CmpOp::split(text);
        match parse_value(rest) {
            Some(value) => Some(Constraint { op, value }),
            None => {
                self.err(node.pos, path, format!("expected {expected}, got {}", quoted(text)));
                None
            }
        }
    }

    fn resources(&mut self, node: &Node, path: &str) -> Option<Resources> {
        let fields = self.record(node, path, "a map like {memory: 8GiB, cpus: 2, pids: 512}", RESOURCES_KEYS)?;
        let mut r = Resources::default();
        let mut ok = true;
        for (name, _, v) in fields {
            let p = join(path, name);
            let p = p.as_str();
            let good = match name {
                "memory" => match v
                    .scalar_text()
                    .filter(|_| matches!(v.value, Value::Scalar(Kind::Str | Kind::Int | Kind::Float, _)))
                {
                    Some(t) => self.size(t, v, p, "expected a size like 8GiB or 512MiB").map(|b| r.memory = Some(b)),
                    None => {
                        self.type_err(v, p, "a size like 8GiB or 512MiB");
                        None
                    }
                },
                "cpus" => self.cpus(v, p).map(|m| r.cpu_millis = Some(m)),
                "pids" => {
                    self.int_in(v, p, 1, i64::from(u32::MAX), "a process limit").map(|n| r.pids = u32::try_from(n).ok())
                }
                _ => Some(()),
            };
            ok &= good.is_some();
        }
        ok.then_some(r)
    }

    fn cpus(&mut self, node: &Node, path: &str) -> Option<u32> {
        const EXPECTED: &str = "expected a number of CPUs greater than 0, like 2 or 1.5";
        let n = match &node.value {
            Value::Scalar(Kind::Int | Kind::Float, t) => {
                t.parse::<f64>().ok().or_else(|| int_value(node).map(|n| n as f64))
            }
            _ => None,
        };
        let millis = n.filter(|x| x.is_finite() && *x > 0.0).map(|x| (x * 1000.0).round());
        match millis {
            Some(m) if m >= 1.0 && m <= f64::from(u32::MAX) => Some(m as u32),
            _ => {
                self.err(node.pos, path, format!("{EXPECTED}, got {}", node.describe()));
                None
            }
        }
    }

    fn choice(&mut self, node: &Node, path: &str, options: &[&'static str]) -> Option<&'static str> {
        if let Some(s) = node.str() {
            if let Some(o) = options.iter().find(|o| **o == s) {
                return Some(o);
            }
        }
        let got = node.describe();
        self.err(node.pos, path, format!("expected one of {}, got {got}", one_of(options)));
        None
    }

    fn image(&mut self, node: &Node, path: &str) -> Option<String> {
        let image = self.word(node, path, "an image")?;
        if let Err(why) = crate::image::check_reference(&image) {
            self.err(node.pos, path, format!("{}: {why}", quoted(&image)));
            return None;
        }
        Some(image)
    }

    /// `[NAME, ...]` (set on the coordinator), or `{NAME: "gpuci:v1:…" | null, ...}` (encrypted
    /// in this file; null: set on the coordinator).
    fn secrets(&mut self, node: &Node, path: &str) -> Option<(Vec<String>, BTreeMap<String, String>)> {
        if let Value::Map(_) = &node.value {
            let fields = self.map(node, path, "a list of secret names or a map of them")?;
            let (mut names, mut sealed) = (Vec::new(), BTreeMap::new());
            let mut ok = true;
            for (name, pos, v) in fields {
                let p = join(path, name);
                if !is_env_name(name) {
                    let why = format!(
                        "invalid secret name {}: expected an environment variable name like HF_TOKEN",
                        quoted(name)
                    );
                    self.err(pos, &p, why);
                    ok = false;
                    continue;
                }
                match &v.value {
                    Value::Scalar(Kind::Null, _) => names.push(name.to_string()),
                    Value::Scalar(Kind::Str, t) if crate::secret_scope::is_sealed_text(t) => {
                        sealed.insert(name.to_string(), t.clone());
                    }
                    _ => {
                        // Never echo a scalar here: it may be the secret itself, in clear.
                        let got = match &v.value {
                            Value::Scalar(Kind::Str, _) => "a string that is not one".to_string(),
                            Value::Scalar(Kind::Int | Kind::Float, _) => "a number".to_string(),
                            Value::Scalar(Kind::Bool, _) => "a boolean".to_string(),
                            _ => v.describe(),
                        };
                        let got = format!("{got} (not shown: it may be a secret in clear)");
                        self.err(
                            v.pos,
                            &p,
                            format!("expected a value from `gpuci secret encrypt` (\"gpuci:v1:…\") or null (a secret set on the coordinator), got {got}"),
                        );
                        ok = false;
                    }
                }
            }
            return ok.then_some((names, sealed));
        }
        let items = self.string_list(node, path)?;
        let mut out: Vec<String> = Vec::new();
        let mut ok = true;
        for (s, pos, p) in items {
            if !is_env_name(&s) {
                // `NAME=value` is someone pasting the value: show the name only.
                let shown = match s.split_once('=') {
                    Some((name, _)) => format!("{}=… (the rest is not shown: it may be a secret)", quoted(name)),
                    None => quoted(&s),
                };
                self.err(
                    pos,
                    p,
                    format!("invalid secret name {shown}: expected an environment variable name like HF_TOKEN"),
                );
                ok = false;
            } else if out.contains(&s) {
                self.err(pos, p, format!("`{s}` is listed twice"));
                ok = false;
            } else {
                out.push(s);
            }
        }
        ok.then_some((out, BTreeMap::new()))
    }

    fn cache(&mut self, node: &Node, path: &str) -> Option<Vec<String>> {
        let items = self.string_list(node, path)?;
        let mut out: Vec<String> = Vec::new();
        let mut ok = true;
        for (s, pos, p) in items {
            let problem = if s.trim().is_empty() {
                Some("a cache path must not be empty")
            } else if s.starts_with('/') {
                Some("cache paths are relative to the workspace; absolute paths are not allowed")
            } else if s.starts_with('~') {
                Some("cache paths are relative to the workspace; `~` is not expanded")
            } else if s.split(['/', '\\']).any(|c| c == "..") {
                Some("cache paths must stay inside the workspace; `..` is not allowed")
            } else {
                None
            };
            match problem {
                Some(m) => {
                    self.err(pos, p, m);
                    ok = false;
                }
                None => out.push(s),
            }
        }
        ok.then_some(out)
    }

    /// Unique keys, `depends_on` targets that exist, no cycles.
    fn check_graph(&mut self, drafts: &[Draft], path: &str) {
        // Keys: the first holder of a key keeps it.
        let mut owner: HashMap<&str, usize> = HashMap::new();
        let existing = self.existing;
        for (i, d) in drafts.iter().enumerate() {
            let key = d.step.key.as_str();
            if existing.is_some_and(|e| e.has(key)) {
                let (at, field) = match d.key_pos {
                    Some(p) => (p, format!("{path}[{}].key", d.index)),
                    None => (d.pos, format!("{path}[{}]", d.index)),
                };
                self.err(
                    at,
                    field,
                    format!(
                        "step key `{key}` is already used by a step of this pipeline; give the added step another key"
                    ),
                );
                continue;
            }
            let Some(&first) = owner.get(key) else {
                owner.insert(key, i);
                continue;
            };
            let f = &drafts[first];
            let first_desc = match f.key_pos {
                Some(p) => format!("{path}[{}] at {p}", f.index),
                None => format!("{path}[{}], which has no key and is named `{key}` by default", f.index),
            };
            match d.key_pos {
                Some(p) => self.err(p, format!("{path}[{}].key", d.index), format!("duplicate step key `{key}` (first used by {first_desc})")),
                None => self.err(d.pos, format!("{path}[{}]", d.index), format!("this step has no key and would be named `{key}`, which {first_desc} already uses; give it a `key`")),
            }
        }

        // Edges, in file order; bad targets reported.
        let keys: Vec<&str> = drafts.iter().map(|d| d.step.key.as_str()).collect();
        // For "unknown step" errors: the distinct keys in file order, at most ten.
        let listing = {
            const MAX: usize = 10;
            let mut shown: Vec<&str> = Vec::new();
            for (i, k) in keys.iter().enumerate() {
                if shown.len() < MAX && owner.get(k) == Some(&i) {
                    shown.push(k);
                }
            }
            match owner.len() - shown.len() {
                0 => shown.join(", "),
                more => format!("{} and {more} more", shown.join(", ")),
            }
        };
        let mut edges: Vec<Vec<(usize, Pos, String)>> = vec![Vec::new(); drafts.len()];
        for (i, d) in drafts.iter().enumerate() {
            let mut seen: Vec<&str> = Vec::new();
            for (dep, pos, p) in &d.deps {
                if seen.contains(&dep.as_str()) {
                    self.err(*pos, p, format!("`{dep}` is listed twice"));
                    continue;
                }
                seen.push(dep);
                if *dep == d.step.key {
                    self.err(*pos, p, format!("step `{dep}` cannot depend on itself"));
                } else if let Some(&j) = owner.get(dep.as_str()) {
                    edges[i].push((j, *pos, p.clone()));
                } else if existing.is_some_and(|e| e.has(dep)) {
                    // A step of the running pipeline: it cannot depend on the new ones, so
                    // no cycle runs through it.
                } else {
                    let hint = match suggest(dep, keys.iter().copied()) {
                        Some(s) => format!(", did you mean `{s}`?"),
                        None => format!(" (steps are: {listing})"),
                    };
                    self.err(*pos, p, format!("unknown step `{dep}`{hint}"));
                }
            }
        }

        for cycle in find_cycles(&edges) {
            // Report at the edge leaving the cycle's first step in file order.
            let [a, b, ..] = cycle[..] else { continue };
            let Some((_, pos, p)) = edges[a].iter().find(|(j, _, _)| *j == b) else {
                continue;
            };
            // A long cycle is named by its ends: a hostile file's 1,000-step cycles, each
            // spelt out, made a quarter of a gigabyte of errors.
            let mut names: Vec<&str> = cycle.iter().map(|&k| keys[k]).collect();
            let steps = names.len() - 1;
            if names.len() > MAX_CYCLE_NAMES {
                let tail = names.split_off(names.len() - MAX_CYCLE_NAMES / 2);
                names.truncate(MAX_CYCLE_NAMES / 2);
                names.push("…");
                names.extend(tail);
            }
            let len = if steps > MAX_CYCLE_NAMES { format!(" ({steps} steps)") } else { String::new() };
            self.err(*pos, p.clone(), format!("dependency cycle{len}: {}", names.join(" -> ")));
        }
    }
}

/// Bytes (names and values) one `env:` map may hold, the pipeline's or a step's.
pub const MAX_ENV_BYTES: usize = 32 * 1024;

/// Cycles reported at most; one is enough to fix, and a hostile file can hold tens of
/// thousands (each back edge of a long chain is one).
const MAX_CYCLES: usize = 8;
/// Step keys a reported cycle names (its first and last halves).
const MAX_CYCLE_NAMES: usize = 12;

/// Cycles found by a depth-first search (at most [`MAX_CYCLES`]), each as step indices
/// starting at its smallest index and ending where it started (`[0, 2, 0]`), without repeats.
/// Iterative, so that a long chain of steps cannot overflow the stack.
fn find_cycles(edges: &[Vec<(usize, Pos, String)>]) -> Vec<Vec<usize>> {
    #[derive(Clone, Copy, PartialEq)]
    enum Color {
        White,
        Grey,
        Black,
    }
    let n = edges.len();
    let mut color = vec![Color::White; n];
    let mut cycles: Vec<Vec<usize>> = Vec::new();
    for start in 0..n {
        if color[start] != Color::White {
            continue;
        }
        // (node, next edge to look at)
        let mut stack: Vec<(usize, usize)> = vec![(start, 0)];
        color[start] = Color::Grey;
        while let Some(&mut (u, ref mut next)) = stack.last_mut() {
            if let Some((v, _, _)) = edges[u].get(*next) {
                let v = *v;
                *next += 1;
                match color[v] {
                    Color::White => {
                        color[v] = Color::Grey;
                        stack.push((v, 0));
                    }
                    Color::Grey => {
                        let from = stack.iter().position(|(s, _)| *s == v).unwrap_or(0);
                        let mut cycle: Vec<usize> = stack[from..].iter().map(|(s, _)| *s).collect();
                        let min = cycle.iter().enumerate().min_by_key(|(_, s)| **s).map_or(0, |(i, _)| i);
                        cycle.rotate_left(min);
                        cycle.push(cycle[0]);
                        if !cycles.contains(&cycle) {
                            cycles.push(cycle);
                            if cycles.len() == MAX_CYCLES {
                                return cycles;
                            }
                        }
                    }
                    Color::Black => {}
                }
            } else {
                color[u] = Color::Black;
                stack.pop();
            }
        }
    }
    cycles
}

fn parse_compute_capability(s: &str) -> Option<ComputeCapability> {
    let (major, minor) = s.split_once('.').unwrap_or((s, "0"));
    let digits = |p: &str| !p.is_empty() && p.len() <= 3 && p.bytes().all(|b| b.is_ascii_digit());
    if !digits(major) || !digits(minor) {
        return None;
    }
    Some(ComputeCapability { major: major.parse().ok()?, minor: minor.parse().ok()? })
}
