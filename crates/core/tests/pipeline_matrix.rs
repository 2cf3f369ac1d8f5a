//! `matrix:`, `soft_fail:` and `allow_dependency_failure:`: expansion, interpolation and
//! every error with its position. The exact texts are the product's UX.
#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

use gpuci_core::gpu::CmpOp;
use gpuci_core::pipeline::{parse, Pipeline, SoftFail, MAX_MATRIX_JOBS, MAX_PIPELINE_JOBS};

fn ok(yaml: &str) -> Pipeline {
    parse("ci.yml", yaml).unwrap_or_else(|e| panic!("expected to parse, got:\n{e}"))
}

fn errors(yaml: &str) -> Vec<String> {
    match parse("ci.yml", yaml) {
        Ok(p) => panic!("expected errors, parsed {p:#?}"),
        Err(e) => e.0.iter().map(ToString::to_string).collect(),
    }
}

const TWO_BY_TWO: &str = r#"
steps:
  - key: build
    command: make
  - key: test
    label: Tests
    depends_on: build
    matrix:
      setup:
        python: ["3.11", "3.12"]
        cuda: ["12.4", "12.6"]
    command: "echo python={{matrix.python}} cuda={{ matrix.cuda }}"
    env: {PYTHON: "{{matrix.python}}"}
    image: "nvidia/cuda:{{matrix.cuda}}.0-runtime-ubuntu22.04"
    agents: {queue: "cuda-{{matrix.cuda}}"}
    gpu: {cuda: ">={{matrix.cuda}}"}
  - key: report
    depends_on: [test]
    command: make report
"#;

#[test]
fn a_two_by_two_matrix_expands_in_order_with_values_in_every_field() {
    let p = ok(TWO_BY_TWO);
    let keys: Vec<&str> = p.steps.iter().map(|s| s.key.as_str()).collect();
    assert_eq!(
        keys,
        [
            "build",
            "test[python=3.11,cuda=12.4]",
            "test[python=3.11,cuda=12.6]",
            "test[python=3.12,cuda=12.4]",
            "test[python=3.12,cuda=12.6]",
            "report"
        ]
    );
    let t = &p.steps[2];
    assert_eq!(t.display_name(), "Tests (python=3.11, cuda=12.6)");
    assert_eq!(t.command, ["echo python=3.11 cuda=12.6"]);
    assert_eq!(t.env["PYTHON"], "3.11");
    assert_eq!(t.image.as_deref(), Some("nvidia/cuda:12.6.0-runtime-ubuntu22.04"));
    assert_eq!(t.agents["queue"], "cuda-12.6");
    let cuda = t.gpu.cuda.as_ref().unwrap();
    assert_eq!((cuda.op, cuda.value.to_string()), (CmpOp::Ge, "12.6".to_string()));
    assert_eq!(t.gpu.count, 1, "`gpu:` alone still means one GPU");
    assert_eq!(t.depends_on, ["build"]);
    let m = t.matrix.as_ref().unwrap();
    assert_eq!(m.step, "test");
    assert_eq!(m.describe(", "), "python=3.11, cuda=12.6");
    // `depends_on` the matrix step means all of its jobs.
    assert_eq!(p.steps[5].depends_on, &keys[1..5]);
    assert!(p.steps[0].matrix.is_none() && p.steps[5].matrix.is_none());
    // Deterministic: the same file gives the same jobs.
    assert_eq!(ok(TWO_BY_TWO), p);
}

