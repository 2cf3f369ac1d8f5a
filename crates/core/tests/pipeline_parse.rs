//! Pipelines that parse, and what they parse to.
#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

use gpuci_core::duration::Duration;
use gpuci_core::gpu::{CmpOp, ComputeCapability, Constraint, GpuRequirements, Version};
use gpuci_core::job::RetryOn;
use gpuci_core::pipeline::{parse, Concurrency, NetworkMode, Pipeline, Resources, RetryPolicy, SandboxMode, Step};
use gpuci_core::quantity::Bytes;
use std::collections::BTreeMap;
use std::path::PathBuf;

fn ok(yaml: &str) -> Pipeline {
    match parse("ci.yml", yaml) {
        Ok(p) => p,
        Err(e) => panic!("expected a pipeline, got:\n{e}"),
    }
}

fn map(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
}

fn repo_file(path: &str) -> PathBuf {
    PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR")).join("../..").join(path)
}

#[test]
fn minimal_step_gets_defaults() {
    let p = ok("steps:\n  - command: make\n");
    assert_eq!(p, Pipeline { env: BTreeMap::new(), steps: vec![Step::new("step-1", "make")] });
}

#[test]
fn default_keys_are_one_based_positions() {
    let p = ok("steps:\n  - command: a\n  - key: named\n    command: b\n  - command: c\n");
    let keys: Vec<&str> = p.steps.iter().map(|s| s.key.as_str()).collect();
    assert_eq!(keys, ["step-1", "named", "step-3"]);
}

#[test]
fn top_level_list_is_shorthand_for_steps() {
    let p = ok("- command: a\n- key: b\n  command: b\n  depends_on: step-1\n");
    assert_eq!(p.steps.len(), 2);
    assert_eq!(p.steps[1].depends_on, ["step-1"]);
}

