//! The pipeline format, `.gpuci.yml`: typed, validated values.
//!
//! `parse` turns YAML text into a [`Pipeline`] or a list of [`PipelineError`]s, each naming
//! `file:line:column`, the field, and what was expected. `schema` publishes a JSON Schema of
//! the file format for editors. Nothing outside this module sees raw YAML.

use crate::artifacts::ArtifactSpec;
use crate::duration::Duration;
use crate::gpu::GpuRequirements;
use crate::job::RetryOn;
use crate::quantity::Bytes;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

mod parse;
pub mod schema;
pub mod upload;

pub use parse::{is_env_name, parse, PipelineError, PipelineErrors, MAX_MATRIX_JOBS, MAX_PIPELINE_JOBS};

/// The queue timeout a step gets when it names none.
pub const DEFAULT_QUEUE_TIMEOUT: Duration = Duration::from_secs(30 * 60);

/// A validated pipeline.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Pipeline {
    /// Pipeline-wide environment, merged under each step's `env`.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    pub steps: Vec<Step>,
}

/// One validated step; each becomes a job.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Step {
    /// Unique within the pipeline; given, or `step-N` (1-based) when absent.
    pub key: String,
    #[serde(default)]
    pub label: Option<String>,
    /// Shell lines, run in order; the step fails at the first failing line.
    pub command: Vec<String>,
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    #[serde(default)]
    pub timeout: Option<Duration>,
    #[serde(default)]
    pub queue_timeout: Option<Duration>,
    /// Agent tags that must all match, e.g. `queue: cuda`.
    #[serde(default)]
    pub agents: BTreeMap<String, String>,
    #[serde(default)]
    pub depends_on: Vec<String>,
    #[serde(default)]
    pub retry: RetryPolicy,
    #[serde(default)]
    pub concurrency: Option<Concurrency>,
    /// GPU count and properties (`gpus:` and `gpu:` in the file).
    #[serde(default)]
    pub gpu: GpuRequirements,
    #[serde(default)]
    pub resources: Resources,
    #[serde(default)]
    pub network: NetworkMode,
    #[serde(default)]
    pub sandbox: SandboxMode,
    /// Container image; the step then needs an agent with a container runtime.
    #[serde(default)]
    pub image: Option<String>,
    /// The deployment environment the step declares: it gets that environment's secrets.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub environment: Option<String>,
    /// Names of secrets the job receives as environment variables, from the coordinator's store.
    #[serde(default)]
    pub secrets: Vec<String>,
    /// Secrets encrypted in the pipeline file (`gpuci secret encrypt`): name → `gpuci:v1:…`.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub encrypted_secrets: BTreeMap<String, String>,
    /// Paths (relative to the workspace) kept per repository between jobs.
    #[serde(default)]
    pub cache: Vec<String>,
    /// Files uploaded when the step ends (`artifacts:`; [`crate::artifacts`]).
    #[serde(default, skip_serializing_if = "ArtifactSpec::is_empty")]
    pub artifacts: ArtifactSpec,
    /// Keys of steps (each in `depends_on`) whose artifacts are placed in the workspace before
    /// the command runs (`artifacts_from:`); a matrix step's key stands for all of its jobs.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub artifacts_from: Vec<String>,
    /// JUnit XML files (globs) uploaded when the step ends, whatever its outcome, and read by
    /// the coordinator (`test_reports:`; [`crate::test_report`]).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub test_reports: Vec<String>,
    /// Failures that do not fail the pipeline (`soft_fail:`).
    #[serde(default, skip_serializing_if = "SoftFail::is_never")]
    pub soft_fail: SoftFail,
    /// Run once every dependency has ended, whatever its outcome (`allow_dependency_failure:`);
    /// otherwise a dependency that did not succeed skips this step.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub allow_dependency_failure: bool,
    /// Set on each job a `matrix:` step expands to: that step's key and this job's values.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub matrix: Option<MatrixJob>,
    /// `if:`: the step runs only when this condition holds for the build
    /// ([`crate::condition`]); validated when the file is parsed, decided at submission.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub condition: Option<String>,
    /// Set by the coordinator at submission, never by a file: the job was created skipped
    /// because its condition (or, through `depends_on`, a dependency's) was false for the
    /// build. Such a skip counts as neither success nor failure (`crate::progress`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub skipped_by_condition: bool,
}

