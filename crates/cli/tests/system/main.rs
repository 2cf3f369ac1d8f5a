//! Whole-system tests: a real coordinator process and real agent processes on 127.0.0.1.
#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

#[path = "../common/mod.rs"]
mod common;

use common::*;
use gpuci_core::job::JobState;
use std::time::Duration;

const T: Duration = Duration::from_secs(60);

mod helpers;
use helpers::*;

mod isolation;
mod lifecycle;
mod pipelines;
mod secrets;
