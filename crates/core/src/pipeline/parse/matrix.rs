//! `matrix:` on a step: one job per combination of axis values, `{{matrix.NAME}}` in the
//! step's settings replaced by each job's values.
//!
//! The rules, here and nowhere else:
//! - `setup:` maps axis names to non-empty lists of values (strings, numbers or booleans,
//!   taken as text). The combinations are the product of the axes, the first axis varying
//!   slowest, so the order is the file's and never changes between runs.
//! - `exclude:` entries name some axes; a combination that matches all of them is left out.
//!   `include:` entries name every axis and add a combination after the product (values
//!   outside `setup:` allowed), in file order; a combination already present is an error.
//! - At most [`MAX_MATRIX_JOBS`] jobs per step and [`MAX_PIPELINE_JOBS`] per pipeline.
//! - `{{matrix.NAME}}` (spaces inside the braces allowed) is the one interpolation syntax;
//!   it works in the fields named by [`INTERPOLATED`], anywhere else it is an error. Other
//!   `{{…}}` text (a Go template in a command) is left alone.
//! - Substitution happens on the spanned tree before a step is read, so an interpolated
//!   value is checked like a written one and its errors point at the field that used it.
//!   `gpus: "{{matrix.gpus}}"` alone in a field is read as the value's own YAML type.
//! - Each job's key is `KEY[axis=value,…]` and its label `LABEL (axis=value, …)` (the label
//!   is kept as interpolated when it uses matrix values itself). `depends_on: KEY` means every
//!   job of the matrix.

use super::{index, join, quoted, resolve_plain, suggest, Ctx, Draft, Fields, Kind, Node, Pos, Value};
use crate::pipeline::{MatrixJob, MatrixValue, Step};
use std::collections::{HashMap, HashSet};

/// Keys of `matrix:`.
pub(crate) const MATRIX_KEYS: &[&str] = &["setup", "include", "exclude"];
/// Most jobs one step's matrix may expand to.
pub const MAX_MATRIX_JOBS: usize = 256;
/// Most jobs one pipeline may have, matrices expanded.
pub const MAX_PIPELINE_JOBS: usize = 1024;
/// Fields whose strings may use `{{matrix.NAME}}`.
pub(crate) const INTERPOLATED: &[&str] = &["label", "command", "env", "image", "gpus", "gpu", "agents"];
/// Longest matrix value; values end up in job names.
const MAX_VALUE_LEN: usize = 128;
/// Settings read for all matrix jobs of a file together (a step's size × its jobs): a small
/// file must not make the parser do unbounded work.
const MAX_EXPANDED_NODES: usize = 1_000_000;

/// A valid matrix: its axes and the combinations, one value per axis, in job order.
pub(super) struct Matrix {
    axes: Vec<String>,
    combos: Vec<Vec<String>>,
}

/// One `{{matrix…}}` in a string: its byte range and the axis it names (`None`: `{{matrix}}`).
struct Ref<'t> {
    start: usize,
    end: usize,
    name: Option<&'t str>,
}

fn refs(text: &str) -> Vec<Ref<'_>> {
    let mut out = Vec::new();
    let mut from = 0;
    while let Some(a) = text[from..].find("{{") {
        let start = from + a;
        let Some(b) = text[start + 2..].find("}}") else { break };
        let end = start + 2 + b + 2;
        let inner = text[start + 2..end - 2].trim();
        if inner == "matrix" {
            out.push(Ref { start, end, name: None });
            from = end;
        } else if let Some(name) = inner.strip_prefix("matrix.") {
            out.push(Ref { start, end, name: Some(name.trim()) });
            from = end;
        } else {
            from = start + 2;
        }
    }
    out
}

fn is_axis_name(s: &str) -> bool {
    let mut chars = s.chars();
    s.len() <= 64
        && chars.next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
}

