//! Stage 1 of reading a pipeline file: yaml-rust2's events → a small spanned tree ([`Node`]),
//! every node marked with its `line:column`.
//!
//! Syntax errors, a second document, unknown tags, runaway nesting ([`super::MAX_DEPTH`]) and
//! alias bombs ([`super::MAX_NODES`]) stop here with one [`Fatal`] error. Anchors, aliases (a
//! copy of the anchored node) and merge keys (`<<: *defaults`) are resolved here, so stage 2
//! never sees them. This module knows YAML, not the pipeline format: it must not check fields.

use super::{MAX_DEPTH, MAX_NODES};
use std::collections::HashMap;
use yaml_rust2::parser::{Event, Parser, Tag};
use yaml_rust2::scanner::{Marker, TScalarStyle};

// ---------------------------------------------------------------------------------------------
// Stage 1: events → spanned tree

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(super) struct Pos {
    pub(super) line: usize,
    pub(super) column: usize,
}

impl Pos {
    pub(super) const START: Pos = Pos { line: 1, column: 1 };

    pub(super) fn of(m: &Marker) -> Pos {
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
pub(super) enum Kind {
    Null,
    Bool,
    Int,
    Float,
    Str,
}

#[derive(Clone, Debug)]
pub(super) enum Value {
    Scalar(Kind, String),
    Seq(Vec<Node>),
    Map(Vec<(Node, Node)>),
}

#[derive(Clone, Debug)]
pub(super) struct Node {
    pub(super) pos: Pos,
    pub(super) value: Value,
}

impl Node {
    /// What the node is, for "expected X, got Y".
    pub(super) fn describe(&self) -> String {
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
    pub(super) fn scalar_text(&self) -> Option<&str> {
        match &self.value {
            Value::Scalar(Kind::Null, _) => None,
            Value::Scalar(_, t) => Some(t),
            _ => None,
        }
    }

    pub(super) fn str(&self) -> Option<&str> {
        match &self.value {
            Value::Scalar(Kind::Str, t) => Some(t),
            _ => None,
        }
    }

    pub(super) fn size(&self) -> usize {
        match &self.value {
            Value::Scalar(..) => 1,
            Value::Seq(items) => 1 + items.iter().map(Node::size).sum::<usize>(),
            Value::Map(entries) => 1 + entries.iter().map(|(k, v)| k.size() + v.size()).sum::<usize>(),
        }
    }
}

/// `"text"`, shortened so that a pasted blob does not flood the terminal.
pub(super) fn quoted(s: &str) -> String {
    const MAX: usize = 60;
    if s.chars().count() <= MAX {
        format!("{s:?}")
    } else {
        let head: String = s.chars().take(MAX).collect();
        format!("{:?}…", head)
    }
}

/// YAML 1.2 core schema resolution of a plain scalar. Quoted and block scalars are strings.
pub(super) fn resolve_plain(t: &str) -> Kind {
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
pub(super) fn int_value(node: &Node) -> Option<i64> {
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
pub(super) struct Fatal {
    pub(super) pos: Pos,
    pub(super) field: &'static str,
    pub(super) message: String,
}

pub(super) fn fatal(pos: Pos, message: impl Into<String>) -> Fatal {
    Fatal { pos, field: "(syntax)", message: message.into() }
}

pub(super) enum Frame {
    Seq { pos: Pos, anchor: usize, items: Vec<Node> },
    Map { pos: Pos, anchor: usize, entries: Vec<(Node, Node)>, key: Option<Node> },
}

#[derive(Default)]
pub(super) struct Builder {
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

pub(super) fn is_merge_key(k: &Node) -> bool {
    matches!(&k.value, Value::Scalar(Kind::Str, t) if t == "<<")
}

/// Apply YAML merge keys: `<<: *defaults` (or a list of aliases) adds the entries of the
/// merged maps that the map does not set itself. A `<<` whose value is not a map (or list of
/// maps) is left in place, and validation reports it.
pub(super) fn merge_keys(entries: Vec<(Node, Node)>) -> Vec<(Node, Node)> {
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

pub(super) fn check_tag(tag: &Option<Tag>, allowed: &str, pos: Pos) -> Result<bool, Fatal> {
    match tag {
        None => Ok(false),
        Some(t) if (t.handle == "tag:yaml.org,2002:" || t.handle == "!!") && t.suffix == allowed => Ok(true),
        Some(t) => Err(fatal(pos, format!("YAML tags are not supported here (found `{}{}`)", t.handle, t.suffix))),
    }
}

pub(super) fn build_tree(text: &str) -> Result<Option<Node>, Fatal> {
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
