//! Dynamic steps: a running job adds steps to its own pipeline (`gpuci pipeline upload`).
//!
//! The rules, here and nowhere else:
//! - The uploaded file is a pipeline file, read by the same parser with the same limits; its
//!   errors name `file:line:column` and the field exactly as `gpuci submit`'s do.
//! - Its step keys must not be keys of the running pipeline (nor the key of one of its
//!   `matrix:` steps): an error at the key, naming it. A step without a key would be named
//!   `step-N` and usually clashes: give added steps keys.
//! - `depends_on` (and `artifacts_from`) may name steps of the running pipeline; a matrix
//!   step's key stands for all of its jobs, as in a file. Added steps depend on nothing
//!   unless they say so (as Buildkite's `pipeline upload`): they may start while the
//!   uploading job still runs.
//! - The pipeline's jobs and the added ones together stay within [`MAX_PIPELINE_JOBS`]; a job
//!   may upload at most [`MAX_UPLOADS_PER_JOB`] times, each file at most [`MAX_UPLOAD_BYTES`].
//! - Trust is the pipeline's origin's: added steps become jobs of the same pipeline, so a fork
//!   pull request's added step gets no secrets and runs where its pipeline's jobs may. A file
//!   from an origin that may not run outside the sandbox cannot ask for `sandbox: none`
//!   (an error at the field, rather than a job that waits for an agent that never takes it).
//!
//! [`MAX_PIPELINE_JOBS`]: super::MAX_PIPELINE_JOBS

use super::{Pipeline, PipelineErrors};
use std::collections::BTreeMap;

/// Most uploads one job (one attempt) may make.
pub const MAX_UPLOADS_PER_JOB: u32 = 16;
/// Largest uploaded file, in bytes.
pub const MAX_UPLOAD_BYTES: usize = 256 * 1024;

/// What the running pipeline already has.
#[derive(Clone, Debug, Default)]
pub struct Existing {
    /// Every name `depends_on` may use → the job keys it stands for: each job's key (itself),
    /// and each matrix step's key (all of its jobs).
    names: BTreeMap<String, Vec<String>>,
    /// Jobs of the pipeline (every attempt counts: the cap bounds the rows one pipeline makes).
    pub jobs: usize,
    /// Whether the pipeline's origin may run outside the sandbox (`crate::trust`).
    pub may_run_unsandboxed: bool,
}

impl Existing {
    /// From the pipeline's jobs' steps (any order, retries included).
    pub fn new<'a>(steps: impl IntoIterator<Item = &'a super::Step>, may_run_unsandboxed: bool) -> Existing {
        let mut names: BTreeMap<String, Vec<String>> = BTreeMap::new();
        let mut jobs = 0;
        for s in steps {
            jobs += 1;
            let own = names.entry(s.key.clone()).or_default();
            if !own.contains(&s.key) {
                own.push(s.key.clone());
            }
            if let Some(m) = &s.matrix {
                let all = names.entry(m.step.clone()).or_default();
                if !all.contains(&s.key) {
                    all.push(s.key.clone());
                }
            }
        }
        Existing { names, jobs, may_run_unsandboxed }
    }

    /// Whether `name` is a step key of the pipeline (a job's, or a matrix step's).
    pub fn has(&self, name: &str) -> bool {
        self.names.contains_key(name)
    }
}

