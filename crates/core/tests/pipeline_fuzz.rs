//! `parse` never panics, whatever the input: it is fed untrusted files from pull requests.
#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

use gpuci_core::pipeline::parse;
use proptest::prelude::*;

const FULL: &str = include_str!("fixtures/pipelines/full.gpuci.yml");
const HELLO: &str = include_str!("../../../examples/hello.gpuci.yml");
const GPU: &str = include_str!("../../../examples/gpu.gpuci.yml");

/// Parse, and check that errors are sorted and carry 1-based positions.
fn check(text: &str) {
    if let Err(e) = parse("fuzz.yml", text) {
        assert!(!e.0.is_empty(), "an Err must hold at least one error");
        let positions: Vec<(usize, usize)> = e.0.iter().map(|e| (e.line, e.column)).collect();
        assert!(positions.windows(2).all(|w| w[0] <= w[1]), "errors not sorted: {positions:?}");
        assert!(positions.iter().all(|&(l, c)| l >= 1 && c >= 1), "0-based position in {e}");
    }
}

#[test]
fn every_prefix_and_every_line_removed() {
    for text in [FULL, HELLO, GPU] {
        for (i, _) in text.char_indices() {
            check(&text[..i]);
        }
        let lines: Vec<&str> = text.lines().collect();
        for skip in 0..lines.len() {
            let mangled: Vec<&str> = lines.iter().enumerate().filter(|(i, _)| *i != skip).map(|(_, l)| *l).collect();
            check(&mangled.join("\n"));
        }
    }
}

#[test]
fn hostile_shapes() {
    let cases = [
        "[".repeat(100_000),
        "{".repeat(100_000),
        "- ".repeat(10_000),
        format!("steps:\n{}", "  - command: x\n".repeat(5_000)),
        format!(
            "steps:\n{}",
            (0..2_000)
                .map(|i| format!("  - {{key: s{i}, command: x, depends_on: s{}}}\n", (i + 1) % 2_000))
                .collect::<String>()
        ),
        "&a [*a]".into(),
        "*unknown".into(),
        "steps: !!binary aGVsbG8=".into(),
        "\u{feff}steps:\n  - command: x\n".into(),
        "steps:\n  - command: \"\\xff\\u0000\"\n".into(),
        "? [complex, key]\n: value\n".into(),
        "steps:\n  - {? {a: b} : c}\n".into(),
        "%YAML 1.2\n---\nsteps: []\n".into(),
        "steps:\n  - command: x\n    gpu: {memory: \">=99999999999999999999TiB\", compute_capability: \"9999.9999\"}\n"
            .into(),
        "steps:\n  - command: x\n    resources: {cpus: 1e300, pids: 99999999999999999999999}\n".into(),
        "steps:\n  - command: x\n    gpus: 0x7fffffffffffffffffff\n".into(),
    ];
    for c in &cases {
        check(c);
    }
}

/// Characters that make YAML interesting.
fn yamlish() -> impl Strategy<Value = String> {
    proptest::collection::vec(
        prop_oneof![
            Just("steps:".to_string()),
            Just("\n".to_string()),
            Just("  ".to_string()),
            Just("- ".to_string()),
            Just("command: ".to_string()),
            Just("depends_on: ".to_string()),
            Just("gpu: ".to_string()),
            Just("key: ".to_string()),
            Just("&a ".to_string()),
            Just("*a".to_string()),
            Just("<<: ".to_string()),
            "[\\[\\]{}:,#&*!|>'\"%@`?\\-\\\\ a-z0-9\t\n.]{0,6}",
        ],
        0..40,
    )
    .prop_map(|parts| parts.concat())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2_000, ..ProptestConfig::default() })]

    #[test]
    fn never_panics_on_yamlish_input(text in yamlish()) {
        check(&text);
    }

    #[test]
    fn never_panics_on_arbitrary_text(text in any::<String>()) {
        check(&text);
    }

    #[test]
    fn never_panics_on_mangled_examples(which in 0usize..3, at in any::<prop::sample::Index>(), len in 0usize..20, insert in "[\\[\\]{}:,#&*!|>'\"\\- \n\ta-z0-9]{0,4}") {
        let text = [FULL, HELLO, GPU][which];
        let chars: Vec<char> = text.chars().collect();
        let start = at.index(chars.len());
        let end = (start + len).min(chars.len());
        let mangled: String = chars[..start].iter().chain(insert.chars().collect::<Vec<_>>().iter()).chain(chars[end..].iter()).collect();
        check(&mangled);
    }
}