/// `node` with every `{{matrix.NAME}}` in its strings replaced by the combination's value.
/// `typed`: a string that is nothing but one reference takes the YAML type of its value
/// (`gpus: "{{matrix.gpus}}"` is a number when the value is).
fn substitute(node: &Node, axes: &[String], combo: &[String], typed: bool) -> Node {
    let value = match &node.value {
        Value::Scalar(Kind::Str, t) => {
            let found = refs(t);
            if found.is_empty() {
                return node.clone();
            }
            let mut out = String::with_capacity(t.len());
            let mut at = 0;
            for r in &found {
                out.push_str(&t[at..r.start]);
                let k = r.name.and_then(|n| axes.iter().position(|a| a == n));
                out.push_str(k.map_or("", |k| combo[k].as_str()));
                at = r.end;
            }
            out.push_str(&t[at..]);
            let whole = found.len() == 1 && found[0].start == 0 && found[0].end == t.len();
            let kind = match resolve_plain(&out) {
                k @ (Kind::Int | Kind::Float | Kind::Bool) if typed && whole => k,
                _ => Kind::Str,
            };
            Value::Scalar(kind, out)
        }
        Value::Scalar(..) => return node.clone(),
        Value::Seq(items) => Value::Seq(items.iter().map(|n| substitute(n, axes, combo, false)).collect()),
        Value::Map(entries) => {
            Value::Map(entries.iter().map(|(k, v)| (k.clone(), substitute(v, axes, combo, false))).collect())
        }
    };
    Node { pos: node.pos, value }
}

/// The steps of the pipeline in order, each matrix step replaced by its jobs, and
/// `depends_on` a matrix step replaced by all of its jobs.
pub(super) fn flatten(drafts: Vec<Draft>) -> Vec<Step> {
    let jobs_of: HashMap<String, Vec<String>> = drafts
        .iter()
        .filter(|d| !d.expanded.is_empty())
        .map(|d| (d.step.key.clone(), d.expanded.iter().map(|s| s.key.clone()).collect()))
        .collect();
    let mut out = Vec::new();
    for d in drafts {
        let steps = if d.expanded.is_empty() { vec![d.step] } else { d.expanded };
        for mut s in steps {
            s.depends_on = s
                .depends_on
                .iter()
                .flat_map(|dep| jobs_of.get(dep).cloned().unwrap_or_else(|| vec![dep.clone()]))
                .collect();
            s.artifacts_from = s
                .artifacts_from
                .iter()
                .flat_map(|dep| jobs_of.get(dep).cloned().unwrap_or_else(|| vec![dep.clone()]))
                .collect();
            out.push(s);
        }
    }
    out
}

