//! `if:` on a step: a small expression over the build's facts, decided when the pipeline is
//! submitted.
//!
//! The language, here and nowhere else (docs/pipelines.md shows it to users):
//!
//! ```text
//! condition  := or
//! or         := and ( "||" and )*
//! and        := unary ( "&&" unary )*
//! unary      := "!" unary | primary
//! primary    := "(" condition ")" | "true" | "false" | changed | comparison
//! changed    := "changed" "(" STRING ( "," STRING )* ")"
//! comparison := operand ( "==" | "!=" ) operand
//!             | operand ( "=~" | "!~" ) REGEX
//! operand    := FACT | STRING
//! FACT       := build.branch | build.tag | build.event | build.commit | env.NAME
//! STRING     := "…" or '…', escapes \\ \" \' \n \t
//! REGEX      := /…/ (the `regex` crate's syntax; `\/` is a `/`), unanchored
//! ```
//!
//! - `!` binds tightest, then comparisons (which do not chain), then `&&`, then `||`.
//! - There are no loops, no variables and one function, `changed(glob, …)`: true when a
//!   changed path matches one of the globs (`*` and `?` within a path segment, `**` across
//!   segments, matched against the whole path from the repository root).
//! - Bounded: [`MAX_LEN`] bytes, [`MAX_DEPTH`] nested `(`/`!`, [`MAX_TERMS`] comparisons
//!   and calls, [`MAX_GLOBS`] globs a call, regexes compiled within [`MAX_REGEX_SIZE`]. The
//!   `regex` crate matches in linear time, so evaluation is linear in the condition's size
//!   (times the number of changed paths, for `changed`).
//! - `build.event` compares only with `push`, `pull_request`, `schedule` or `manual`; another
//!   literal is an error, not a condition that is quietly always false.
//! - **Missing facts.** A fact the submitter did not know (a detached HEAD has no branch;
//!   `gpuci submit` outside git knows no changes) is *unknown*, and the logic is three-valued
//!   (Kleene): `unknown && false` is false, `unknown || true` is true, `!unknown` is unknown.
//!   A condition that ends unknown **runs** the step (its queued reason says which facts were
//!   missing): a step is never skipped because a fact was missing. `env.NAME` is never unknown:
//!   an unset variable is `""`.
//!
//! [`plan`] applies the conditions of a pipeline: which jobs are created skipped, and why.

use crate::pipeline::Step;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashSet};

mod parse;
#[cfg(test)]
mod tests;

pub use parse::ConditionError;

/// Longest condition, in bytes.
pub const MAX_LEN: usize = 1024;
/// Deepest nesting of `(` and `!`.
pub const MAX_DEPTH: usize = 16;
/// Most comparisons, `changed(…)` calls and `true`/`false` in one condition.
pub const MAX_TERMS: usize = 32;
/// Most globs in one `changed(…)`.
pub const MAX_GLOBS: usize = 16;
/// Most memory one compiled regex (a `=~` or a `changed(…)`'s globs) may take, in bytes.
pub const MAX_REGEX_SIZE: usize = 256 << 10;
/// Most changed paths a submission may list; a submitter with more sends none (unknown).
pub const MAX_CHANGED_PATHS: usize = 10_000;

/// What a build is, as far as conditions can see. `None` anywhere means unknown.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct BuildFacts {
    /// The branch built (`main`); unknown for a detached HEAD.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub branch: Option<String>,
    /// The tag built (`v1.2.0`); `""` when the commit has none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tag: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub event: Option<BuildEvent>,
    /// The commit SHA.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub commit: Option<String>,
    /// Paths changed by the build (relative to the repository root, `/`-separated); empty
    /// when nothing changed, `None` when nobody knows.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub changed: Option<Vec<String>>,
    /// The commit's subject (its message's first line). Shown in the builds list; no
    /// condition reads it (a commit message is the author's to choose, not a fact to gate on).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub subject: Option<String>,
    /// The commit's author (name), or who pushed or opened the pull request. Shown only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub author: Option<String>,
}

/// What started a build.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum BuildEvent {
    Push,
    PullRequest,
    Schedule,
    /// `gpuci submit` and the API.
    Manual,
}

impl BuildEvent {
    pub const NAMES: &'static [&'static str] = &["push", "pull_request", "schedule", "manual"];

    pub fn as_str(self) -> &'static str {
        match self {
            BuildEvent::Push => "push",
            BuildEvent::PullRequest => "pull_request",
            BuildEvent::Schedule => "schedule",
            BuildEvent::Manual => "manual",
        }
    }

    pub fn parse(s: &str) -> Option<BuildEvent> {
        Some(match s {
            "push" => BuildEvent::Push,
            "pull_request" => BuildEvent::PullRequest,
            "schedule" => BuildEvent::Schedule,
            "manual" => BuildEvent::Manual,
            _ => return None,
        })
    }
}

