//! Fleets end to end: a real coordinator with `[[fleet]]`s whose machines are real `gpuci agent`
//! processes made by the exec provider's reference program
//! (`crates/providers/tests/exec-ref/gpuci-exec-local`, speaking docs/providers/exec.md). Jobs
//! that no agent can take make machines appear; idle machines go away; what went wrong is
//! shown on the fleet and on the waiting job.
#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

#[path = "../common/mod.rs"]
mod common;
mod harness;
mod providers;
mod restarts;
mod scaling;

use common::*;
use harness::*;
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::time::Duration;
