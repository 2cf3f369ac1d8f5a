//! The pipeline format: the top level, `env:`, `steps:` and the fields of one step (what it
//! runs, where, with which secrets and caches).
//!
//! A bad field is recorded and replaced by its default so the rest of the step is still
//! checked. Fields with rules of their own live beside this module: `if:`, `soft_fail:`,
//! `retry:` and `concurrency:` in `conditions`, `gpu:` and `resources:` in `resources`,
//! `matrix:` in `matrix`, `artifacts:` in `artifacts`; cross-step rules in `graph`.

use super::{
    index, is_env_name, is_step_key, join, matrix, one_of, quoted, Ctx, Draft, Kind, Node, Pos, Value, MAX_ENV_BYTES,
    MAX_GPUS, MAX_KEY_LEN, MAX_PIPELINE_JOBS, STEP_KEYS, TOP_KEYS,
};
use crate::gpu::GpuRequirements;
use crate::pipeline::{NetworkMode, Pipeline, SandboxMode, Step};
use std::collections::BTreeMap;

impl Ctx<'_> {
    pub(super) fn pipeline(&mut self, root: Option<&Node>) -> Option<Pipeline> {
        const EXPECTED: &str = "a map with `steps:` or a list of steps";
        let Some(root) = root else {
            self.err(Pos::START, "(root)", format!("the file is empty; expected {EXPECTED}"));
            return None;
        };
        match &root.value {
            Value::Seq(_) => {
                let steps = self.steps(root, "steps")?;
                Some(Pipeline { env: BTreeMap::new(), steps })
            }
            Value::Map(_) => {
                let fields = self.record(root, "", EXPECTED, TOP_KEYS)?;
                let mut env = Some(BTreeMap::new());
                let mut steps = None;
                let mut saw_steps = false;
                for (name, _, v) in fields {
                    match name {
                        "env" => env = self.env(v, "env"),
                        "steps" => {
                            saw_steps = true;
                            steps = self.steps(v, "steps");
                        }
                        _ => {}
                    }
                }
                if !saw_steps {
                    self.err(root.pos, "steps", "missing: a pipeline needs `steps:`, a list of steps");
                }
                Some(Pipeline { env: env?, steps: steps? })
            }
            Value::Scalar(Kind::Null, _) => {
                self.err(root.pos, "(root)", format!("the file is empty; expected {EXPECTED}"));
                None
            }
            _ => {
                self.type_err(root, "(root)", EXPECTED);
                None
            }
        }
    }

    pub(super) fn env(&mut self, node: &Node, path: &str) -> Option<BTreeMap<String, String>> {
        let fields = self.map(node, path, "a map of environment variables")?;
        let mut env = BTreeMap::new();
        for (name, pos, v) in fields {
            let p = join(path, name);
            if !is_env_name(name) {
                self.err(
                    pos,
                    &p,
                    format!(
                        "invalid variable name {}: expected letters, digits and `_`, not starting with a digit",
                        quoted(name)
                    ),
                );
                continue;
            }
            if let Some(value) = self.text(v, &p) {
                env.insert(name.to_string(), value);
            }
        }
        // Every job of the pipeline carries its environment: a large one, times 1,024 jobs, was
        // a quarter of a gigabyte in the database from one upload (outsider finding).
        let bytes: usize = env.iter().map(|(k, v)| k.len() + v.len()).sum();
        if bytes > MAX_ENV_BYTES {
            self.err(
                node.pos,
                path,
                format!("{bytes} bytes of variables, more than the {MAX_ENV_BYTES} one `env:` may hold"),
            );
            return None;
        }
        Some(env)
    }

    pub(super) fn steps(&mut self, node: &Node, path: &str) -> Option<Vec<Step>> {
        let Value::Seq(items) = &node.value else {
            self.type_err(node, path, "a list of steps");
            return None;
        };
        if items.is_empty() {
            self.err(node.pos, path, "expected at least one step, got an empty list");
            return None;
        }
        // Steps with errors still take part in the cross-step checks, so that one run reports
        // a bad `depends_on` next to a bad `timeout`.
        let mut all_read = true;
        let mut drafts = Vec::with_capacity(items.len());
        for (i, item) in items.iter().enumerate() {
            match self.step(item, &index(path, i), i) {
                Some((draft, ok)) => {
                    all_read &= ok;
                    drafts.push(draft);
                }
                None => all_read = false,
            }
        }
        self.check_graph(&drafts, path);
        if self.jobs > MAX_PIPELINE_JOBS {
            let with = match self.existing {
                Some(e) => format!(" with the pipeline's {} jobs", e.jobs),
                None => String::new(),
            };
            self.err(
                node.pos,
                path,
                format!(
                    "the steps expand to {} jobs{with} (matrices included), more than the {MAX_PIPELINE_JOBS} a pipeline may have",
                    self.jobs
                ),
            );
            return None;
        }
        all_read.then(|| matrix::flatten(drafts))
    }

    /// The step as read (a matrix step: each of its jobs), and whether it was read without
    /// errors; `None` when it is not a map.
    pub(super) fn step(&mut self, node: &Node, path: &str, i: usize) -> Option<(Draft, bool)> {
        let fields = self.record(node, path, "a map of step settings", STEP_KEYS)?;
        self.matrix_step(node, path, i, fields)
    }

    /// One reading of a step's fields. `unread` names fields that were given but left out of
    /// `fields` (their errors are already reported), so that they do not count as missing.
    pub(super) fn read_step(
        &mut self,
        pos: Pos,
        path: &str,
        i: usize,
        fields: &[(&str, Pos, &Node)],
        unread: &[&str],
    ) -> (Draft, bool) {
        let mut step = Step::new(format!("step-{}", i + 1), String::new());
        step.command.clear();
        let mut draft =
            Draft { index: i, step: Step::new("", ""), pos, key_pos: None, deps: Vec::new(), expanded: Vec::new() };
        let mut ok = true;
        let mut have_command = unread.contains(&"command");
        let mut gpus_field: Option<(&Node, Option<u32>)> = None;
        let mut gpu_field: Option<(Pos, GpuRequirements, bool)> = None;
        let mut artifacts_from: Vec<(String, Pos, String)> = Vec::new();

        // Each arm records its own errors; `ok` only tracks whether the step is usable.
        for &(name, _, v) in fields {
            let p = join(path, name);
            let p = p.as_str();
            let good = match name {
                "key" => self.step_key(v, p).map(|k| {
                    step.key = k;
                    draft.key_pos = Some(v.pos);
                }),
                "label" => self.string(v, p).map(|l| step.label = Some(l)),
                "command" => {
                    have_command = true;
                    self.command(v, p).map(|c| step.command = c)
                }
                "env" => self.env(v, p).map(|e| step.env = e),
                "timeout" => self.duration(v, p).map(|d| step.timeout = Some(d)),
                "queue_timeout" => self.duration(v, p).map(|d| step.queue_timeout = Some(d)),
                "agents" => self.agents(v, p).map(|a| step.agents = a),
                "depends_on" => self.strings(v, p).map(|deps| draft.deps = deps),
                "retry" => self.retry(v, p).map(|r| step.retry = r),
                "concurrency" => self.concurrency(v, p).map(|c| step.concurrency = Some(c)),
                "gpus" => {
                    let n = self.int_in(v, p, 0, MAX_GPUS, "a GPU count").and_then(|n| u32::try_from(n).ok());
                    gpus_field = Some((v, n));
                    n.map(|_| ())
                }
                "gpu" => self.gpu(v, p).map(|(g, any)| gpu_field = Some((v.pos, g, any))),
                "resources" => self.resources(v, p).map(|r| step.resources = r),
                "network" => self.choice(v, p, &["default", "none"]).map(|n| {
                    step.network = if n == "none" { NetworkMode::None } else { NetworkMode::Default };
                }),
                "sandbox" => self.choice(v, p, &["default", "none"]).and_then(|n| {
                    // Trust is the pipeline's origin's, never the uploaded file's.
                    if n == "none" && self.existing.is_some_and(|e| !e.may_run_unsandboxed) {
                        self.err(
                            v.pos,
                            p,
                            "a step added by a job of an untrusted origin cannot run outside the sandbox",
                        );
                        return None;
                    }
                    step.sandbox = if n == "none" { SandboxMode::None } else { SandboxMode::Default };
                    Some(())
                }),
                "image" => self.image(v, p).map(|img| step.image = Some(img)),
                "environment" => self.word(v, p, "an environment name").and_then(|e| {
                    match crate::secret_scope::valid_environment(&e) {
                        Ok(()) => {
                            step.environment = Some(e);
                            Some(())
                        }
                        Err(why) => {
                            self.err(v.pos, p, why);
                            None
                        }
                    }
                }),
                "secrets" => self.secrets(v, p).map(|(names, sealed)| {
                    step.secrets = names;
                    step.encrypted_secrets = sealed;
                }),
                "cache" => self.cache(v, p).map(|c| step.cache = c),
                "artifacts" => self.artifacts(v, p).map(|a| step.artifacts = a),
                "artifacts_from" => self.artifacts_from(v, p).map(|a| artifacts_from = a),
                "test_reports" => self.test_reports(v, p).map(|t| step.test_reports = t),
                "soft_fail" => self.soft_fail(v, p).map(|s| step.soft_fail = s),
                "allow_dependency_failure" => self.bool(v, p).map(|b| step.allow_dependency_failure = b),
                "if" => self.condition(v, p).map(|c| step.condition = Some(c)),
                // Read by `matrix_step` before the fields.
                _ => Some(()),
            };
            ok &= good.is_some();
        }

        if !have_command {
            self.err(pos, join(path, "command"), "missing: every step needs a `command`");
            ok = false;
        }
        // `gpu:` alone means one GPU with those properties; `gpus: 0` with properties is a contradiction.
        let mut gpu = gpu_field.as_ref().map(|(_, g, _)| g.clone()).unwrap_or_default();
        let any_property = gpu_field.as_ref().is_some_and(|(_, _, any)| *any);
        match gpus_field {
            Some((gpus_node, Some(0))) if any_property => {
                self.err(
                    gpus_node.pos,
                    join(path, "gpus"),
                    "is 0, but `gpu:` asks for GPU properties; remove one of them",
                );
                ok = false;
            }
            Some((_, Some(n))) => gpu.count = n,
            None if gpu_field.is_some() => gpu.count = 1,
            _ => {}
        }
        step.gpu = gpu;
        step.depends_on = draft.deps.iter().map(|(d, _, _)| d.clone()).collect();
        // Artifacts come from steps that have ended before this one starts: its dependencies.
        for (key, at, p) in &artifacts_from {
            if !step.depends_on.contains(key) && !unread.contains(&"depends_on") {
                self.err(
                    *at,
                    p,
                    format!("`{key}` is not in this step's `depends_on`; artifacts come only from steps it waits for"),
                );
                ok = false;
            }
        }
        step.artifacts_from = artifacts_from.into_iter().map(|(k, _, _)| k).collect();

        draft.step = step;
        (draft, ok)
    }

    pub(super) fn step_key(&mut self, node: &Node, path: &str) -> Option<String> {
        let key = self.word(node, path, "a step key")?;
        if !is_step_key(&key) {
            self.err(node.pos, path, format!("invalid step key {}: use letters, digits, `-` and `_`", quoted(&key)));
            return None;
        }
        if key.len() > MAX_KEY_LEN {
            self.err(node.pos, path, format!("step key is longer than {MAX_KEY_LEN} characters"));
            return None;
        }
        Some(key)
    }

    pub(super) fn command(&mut self, node: &Node, path: &str) -> Option<Vec<String>> {
        let lines = self.strings(node, path)?;
        if matches!(node.value, Value::Seq(ref items) if items.is_empty()) {
            self.err(node.pos, path, "expected at least one command, got an empty list");
            return None;
        }
        let mut ok = true;
        for (line, pos, p) in &lines {
            if line.trim().is_empty() {
                self.err(*pos, p, "a command must not be empty");
                ok = false;
            }
        }
        // Items that were not strings were reported and dropped by `strings`.
        let expected = match &node.value {
            Value::Seq(items) => items.len(),
            _ => 1,
        };
        (ok && lines.len() == expected).then(|| lines.into_iter().map(|(l, _, _)| l).collect())
    }

    pub(super) fn agents(&mut self, node: &Node, path: &str) -> Option<BTreeMap<String, String>> {
        let fields = self.map(node, path, "a map of agent tags, like {queue: cuda}")?;
        let mut tags = BTreeMap::new();
        let mut ok = true;
        for (name, pos, v) in fields {
            let p = join(path, name);
            if name.trim().is_empty() {
                self.err(pos, &p, "an agent tag name must not be empty");
                ok = false;
                continue;
            }
            if name.contains('\0') {
                self.err(pos, &p, "contains a NUL byte (\\0), which no command line or environment variable can hold");
                ok = false;
                continue;
            }
            match self.text(v, &p) {
                Some(value) => {
                    tags.insert(name.to_string(), value);
                }
                None => ok = false,
            }
        }
        ok.then_some(tags)
    }

    pub(super) fn choice(&mut self, node: &Node, path: &str, options: &[&'static str]) -> Option<&'static str> {
        if let Some(s) = node.str() {
            if let Some(o) = options.iter().find(|o| **o == s) {
                return Some(o);
            }
        }
        let got = node.describe();
        self.err(node.pos, path, format!("expected one of {}, got {got}", one_of(options)));
        None
    }

    pub(super) fn image(&mut self, node: &Node, path: &str) -> Option<String> {
        let image = self.word(node, path, "an image")?;
        if let Err(why) = crate::image::check_reference(&image) {
            self.err(node.pos, path, format!("{}: {why}", quoted(&image)));
            return None;
        }
        Some(image)
    }

    /// `[NAME, ...]` (set on the coordinator), or `{NAME: "gpuci:v1:…" | null, ...}` (encrypted
    /// in this file; null: set on the coordinator).
    pub(super) fn secrets(&mut self, node: &Node, path: &str) -> Option<(Vec<String>, BTreeMap<String, String>)> {
        if let Value::Map(_) = &node.value {
            let fields = self.map(node, path, "a list of secret names or a map of them")?;
            let (mut names, mut sealed) = (Vec::new(), BTreeMap::new());
            let mut ok = true;
            for (name, pos, v) in fields {
                let p = join(path, name);
                if !is_env_name(name) {
                    let why = format!(
                        "invalid secret name {}: expected an environment variable name like HF_TOKEN",
                        quoted(name)
                    );
                    self.err(pos, &p, why);
                    ok = false;
                    continue;
                }
                match &v.value {
                    Value::Scalar(Kind::Null, _) => names.push(name.to_string()),
                    Value::Scalar(Kind::Str, t) if crate::secret_scope::is_sealed_text(t) => {
                        sealed.insert(name.to_string(), t.clone());
                    }
                    _ => {
                        // Never echo a scalar here: it may be the secret itself, in clear.
                        let got = match &v.value {
                            Value::Scalar(Kind::Str, _) => "a string that is not one".to_string(),
                            Value::Scalar(Kind::Int | Kind::Float, _) => "a number".to_string(),
                            Value::Scalar(Kind::Bool, _) => "a boolean".to_string(),
                            _ => v.describe(),
                        };
                        let got = format!("{got} (not shown: it may be a secret in clear)");
                        self.err(
                            v.pos,
                            &p,
                            format!("expected a value from `gpuci secret encrypt` (\"gpuci:v1:…\") or null (a secret set on the coordinator), got {got}"),
                        );
                        ok = false;
                    }
                }
            }
            return ok.then_some((names, sealed));
        }
        let items = self.string_list(node, path)?;
        let mut out: Vec<String> = Vec::new();
        let mut ok = true;
        for (s, pos, p) in items {
            if !is_env_name(&s) {
                // `NAME=value` is someone pasting the value: show the name only.
                let shown = match s.split_once('=') {
                    Some((name, _)) => format!("{}=… (the rest is not shown: it may be a secret)", quoted(name)),
                    None => quoted(&s),
                };
                self.err(
                    pos,
                    p,
                    format!("invalid secret name {shown}: expected an environment variable name like HF_TOKEN"),
                );
                ok = false;
            } else if out.contains(&s) {
                self.err(pos, p, format!("`{s}` is listed twice"));
                ok = false;
            } else {
                out.push(s);
            }
        }
        ok.then_some((out, BTreeMap::new()))
    }

    pub(super) fn cache(&mut self, node: &Node, path: &str) -> Option<Vec<String>> {
        let items = self.string_list(node, path)?;
        let mut out: Vec<String> = Vec::new();
        let mut ok = true;
        for (s, pos, p) in items {
            let problem = if s.trim().is_empty() {
                Some("a cache path must not be empty")
            } else if s.starts_with('/') {
                Some("cache paths are relative to the workspace; absolute paths are not allowed")
            } else if s.starts_with('~') {
                Some("cache paths are relative to the workspace; `~` is not expanded")
            } else if s.split(['/', '\\']).any(|c| c == "..") {
                Some("cache paths must stay inside the workspace; `..` is not allowed")
            } else {
                None
            };
            match problem {
                Some(m) => {
                    self.err(pos, p, m);
                    ok = false;
                }
                None => out.push(s),
            }
        }
        ok.then_some(out)
    }
}