/// Parse `text` (named `file` in errors) as steps to add to the pipeline `existing` describes.
/// The answer's `depends_on` and `artifacts_from` name job keys: a matrix step of the running
/// pipeline is expanded to its jobs, as the parser does for matrices of the file itself.
pub fn parse_upload(file: &str, text: &str, existing: &Existing) -> Result<Pipeline, PipelineErrors> {
    let mut pipeline = super::parse::parse_in(file, text, Some(existing))?;
    let expand = |names: &[String]| -> Vec<String> {
        let mut out: Vec<String> = Vec::new();
        for n in names {
            let keys = existing.names.get(n).cloned().unwrap_or_else(|| vec![n.clone()]);
            for k in keys {
                if !out.contains(&k) {
                    out.push(k);
                }
            }
        }
        out
    };
    for s in &mut pipeline.steps {
        s.depends_on = expand(&s.depends_on);
        s.artifacts_from = expand(&s.artifacts_from);
    }
    Ok(pipeline)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pipeline::{MatrixJob, MatrixValue, SandboxMode, Step, MAX_PIPELINE_JOBS};

    fn existing() -> Existing {
        let mut t1 = Step::new("test[py=3.11]", "x");
        t1.matrix = Some(MatrixJob {
            step: "test".into(),
            values: vec![MatrixValue { axis: "py".into(), value: "3.11".into() }],
        });
        let mut t2 = Step::new("test[py=3.12]", "x");
        t2.matrix = Some(MatrixJob {
            step: "test".into(),
            values: vec![MatrixValue { axis: "py".into(), value: "3.12".into() }],
        });
        Existing::new(&[Step::new("build", "make"), t1, t2], false)
    }

    #[test]
    fn added_steps_may_depend_on_steps_of_the_running_pipeline_and_on_each_other() {
        let text = "steps:\n  - key: a\n    command: x\n    depends_on: build\n  - key: b\n    command: y\n    depends_on: [a, test]\n";
        let p = parse_upload("gen.yml", text, &existing()).unwrap();
        assert_eq!(p.steps[0].depends_on, vec!["build"]);
        assert_eq!(p.steps[1].depends_on, vec!["a", "test[py=3.11]", "test[py=3.12]"]);
    }

    #[test]
    fn added_steps_depend_on_nothing_unless_they_say_so() {
        let p = parse_upload("gen.yml", "steps:\n  - key: a\n    command: x\n", &existing()).unwrap();
        assert!(p.steps[0].depends_on.is_empty());
    }

    #[test]
    fn a_key_the_pipeline_has_is_refused_at_the_key_naming_it() {
        for key in ["build", "test"] {
            let text = format!("steps:\n  - key: ok\n    command: x\n  - key: \"{key}\"\n    command: y\n");
            let errs = parse_upload("gen.yml", &text, &existing()).unwrap_err();
            assert_eq!(errs.len(), 1, "{errs}");
            let e = &errs.0[0];
            assert_eq!((e.line, e.column, e.field.as_str()), (4, 10, "steps[1].key"), "{e}");
            assert!(e.message.contains(&format!("`{key}` is already used")), "{e}");
        }
        // The same file submitted on its own is fine: the clash is with the running pipeline.
        assert!(crate::pipeline::parse("gen.yml", "steps:\n  - key: build\n    command: y\n").is_ok());
    }

    #[test]
    fn an_unknown_dependency_is_an_error_with_its_position() {
        let text = "steps:\n  - key: a\n    command: x\n    depends_on: [nope]\n";
        let errs = parse_upload("gen.yml", text, &existing()).unwrap_err();
        let e = &errs.0[0];
        assert_eq!((e.file.as_str(), e.line, e.field.as_str()), ("gen.yml", 4, "steps[0].depends_on[0]"), "{e}");
        assert!(e.message.contains("unknown step `nope`"), "{e}");
    }

    #[test]
    fn the_pipelines_jobs_count_towards_the_cap() {
        let mut ex = existing();
        ex.jobs = MAX_PIPELINE_JOBS - 1;
        assert!(parse_upload("gen.yml", "steps:\n  - key: a\n    command: x\n", &ex).is_ok());
        let two = "steps:\n  - key: a\n    command: x\n  - key: b\n    command: x\n";
        let errs = parse_upload("gen.yml", two, &ex).unwrap_err();
        assert!(errs.0[0].message.contains(&format!("more than the {MAX_PIPELINE_JOBS}")), "{errs}");
        let matrix = "steps:\n  - key: m\n    command: x\n    matrix:\n      setup:\n        a: [1, 2]\n";
        assert!(parse_upload("gen.yml", matrix, &ex).is_err());
    }

    #[test]
    fn an_untrusted_pipeline_cannot_add_a_step_outside_the_sandbox() {
        let text = "steps:\n  - key: a\n    command: x\n    sandbox: none\n";
        let errs = parse_upload("gen.yml", text, &existing()).unwrap_err();
        let e = &errs.0[0];
        assert_eq!((e.line, e.column, e.field.as_str()), (4, 14, "steps[0].sandbox"), "{e}");
        let mut trusted = existing();
        trusted.may_run_unsandboxed = true;
        let p = parse_upload("gen.yml", text, &trusted).unwrap();
        assert_eq!(p.steps[0].sandbox, SandboxMode::None);
    }

    #[test]
    fn errors_read_like_submits() {
        let errs = parse_upload("gen.yml", "steps:\n  - key: a\n    comand: x\n", &existing()).unwrap_err();
        assert_eq!(
            errs.to_string(),
            crate::pipeline::parse("gen.yml", "steps:\n  - key: a\n    comand: x\n").unwrap_err().to_string()
        );
    }
}
