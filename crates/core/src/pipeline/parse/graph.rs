//! Cross-step rules, run after every step is read: step keys are unique (and not already
//! taken by the running pipeline steps are added to), `depends_on` names a step that exists,
//! and the dependencies have no cycle.
//!
//! The cycle search is iterative and reports at most [`MAX_CYCLES`] cycles, so a hostile file
//! with a long chain of steps cannot overflow the stack or flood the output.

use super::{suggest, Ctx, Draft, Pos};
use std::collections::HashMap;

impl Ctx<'_> {
    /// Unique keys, `depends_on` targets that exist, no cycles.
    pub(super) fn check_graph(&mut self, drafts: &[Draft], path: &str) {
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