impl Step {
    /// The name people see: the label, else the key.
    pub fn display_name(&self) -> &str {
        self.label.as_deref().unwrap_or(&self.key)
    }

    pub fn effective_queue_timeout(&self) -> Duration {
        self.queue_timeout.unwrap_or(DEFAULT_QUEUE_TIMEOUT)
    }

    /// A step with defaults, for tests and programmatic submission.
    pub fn new(key: impl Into<String>, command: impl Into<String>) -> Step {
        Step {
            key: key.into(),
            label: None,
            command: vec![command.into()],
            env: BTreeMap::new(),
            timeout: None,
            queue_timeout: None,
            agents: BTreeMap::new(),
            depends_on: Vec::new(),
            retry: RetryPolicy::default(),
            concurrency: None,
            gpu: GpuRequirements::default(),
            resources: Resources::default(),
            network: NetworkMode::default(),
            sandbox: SandboxMode::default(),
            image: None,
            environment: None,
            secrets: Vec::new(),
            encrypted_secrets: BTreeMap::new(),
            cache: Vec::new(),
            artifacts: ArtifactSpec::default(),
            artifacts_from: Vec::new(),
            test_reports: Vec::new(),
            soft_fail: SoftFail::Never,
            allow_dependency_failure: false,
            matrix: None,
            condition: None,
            skipped_by_condition: false,
        }
    }
}

/// `soft_fail:` on a step: which failures leave the pipeline green. The job still ends
/// `failed` (or `timed_out`) and is shown as soft failed; its dependents run as if it had
/// succeeded. Decided by [`crate::progress::is_soft_failure`].
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum SoftFail {
    /// Every failure fails the pipeline (the default).
    #[default]
    Never,
    /// `soft_fail: true`: the step failing or running past its timeout.
    Always,
    /// `soft_fail: [1, 42]`: the command exiting with one of these codes.
    ExitCodes(Vec<i32>),
}

impl SoftFail {
    pub fn is_never(&self) -> bool {
        *self == SoftFail::Never
    }
}

/// Which job of a `matrix:` step this is.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct MatrixJob {
    /// The key of the step as written, which `depends_on` names.
    pub step: String,
    /// One value per axis, in the order the axes are written under `setup:`.
    pub values: Vec<MatrixValue>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct MatrixValue {
    pub axis: String,
    pub value: String,
}

impl MatrixJob {
    /// `python=3.11, cuda=12.4`: how the job's name shows its values.
    pub fn describe(&self, separator: &str) -> String {
        self.values.iter().map(|v| format!("{}={}", v.axis, v.value)).collect::<Vec<_>>().join(separator)
    }
}

/// `retry: {count: 2, on: [lost]}`; the default retries nothing.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct RetryPolicy {
    pub count: u32,
    /// Outcomes that retry. Given a count but no `on`, only `lost` retries: a failing test
    /// retried until green hides bugs, a vanished machine does not.
    pub on: Vec<RetryOn>,
}

/// `concurrency: {group: deploy, cancel_in_progress: true}`: at most one job of a group runs
/// at a time; with `cancel_in_progress` a newer job cancels the running one instead of waiting.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Concurrency {
    pub group: String,
    #[serde(default)]
    pub cancel_in_progress: bool,
}

/// `resources: {memory: 8GiB, cpus: 2, pids: 512}`, enforced by the sandbox.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Resources {
    #[serde(default)]
    pub memory: Option<Bytes>,
    /// Thousandths of a CPU (`cpus: 1.5` is 1500).
    #[serde(default)]
    pub cpu_millis: Option<u32>,
    #[serde(default)]
    pub pids: Option<u32>,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum NetworkMode {
    #[default]
    Default,
    None,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum SandboxMode {
    #[default]
    Default,
    /// Explicit opt-out; logged, and a pool can forbid it.
    None,
}