impl Ctx<'_> {
    /// A step from its fields: once, or once per combination of its `matrix:`.
    pub(super) fn matrix_step(
        &mut self,
        node: &Node,
        path: &str,
        i: usize,
        fields: Fields<'_>,
    ) -> Option<(Draft, bool)> {
        let matrix_node = fields.iter().find(|(n, _, _)| *n == "matrix").map(|(_, _, v)| *v);
        // `None`: no matrix; `Some(None)`: one whose axes are wrong; `Some(Some(Err(axes)))`:
        // right axes (matrix values are checked against them), wrong combinations.
        let matrix = matrix_node.map(|m| self.matrix(m, &join(path, "matrix")));
        let axes = match &matrix {
            Some(Some(Ok(m))) => Some(m.axes.as_slice()),
            Some(Some(Err(axes))) => Some(axes.as_slice()),
            _ => None,
        };
        let mut refs_ok = true;
        let uses: Vec<bool> = fields
            .iter()
            .map(|&(name, _, v)| {
                name != "matrix"
                    && self.check_refs(name, v, &join(path, name), matrix_node.is_some(), axes, &mut refs_ok)
            })
            .collect();
        let plain: Vec<(&str, Pos, &Node)> =
            fields.iter().zip(&uses).filter(|(f, used)| !**used && f.0 != "matrix").map(|(f, _)| *f).collect();
        let unread: Vec<&str> = fields.iter().zip(&uses).filter(|(_, used)| **used).map(|(f, _)| f.0).collect();

        let m = match matrix {
            Some(Some(Ok(m))) if refs_ok => m,
            // No matrix, or one that cannot be used: read the step once, leaving out the
            // fields that use matrix values (their errors are reported).
            other => {
                self.jobs += match &other {
                    Some(Some(Ok(m))) => m.combos.len(),
                    _ => 1,
                };
                let (draft, ok) = self.read_step(node.pos, path, i, &plain, &unread);
                return Some((draft, ok && refs_ok && other.is_none()));
            }
        };
        self.jobs += m.combos.len();
        self.expanded_nodes = self.expanded_nodes.saturating_add(node.size().saturating_mul(m.combos.len()));
        let too_big = self.expanded_nodes > MAX_EXPANDED_NODES;
        if too_big {
            let at = matrix_node.map_or(node.pos, |n| n.pos);
            self.err(
                at,
                join(path, "matrix"),
                format!(
                    "the matrices of this file would have gpuci read more than {MAX_EXPANDED_NODES} settings (each step's size × its jobs); use fewer combinations or shorter steps"
                ),
            );
        }
        if too_big || self.jobs > MAX_PIPELINE_JOBS {
            // Not expanded: `steps` reports the job count.
            let (draft, _) = self.read_step(node.pos, path, i, &plain, &unread);
            return Some((draft, false));
        }

        let label_used = fields.iter().zip(&uses).any(|(f, used)| *used && f.0 == "label");
        let mut first: Option<Draft> = None;
        let mut expanded = Vec::with_capacity(m.combos.len());
        let mut ok = true;
        for combo in &m.combos {
            let owned: Vec<Option<Node>> = fields
                .iter()
                .zip(&uses)
                .map(|(f, used)| used.then(|| substitute(f.2, &m.axes, combo, f.0 == "gpus")))
                .collect();
            let these: Vec<(&str, Pos, &Node)> = fields
                .iter()
                .zip(&owned)
                .filter(|(f, _)| f.0 != "matrix")
                .map(|(f, o)| (f.0, f.1, o.as_ref().unwrap_or(f.2)))
                .collect();
            let (draft, good) = self.read_step(node.pos, path, i, &these, &[]);
            ok &= good;
            let job = MatrixJob {
                step: draft.step.key.clone(),
                values: m
                    .axes
                    .iter()
                    .zip(combo)
                    .map(|(a, v)| MatrixValue { axis: a.clone(), value: v.clone() })
                    .collect(),
            };
            let mut step = draft.step.clone();
            step.key = format!("{}[{}]", job.step, job.describe(","));
            if !label_used {
                step.label = Some(format!("{} ({})", draft.step.display_name(), job.describe(", ")));
            }
            step.matrix = Some(job);
            expanded.push(step);
            if first.is_none() {
                first = Some(draft);
            }
        }
        let mut draft = first?;
        draft.expanded = expanded;
        Some((draft, ok))
    }

    /// Reports every `{{matrix…}}` in `node` that cannot be replaced: in a field that takes
    /// none, in a step without a matrix, naming an unknown axis, or unquoted (YAML then reads
    /// it as a map). `axes` is `None` when the step has no usable matrix. Returns whether
    /// the field uses matrix values.
    fn check_refs(
        &mut self,
        field: &str,
        node: &Node,
        path: &str,
        has_matrix: bool,
        axes: Option<&[String]>,
        refs_ok: &mut bool,
    ) -> bool {
        match &node.value {
            Value::Scalar(Kind::Str, t) => {
                let found = refs(t);
                for r in &found {
                    let written = &t[r.start..r.end];
                    let problem = if !INTERPOLATED.contains(&field) {
                        Some(format!(
                            "{written}: matrix values can be used in {}, not in `{field}`",
                            INTERPOLATED.iter().map(|f| format!("`{f}`")).collect::<Vec<_>>().join(", ")
                        ))
                    } else if !has_matrix {
                        Some(format!("{written} names a matrix value, but this step has no `matrix:`"))
                    } else if let Some(axes) = axes {
                        let listing = axes.join(", ");
                        match r.name {
                            None | Some("") => Some(format!(
                                "{written} needs an axis name: write {{{{matrix.NAME}}}} (axes: {listing})"
                            )),
                            Some(n) if axes.iter().any(|a| a == n) => None,
                            Some(n) => Some(match suggest(n, axes.iter().map(String::as_str)) {
                                Some(s) => format!("unknown matrix axis `{n}`, did you mean `{s}`?"),
                                None => format!("unknown matrix axis `{n}` (axes: {listing})"),
                            }),
                        }
                    } else {
                        None
                    };
                    if let Some(p) = problem {
                        self.err(node.pos, path, p);
                        *refs_ok = false;
                    }
                }
                !found.is_empty()
            }
            Value::Scalar(..) => false,
            Value::Seq(items) => {
                let mut used = false;
                for (k, item) in items.iter().enumerate() {
                    used |= self.check_refs(field, item, &index(path, k), has_matrix, axes, refs_ok);
                }
                used
            }
            Value::Map(entries) => {
                if let Some(name) = unquoted_reference(node) {
                    self.err(
                        node.pos,
                        path,
                        format!(
                            "{{{{{name}}}}} must be quoted: unquoted, YAML reads a value starting with `{{` as a map; write \"{{{{{name}}}}}\""
                        ),
                    );
                    *refs_ok = false;
                    return true;
                }
                let mut used = false;
                for (k, v) in entries {
                    let key = k.scalar_text().unwrap_or_default();
                    if !refs(key).is_empty() {
                        self.err(k.pos, join(path, key), "matrix values cannot be used in a key, only in values");
                        *refs_ok = false;
                        used = true;
                    }
                    used |= self.check_refs(field, v, &join(path, key), has_matrix, axes, refs_ok);
                }
                used
            }
        }
    }

    /// `matrix:`: its axes and combinations, every problem reported; `Err` holds the axes of a
    /// matrix whose axes are right but whose combinations are not.
    fn matrix(&mut self, node: &Node, path: &str) -> Option<Result<Matrix, Vec<String>>> {
        const EXPECTED: &str = "a map like {setup: {python: [\"3.11\", \"3.12\"]}}";
        if let Value::Seq(_) = node.value {
            self.err(
                node.pos,
                path,
                format!("expected {EXPECTED}, got a list; name the axis, so that the step can use its values as {{{{matrix.NAME}}}}: `matrix: {{setup: {{NAME: [...]}}}}`"),
            );
            return None;
        }
        let fields = self.map(node, path, EXPECTED)?;
        let (mut setup, mut include, mut exclude) = (None, None, None);
        let mut ok = true;
        let mut misplaced_axis = false;
        for (name, pos, v) in fields {
            let p = join(path, name);
            match name {
                "setup" => setup = Some((v, p)),
                "include" => include = Some((v, p)),
                "exclude" => exclude = Some((v, p)),
                "adjustments" => {
                    self.err(pos, p, "Buildkite's `adjustments` are written `include:` (combinations to add) and `exclude:` (combinations to leave out) here");
                    ok = false;
                }
                _ if matches!(v.value, Value::Seq(_)) => {
                    self.err(
                        pos,
                        p,
                        format!(
                            "unknown key `{name}`; axes go under `setup:`, like `matrix: {{setup: {{{name}: [...]}}}}`"
                        ),
                    );
                    misplaced_axis = true;
                    ok = false;
                }
                _ => {
                    let hint = match suggest(name, MATRIX_KEYS.iter().copied()) {
                        Some(s) => format!(", did you mean `{s}`?"),
                        None => format!("; expected one of: {}", MATRIX_KEYS.join(", ")),
                    };
                    self.err(pos, p, format!("unknown key `{name}`{hint}"));
                    ok = false;
                }
            }
        }
        let Some((setup_node, setup_path)) = setup else {
            if misplaced_axis {
                return None;
            }
            self.err(
                node.pos,
                join(path, "setup"),
                "missing: a matrix needs `setup:`, a map of axes to their values, like {python: [\"3.11\", \"3.12\"]}",
            );
            return None;
        };
        let axes = self.axes(setup_node, &setup_path)?;
        let names: Vec<String> = axes.iter().map(|(n, _)| n.clone()).collect();
        let excludes = match exclude {
            Some((v, p)) => self.exclusions(v, &p, &axes),
            None => Some(Vec::new()),
        };
        let includes = match include {
            Some((v, p)) => self.inclusions(v, &p, &axes),
            None => Some(Vec::new()),
        };

        let product = axes.iter().try_fold(1usize, |n, (_, values)| n.checked_mul(values.len()));
        if product.is_none_or(|n| n > MAX_MATRIX_JOBS) {
            let shape = axes.iter().map(|(n, v)| format!("{n}: {}", v.len())).collect::<Vec<_>>().join(" × ");
            let count = product.map_or_else(|| "too many".to_string(), |n| n.to_string());
            self.err(
                setup_node.pos,
                &setup_path,
                format!("expands to {count} jobs ({shape}), more than the {MAX_MATRIX_JOBS} one step may have"),
            );
            return Some(Err(names));
        }
        let (Some(excludes), Some(includes), true) = (excludes, includes, ok) else {
            return Some(Err(names));
        };

        // The product, first axis slowest.
        let mut combos: Vec<Vec<String>> = Vec::new();
        let mut at = vec![0usize; axes.len()];
        'product: loop {
            let combo: Vec<String> = at.iter().zip(&axes).map(|(&k, (_, values))| values[k].clone()).collect();
            let excluded = excludes.iter().any(|ex| ex.iter().all(|(axis, value)| combo[*axis] == *value));
            if !excluded {
                combos.push(combo);
            }
            for d in (0..axes.len()).rev() {
                at[d] += 1;
                if at[d] < axes[d].1.len() {
                    continue 'product;
                }
                at[d] = 0;
            }
            break;
        }
        for (combo, pos, p) in includes {
            if combos.contains(&combo) {
                let shown = names.iter().zip(&combo).map(|(a, v)| format!("{a}={v}")).collect::<Vec<_>>().join(", ");
                self.err(pos, p, format!("this combination ({shown}) is already in the matrix"));
                ok = false;
            } else {
                combos.push(combo);
            }
        }
        if combos.len() > MAX_MATRIX_JOBS {
            self.err(
                node.pos,
                path,
                format!(
                    "expands to {} jobs with its includes, more than the {MAX_MATRIX_JOBS} one step may have",
                    combos.len()
                ),
            );
            return Some(Err(names));
        }
        if combos.is_empty() {
            self.err(node.pos, path, "every combination is excluded: the step would run no job");
            return Some(Err(names));
        }
        // Job keys are `KEY[a=v,b=w]`: values holding `,` or `=` could make two of them equal.
        let mut seen = HashSet::new();
        for combo in &combos {
            let key = names.iter().zip(combo).map(|(a, v)| format!("{a}={v}")).collect::<Vec<_>>().join(",");
            if !seen.insert(key.clone()) {
                self.err(
                    node.pos,
                    path,
                    format!("two combinations would both be named [{key}]; avoid `,` and `=` in values"),
                );
                return Some(Err(names));
            }
        }
        Some(if ok { Ok(Matrix { axes: names, combos }) } else { Err(names) })
    }

    /// `setup:`: axis name → its values, in file order.
    fn axes(&mut self, node: &Node, path: &str) -> Option<Vec<(String, Vec<String>)>> {
        let fields = self.map(node, path, "a map of axes to their values, like {python: [\"3.11\", \"3.12\"]}")?;
        if fields.is_empty() {
            self.err(node.pos, path, "a matrix needs at least one axis, like {python: [\"3.11\", \"3.12\"]}");
            return None;
        }
        let mut axes = Vec::new();
        let mut ok = true;
        for (name, pos, v) in fields {
            let p = join(path, name);
            if !is_axis_name(name) {
                self.err(
                    pos,
                    &p,
                    format!(
                        "invalid axis name {}: use letters, digits, `-` and `_`, starting with a letter",
                        quoted(name)
                    ),
                );
                ok = false;
                continue;
            }
            let items = match &v.value {
                Value::Seq(items) if items.is_empty() => {
                    self.err(v.pos, &p, format!("axis `{name}` has no values; give at least one"));
                    ok = false;
                    continue;
                }
                Value::Seq(items) => items,
                _ => {
                    self.type_err(v, &p, &format!("a list of values for axis `{name}`"));
                    ok = false;
                    continue;
                }
            };
            let mut values: Vec<String> = Vec::new();
            for (k, item) in items.iter().enumerate() {
                let ip = index(&p, k);
                match self.matrix_value(item, &ip) {
                    Some(value) if values.contains(&value) => {
                        self.err(item.pos, &ip, format!("{} is listed twice", quoted(&value)));
                        ok = false;
                    }
                    Some(value) => values.push(value),
                    None => ok = false,
                }
            }
            axes.push((name.to_string(), values));
        }
        ok.then_some(axes)
    }

    fn matrix_value(&mut self, node: &Node, path: &str) -> Option<String> {
        let value = self.text(node, path)?;
        let problem = if value.trim().is_empty() {
            Some("a matrix value must not be empty".to_string())
        } else if value.chars().count() > MAX_VALUE_LEN {
            Some(format!("a matrix value is at most {MAX_VALUE_LEN} characters"))
        } else if value.chars().any(char::is_control) {
            Some("a matrix value must not contain control characters (newlines, tabs)".to_string())
        } else {
            None
        };
        match problem {
            Some(p) => {
                self.err(node.pos, path, p);
                None
            }
            None => Some(value),
        }
    }

    /// An axis of `axes` named in an include or exclude entry.
    fn axis_of(&mut self, name: &str, pos: Pos, path: &str, axes: &[(String, Vec<String>)]) -> Option<usize> {
        if let Some(k) = axes.iter().position(|(a, _)| a == name) {
            return Some(k);
        }
        let hint = match suggest(name, axes.iter().map(|(a, _)| a.as_str())) {
            Some(s) => format!(", did you mean `{s}`?"),
            None => format!(" (axes: {})", axes.iter().map(|(a, _)| a.as_str()).collect::<Vec<_>>().join(", ")),
        };
        self.err(pos, path, format!("unknown matrix axis `{name}`{hint}"));
        None
    }

    fn entries<'n>(&mut self, node: &'n Node, path: &str, expected: &str) -> Option<Vec<(String, &'n Node)>> {
        match &node.value {
            Value::Seq(items) => Some(items.iter().enumerate().map(|(k, item)| (index(path, k), item)).collect()),
            _ => {
                self.type_err(node, path, expected);
                None
            }
        }
    }

    /// `exclude:`: each entry as (axis, value) pairs that must all match.
    fn exclusions(
        &mut self,
        node: &Node,
        path: &str,
        axes: &[(String, Vec<String>)],
    ) -> Option<Vec<Vec<(usize, String)>>> {
        const EXPECTED: &str = "a list of combinations to leave out, like [{python: \"3.11\", cuda: \"12.6\"}]";
        let entries = self.entries(node, path, EXPECTED)?;
        let mut out = Vec::new();
        let mut ok = true;
        for (p, item) in entries {
            let Some(fields) = self.map(item, &p, "a map of axes to values, like {python: \"3.11\"}") else {
                ok = false;
                continue;
            };
            if fields.is_empty() {
                self.err(item.pos, &p, "an empty exclude would leave out every combination; name axes and values");
                ok = false;
                continue;
            }
            let mut pairs = Vec::new();
            for (name, pos, v) in fields {
                let vp = join(&p, name);
                let axis = self.axis_of(name, pos, &vp, axes);
                let value = self.matrix_value(v, &vp);
                match (axis, value) {
                    (Some(k), Some(value)) if axes[k].1.contains(&value) => pairs.push((k, value)),
                    (Some(k), Some(value)) => {
                        let values = axes[k].1.join(", ");
                        let hint = suggest(&value, axes[k].1.iter().map(String::as_str))
                            .map(|s| format!(", did you mean {}?", quoted(s)))
                            .unwrap_or_default();
                        self.err(
                            v.pos,
                            &vp,
                            format!("{} is not a value of axis `{name}` (its values: {values}){hint}", quoted(&value)),
                        );
                        ok = false;
                    }
                    _ => ok = false,
                }
            }
            out.push(pairs);
        }
        ok.then_some(out)
    }

    /// `include:`: each entry as a full combination, with its position and path.
    fn inclusions(
        &mut self,
        node: &Node,
        path: &str,
        axes: &[(String, Vec<String>)],
    ) -> Option<Vec<(Vec<String>, Pos, String)>> {
        const EXPECTED: &str = "a list of combinations to add, like [{python: \"3.13\", cuda: \"12.6\"}]";
        let entries = self.entries(node, path, EXPECTED)?;
        let mut out = Vec::new();
        let mut ok = true;
        for (p, item) in entries {
            let Some(fields) = self.map(item, &p, "a map giving a value for every axis, like {python: \"3.13\"}")
            else {
                ok = false;
                continue;
            };
            let mut combo: Vec<Option<String>> = vec![None; axes.len()];
            let mut good = true;
            for (name, pos, v) in fields {
                let vp = join(&p, name);
                let axis = self.axis_of(name, pos, &vp, axes);
                match (axis, self.matrix_value(v, &vp)) {
                    (Some(k), Some(value)) => combo[k] = Some(value),
                    _ => good = false,
                }
            }
            let missing: Vec<&str> =
                axes.iter().zip(&combo).filter(|(_, v)| v.is_none()).map(|((a, _), _)| a.as_str()).collect();
            if good && !missing.is_empty() {
                let all = axes.iter().map(|(a, _)| a.as_str()).collect::<Vec<_>>().join(", ");
                let list = missing.iter().map(|m| format!("`{m}`")).collect::<Vec<_>>().join(", ");
                self.err(item.pos, &p, format!("missing {list}: an include gives a value for every axis ({all})"));
                good = false;
            }
            if good {
                out.push((combo.into_iter().flatten().collect(), item.pos, p));
            }
            ok &= good;
        }
        ok.then_some(out)
    }
}

/// `{{matrix.NAME}}` written unquoted, which YAML reads as `{{matrix.NAME: null}: null}`:
/// the name, when `node` is that.
fn unquoted_reference(node: &Node) -> Option<String> {
    let Value::Map(outer) = &node.value else { return None };
    let [(key, value)] = outer.as_slice() else { return None };
    let Value::Map(inner) = &key.value else { return None };
    let [(name, inner_value)] = inner.as_slice() else { return None };
    let is_null = |n: &Node| matches!(n.value, Value::Scalar(Kind::Null, _));
    let name = name.scalar_text()?;
    (is_null(value) && is_null(inner_value) && (name == "matrix" || name.starts_with("matrix.")))
        .then(|| name.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn references_are_found_with_or_without_spaces_and_other_braces_are_left_alone() {
        let text = "a {{matrix.python}} b {{ matrix.cuda }} {{.State}} {{matrix}} {{ unclosed";
        let found: Vec<Option<&str>> = refs(text).iter().map(|r| r.name).collect();
        assert_eq!(found, vec![Some("python"), Some("cuda"), None]);
        assert!(refs("docker inspect --format '{{.State.Running}}'").is_empty());
    }
}
