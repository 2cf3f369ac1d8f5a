//! `if:` in a pipeline file: accepted, kept on the step, and refused with the position of the
//! offending token inside the value.
#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

use gpuci_core::pipeline::parse;

fn errors(text: &str) -> Vec<String> {
    parse("p.yml", text).err().unwrap_or_else(|| panic!("parsed:\n{text}")).iter().map(|e| e.to_string()).collect()
}

#[test]
fn a_condition_is_kept_on_the_step_and_on_every_matrix_job() {
    let p = parse(
        "p.yml",
        r#"steps:
  - key: deploy
    command: make deploy
    if: build.branch == "main" && build.event != "pull_request"
  - key: test
    command: pytest
    if: 'changed("src/**/*.cu") || env.RUN_GPU == "1"'
    matrix: {setup: {py: ["3.11", "3.12"]}}
  - command: always
    if: true
"#,
    )
    .unwrap();
    assert_eq!(p.steps[0].condition.as_deref(), Some(r#"build.branch == "main" && build.event != "pull_request""#));
    assert_eq!(p.steps[1].condition.as_deref(), Some(r#"changed("src/**/*.cu") || env.RUN_GPU == "1""#));
    assert_eq!(p.steps[2].condition, p.steps[1].condition, "each matrix job");
    assert_eq!(p.steps[3].condition.as_deref(), Some("true"));
    assert!(p.steps.iter().all(|s| !s.skipped_by_condition), "only the coordinator sets it");
}

#[test]
fn errors_point_at_the_token_inside_the_value() {
    // Plain: the column of `brnch`'s start is the value's column plus the offset.
    assert_eq!(
        errors("steps:\n  - command: x\n    if: build.brnch == \"main\"\n"),
        vec![
            "p.yml:3:9: steps[0].if: unknown name `build.brnch`, did you mean `build.branch`? (in `if: \"build.brnch == \\\"main\\\"\"`)"
        ]
    );
    // Quoted: the quote is not part of the value.
    let e = errors("steps:\n  - command: x\n    if: 'build.branch = \"main\"'\n");
    assert!(e[0].starts_with("p.yml:3:23: steps[0].if: `=` is not an operator"), "{e:?}");
    let e = errors("steps:\n  - command: x\n    if: \"build.event == 'pr'\"\n");
    assert!(e[0].starts_with("p.yml:3:25: steps[0].if: build.event is one of"), "{e:?}");
    // A block scalar: where its text starts, the condition quoted in the message.
    let e = errors("steps:\n  - command: x\n    if: >\n      build.branch ==\n      nope\n");
    assert!(e[0].starts_with("p.yml:4:7: steps[0].if: unknown name `nope`"), "{e:?}");
    // Not a string.
    let e = errors("steps:\n  - command: x\n    if: [a]\n");
    assert!(e[0].contains("steps[0].if: expected a string"), "{e:?}");
    // Every error in one pass, next to other fields' errors.
    let e = errors("steps:\n  - command: x\n    if: (true\n    timeout: soon\n  - command: y\n    if: changed()\n");
    assert_eq!(e.len(), 3, "{e:?}");
    assert!(e[0].starts_with("p.yml:3:14: steps[0].if: expected `)`"), "{e:?}");
    assert!(e[2].starts_with("p.yml:6:17: steps[1].if: changed() needs at least one glob"), "{e:?}");
}