#[test]
fn every_field() {
    let yaml = "\
env: {FOO: bar, PORT: 8080, DEBUG: true}
steps:
  - key: build
    command: make
  - key: Train_2
    label: \"Train\"
    command:
      - pip install -e .
      - pytest
    env: {CUDA_HOME: /usr/local/cuda}
    timeout: 1h30m
    queue_timeout: 10m
    agents: {queue: cuda, tier: 2}
    depends_on: [build]
    retry: {count: 2, on: [lost, failed, timed_out]}
    concurrency: {group: deploy, cancel_in_progress: true}
    gpus: 2
    gpu: {memory: \">=40GiB\", compute_capability: \">=8.0\", model: \"H100*\", driver: \">=535\", cuda: 12.1, mig: 1g.10gb}
    resources: {memory: 8GiB, cpus: 1.5, pids: 512}
    network: none
    sandbox: none
    image: \"nvcr.io/nvidia/pytorch:24.05-py3\"
    secrets: [HF_TOKEN]
    cache: [.cache/pip, target]
";
    let p = ok(yaml);
    assert_eq!(p.env, map(&[("FOO", "bar"), ("PORT", "8080"), ("DEBUG", "true")]));
    let want = Step {
        key: "Train_2".into(),
        label: Some("Train".into()),
        command: vec!["pip install -e .".into(), "pytest".into()],
        env: map(&[("CUDA_HOME", "/usr/local/cuda")]),
        timeout: Some(Duration::from_secs(5400)),
        queue_timeout: Some(Duration::from_secs(600)),
        agents: map(&[("queue", "cuda"), ("tier", "2")]),
        depends_on: vec!["build".into()],
        retry: RetryPolicy { count: 2, on: vec![RetryOn::Lost, RetryOn::Failed, RetryOn::TimedOut] },
        concurrency: Some(Concurrency { group: "deploy".into(), cancel_in_progress: true }),
        gpu: GpuRequirements {
            count: 2,
            memory: Some(Constraint { op: CmpOp::Ge, value: Bytes(40 << 30) }),
            compute_capability: Some(Constraint { op: CmpOp::Ge, value: ComputeCapability { major: 8, minor: 0 } }),
            model: Some("H100*".into()),
            driver: Some(Constraint { op: CmpOp::Ge, value: Version::new(vec![535]) }),
            cuda: Some(Constraint { op: CmpOp::Ge, value: Version::new(vec![12, 1]) }),
            mig_profile: Some("1g.10gb".into()),
        },
        resources: Resources { memory: Some(Bytes(8 << 30)), cpu_millis: Some(1500), pids: Some(512) },
        network: NetworkMode::None,
        sandbox: SandboxMode::None,
        image: Some("nvcr.io/nvidia/pytorch:24.05-py3".into()),
        secrets: vec!["HF_TOKEN".into()],
        encrypted_secrets: Default::default(),
        environment: None,
        cache: vec![".cache/pip".into(), "target".into()],
        artifacts: Default::default(),
        artifacts_from: Vec::new(),
        test_reports: Vec::new(),
        soft_fail: Default::default(),
        allow_dependency_failure: false,
        matrix: None,
        condition: None,
        skipped_by_condition: false,
    };
    assert_eq!(p.steps[1], want);
}

#[test]
fn retry_shorthand_and_defaults() {
    let p = ok("steps:\n  - command: a\n    retry: 2\n  - command: b\n    retry: {count: 3}\n  - command: c\n    retry: {count: 1, on: failed}\n  - command: d\n");
    assert_eq!(p.steps[0].retry, RetryPolicy { count: 2, on: vec![RetryOn::Lost] });
    assert_eq!(p.steps[1].retry, RetryPolicy { count: 3, on: vec![RetryOn::Lost] });
    assert_eq!(p.steps[2].retry, RetryPolicy { count: 1, on: vec![RetryOn::Failed] });
    assert_eq!(p.steps[3].retry, RetryPolicy::default());
}

#[test]
fn concurrency_shorthand() {
    let p = ok("steps:\n  - command: a\n    concurrency: deploy\n");
    assert_eq!(p.steps[0].concurrency, Some(Concurrency { group: "deploy".into(), cancel_in_progress: false }));
}

#[test]
fn gpu_without_gpus_means_one() {
    let p = ok("steps:\n  - command: a\n    gpu: {model: A100}\n  - command: b\n    gpus: 4\n  - command: c\n    gpus: 0\n  - command: d\n    gpus: 3\n    gpu: {memory: 80GB}\n");
    assert_eq!(p.steps[0].gpu.count, 1);
    assert_eq!(p.steps[0].gpu.model.as_deref(), Some("A100"));
    assert_eq!(p.steps[1].gpu, GpuRequirements { count: 4, ..Default::default() });
    assert_eq!(p.steps[2].gpu, GpuRequirements::default());
    assert_eq!(p.steps[3].gpu.count, 3);
    assert_eq!(p.steps[3].gpu.memory, Some(Constraint { op: CmpOp::Ge, value: Bytes(80_000_000_000) }));
}

#[test]
fn constraint_operators() {
    let p = ok("steps:\n  - command: a\n    gpu: {memory: \"<= 24GiB\", compute_capability: \"==9.0\", driver: \">535.104.05\", cuda: \"<12.4\"}\n");
    let g = &p.steps[0].gpu;
    assert_eq!(g.memory, Some(Constraint { op: CmpOp::Le, value: Bytes(24 << 30) }));
    assert_eq!(
        g.compute_capability,
        Some(Constraint { op: CmpOp::Eq, value: ComputeCapability { major: 9, minor: 0 } })
    );
    assert_eq!(g.driver, Some(Constraint { op: CmpOp::Gt, value: Version::new(vec![535, 104, 5]) }));
    assert_eq!(g.cuda, Some(Constraint { op: CmpOp::Lt, value: Version::new(vec![12, 4]) }));
}

#[test]
fn command_may_be_a_block_scalar() {
    let p = ok("steps:\n  - command: |\n      set -e\n      make\n");
    assert_eq!(p.steps[0].command, ["set -e\nmake\n"]);
}

#[test]
fn anchors_aliases_and_merge_keys() {
    let yaml = "\
steps:
  - &base
    key: one
    command: make
    timeout: 10m
    gpus: 1
  - <<: *base
    key: two
    depends_on: [one]
";
    let p = ok(yaml);
    assert_eq!(p.steps[1].key, "two");
    assert_eq!(p.steps[1].timeout, Some(Duration::from_secs(600)));
    assert_eq!(p.steps[1].gpu.count, 1);
    assert_eq!(p.steps[1].command, ["make"]);
}

#[test]
fn hello_example_runs_without_gpus() {
    let path = repo_file("examples/hello.gpuci.yml");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let p = match parse("examples/hello.gpuci.yml", &text) {
        Ok(p) => p,
        Err(e) => panic!("{e}"),
    };
    let keys: Vec<&str> = p.steps.iter().map(|s| s.key.as_str()).collect();
    assert_eq!(keys, ["build", "test", "lint", "report"]);
    assert!(p.steps.iter().all(|s| s.gpu.count == 0 && s.image.is_none()));
    assert_eq!(p.steps[3].depends_on, ["test", "lint"]);
}

#[test]
fn gpu_example_parses() {
    let path = repo_file("examples/gpu.gpuci.yml");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let p = match parse("examples/gpu.gpuci.yml", &text) {
        Ok(p) => p,
        Err(e) => panic!("{e}"),
    };
    let counts: Vec<u32> = p.steps.iter().map(|s| s.gpu.count).collect();
    assert_eq!(counts, [1, 1, 2, 1]);
    assert_eq!(p.steps[3].gpu.mig_profile.as_deref(), Some("1g.10gb"));
}

#[test]
fn fixture_with_every_field_parses() {
    let path = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/pipelines/full.gpuci.yml");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    if let Err(e) = parse("full.gpuci.yml", &text) {
        panic!("{e}");
    }
}

