//! Every YAML example in the user documentation parses, so the docs cannot drift from the
//! parser unnoticed.
//!
//! Checked: each ```yaml (or ```yml) block in `docs/pipelines.md` and `README.md`.
//! - A block parses with `gpuci_core::pipeline::parse`, unless the line before its fence
//!   (blank lines aside) is `<!-- invalid -->`: then it must fail to parse.
//! - When an invalid block is directly followed by a ```text block, that block is the
//!   expected output, one error per line, exactly as `gpuci validate` prints it. The file
//!   name is taken from the first expected line (`bad.gpuci.yml:5:3: ...`).
//!
//! Also checked: every key of the format (from the JSON Schema, which a test in `schema.rs`
//! keeps equal to the parser's key lists) is mentioned in `docs/pipelines.md`, and every top-level
//! and step key has a heading there.
#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

use gpuci_core::pipeline::{parse, schema::json_schema};
use std::path::PathBuf;

const INVALID_MARK: &str = "<!-- invalid -->";

fn repo_file(rel: &str) -> (PathBuf, String) {
    let path = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"))
        .join("../..")
        .join(rel);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    (path, text)
}

/// A fenced code block.
#[derive(Debug)]
struct Block {
    /// The first word of the info string (`yaml`, `text`, ...).
    lang: String,
    /// 1-based line of the opening fence.
    line: usize,
    /// The content, with the fence's indentation removed.
    text: String,
    /// The previous non-blank line before the opening fence, trimmed.
    before: String,
    /// Index of the block that directly follows this one (only blank lines between).
    next: Option<usize>,
}

/// The fenced blocks of a Markdown text, in order. Fences may be indented (blocks in lists)
/// and may use three or more backticks; the closing fence must use at least as many.
fn blocks(markdown: &str) -> Vec<Block> {
    let lines: Vec<&str> = markdown.lines().collect();
    let mut out: Vec<Block> = Vec::new();
    // (block index, line index of its closing fence)
    let mut last_close: Option<(usize, usize)> = None;
    let mut i = 0;
    while i < lines.len() {
        let line = lines[i];
        let trimmed = line.trim_start();
        let ticks = trimmed.bytes().take_while(|b| *b == b'`').count();
        if ticks < 3 {
            i += 1;
            continue;
        }
        let indent = line.len() - trimmed.len();
        let info = trimmed[ticks..].trim();
        let lang = info.split_whitespace().next().unwrap_or("").to_ascii_lowercase();
        let before = lines[..i].iter().rev().map(|l| l.trim()).find(|l| !l.is_empty()).unwrap_or("").to_string();
        let mut body = Vec::new();
        let mut j = i + 1;
        while j < lines.len() {
            let t = lines[j].trim_start();
            let closing = t.bytes().take_while(|b| *b == b'`').count();
            if closing >= ticks && t[closing..].trim().is_empty() {
                break;
            }
            // Remove up to `indent` leading spaces, as Markdown does.
            let l = lines[j];
            let strip = l.len() - l.trim_start_matches(' ').len();
            body.push(&l[strip.min(indent)..]);
            j += 1;
        }
        assert!(j < lines.len(), "line {}: code block is never closed", i + 1);
        let index = out.len();
        if let Some((prev, close)) = last_close {
            if lines[close + 1..i].iter().all(|l| l.trim().is_empty()) {
                out[prev].next = Some(index);
            }
        }
        let mut text = body.join("\n");
        text.push('\n');
        out.push(Block { lang, line: i + 1, text, before, next: None });
        last_close = Some((index, j));
        i = j + 1;
    }
    out
}

