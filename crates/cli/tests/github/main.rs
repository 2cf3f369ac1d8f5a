//! GitHub integration, end to end: a real `gpuci server` (with a `[github]` config) and
//! `gpuci agent` (simulated GPUs, bubblewrap), against the GitHub API test server from
//! `gpuci-github-testserver`, which checks every request gpuci sends (and every response it
//! gives) against GitHub's published REST description, sends signed webhooks, and provides a
//! stand-in for the Actions runner's `run.sh` that registers with its JIT config, takes one
//! job, runs it and exits.
//!
//! One test binary (each links the whole of gpuci): this file is the harness (`Setup`, the
//! test GitHub), the modules hold the tests by area.

// A failed unwrap in a test is the test failing, with the value in the message.
#![allow(clippy::unwrap_used)]

#[path = "../common/mod.rs"]
mod common;
mod harness;
mod pipelines;
mod runners;
mod secrets;
mod standby;
mod webhooks;

use common::*;
use gpuci_core::job::JobState;
use gpuci_github_testserver::{install_fake_runner, install_runner_that_exits, Fault, FaultKind, Options, TestGitHub};
use harness::*;
use serde_json::{json, Value};
use std::path::PathBuf;
use std::time::Duration;