/// A parsed condition.
#[derive(Clone, Debug)]
pub struct Condition {
    text: String,
    expr: parse::Expr,
}

/// Kleene's three values.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Truth {
    False,
    True,
    Unknown,
}

impl Truth {
    fn of(b: bool) -> Truth {
        if b {
            Truth::True
        } else {
            Truth::False
        }
    }
    fn not(self) -> Truth {
        match self {
            Truth::False => Truth::True,
            Truth::True => Truth::False,
            Truth::Unknown => Truth::Unknown,
        }
    }
    fn and(self, o: Truth) -> Truth {
        match (self, o) {
            (Truth::False, _) | (_, Truth::False) => Truth::False,
            (Truth::True, Truth::True) => Truth::True,
            _ => Truth::Unknown,
        }
    }
    fn or(self, o: Truth) -> Truth {
        match (self, o) {
            (Truth::True, _) | (_, Truth::True) => Truth::True,
            (Truth::False, Truth::False) => Truth::False,
            _ => Truth::Unknown,
        }
    }
}

/// A condition's value and the facts it read, described (`build.branch = "dev"`), in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Verdict {
    pub truth: Truth,
    pub read: Vec<String>,
}

impl Condition {
    /// Parse `text` strictly; an error names the character (0-based, in chars) it is about.
    pub fn parse(text: &str) -> Result<Condition, ConditionError> {
        let expr = parse::parse(text)?;
        Ok(Condition { text: text.to_string(), expr })
    }

    pub fn text(&self) -> &str {
        &self.text
    }

    /// The condition's value for a build whose pipeline environment is `env`.
    pub fn evaluate(&self, facts: &BuildFacts, env: &BTreeMap<String, String>) -> Verdict {
        let mut read = Vec::new();
        let truth = self.expr.eval(facts, env, &mut read);
        let mut seen = HashSet::new();
        read.retain(|r| seen.insert(r.clone()));
        Verdict { truth, read }
    }
}

/// What to do with one job of a submitted pipeline.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Decision {
    /// Queue it; `note` says why when its condition could not be decided.
    Run { note: Option<String> },
    /// Create it skipped, with this reason; it never runs and counts as neither success nor
    /// failure (`crate::progress`).
    Skip(String),
}

/// The decision for each step of a pipeline (in order): a step whose condition is false is
/// skipped; so is, transitively, a step that depends on a skipped one, unless it has
/// `allow_dependency_failure` (the rule `crate::progress::gate` applies to any skipped
/// dependency). `env` is the pipeline's environment (the submission's, under the file's).
pub fn plan(steps: &[Step], facts: &BuildFacts, env: &BTreeMap<String, String>) -> Vec<Decision> {
    let mut out: Vec<Decision> = steps
        .iter()
        .map(|s| {
            let Some(text) = &s.condition else { return Decision::Run { note: None } };
            // The file was validated: a condition that no longer parses (a coordinator older
            // than the file's language) runs rather than vanishing.
            let Ok(c) = Condition::parse(text) else {
                return Decision::Run { note: Some(format!("condition `{text}` could not be read; the step runs")) };
            };
            let v = c.evaluate(facts, env);
            let facts = v.read.join(", ");
            match v.truth {
                Truth::True => Decision::Run { note: None },
                Truth::False => Decision::Skip(format!("skipped: `if: {text}` is false ({facts})")),
                Truth::Unknown => {
                    Decision::Run { note: Some(format!("`if: {text}` could not be decided ({facts}); the step runs")) }
                }
            }
        })
        .collect();
    // Cascade through depends_on until nothing changes; each pass skips at least one more
    // step or ends, so at most `steps.len()` passes.
    let index: BTreeMap<&str, usize> = steps.iter().enumerate().map(|(i, s)| (s.key.as_str(), i)).collect();
    loop {
        let mut changed = false;
        for (i, s) in steps.iter().enumerate() {
            if s.allow_dependency_failure || matches!(out[i], Decision::Skip(_)) {
                continue;
            }
            let skipped_dep = s
                .depends_on
                .iter()
                .find(|d| index.get(d.as_str()).is_some_and(|&j| matches!(out[j], Decision::Skip(_))));
            if let Some(dep) = skipped_dep {
                out[i] = Decision::Skip(format!(
                    "skipped: dependency `{dep}` was skipped by a condition; this step never ran"
                ));
                changed = true;
            }
        }
        if !changed {
            return out;
        }
    }
}
