//! `artifacts:` and `artifacts_from:` in pipeline files: what they parse to, and positioned
//! errors for what they refuse.
#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

use gpuci_core::artifacts::{ArtifactSpec, ArtifactWhen};
use gpuci_core::pipeline::{parse, Pipeline};

fn ok(yaml: &str) -> Pipeline {
    match parse("ci.yml", yaml) {
        Ok(p) => p,
        Err(e) => panic!("expected a pipeline, got:\n{e}"),
    }
}

fn errors(yaml: &str) -> String {
    match parse("ci.yml", yaml) {
        Ok(p) => panic!("expected errors, got {p:?}"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn list_string_and_map_forms() {
    let p = ok("steps:
  - key: build
    command: make
    artifacts: [\"dist/*.whl\", \"logs/**\"]
  - key: one
    command: make
    artifacts: out.txt
  - key: test
    command: pytest
    depends_on: [build, one]
    artifacts_from: build
    artifacts:
      paths: [report.xml]
      when: on_failure
");
    assert_eq!(
        p.steps[0].artifacts,
        ArtifactSpec { paths: vec!["dist/*.whl".into(), "logs/**".into()], when: ArtifactWhen::Always }
    );
    assert_eq!(p.steps[1].artifacts.paths, ["out.txt"]);
    assert_eq!(p.steps[2].artifacts, ArtifactSpec { paths: vec!["report.xml".into()], when: ArtifactWhen::OnFailure });
    assert_eq!(p.steps[2].artifacts_from, ["build"]);
}

#[test]
fn hostile_patterns_are_refused_at_their_position() {
    let e = errors(
        "steps:
  - command: make
    artifacts: [\"../../etc/passwd\", \"/etc/shadow\", \"~/.ssh/id_rsa\", \"ok/*\", \"\"]
",
    );
    assert!(e.contains("ci.yml:3:17: steps[0].artifacts[0]: artifact paths must stay inside the workspace"), "{e}");
    assert!(e.contains("ci.yml:3:37: steps[0].artifacts[1]: artifact paths are relative"), "{e}");
    assert!(e.contains("steps[0].artifacts[2]: artifact paths are relative to the workspace; `~`"), "{e}");
    assert!(e.contains("steps[0].artifacts[4]: an artifact path must not be empty"), "{e}");
    assert!(!e.contains("artifacts[3]"), "{e}");
}

#[test]
fn map_form_is_strict() {
    let e = errors(
        "steps:
  - command: make
    artifacts:
      path: [a]
      when: sometimes
",
    );
    assert!(e.contains("ci.yml:4:7: steps[0].artifacts.path: unknown key `path`, did you mean `paths`?"), "{e}");
    assert!(e.contains("ci.yml:5:13: steps[0].artifacts.when:"), "{e}");
    assert!(e.contains("on_success"), "{e}");
    assert!(e.contains("steps[0].artifacts.paths: missing"), "{e}");
    let e = errors("steps:\n  - command: make\n    artifacts: []\n");
    assert!(e.contains("ci.yml:3:16: steps[0].artifacts: an empty list uploads nothing"), "{e}");
    let e = errors("steps:\n  - command: make\n    artifacts: {paths: [a], when: always, x: 1}\n");
    assert!(e.contains("steps[0].artifacts.x: unknown key"), "{e}");
}

#[test]
fn artifacts_from_must_be_a_dependency() {
    let e = errors(
        "steps:
  - key: build
    command: make
  - key: other
    command: make
  - command: test
    depends_on: [build]
    artifacts_from: [build, other]
",
    );
    assert!(e.contains("ci.yml:8:29: steps[2].artifacts_from[1]: `other` is not in this step's `depends_on`"), "{e}");
    assert!(!e.contains("artifacts_from[0]"), "{e}");
}

#[test]
fn artifacts_from_a_matrix_step_means_all_its_jobs() {
    let p = ok("steps:
  - key: build
    command: make {{matrix.cuda}}
    matrix: {setup: {cuda: [\"12.4\", \"12.6\"]}}
    artifacts: [\"dist/*\"]
  - key: test
    command: test
    depends_on: build
    artifacts_from: build
");
    assert_eq!(p.steps[2].artifacts_from, ["build[cuda=12.4]", "build[cuda=12.6]"]);
    assert_eq!(p.steps[0].artifacts.paths, ["dist/*"]);
}
