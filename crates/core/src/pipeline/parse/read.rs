//! Typed readers of one tree node (a map with known keys, a string, an integer in range, a
//! duration, a size) for stage 2 of reading a pipeline file.
//!
//! Each reader records an error with the node's position, the field path and what was
//! expected, and returns `None`; it never stops the walk, so that every error in the file is
//! found in one pass. The pipeline format itself (which fields a step has) is not known here.

use super::{index, int_value, join, one_of, quoted, suggest, Ctx, Fields, Kind, Node, PipelineError, Pos, Value};
use crate::duration::Duration;
use crate::quantity::Bytes;

impl Ctx<'_> {
    pub(super) fn err(&mut self, pos: Pos, field: impl Into<String>, message: impl Into<String>) {
        self.errors.push(PipelineError {
            file: self.file.to_string(),
            line: pos.line,
            column: pos.column,
            field: field.into(),
            message: message.into(),
        });
    }

    pub(super) fn type_err(&mut self, node: &Node, path: &str, expected: &str) {
        let got = node.describe();
        self.err(node.pos, path, format!("expected {expected}, got {got}"));
    }

    /// The entries of a map, with non-string and repeated keys reported (the first of a
    /// repeated key is kept).
    pub(super) fn map<'n>(&mut self, node: &'n Node, path: &str, expected: &str) -> Option<Fields<'n>> {
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
    pub(super) fn record<'n>(
        &mut self,
        node: &'n Node,
        path: &str,
        expected: &str,
        allowed: &[&str],
    ) -> Option<Fields<'n>> {
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
    pub(super) fn no_nul(&mut self, node: &Node, path: &str, s: &str) -> Option<String> {
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

    pub(super) fn string(&mut self, node: &Node, path: &str) -> Option<String> {
        match node.str() {
            Some(s) => self.no_nul(node, path, s),
            None => {
                self.type_err(node, path, "a string");
                None
            }
        }
    }

    /// A non-empty string without whitespace at the ends.
    pub(super) fn word(&mut self, node: &Node, path: &str, what: &str) -> Option<String> {
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
    pub(super) fn text(&mut self, node: &Node, path: &str) -> Option<String> {
        match (&node.value, node.scalar_text()) {
            (Value::Scalar(..), Some(t)) => self.no_nul(node, path, t),
            _ => {
                self.type_err(node, path, "a string, number or boolean");
                None
            }
        }
    }

    pub(super) fn bool(&mut self, node: &Node, path: &str) -> Option<bool> {
        match &node.value {
            Value::Scalar(Kind::Bool, t) => Some(t.eq_ignore_ascii_case("true")),
            _ => {
                self.type_err(node, path, "true or false");
                None
            }
        }
    }

    /// An integer in `lo..=hi`, described as `what` in the error.
    pub(super) fn int_in(&mut self, node: &Node, path: &str, lo: i64, hi: i64, what: &str) -> Option<i64> {
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
    pub(super) fn strings(&mut self, node: &Node, path: &str) -> Option<Vec<(String, Pos, String)>> {
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
    pub(super) fn string_list(&mut self, node: &Node, path: &str) -> Option<Vec<(String, Pos, String)>> {
        match &node.value {
            Value::Seq(items) => Some(self.string_items(items, path)),
            _ => {
                self.type_err(node, path, "a list of strings");
                None
            }
        }
    }

    pub(super) fn string_items(&mut self, items: &[Node], path: &str) -> Vec<(String, Pos, String)> {
        let mut out = Vec::with_capacity(items.len());
        for (i, item) in items.iter().enumerate() {
            let p = index(path, i);
            if let Some(s) = self.string(item, &p) {
                out.push((s, item.pos, p));
            }
        }
        out
    }

    pub(super) fn duration(&mut self, node: &Node, path: &str) -> Option<Duration> {
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
    pub(super) fn size(&mut self, text: &str, node: &Node, path: &str, expected: &str) -> Option<Bytes> {
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
}
