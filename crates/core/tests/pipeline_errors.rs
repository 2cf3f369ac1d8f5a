//! Every error path of the `.gpuci.yml` parser. The exact texts are the product's UX: change
//! them on purpose, not by accident.
#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

use gpuci_core::pipeline::{parse, PipelineErrors};

/// The errors for `yaml`, as printed.
fn errors(yaml: &str) -> Vec<String> {
    match parse("ci.yml", yaml) {
        Ok(p) => panic!("expected errors, parsed {p:#?}"),
        Err(e) => e.0.iter().map(ToString::to_string).collect(),
    }
}

/// The single error for `yaml`.
fn error(yaml: &str) -> String {
    let errs = errors(yaml);
    assert_eq!(errs.len(), 1, "expected one error, got {errs:#?}");
    errs.into_iter().next().unwrap_or_default()
}

#[test]
fn syntax_error_names_the_parsers_position() {
    let e = error("steps:\n  - command: [a, b\n  - key: x\n");
    assert!(e.starts_with("ci.yml:"), "{e}");
    assert!(e.contains(": (syntax): "), "{e}");
}

#[test]
fn syntax_error_tab_indentation() {
    let e = error("steps:\n\t- command: make\n");
    assert!(e.starts_with("ci.yml:2:2: (syntax): tabs disallowed"), "{e}");
}

