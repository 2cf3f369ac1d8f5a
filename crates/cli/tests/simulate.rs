//! `gpuci simulate`: the binary reads a server config and a trace, prints the three policies'
//! figures (or JSON), and names the file and place of bad input with exit code 2.
#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_gpuci");

fn traces() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../traces")
}

fn simulate(config: &Path, trace: &Path, extra: &[&str]) -> std::process::Output {
    Command::new(BIN)
        .arg("simulate")
        .arg("--config")
        .arg(config)
        .arg("--trace")
        .arg(trace)
        .args(extra)
        .output()
        .expect("run gpuci simulate")
}

#[test]
fn the_tiny_trace_gives_the_figures_worked_out_by_hand() {
    let (config, trace) = (traces().join("tiny-fleets.toml"), traces().join("tiny.csv"));
    let out = simulate(&config, &trace, &["--json"]);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let report: Value = serde_json::from_slice(&out.stdout).expect("JSON on stdout");
    assert_eq!(report["jobs"], 3);
    let runs = report["runs"].as_array().expect("runs");
    let by_policy = |p: &str| runs.iter().find(|r| r["policy"] == p).unwrap_or_else(|| panic!("no {p}: {report}"));
    // gpuci: m1 0..450 s and m2 10..450 s at $3.60/h (crates/simulate/tests/hand_checked.rs).
    let gpuci = &by_policy("gpuci")["total"];
    assert!((gpuci["paid_gpu_hours"].as_f64().unwrap() - 890.0 / 3600.0).abs() < 1e-9, "{gpuci}");
    assert!((gpuci["cost_usd"].as_f64().unwrap() - 0.89).abs() < 1e-9, "{gpuci}");
    assert!((gpuci["lower_bound_gpu_hours"].as_f64().unwrap() - 350.0 / 3600.0).abs() < 1e-9, "{gpuci}");
    // Always on: two machines for the whole 450 s.
    let always = &by_policy("always-on")["total"];
    assert!((always["paid_gpu_hours"].as_f64().unwrap() - 900.0 / 3600.0).abs() < 1e-9, "{always}");
    assert!(by_policy("fixed-idle-5m").is_object());

    // The table for people, one policy.
    let out = simulate(&config, &trace, &["--policy", "gpuci"]);
    assert_eq!(out.status.code(), Some(0));
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(table.contains("policy gpuci") && !table.contains("policy always-on"), "{table}");
}

#[test]
fn bad_input_names_the_file_and_place() {
    let dir = tempfile::tempdir().expect("tempdir");
    let trace = dir.path().join("jobs.csv");
    std::fs::write(
        &trace,
        "job_id,submit_s,duration_s,pool,gpus,group,cancel_in_progress\na,0,100,t4,1,,0\nb,x,1,t4,1,,0\n",
    )
    .expect("write");
    let out = simulate(&traces().join("tiny-fleets.toml"), &trace, &[]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("jobs.csv:3") && err.contains("submit_s"), "{err}");

    let config = dir.path().join("server.toml");
    std::fs::write(&config, "[[fleet]]\nname = \"t4\"\nprovider = \"exec\"\nmax = \"many\"\n").expect("write");
    let out = simulate(&config, &traces().join("tiny.csv"), &[]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("server.toml:4:") && err.contains("max"), "{err}");

    let out = simulate(&config, &dir.path().join("missing.csv"), &[]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("missing.csv"));
}