#[test]
fn secrets_may_be_a_map_of_encrypted_values_and_names_set_on_the_coordinator() {
    let sealed = "gpuci:v1:0123456789ab:YWdlLWVuY3J5cHRpb24ub3JnL3YxCg==";
    let src =
        format!("steps:\n  - command: x\n    secrets:\n      CODECOV_TOKEN: \"{sealed}\"\n      HF_TOKEN: null\n");
    let p = gpuci_core::pipeline::parse("ci.yml", &src).expect("parses");
    assert_eq!(p.steps[0].secrets, vec!["HF_TOKEN".to_string()]);
    assert_eq!(p.steps[0].encrypted_secrets.get("CODECOV_TOKEN").map(String::as_str), Some(sealed));
    let bad = "steps:\n  - command: x\n    secrets:\n      CODECOV_TOKEN: the-token-in-clear\n";
    let e = gpuci_core::pipeline::parse("ci.yml", bad).expect_err("a value in clear");
    let text = e.to_string();
    assert!(text.contains("ci.yml:4:22") && text.contains("steps[0].secrets.CODECOV_TOKEN"), "{text}");
    assert!(text.contains("expected a value from `gpuci secret encrypt`"), "{text}");
    assert!(!text.contains("the-token-in-clear"), "the error repeats a value in clear: {text}");
}

#[test]
fn a_secret_value_pasted_under_secrets_is_never_repeated_in_the_error() {
    for (src, value) in [
        ("steps:\n  - command: x\n    secrets:\n      HF_TOKEN: 98765432109876\n", "98765432109876"),
        ("steps:\n  - command: x\n    secrets:\n      HF_TOKEN: true\n", "true"),
        ("steps:\n  - command: x\n    secrets: [\"HF_TOKEN=hf_c13arvalue\"]\n", "hf_c13arvalue"),
    ] {
        let e = gpuci_core::pipeline::parse("ci.yml", src).expect_err("invalid").to_string();
        assert!(!e.contains(value), "{e}");
        assert!(e.contains("HF_TOKEN"), "{e}");
    }
}
