//! The `gpuci` command line as a user runs it.
#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

mod common;

use common::BIN;
use std::process::Command;

fn gpuci(args: &[&str]) -> std::process::Output {
    Command::new(BIN).args(args).output().expect("run gpuci")
}

#[test]
fn run_executes_the_example_pipeline_and_exits_with_its_result() {
    let dir = common::tempdir();
    let file = dir.path().join("ok.yml");
    std::fs::write(
        &file,
        "steps:\n  - key: a\n    command: echo alpha\n  - key: b\n    depends_on: a\n    command: echo beta\n",
    )
    .unwrap();
    let out = gpuci(&["run", file.to_str().unwrap(), "--isolation", common::isolation()]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "stdout:\n{stdout}\nstderr:\n{stderr}");
    assert!(stdout.contains("a │ alpha") && stdout.contains("b │ beta"), "{stdout}");
    assert!(stderr.contains("✓ a succeeded") && stderr.contains("pipeline succeeded"), "{stderr}");

    std::fs::write(&file, "steps:\n  - key: a\n    command: exit 4\n").unwrap();
    let out = gpuci(&["run", file.to_str().unwrap(), "--isolation", common::isolation()]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("exited with code 4"));
}

#[test]
fn run_rejects_a_broken_pipeline_with_file_line_column_and_exit_2() {
    let dir = common::tempdir();
    let file = dir.path().join("bad.yml");
    std::fs::write(&file, "steps:\n  - key: a\n    comand: echo\n").unwrap();
    let out = gpuci(&["run", file.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("bad.yml:3:5: steps[0].comand: unknown key `comand`, did you mean `command`?"), "{stderr}");
    let out = gpuci(&["run", "/nonexistent/x.yml"]);
    assert_eq!(out.status.code(), Some(2));
}

#[test]
fn validate_and_schema() {
    let root =
        format!("{}/../../examples", std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    let out = gpuci(&["validate", &format!("{root}/hello.gpuci.yml"), &format!("{root}/gpu.gpuci.yml")]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let out = gpuci(&["schema"]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("schema is JSON");
    assert!(v["definitions"]["RawPipeline"]["properties"]["steps"].is_object(), "{v}");
}

#[test]
fn doctor_on_a_host_without_gpus_says_so_and_checks_the_rest() {
    let out = gpuci(&["doctor", "--json"]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("doctor --json");
    let checks = v["checks"].as_array().unwrap();
    assert!(checks.iter().any(|c| c["name"] == "sandbox.bubblewrap"));
    if !std::path::Path::new("/dev/nvidiactl").exists() {
        let inv = checks.iter().find(|c| c["name"] == "gpu.inventory").unwrap();
        assert_eq!(inv["status"], "skip", "{inv}");
    }
    assert_eq!(out.status.success(), v["passed"].as_bool().unwrap());
}

/// Issue 26: `gpuci up --isolation none` without `--allow-unsandboxed` used to start, then
/// fail 5s later with "the local agent did not connect within 5s". It is refused at once,
/// as bad usage, naming the flag; `gpuci run` the same.
#[test]
fn isolation_none_without_allow_unsandboxed_is_refused_at_once_naming_the_flag() {
    let dir = common::tempdir();
    let data = dir.path().join("data");
    let file = dir.path().join("ok.yml");
    std::fs::write(&file, "steps:\n  - key: a\n    command: echo alpha\n").unwrap();
    let up = ["up", "--data-dir", data.to_str().unwrap(), "--listen", "127.0.0.1:0", "--isolation", "none"];
    let run = ["run", file.to_str().unwrap(), "--isolation", "none"];
    for args in [&up[..], &run[..]] {
        let out = gpuci(args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains("--allow-unsandboxed"), "{args:?}: {stderr}");
        assert!(!stderr.contains("did not connect"), "{args:?}: {stderr}");
    }
}

/// Regression (outsider attack): a standby with `--heartbeat 10s` and the default
/// `--lost-after 30s` started without a word, took over from a frozen leader, and called its
/// agents lost before they had left the frozen one: 12 running jobs ended `lost` and then ran
/// to their end. Such a standby is refused at start, saying what would work.
#[test]
fn a_standby_whose_lost_after_is_shorter_than_its_agents_take_to_follow_a_takeover_is_refused() {
    let dir = common::tempdir();
    let data = dir.path().join("standby");
    // The check comes before any connection: no database is needed to see it.
    let base = ["server", "--listen", "127.0.0.1:0", "--standby", "--database", "postgres://gpuci@127.0.0.1:1/gpuci"];
    let mut args = base.to_vec();
    args.extend(["--data-dir", data.to_str().unwrap(), "--heartbeat", "10s"]);
    let out = gpuci(&args);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(stderr.contains("--lost-after 30s is too short") && stderr.contains("45s or more"), "{stderr}");
}
