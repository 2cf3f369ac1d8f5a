//! The fields of a step that decide whether and how often it runs or counts as failed:
//! `if:` (checked now, its errors pointing at the token inside the value), `soft_fail:`,
//! `retry:` and `concurrency:`.

use super::{
    index, int_value, join, one_of, quoted, suggest, Ctx, Kind, Node, Pos, Value, CONCURRENCY_KEYS, MAX_RETRIES,
    RETRY_KEYS, SOFT_FAIL_KEYS,
};
use crate::job::RetryOn;
use crate::pipeline::{Concurrency, RetryPolicy, SoftFail};

impl Ctx<'_> {
    /// `soft_fail: true`, or a list of exit codes: `[1, 42]`, or Buildkite's
    /// `[{exit_status: 1}, {exit_status: "*"}]`.
    pub(super) fn soft_fail(&mut self, node: &Node, path: &str) -> Option<SoftFail> {
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
    pub(super) fn condition(&mut self, node: &Node, path: &str) -> Option<String> {
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
    pub(super) fn position_in(&self, node: &Node, value: &str, offset: usize) -> Pos {
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

    pub(super) fn retry(&mut self, node: &Node, path: &str) -> Option<RetryPolicy> {
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

    pub(super) fn retry_on(&mut self, node: &Node, path: &str) -> Option<Vec<RetryOn>> {
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

    pub(super) fn concurrency(&mut self, node: &Node, path: &str) -> Option<Concurrency> {
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
}