#[test]
fn unknown_keys_suggest_the_closest() {
    let yaml = "\
steps:
  - comand: make
    depend_on: [x]
    timout: 10m
    gpu: {memroy: \">=40GiB\"}
";
    assert_eq!(
        errors(yaml),
        [
            "ci.yml:2:5: steps[0].comand: unknown key `comand`, did you mean `command`?",
            "ci.yml:3:5: steps[0].depend_on: unknown key `depend_on`, did you mean `depends_on`?",
            "ci.yml:4:5: steps[0].timout: unknown key `timout`, did you mean `timeout`?",
            "ci.yml:5:11: steps[0].gpu.memroy: unknown key `memroy`, did you mean `memory`?",
            // `comand` is not `command`, so the step has none.
            "ci.yml:2:5: steps[0].command: missing: every step needs a `command`",
        ]
        .to_vec()
        .sorted_by_position()
    );
}

#[test]
fn unknown_key_without_a_close_match_lists_the_keys() {
    assert_eq!(
        error("steps:\n  - command: make\n    frobnicate: 1\n"),
        "ci.yml:3:5: steps[0].frobnicate: unknown key `frobnicate`; expected one of: key, label, command, env, timeout, \
         queue_timeout, agents, depends_on, retry, concurrency, gpus, gpu, resources, network, sandbox, image, secrets, environment, cache, \
         artifacts, artifacts_from, test_reports, matrix, soft_fail, allow_dependency_failure, if"
    );
}

#[test]
fn unknown_top_level_key() {
    assert_eq!(
        error("step:\n  - command: make\nsteps:\n  - command: make\n"),
        "ci.yml:1:1: step: unknown key `step`, did you mean `steps`?"
    );
}

#[test]
fn wrong_types() {
    assert_eq!(
        error("steps:\n  - command: {run: make}\n"),
        "ci.yml:2:14: steps[0].command: expected a string or a list of strings, got a map"
    );
    assert_eq!(
        error("steps:\n  - command: [make, 3]\n"),
        "ci.yml:2:21: steps[0].command[1]: expected a string, got a number (3)"
    );
    assert_eq!(
        error("steps:\n  - command: make\n    label: [a]\n"),
        "ci.yml:3:12: steps[0].label: expected a string, got a list"
    );
    assert_eq!(
        error("steps:\n  - command: make\n    env: [A]\n"),
        "ci.yml:3:10: steps[0].env: expected a map of environment variables, got a list"
    );
    assert_eq!(error("steps: make\n"), "ci.yml:1:8: steps: expected a list of steps, got a string (\"make\")");
    assert_eq!(
        error("steps:\n  - make\n"),
        "ci.yml:2:5: steps[0]: expected a map of step settings, got a string (\"make\")"
    );
    assert_eq!(
        error("steps:\n  - command: make\n    concurrency: {group: d, cancel_in_progress: yes}\n"),
        "ci.yml:3:49: steps[0].concurrency.cancel_in_progress: expected true or false, got a string (\"yes\")"
    );
    assert_eq!(
        error("steps:\n  - command: make\n    gpu: 2\n"),
        "ci.yml:3:10: steps[0].gpu: expected a map of GPU properties, got a number (2); for a GPU count write `gpus: 2`"
    );
}

#[test]
fn root_must_be_a_map_or_a_list() {
    assert_eq!(error(""), "ci.yml:1:1: (root): the file is empty; expected a map with `steps:` or a list of steps");
    assert_eq!(
        error("# nothing\n"),
        "ci.yml:1:1: (root): the file is empty; expected a map with `steps:` or a list of steps"
    );
    assert_eq!(
        error("hello"),
        "ci.yml:1:1: (root): expected a map with `steps:` or a list of steps, got a string (\"hello\")"
    );
    assert_eq!(error("env: {A: b}\n"), "ci.yml:1:1: steps: missing: a pipeline needs `steps:`, a list of steps");
}

#[test]
fn missing_command() {
    assert_eq!(
        error("steps:\n  - command: make\n  - key: test\n    label: Test\n"),
        "ci.yml:3:5: steps[1].command: missing: every step needs a `command`"
    );
}

#[test]
fn empty_commands() {
    assert_eq!(error("steps:\n  - command: \"\"\n"), "ci.yml:2:14: steps[0].command: a command must not be empty");
    assert_eq!(
        error("steps:\n  - command: []\n"),
        "ci.yml:2:14: steps[0].command: expected at least one command, got an empty list"
    );
    assert_eq!(
        error("steps:\n  - command: [make, \"  \"]\n"),
        "ci.yml:2:21: steps[0].command[1]: a command must not be empty"
    );
}

#[test]
fn empty_steps() {
    assert_eq!(error("steps: []\n"), "ci.yml:1:8: steps: expected at least one step, got an empty list");
    assert_eq!(error("steps:\n"), "ci.yml:1:1: steps: expected a list of steps, got null");
}

#[test]
fn duplicate_step_keys_name_the_first() {
    assert_eq!(
        error("steps:\n  - key: build\n    command: a\n  - key: build\n    command: b\n"),
        "ci.yml:4:10: steps[1].key: duplicate step key `build` (first used by steps[0] at 2:10)"
    );
}

#[test]
fn explicit_key_colliding_with_a_default_name() {
    assert_eq!(
        error("steps:\n  - command: a\n  - key: step-1\n    command: b\n"),
        "ci.yml:3:10: steps[1].key: duplicate step key `step-1` (first used by steps[0], which has no key and is named `step-1` by default)"
    );
}

#[test]
fn duplicate_yaml_keys() {
    assert_eq!(
        error("steps:\n  - command: a\n    timeout: 1m\n    timeout: 2m\n"),
        "ci.yml:4:5: steps[0].timeout: duplicate key `timeout` (first set at 3:5)"
    );
    assert_eq!(
        error("env:\n  A: 1\n  A: 2\nsteps:\n  - command: a\n"),
        "ci.yml:3:3: env.A: duplicate key `A` (first set at 2:3)"
    );
}

#[test]
fn depends_on_unknown_step_suggests() {
    assert_eq!(
        error("steps:\n  - key: build\n    command: a\n  - key: test\n    command: b\n    depends_on: [biuld]\n"),
        "ci.yml:6:18: steps[1].depends_on[0]: unknown step `biuld`, did you mean `build`?"
    );
    assert_eq!(
        error("steps:\n  - key: build\n    command: a\n  - key: test\n    command: b\n    depends_on: deploy\n"),
        "ci.yml:6:17: steps[1].depends_on: unknown step `deploy` (steps are: build, test)"
    );
}

#[test]
fn self_dependency() {
    assert_eq!(
        error("steps:\n  - key: a\n    command: x\n    depends_on: a\n"),
        "ci.yml:4:17: steps[0].depends_on: step `a` cannot depend on itself"
    );
}

#[test]
fn cycles_are_named() {
    let yaml = "\
steps:
  - key: a
    command: x
    depends_on: [c]
  - key: b
    command: x
    depends_on: [a]
  - key: c
    command: x
    depends_on: [b]
";
    assert_eq!(error(yaml), "ci.yml:4:18: steps[0].depends_on[0]: dependency cycle: a -> c -> b -> a");

    let two = "steps:\n  - {key: a, command: x, depends_on: b}\n  - {key: b, command: x, depends_on: a}\n";
    assert_eq!(error(two), "ci.yml:2:38: steps[0].depends_on: dependency cycle: a -> b -> a");
}

/// An outsider's file: a chain of 1,000 steps whose second half each also depend on the
/// first 86 — 43,000 back edges, each a cycle of hundreds of steps. It made 43,000 errors and
/// 244 MB of text (and held the coordinator's scheduler half a minute per upload); a handful
/// of cycles, each named by its ends, is what a user needs.
#[test]
fn a_file_of_countless_long_cycles_gets_a_few_short_errors() {
    let mut yaml = String::from("steps:\n");
    for i in 0..1000 {
        let mut deps: Vec<String> = (i < 999).then(|| format!("k{}", i + 1)).into_iter().collect();
        if i >= 500 {
            deps.extend((0..86).map(|j| format!("k{j}")));
        }
        yaml.push_str(&format!("  - {{key: k{i}, command: x, depends_on: [{}]}}\n", deps.join(", ")));
    }
    let errs = errors(&yaml);
    assert!(
        (1..=8).contains(&errs.len()),
        "{} errors: {:?}",
        errs.len(),
        errs.iter().map(|e| e.chars().take(160).collect::<String>()).collect::<Vec<_>>()
    );
    let text: usize = errs.iter().map(String::len).sum();
    assert!(text < 4096, "{text} bytes of errors: {:?}", &errs[..1]);
    assert!(errs[0].contains("dependency cycle (") && errs[0].contains(" -> … -> "), "{}", errs[0]);
}

#[test]
fn durations() {
    assert_eq!(
        error("steps:\n  - command: a\n    timeout: ten minutes\n"),
        "ci.yml:3:14: steps[0].timeout: expected a duration like 90s, 30m, 1h30m, got \"ten minutes\""
    );
    assert_eq!(
        error("steps:\n  - command: a\n    queue_timeout: 30\n"),
        "ci.yml:3:20: steps[0].queue_timeout: expected a duration like 90s, 30m, 1h30m, got 30 (add a unit: ms, s, m, h or d)"
    );
    assert_eq!(
        error("steps:\n  - command: a\n    timeout: 0s\n"),
        "ci.yml:3:14: steps[0].timeout: must be longer than 0s"
    );
}

#[test]
fn gpu_constraints() {
    let yaml = "\
steps:
  - command: a
    gpu:
      memory: \">=lots\"
      compute_capability: eight
      driver: \">=535.x\"
      cuda: twelve
";
    assert_eq!(
        errors(yaml),
        [
            "ci.yml:4:15: steps[0].gpu.memory: expected a memory constraint like \">=40GiB\", got \">=lots\"",
            "ci.yml:5:27: steps[0].gpu.compute_capability: expected a compute capability constraint like \">=8.0\", got \"eight\"",
            "ci.yml:6:15: steps[0].gpu.driver: expected a driver version constraint like \">=535\" or \">=535.104\", got \">=535.x\"",
            "ci.yml:7:13: steps[0].gpu.cuda: expected a CUDA version constraint like \">=12.1\", got \"twelve\"",
        ]
    );
    assert_eq!(
        error("steps:\n  - command: a\n    gpu: {memory: 40}\n"),
        "ci.yml:3:19: steps[0].gpu.memory: expected a memory constraint like \">=40GiB\", got \"40\""
    );
}

#[test]
fn gpu_counts() {
    assert_eq!(
        error("steps:\n  - command: a\n    gpus: -1\n"),
        "ci.yml:3:11: steps[0].gpus: expected a GPU count from 0 to 64, got -1"
    );
    assert_eq!(
        error("steps:\n  - command: a\n    gpus: 100\n"),
        "ci.yml:3:11: steps[0].gpus: expected a GPU count from 0 to 64, got 100"
    );
    assert_eq!(
        error("steps:\n  - command: a\n    gpus: two\n"),
        "ci.yml:3:11: steps[0].gpus: expected a GPU count from 0 to 64, got a string (\"two\")"
    );
    assert_eq!(
        error("steps:\n  - command: a\n    gpus: 0\n    gpu: {model: A100}\n"),
        "ci.yml:3:11: steps[0].gpus: is 0, but `gpu:` asks for GPU properties; remove one of them"
    );
}

#[test]
fn retry_errors() {
    assert_eq!(
        error("steps:\n  - command: a\n    retry: 11\n"),
        "ci.yml:3:12: steps[0].retry: expected a retry count from 0 to 10, got 11"
    );
    assert_eq!(
        error("steps:\n  - command: a\n    retry: {count: 2, on: [lost, crashed]}\n"),
        "ci.yml:3:34: steps[0].retry.on[1]: expected one of failed, timed_out, lost, got \"crashed\""
    );
    assert_eq!(
        error("steps:\n  - command: a\n    retry: {count: 2, on: [faild]}\n"),
        "ci.yml:3:28: steps[0].retry.on[0]: expected one of failed, timed_out, lost, got \"faild\", did you mean `failed`?"
    );
    assert_eq!(
        error("steps:\n  - command: a\n    retry: {on: [lost]}\n"),
        "ci.yml:3:12: steps[0].retry.count: missing: say how many times to retry, e.g. `count: 2`"
    );
    assert_eq!(
        error("steps:\n  - command: a\n    retry: always\n"),
        "ci.yml:3:12: steps[0].retry: expected a retry count or a map like {count: 2, on: [lost]}, got a string (\"always\")"
    );
}

#[test]
fn enums_and_lists() {
    assert_eq!(
        error("steps:\n  - command: a\n    network: host\n"),
        "ci.yml:3:14: steps[0].network: expected one of default, none, got a string (\"host\")"
    );
    assert_eq!(
        error("steps:\n  - command: a\n    secrets: [HF_TOKEN, hf-token]\n"),
        "ci.yml:3:25: steps[0].secrets[1]: invalid secret name \"hf-token\": expected an environment variable name like HF_TOKEN"
    );
    assert_eq!(
        errors("steps:\n  - command: a\n    cache: [/root/.cache, ../x, ~/.cache]\n"),
        [
            "ci.yml:3:13: steps[0].cache[0]: cache paths are relative to the workspace; absolute paths are not allowed",
            "ci.yml:3:27: steps[0].cache[1]: cache paths must stay inside the workspace; `..` is not allowed",
            "ci.yml:3:33: steps[0].cache[2]: cache paths are relative to the workspace; `~` is not expanded",
        ]
    );
}

#[test]
fn resources() {
    assert_eq!(
        errors("steps:\n  - command: a\n    resources: {memory: 8, cpus: 0, pids: 0}\n"),
        [
            "ci.yml:3:25: steps[0].resources.memory: expected a size like 8GiB or 512MiB, got \"8\"",
            "ci.yml:3:34: steps[0].resources.cpus: expected a number of CPUs greater than 0, like 2 or 1.5, got a number (0)",
            "ci.yml:3:43: steps[0].resources.pids: expected a process limit from 1 to 4294967295, got 0",
        ]
    );
}

#[test]
fn invalid_step_key() {
    assert_eq!(
        error("steps:\n  - key: \"build it\"\n    command: a\n"),
        "ci.yml:2:10: steps[0].key: invalid step key \"build it\": use letters, digits, `-` and `_`"
    );
}

#[test]
fn env_values_and_names() {
    assert_eq!(
        errors("env:\n  1A: x\n  B: {c: d}\n  C: ~\nsteps:\n  - command: a\n"),
        [
            "ci.yml:2:3: env.1A: invalid variable name \"1A\": expected letters, digits and `_`, not starting with a digit",
            "ci.yml:3:6: env.B: expected a string, number or boolean, got a map",
            "ci.yml:4:6: env.C: expected a string, number or boolean, got null",
        ]
    );
}

#[test]
fn all_errors_in_one_pass_sorted_by_position() {
    let yaml = "\
steps:
  - key: build
    command: make
    timeout: soon
  - key: test
    comand: make test
    depends_on: [buld]
    gpus: 100
";
    let errs = errors(yaml);
    assert_eq!(errs.len(), 5, "{errs:#?}");
    let positions: Vec<(usize, usize)> = match parse("ci.yml", yaml) {
        Err(PipelineErrors(e)) => e.iter().map(|e| (e.line, e.column)).collect(),
        Ok(_) => Vec::new(),
    };
    let mut sorted = positions.clone();
    sorted.sort();
    assert_eq!(positions, sorted);
}

#[test]
fn multiple_documents_are_rejected() {
    assert_eq!(
        error("steps:\n  - command: a\n---\nsteps:\n  - command: b\n"),
        "ci.yml:3:1: (root): found a second YAML document; a pipeline file holds exactly one"
    );
}

#[test]
fn tags_are_rejected_except_str() {
    let e = error("steps:\n  - command: !shell make\n");
    assert!(e.starts_with("ci.yml:2:21: (syntax): YAML tags are not supported here"), "{e}");
    assert!(parse("ci.yml", "steps:\n  - command: a\n    label: !!str 12\n").is_ok());
}

#[test]
fn recursive_alias_and_alias_bombs() {
    let e = error("a: &a [*a]\nsteps: []\n");
    assert!(e.contains("(syntax)"), "{e}");
    let mut bomb = String::from("a0: &a0 [x, x, x, x, x, x, x, x, x, x]\n");
    for i in 1..10 {
        let p = i - 1;
        bomb.push_str(&format!("a{i}: &a{i} [*a{p}, *a{p}, *a{p}, *a{p}, *a{p}, *a{p}, *a{p}, *a{p}, *a{p}, *a{p}]\n"));
    }
    let e = error(&bomb);
    assert!(e.contains("more than 200000 nodes"), "{e}");
}

#[test]
fn deep_nesting_is_an_error_not_a_crash() {
    let deep = format!("steps: {}{}\n", "[".repeat(10_000), "]".repeat(10_000));
    let e = error(&deep);
    // yaml-rust2 has its own, lower, limit; either is fine, as long as it is an error.
    assert!(e.contains("nested more than 64 levels deep") || e.contains("recursion limit exceeded"), "{e}");
    let deep = format!("steps: {}{}\n", "[".repeat(70), "]".repeat(70));
    assert!(error(&deep).contains("nested more than 64 levels deep"));
}

#[test]
fn bad_merge_key() {
    assert_eq!(
        error("steps:\n  - command: a\n    <<: 3\n"),
        "ci.yml:3:5: steps[0].<<: a merge key takes a map or a list of maps (`<<: *defaults`), got a number (3)"
    );
}

trait SortedByPosition {
    fn sorted_by_position(self) -> Self;
}

impl SortedByPosition for Vec<&str> {
    /// Sort printed errors by their `line:column`, as the parser does.
    fn sorted_by_position(mut self) -> Self {
        let pos = |s: &&str| -> (usize, usize) {
            let mut it = s.split(':').skip(1).map(|n| n.parse().unwrap_or(0));
            (it.next().unwrap_or(0), it.next().unwrap_or(0))
        };
        self.sort_by_key(pos);
        self
    }
}

/// The whole output for a file with many mistakes, as a person reads it.
#[test]
fn many_mistakes_snapshot() {
    let dir = std::path::PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/pipelines");
    let text = std::fs::read_to_string(dir.join("bad.gpuci.yml")).unwrap_or_default();
    let got = match parse("bad.gpuci.yml", &text) {
        Ok(_) => panic!("bad.gpuci.yml parsed"),
        Err(e) => format!("{e}\n"),
    };
    let expected_path = dir.join("bad.errors.txt");
    if std::env::var_os("GPUCI_BLESS").is_some() {
        std::fs::write(&expected_path, &got).unwrap_or_else(|e| panic!("{e}"));
        return;
    }
    let expected = std::fs::read_to_string(&expected_path).unwrap_or_default();
    assert!(
        got == expected,
        "error output changed; if that is intended, regenerate with\n  \
         GPUCI_BLESS=1 cargo test -p gpuci-core --test pipeline_errors\n--- got:\n{got}--- expected:\n{expected}"
    );
}

/// Outsider finding (issue 9): a NUL byte in an `env:` value became extra bubblewrap arguments
/// (its `--args` file is NUL-separated): `--cap-add ALL`, host binds, uid 0. No command line or
/// environment variable can hold one, so none is accepted anywhere in a pipeline's text.
#[test]
fn a_nul_byte_is_refused_in_env_values_commands_and_tags() {
    assert_eq!(
        errors(
            "env:\n  A: \"x\\0--cap-add\\0ALL\"\nsteps:\n  - command: \"echo \\0 hi\"\n    env: {B: \"\\0\"}\n    agents: {q: \"a\\0b\"}\n  - command: [ok, \"x\\0\"]\n"
        ),
        [
            "ci.yml:2:6: env.A: contains a NUL byte (\\0), which no command line or environment variable can hold",
            "ci.yml:4:14: steps[0].command: contains a NUL byte (\\0), which no command line or environment variable can hold",
            "ci.yml:5:14: steps[0].env.B: contains a NUL byte (\\0), which no command line or environment variable can hold",
            "ci.yml:6:17: steps[0].agents.q: contains a NUL byte (\\0), which no command line or environment variable can hold",
            "ci.yml:7:19: steps[1].command[1]: contains a NUL byte (\\0), which no command line or environment variable can hold",
        ]
    );
}

/// Outsider round 2: a tag name with a NUL in it, and a raw NUL byte in the file (the YAML
/// reader stopped there and the rest of the file was dropped unseen).
#[test]
fn a_nul_byte_in_a_tag_name_or_raw_in_the_file_is_refused() {
    assert_eq!(
        errors("steps:\n  - command: a\n    agents: {\"q\\0x\": a}\n"),
        ["ci.yml:3:14: steps[0].agents.q\0x: contains a NUL byte (\\0), which no command line or environment variable can hold"]
    );
    assert_eq!(
        errors("steps:\n  - command: echo visible\0\n  - command: echo hidden-step\n"),
        ["ci.yml:2:26: (syntax): the file contains a NUL byte; a pipeline file is text"]
    );
}

#[test]
fn an_env_too_large_for_every_job_to_carry_is_refused_at_the_map() {
    let big = "x".repeat(33 * 1024);
    let e = error(&format!("env:\n  BIG: {big}\nsteps:\n  - command: echo\n"));
    assert!(e.starts_with("ci.yml:2:3: env: ") && e.contains("more than the 32768"), "{}", &e[..120.min(e.len())]);
    let e = error(&format!("steps:\n  - command: echo\n    env:\n      BIG: {big}\n"));
    assert!(e.contains("steps[0].env: ") && e.contains("bytes of variables"), "{}", &e[..120.min(e.len())]);
}
