//! The dashboard in a real headless Chromium (Debian's `chromium` and `chromium-driver`,
//! driven over WebDriver), and `/metrics` checked by `promtool`. Each test asserts what a
//! person would see: log lines arriving without a reload, a job cancelled from its page, a
//! quarantined GPU released, a private job refused to someone not signed in. Screenshots of
//! every main page go to `<target>/tmp/dashboard-screenshots/` (kept as test artefacts).
//!
//! With `CI=true` a missing Chromium, chromedriver or promtool fails the test; elsewhere the
//! test says so and passes without running (`./scripts/test` installs them).
//!
//! One test binary (each links the whole of gpuci): this file is the harness (the browser, the
//! ticking job), the modules hold the tests by area.

#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

mod access;
mod builds;
#[path = "../common/mod.rs"]
mod common;
mod harness;
mod metrics;
mod pages;

use common::*;
use fantoccini::{Client, Locator};
use gpuci_core::job::JobState;
use gpuci_core::quantity::Bytes;
use harness::*;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
