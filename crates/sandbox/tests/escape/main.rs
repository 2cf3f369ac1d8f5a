//! Escape attempts: each must fail, with the reason in the assertion message.
//!
//! They need root, bubblewrap and writable cgroups. When something is missing they skip with a
//! message, except under `CI=true`, where a skipped security test would be a silent hole: there
//! they fail.
#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

use std::collections::BTreeMap;
use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use gpuci_core::quantity::Bytes;
use gpuci_sandbox::{detect, CgroupUse, ExitInfo, Isolation, JobUser, Resources, Sandbox, SandboxSpec};
use tokio::io::AsyncReadExt;

mod helpers;
use helpers::*;

mod basic;
mod hostile;
mod ready;
mod warm;