/// Problems with the YAML blocks of one file, and how many YAML blocks (valid, invalid) it has.
fn check_file(rel: &str) -> (Vec<String>, usize, usize) {
    let (_, markdown) = repo_file(rel);
    let all = blocks(&markdown);
    let mut problems = Vec::new();
    let (mut valid, mut invalid) = (0, 0);
    for b in all.iter().filter(|b| b.lang == "yaml" || b.lang == "yml") {
        let at = format!("{rel}:{}", b.line);
        if b.before != INVALID_MARK {
            valid += 1;
            if let Err(errors) = parse(".gpuci.yml", &b.text) {
                problems.push(format!("{at}: this example does not parse:\n{errors}\n--- example:\n{}", b.text));
            }
            continue;
        }
        invalid += 1;
        let expected = b.next.map(|n| &all[n]).filter(|n| n.lang == "text");
        let file_name = expected
            .and_then(|e| e.text.lines().next())
            .and_then(|l| l.split(':').next())
            .filter(|n| !n.is_empty())
            .unwrap_or(".gpuci.yml");
        match parse(file_name, &b.text) {
            Ok(_) => problems.push(format!("{at}: marked {INVALID_MARK} but parses:\n{}", b.text)),
            Err(errors) => {
                let Some(expected) = expected else { continue };
                let got: Vec<String> = errors.iter().map(ToString::to_string).collect();
                let want: Vec<&str> = expected.text.lines().filter(|l| !l.trim().is_empty()).collect();
                if got != want {
                    problems.push(format!(
                        "{at}: the errors shown (line {}) are not what the parser says.\n--- shown:\n{}\n--- parser:\n{}",
                        expected.line,
                        want.join("\n"),
                        got.join("\n")
                    ));
                }
            }
        }
    }
    (problems, valid, invalid)
}

#[test]
fn pipeline_reference_examples_parse() {
    let (problems, valid, invalid) = check_file("docs/pipelines.md");
    assert!(problems.is_empty(), "{}", problems.join("\n\n"));
    // Guards the extractor itself: the reference has many examples of both kinds.
    assert!(valid >= 10, "found only {valid} valid yaml examples in docs/pipelines.md");
    assert!(invalid >= 3, "found only {invalid} invalid yaml examples in docs/pipelines.md");
}

#[test]
fn readme_examples_parse() {
    let (problems, _, _) = check_file("README.md");
    assert!(problems.is_empty(), "{}", problems.join("\n\n"));
}

/// Every key the format accepts is documented; top-level and step keys have a heading.
#[test]
fn every_key_is_documented() {
    let (_, markdown) = repo_file("docs/pipelines.md");
    let headings: Vec<&str> = markdown.lines().filter(|l| l.starts_with('#')).collect();
    let schema = json_schema();
    let defs = schema["definitions"].as_object().expect("schema has definitions");
    let mut missing = Vec::new();
    for (def, body) in defs {
        let Some(props) = body.get("properties").and_then(|p| p.as_object()) else { continue };
        for key in props.keys() {
            let code = format!("`{key}`");
            let needs_heading = def == "RawPipeline" || def == "RawStep";
            let found =
                if needs_heading { headings.iter().any(|h| h.contains(&code)) } else { markdown.contains(&code) };
            if !found {
                missing.push(format!("{def}.{key}{}", if needs_heading { " (needs a heading)" } else { "" }));
            }
        }
    }
    assert!(missing.is_empty(), "keys not documented in docs/pipelines.md: {}", missing.join(", "));
}

#[test]
fn extractor_finds_blocks_and_markers() {
    let md = "\
text
<!-- invalid -->

```yaml
steps: 1
```

```text
x.yml:1:8: steps: expected a list of steps, got a number (1)
```

- item

  ````yml
  steps:
    - command: make
  ````
";
    let b = blocks(md);
    assert_eq!(b.len(), 3, "{b:#?}");
    assert_eq!((b[0].lang.as_str(), b[0].before.as_str(), b[0].next), ("yaml", INVALID_MARK, Some(1)));
    assert_eq!(b[0].text, "steps: 1\n");
    assert_eq!(b[1].lang, "text");
    assert_eq!(b[1].next, None);
    assert_eq!(b[2].text, "steps:\n  - command: make\n");
    assert!(parse("x.yml", &b[2].text).is_ok());
    let Err(errs) = parse("x.yml", &b[0].text) else { panic!("`steps: 1` must not parse") };
    assert_eq!(errs.to_string(), b[1].text.trim_end());
}