#[test]
fn a_label_with_matrix_values_is_kept_and_a_step_without_a_label_shows_its_key() {
    let p = ok(r#"
- key: t
  label: "py {{matrix.python}}"
  matrix: {setup: {python: [3.11, 3.12]}}
  command: pytest
- matrix: {setup: {n: [1, 2]}}
  command: "echo {{matrix.n}}"
"#);
    let names: Vec<&str> = p.steps.iter().map(|s| s.display_name()).collect();
    assert_eq!(names, ["py 3.11", "py 3.12", "step-2 (n=1)", "step-2 (n=2)"]);
    assert_eq!(p.steps[2].key, "step-2[n=1]");
}

#[test]
fn gpus_takes_a_count_from_the_matrix_and_other_braces_are_left_alone() {
    let p = ok(r#"
- key: scale
  matrix: {setup: {gpus: [1, 2, 4]}}
  gpus: "{{matrix.gpus}}"
  command: "docker inspect --format '{{.State}}' x; echo {{matrix.gpus}}"
"#);
    let counts: Vec<u32> = p.steps.iter().map(|s| s.gpu.count).collect();
    assert_eq!(counts, [1, 2, 4]);
    assert_eq!(p.steps[1].command, ["docker inspect --format '{{.State}}' x; echo 2"]);
}

#[test]
fn exclude_leaves_out_matching_combinations_and_include_adds_after_the_product() {
    let p = ok(r#"
- key: t
  matrix:
    setup:
      python: ["3.11", "3.12"]
      cuda: ["12.4", "12.6"]
    exclude:
      - {python: "3.11", cuda: "12.6"}
    include:
      - {python: "3.13", cuda: "12.6"}
  command: "echo {{matrix.python}}"
- key: u
  matrix:
    setup: {os: [a, b], py: [1, 2]}
    exclude: [{os: a}]
  command: "true"
"#);
    let keys: Vec<&str> = p.steps.iter().map(|s| s.key.as_str()).collect();
    assert_eq!(
        keys,
        [
            "t[python=3.11,cuda=12.4]",
            "t[python=3.12,cuda=12.4]",
            "t[python=3.12,cuda=12.6]",
            "t[python=3.13,cuda=12.6]",
            "u[os=b,py=1]",
            "u[os=b,py=2]",
        ]
    );
    assert_eq!(p.steps[3].command, ["echo 3.13"]);
}

#[test]
fn matrix_errors_name_their_position() {
    let yaml = r#"steps:
  - key: t
    matrix:
      setup:
        python: ["3.11", "3.12"]
        cuda: []
        "bad name": [1]
      exclude:
        - {pyton: "3.11"}
        - {python: "3.10"}
      include:
        - {python: "3.13"}
        - {python: "3.13", cuda: "12.6", os: linux}
    command: "echo {{matrix.pyton}} {{matrix.os}}"
"#;
    assert_eq!(
        errors(yaml),
        [
            "ci.yml:6:15: steps[0].matrix.setup.cuda: axis `cuda` has no values; give at least one",
            "ci.yml:7:9: steps[0].matrix.setup.bad name: invalid axis name \"bad name\": use letters, digits, `-` and `_`, starting with a letter",
        ],
        "the axes must be right before anything is checked against them"
    );

    let yaml = r#"steps:
  - key: t
    matrix:
      setup:
        python: ["3.11", "3.12"]
        cuda: ["12.4"]
      exclude:
        - {pyton: "3.11"}
        - {python: "3.10"}
      include:
        - {python: "3.13"}
        - {python: "3.13", cuda: "12.6", os: linux}
        - {python: "3.12", cuda: "12.4"}
    command: "echo {{matrix.pyton}} {{matrix.os}} {{matrix}}"
    timeout: "{{matrix.python}}"
"#;
    assert_eq!(
        errors(yaml),
        [
            "ci.yml:8:12: steps[0].matrix.exclude[0].pyton: unknown matrix axis `pyton`, did you mean `python`?",
            "ci.yml:9:20: steps[0].matrix.exclude[1].python: \"3.10\" is not a value of axis `python` (its values: 3.11, 3.12), did you mean \"3.11\"?",
            "ci.yml:11:11: steps[0].matrix.include[0]: missing `cuda`: an include gives a value for every axis (python, cuda)",
            "ci.yml:12:42: steps[0].matrix.include[1].os: unknown matrix axis `os` (axes: python, cuda)",
            // Checked against the axes even though the combinations are wrong.
            "ci.yml:14:14: steps[0].command: unknown matrix axis `pyton`, did you mean `python`?",
            "ci.yml:14:14: steps[0].command: unknown matrix axis `os` (axes: python, cuda)",
            "ci.yml:14:14: steps[0].command: {{matrix}} needs an axis name: write {{matrix.NAME}} (axes: python, cuda)",
            "ci.yml:15:14: steps[0].timeout: {{matrix.python}}: matrix values can be used in `label`, `command`, `env`, `image`, `gpus`, `gpu`, `agents`, not in `timeout`",
        ],
    );

    let yaml = r#"steps:
  - key: t
    matrix:
      setup: {python: ["3.11", "3.12"], cuda: ["12.4"]}
      include:
        - {python: "3.12", cuda: "12.4"}
    command: "echo {{matrix.pyton}} {{matrix.os}} {{matrix}}"
    timeout: "{{matrix.python}}"
    env:
      "A_{{matrix.cuda}}": x
"#;
    assert_eq!(
        errors(yaml),
        [
            "ci.yml:6:11: steps[0].matrix.include[0]: this combination (python=3.12, cuda=12.4) is already in the matrix",
            "ci.yml:7:14: steps[0].command: unknown matrix axis `pyton`, did you mean `python`?",
            "ci.yml:7:14: steps[0].command: unknown matrix axis `os` (axes: python, cuda)",
            "ci.yml:7:14: steps[0].command: {{matrix}} needs an axis name: write {{matrix.NAME}} (axes: python, cuda)",
            "ci.yml:8:14: steps[0].timeout: {{matrix.python}}: matrix values can be used in `label`, `command`, `env`, `image`, `gpus`, `gpu`, `agents`, not in `timeout`",
            "ci.yml:10:7: steps[0].env.A_{{matrix.cuda}}: matrix values cannot be used in a key, only in values",
        ],
    );
}

#[test]
fn an_unknown_axis_is_reported_where_it_is_used() {
    let yaml = "steps:\n  - matrix: {setup: {python: [\"3.11\"]}}\n    command: [make, \"tox -e {{matrix.pythn}}\"]\n";
    assert_eq!(errors(yaml), ["ci.yml:3:21: steps[0].command[1]: unknown matrix axis `pythn`, did you mean `python`?"]);
}

#[test]
fn matrix_values_without_a_matrix_and_unquoted_references_are_errors() {
    assert_eq!(
        errors("- command: \"echo {{matrix.python}}\"\n"),
        ["ci.yml:1:12: steps[0].command: {{matrix.python}} names a matrix value, but this step has no `matrix:`"]
    );
    assert_eq!(
        errors("- matrix: {setup: {image: [a, b]}}\n  image: {{matrix.image}}\n  command: make\n"),
        ["ci.yml:2:10: steps[0].image: {{matrix.image}} must be quoted: unquoted, YAML reads a value starting with `{` as a map; write \"{{matrix.image}}\""]
    );
}

#[test]
fn a_bad_interpolated_value_is_checked_like_a_written_one() {
    let errs = errors("- matrix: {setup: {n: [1, many]}}\n  gpus: \"{{matrix.n}}\"\n  command: make\n");
    assert_eq!(errs, ["ci.yml:2:9: steps[0].gpus: expected a GPU count from 0 to 64, got a string (\"many\")"]);
    // An error in a field without matrix values is reported once, not once per job.
    let errs = errors("- matrix: {setup: {n: [1, 2, 3]}}\n  timeout: soon\n  command: \"echo {{matrix.n}}\"\n");
    assert_eq!(errs, ["ci.yml:2:12: steps[0].timeout: expected a duration like 90s, 30m, 1h30m, got \"soon\""]);
}

#[test]
fn matrix_shape_errors() {
    for (yaml, want) in [
        (
            "- matrix: [a, b]\n  command: make\n",
            "ci.yml:1:11: steps[0].matrix: expected a map like {setup: {python: [\"3.11\", \"3.12\"]}}, got a list; name the axis, so that the step can use its values as {{matrix.NAME}}: `matrix: {setup: {NAME: [...]}}`",
        ),
        (
            "- matrix: {python: [a]}\n  command: make\n",
            "ci.yml:1:12: steps[0].matrix.python: unknown key `python`; axes go under `setup:`, like `matrix: {setup: {python: [...]}}`",
        ),
        (
            "- matrix: {include: []}\n  command: make\n",
            "ci.yml:1:11: steps[0].matrix.setup: missing: a matrix needs `setup:`, a map of axes to their values, like {python: [\"3.11\", \"3.12\"]}",
        ),
        (
            "- matrix: {setup: {a: [x]}, adjustments: []}\n  command: make\n",
            "ci.yml:1:29: steps[0].matrix.adjustments: Buildkite's `adjustments` are written `include:` (combinations to add) and `exclude:` (combinations to leave out) here",
        ),
        ("- matrix: {setup: {}}\n  command: make\n", "ci.yml:1:19: steps[0].matrix.setup: a matrix needs at least one axis, like {python: [\"3.11\", \"3.12\"]}"),
        ("- matrix: {setup: {a: [x, x]}}\n  command: make\n", "ci.yml:1:27: steps[0].matrix.setup.a[1]: \"x\" is listed twice"),
        ("- matrix: {setup: {a: x}}\n  command: make\n", "ci.yml:1:23: steps[0].matrix.setup.a: expected a list of values for axis `a`, got a string (\"x\")"),
        ("- matrix: {setup: {a: [\"\"]}}\n  command: make\n", "ci.yml:1:24: steps[0].matrix.setup.a[0]: a matrix value must not be empty"),
        (
            "- matrix: {setup: {a: [x]}, exclude: [{a: x}]}\n  command: make\n",
            "ci.yml:1:11: steps[0].matrix: every combination is excluded: the step would run no job",
        ),
        ("- matrix: {setup: {a: [x]}, exclude: [{}]}\n  command: make\n", "ci.yml:1:39: steps[0].matrix.exclude[0]: an empty exclude would leave out every combination; name axes and values"),
    ] {
        assert_eq!(errors(yaml), [want], "{yaml}");
    }
}

#[test]
fn a_matrix_over_the_cap_is_refused_without_being_expanded() {
    // 10^12 combinations: refused from the axis sizes alone.
    let axis: Vec<String> = (0..10).map(|i| format!("v{i}")).collect();
    let axes: Vec<String> = (0..12).map(|i| format!("a{i}: [{}]", axis.join(", "))).collect();
    let yaml = format!("- matrix:\n    setup: {{{}}}\n  command: make\n", axes.join(", "));
    let errs = errors(&yaml);
    assert_eq!(errs.len(), 1, "{errs:#?}");
    assert!(
        errs[0].starts_with("ci.yml:2:12: steps[0].matrix.setup: expands to 1000000000000 jobs (a0: 10 × a1: 10"),
        "{}",
        errs[0]
    );
    assert!(errs[0].ends_with(&format!("more than the {MAX_MATRIX_JOBS} one step may have")), "{}", errs[0]);

    let values: Vec<String> = (0..17).map(|i| i.to_string()).collect();
    let yaml = format!("- matrix: {{setup: {{a: [{0}], b: [{0}]}}}}\n  command: make\n", values.join(", "));
    assert_eq!(
        errors(&yaml),
        [format!("ci.yml:1:19: steps[0].matrix.setup: expands to 289 jobs (a: 17 × b: 17), more than the {MAX_MATRIX_JOBS} one step may have")]
    );

    // 5 steps of 256 jobs each: each is fine, the pipeline is not.
    let values: Vec<String> = (0..16).map(|i| i.to_string()).collect();
    let step = format!("- matrix: {{setup: {{a: [{0}], b: [{0}]}}}}\n  command: make\n", values.join(", "));
    let yaml = format!("steps:\n{}", step.repeat(5).lines().map(|l| format!("  {l}\n")).collect::<String>());
    assert_eq!(
        errors(&yaml),
        [format!("ci.yml:2:3: steps: the steps expand to 1280 jobs (matrices included), more than the {MAX_PIPELINE_JOBS} a pipeline may have")]
    );
}

#[test]
fn soft_fail_and_allow_dependency_failure_parse() {
    let p = ok(r#"
- key: a
  command: make
  soft_fail: true
- key: b
  command: make
  soft_fail: [1, 42]
- key: c
  command: make
  soft_fail: [{exit_status: 3}]
- key: d
  command: make
  soft_fail: [{exit_status: "*"}]
- key: e
  command: make
  depends_on: [a, b]
  allow_dependency_failure: true
"#);
    assert_eq!(p.steps[0].soft_fail, SoftFail::Always);
    assert_eq!(p.steps[1].soft_fail, SoftFail::ExitCodes(vec![1, 42]));
    assert_eq!(p.steps[2].soft_fail, SoftFail::ExitCodes(vec![3]));
    assert_eq!(p.steps[3].soft_fail, SoftFail::Always);
    assert_eq!(p.steps[4].soft_fail, SoftFail::Never);
    assert!(p.steps[4].allow_dependency_failure && !p.steps[0].allow_dependency_failure);
}

#[test]
fn soft_fail_errors_name_their_position() {
    for (yaml, want) in [
        ("- command: make\n  soft_fail: maybe\n", "ci.yml:2:14: steps[0].soft_fail: expected true, false, or a list of exit codes like [1, 42], got a string (\"maybe\")"),
        ("- command: make\n  soft_fail: []\n", "ci.yml:2:14: steps[0].soft_fail: an empty list soft-fails nothing; write `true`, or list exit codes like [1, 42]"),
        ("- command: make\n  soft_fail: [0]\n", "ci.yml:2:15: steps[0].soft_fail[0]: 0 is success; list the non-zero exit codes that should not fail the pipeline"),
        ("- command: make\n  soft_fail: [1, 256]\n", "ci.yml:2:18: steps[0].soft_fail[1]: expected an exit code from 1 to 255, got 256"),
        ("- command: make\n  soft_fail: [1, 1]\n", "ci.yml:2:18: steps[0].soft_fail[1]: `1` is listed twice"),
        ("- command: make\n  soft_fail: [{exit_code: 1}]\n", "ci.yml:2:16: steps[0].soft_fail[0].exit_code: unknown key `exit_code`; expected one of: exit_status"),
        ("- command: make\n  allow_dependency_failure: yes\n", "ci.yml:2:29: steps[0].allow_dependency_failure: expected true or false, got a string (\"yes\")"),
    ] {
        assert_eq!(errors(yaml), [want], "{yaml}");
    }
}
