//! The coordinator's modules form no import circle (issue 29; docs/architecture.md, "The
//! coordinator's layout"): a module uses only modules below it, so each can be read, tested
//! and changed without the ones above. Reads the crate's own sources: every `crate::NAME`
//! outside comments and test code is an edge from the top-level module the file belongs to.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let p = e.expect("a directory entry").path();
        if p.is_dir() {
            sources(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// The top-level module a source file belongs to (`api/artifacts.rs` → `api`), or `None` for
/// the crate root and test files.
fn module_of(src: &Path, file: &Path) -> Option<String> {
    let rel = file.strip_prefix(src).ok()?;
    let parts: Vec<String> = rel.iter().map(|p| p.to_string_lossy().into_owned()).collect();
    if parts.iter().any(|p| p == "tests" || p == "tests.rs" || p.ends_with("_tests.rs")) {
        return None;
    }
    let top = parts.first()?.trim_end_matches(".rs").to_string();
    (top != "lib").then_some(top)
}

/// The code of a file without comments and without what follows a `#[cfg(test)]` item
/// (a test module at the end of the file), line by line.
fn code(text: &str) -> String {
    let mut out = String::new();
    let mut skip_block = false;
    let mut depth: i64 = 0;
    for line in text.lines() {
        let t = line.trim_start();
        if t.starts_with("//") {
            continue;
        }
        if t.starts_with("#[cfg(test)]") {
            skip_block = true;
            depth = 0;
            continue;
        }
        if skip_block {
            // `mod tests;` (a file) ends at once; `mod tests { ... }` at its closing brace.
            depth += line.matches('{').count() as i64 - line.matches('}').count() as i64;
            if depth <= 0 && (t.ends_with(';') || t.ends_with('}')) {
                skip_block = false;
            }
            continue;
        }
        out.push_str(line.split("//").next().unwrap_or(""));
        out.push('\n');
    }
    out
}

/// `crate::NAME` and `use crate::{NAME, ...}` in `code`.
fn uses(code: &str) -> BTreeSet<String> {
    let mut found = BTreeSet::new();
    let ident = |s: &str| -> String { s.chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect() };
    for (i, _) in code.match_indices("crate::") {
        let rest = &code[i + "crate::".len()..];
        if let Some(group) = rest.strip_prefix('{') {
            let inner = group.split('}').next().unwrap_or("");
            for item in inner.split(',') {
                let name = ident(item.trim());
                if !name.is_empty() {
                    found.insert(name);
                }
            }
        } else {
            let name = ident(rest);
            if !name.is_empty() {
                found.insert(name);
            }
        }
    }
    found
}

/// Module → the modules it uses.
fn graph() -> BTreeMap<String, BTreeSet<String>> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    sources(&src, &mut files);
    let mut g: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for f in &files {
        if let Some(m) = module_of(&src, f) {
            let text = std::fs::read_to_string(f).unwrap_or_else(|e| panic!("{}: {e}", f.display()));
            g.entry(m.clone()).or_default().extend(uses(&code(&text)).into_iter().filter(|u| *u != m));
        }
    }
    let modules: BTreeSet<String> = g.keys().cloned().collect();
    for deps in g.values_mut() {
        deps.retain(|d| modules.contains(d));
    }
    g
}

/// A circle through `from`, if there is one (depth-first search back to it).
fn circle_through(g: &BTreeMap<String, BTreeSet<String>>, from: &str) -> Option<Vec<String>> {
    fn walk(
        g: &BTreeMap<String, BTreeSet<String>>,
        goal: &str,
        at: &str,
        path: &mut Vec<String>,
        seen: &mut BTreeSet<String>,
    ) -> bool {
        for next in g.get(at).into_iter().flatten() {
            if next == goal {
                path.push(next.clone());
                return true;
            }
            if seen.insert(next.clone()) {
                path.push(next.clone());
                if walk(g, goal, next, path, seen) {
                    return true;
                }
                path.pop();
            }
        }
        false
    }
    let mut path = vec![from.to_string()];
    walk(g, from, from, &mut path, &mut BTreeSet::new()).then_some(path)
}

#[test]
fn the_coordinators_modules_form_no_import_circle() {
    let g = graph();
    assert!(g.len() > 20, "the crate's modules were not found: {g:?}");
    assert!(g["api"].contains("brain"), "the reading finds known edges: {:?}", g["api"]);
    let circles: Vec<String> = g.keys().filter_map(|m| circle_through(&g, m)).map(|c| c.join(" → ")).collect();
    assert!(
        circles.is_empty(),
        "modules that import each other (move the shared piece below its users):\n{}",
        circles.join("\n")
    );
}

#[test]
fn the_reading_sees_a_circle_when_there_is_one() {
    let text_a = "use crate::b::X;\n// crate::c in a comment\nfn f() { crate::d::g() }\n#[cfg(test)]\nmod tests {\n    use crate::e;\n}\n";
    assert_eq!(uses(&code(text_a)), ["b", "d"].iter().map(|s| s.to_string()).collect());
    assert_eq!(uses("use crate::{x, y::Z, w};"), ["w", "x", "y"].iter().map(|s| s.to_string()).collect());
    let g: BTreeMap<String, BTreeSet<String>> =
        [("a", vec!["b"]), ("b", vec!["c"]), ("c", vec!["a"]), ("d", vec!["a"])]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v.into_iter().map(str::to_string).collect()))
            .collect();
    assert_eq!(circle_through(&g, "a"), Some(vec!["a".into(), "b".into(), "c".into(), "a".into()]));
    assert_eq!(circle_through(&g, "d"), None);
}
