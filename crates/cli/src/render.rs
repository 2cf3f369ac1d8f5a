//! Human output. Tables and progress for people; `--json` bypasses all of this.
//!
//! Everything a job or a pipeline file can choose (its output, step names, reasons that quote
//! it) is printed through [`gpuci_core::text::escape`], so it cannot act on the terminal, and
//! every log line starts with a column gpuci writes ([`log_mark`]), so the job's text cannot
//! pass for gpuci's own lines.

use gpuci_core::job::JobState;
use gpuci_core::text::escape;
use gpuci_protocol::agent::Stream;
use gpuci_protocol::api::{AgentSummary, JobSummary, WatchEvent};
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::io::Write;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

pub fn now_ms() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as i64)
}

pub fn elapsed(ms: i64) -> String {
    let d = Duration::from_millis(ms.max(0) as u64);
    if d < Duration::from_secs(60) {
        format!("{:.1}s", d.as_secs_f64())
    } else {
        gpuci_core::Duration(Duration::from_secs(d.as_secs())).to_string()
    }
}

fn ago(ms: i64) -> String {
    format!("{} ago", elapsed(now_ms() - ms))
}

/// The column before a log line: `│` for the job's output, `#` for gpuci's own lines. The
/// job's text follows it, escaped, so a job printing `# ...` shows as `│ # ...`.
pub fn log_mark(stream: Stream) -> &'static str {
    match stream {
        Stream::System => "#",
        Stream::Stdout | Stream::Stderr => "│",
    }
}

/// A log line as `gpuci logs` prints it.
pub fn log_line(stream: Stream, text: &str) -> String {
    format!("{} {}", log_mark(stream), escape(text))
}

/// Render rows as aligned columns (cells escaped: names and reasons come from pipelines).
pub fn table(header: &[&str], rows: &[Vec<String>]) -> String {
    let rows: Vec<Vec<String>> = rows.iter().map(|r| r.iter().map(|c| escape(c).into_owned()).collect()).collect();
    let rows = &rows;
    let mut widths: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for r in rows {
        for (i, c) in r.iter().enumerate() {
            widths[i] = widths[i].max(c.chars().count());
        }
    }
    let mut out = String::new();
    let line = |cells: Vec<&str>, out: &mut String| {
        let n = cells.len();
        for (i, c) in cells.into_iter().enumerate() {
            if i + 1 == n {
                out.push_str(c);
            } else {
                let _ = write!(out, "{c:<w$}  ", w = widths[i]);
            }
        }
        out.push('\n');
    };
    line(header.to_vec(), &mut out);
    for r in rows {
        line(r.iter().map(String::as_str).collect(), &mut out);
    }
    out
}

/// A job's state as people read it: a soft failure says so.
pub fn state_text(j: &JobSummary) -> String {
    if j.soft_failed {
        format!("{} (soft)", j.state)
    } else {
        j.state.to_string()
    }
}

pub fn jobs_table(jobs: &[JobSummary]) -> String {
    let rows: Vec<Vec<String>> = jobs
        .iter()
        .map(|j| {
            let when = match (j.started_at_ms, j.finished_at_ms) {
                (Some(s), Some(f)) => elapsed(f - s),
                (Some(s), None) => format!("{} (running)", elapsed(now_ms() - s)),
                (None, _) => ago(j.created_at_ms),
            };
            vec![
                j.id.to_string(),
                j.pipeline_id.to_string(),
                j.name.clone(),
                state_text(j),
                j.agent_name.clone().unwrap_or_else(|| "-".into()),
                if j.gpus.is_empty() { "-".into() } else { j.gpus.len().to_string() },
                when,
                j.reason.clone(),
            ]
        })
        .collect();
    table(&["JOB", "PIPELINE", "STEP", "STATE", "AGENT", "GPUS", "TIME", "REASON"], &rows)
}

pub fn job_detail(j: &JobSummary) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "job {}  {} (pipeline {}, step `{}`, attempt {})",
        j.id,
        escape(&j.name),
        j.pipeline_id,
        escape(&j.step_key),
        j.attempt
    );
    let _ = writeln!(s, "state:    {}", state_text(j));
    if j.soft_failed {
        let _ = writeln!(s, "          soft failed: its step's soft_fail covers this; the pipeline does not fail");
    }
    let _ = writeln!(s, "reason:   {}", escape(&j.reason));
    if let Some(a) = &j.agent_name {
        let _ = writeln!(s, "agent:    {}", escape(a));
    }
    for g in &j.gpus {
        let _ = writeln!(s, "gpu:      {g}");
    }
    // What its agent ran it without (its operator's opt-outs): never a quiet detail.
    if !j.unenforced.is_empty() {
        let _ = writeln!(s, "NOT enforced:");
        for u in &j.unenforced {
            let _ = writeln!(s, "  {:<18} {}", u.key.as_str(), escape(&u.detail));
        }
    }
    if let Some(c) = j.exit_code {
        let _ = writeln!(s, "exit:     {c}");
    }
    if let (Some(st), fin) = (j.started_at_ms, j.finished_at_ms) {
        let _ = writeln!(s, "ran:      {}", elapsed(fin.unwrap_or_else(now_ms) - st));
    }
    if let Some(c) = &j.cost {
        let whole = match c.overhead_usd {
            Some(o) => format!(
                "${:.4}: ${:.4} while it ran + ${o:.4} its share of the machine's boot and idle{}",
                c.usd + o,
                c.usd,
                if j.finished_at_ms.is_none() { " so far" } else { "" }
            ),
            None => format!("${:.4}", c.usd),
        };
        let _ = writeln!(
            s,
            "cost:     {whole} (machine {} of fleet {}, ${:.3}/h)",
            escape(&c.machine),
            escape(&c.fleet),
            c.price_per_hour
        );
    }
    if let Some(t) = &j.telemetry {
        let _ = writeln!(
            s,
            "gpu use:  peak memory {}, mean utilisation {:.0}%, {:.1} GPU-seconds ({} samples)",
            gpuci_core::quantity::Bytes(t.peak_memory_bytes),
            t.mean_utilization_pct,
            t.gpu_seconds,
            t.samples
        );
    }
    s
}

pub fn agents_table(agents: &[AgentSummary]) -> String {
    let mut out = String::new();
    let rows: Vec<Vec<String>> = agents
        .iter()
        .map(|a| {
            let tags: Vec<String> = a.tags.iter().map(|(k, v)| format!("{k}={v}")).collect();
            vec![
                a.name.clone(),
                a.state.clone(),
                format!("{}/{}", a.running.len(), a.slots),
                a.gpus.len().to_string(),
                if tags.is_empty() { "-".into() } else { tags.join(",") },
                a.isolation.clone(),
                a.gpu_backend.clone(),
                a.reason.clone(),
            ]
        })
        .collect();
    out.push_str(&table(&["AGENT", "STATE", "JOBS", "GPUS", "TAGS", "ISOLATION", "GPU SOURCE", "REASON"], &rows));
    for a in agents.iter().filter(|a| !a.gpus.is_empty()) {
        let _ = writeln!(out, "\n{} GPUs:", a.name);
        let rows: Vec<Vec<String>> = a
            .gpus
            .iter()
            .map(|g| {
                let what = match (g.state.as_str(), g.job_id, &g.reason) {
                    ("leased", Some(j), _) => format!("leased to job {j}"),
                    ("quarantined", _, Some(r)) => format!("QUARANTINED: {r}"),
                    (s, _, _) => s.to_string(),
                };
                vec![
                    g.info.index.to_string(),
                    g.info.uuid.clone(),
                    format!("{}{}", g.info.name, if g.info.simulated { " (simulated)" } else { "" }),
                    g.info.memory.to_string(),
                    g.info.compute_capability.to_string(),
                    what,
                ]
            })
            .collect();
        out.push_str(&table(&["  #", "UUID", "MODEL", "MEMORY", "CC", "STATE"], &rows));
    }
    out
}

/// Live pipeline progress: state changes on stderr, job output on stdout prefixed by step.
pub struct Progress {
    jobs: BTreeMap<i64, JobSummary>,
    width: usize,
    pub final_state: Option<String>,
    started: std::time::Instant,
}

impl Progress {
    pub fn new(jobs: &[JobSummary]) -> Self {
        let width = jobs.iter().map(|j| j.step_key.len()).max().unwrap_or(4).min(24);
        Progress { jobs: BTreeMap::new(), width, final_state: None, started: std::time::Instant::now() }
    }

    pub fn on(&mut self, ev: WatchEvent) {
        let mut err = std::io::stderr().lock();
        match ev {
            WatchEvent::Job(j) => {
                let prev = self.jobs.insert(j.id, j.clone());
                let changed = prev.as_ref().is_none_or(|p| p.state != j.state);
                if !changed {
                    return;
                }
                let took =
                    j.started_at_ms.map(|s| elapsed(j.finished_at_ms.unwrap_or_else(now_ms) - s)).unwrap_or_default();
                let line = match j.state {
                    JobState::Queued if prev.is_none() => return,
                    JobState::Queued => format!("↻ {} requeued: {}", j.name, j.reason),
                    JobState::Assigned => return,
                    JobState::Running => {
                        let gpus =
                            if j.gpus.is_empty() { String::new() } else { format!(" on GPU {}", j.gpus.join(", ")) };
                        format!(
                            "▶ {} (job {}) started on {}{gpus}",
                            j.name,
                            j.id,
                            j.agent_name.clone().unwrap_or_default()
                        )
                    }
                    JobState::Succeeded => format!("✓ {} succeeded in {took}", j.name),
                    JobState::Skipped => format!("- {} skipped: {}", j.name, j.reason),
                    st if j.soft_failed => format!(
                        "~ {} soft failed ({st}{}): {}; the pipeline does not fail",
                        j.name,
                        if took.is_empty() { String::new() } else { format!(" after {took}") },
                        j.reason
                    ),
                    st => format!(
                        "✗ {} {st}{}: {}",
                        j.name,
                        if took.is_empty() { String::new() } else { format!(" after {took}") },
                        j.reason
                    ),
                };
                let _ = writeln!(err, "{}", escape(&line));
            }
            WatchEvent::Log { job_id, line } => {
                let key = self.jobs.get(&job_id).map(|j| j.step_key.clone()).unwrap_or_else(|| job_id.to_string());
                let mut out = std::io::stdout().lock();
                let _ = writeln!(out, "{:>w$} {}", escape(&key), log_line(line.stream, &line.text), w = self.width);
            }
            WatchEvent::Done { state } => {
                let mut counts: BTreeMap<String, usize> = BTreeMap::new();
                let mut latest: BTreeMap<&str, &JobSummary> = BTreeMap::new();
                for j in self.jobs.values() {
                    latest.insert(&j.step_key, j);
                }
                for j in latest.values() {
                    *counts.entry(state_text(j)).or_default() += 1;
                }
                let parts: Vec<String> = counts.iter().map(|(s, n)| format!("{n} {s}")).collect();
                let _ = writeln!(
                    err,
                    "pipeline {state} in {} ({})",
                    elapsed(self.started.elapsed().as_millis() as i64),
                    parts.join(", ")
                );
                self.final_state = Some(state);
            }
        }
    }

    pub fn exit_code(&self) -> u8 {
        match self.final_state.as_deref() {
            Some("succeeded") => 0,
            _ => 1,
        }
    }
}

/// `gpuci fleets`: per fleet a headline (machines, wanted and why, spend), its machines with
/// their boot stages, and recent provider errors.
pub fn fleets(fleets: &[serde_json::Value]) -> String {
    use std::fmt::Write;
    // Machine ids, offers and errors come from providers: shown escaped, like job output.
    let s = |v: &serde_json::Value| escape(v.as_str().unwrap_or_default()).to_string();
    let ms = |v: &serde_json::Value| v.as_i64();
    let mut out = String::new();
    for f in fleets {
        let budget = match f["daily_budget_usd"].as_f64() {
            Some(b) => {
                format!(" of ${b:.2}{}", if f["budget_reached"].as_bool() == Some(true) { " (reached)" } else { "" })
            }
            None => String::new(),
        };
        let _ = writeln!(
            out,
            "fleet {} ({}): {} machines, wants {} (max {}, min idle {}); spent today ${:.2}{budget}",
            s(&f["name"]),
            s(&f["provider"]),
            f["count"],
            f["wanted"],
            f["max"],
            f["min_idle"],
            f["spend_today_usd"].as_f64().unwrap_or(0.0)
        );
        if let Some(u) = f["unavailable"].as_str() {
            let _ = writeln!(out, "  unavailable: {u}");
        }
        if !s(&f["why"]).is_empty() {
            let _ = writeln!(out, "  why: {}", s(&f["why"]));
        }
        if let Some(until) = f["breaker_open_until"].as_u64() {
            let _ =
                writeln!(out, "  spot breaker open: on-demand only for {}", elapsed(until as i64 * 1000 - now_ms()));
        }
        let machines = f["machines"].as_array().cloned().unwrap_or_default();
        if !machines.is_empty() {
            let rows: Vec<Vec<String>> = machines
                .iter()
                .map(|m| {
                    let requested = ms(&m["requested_at_ms"]).unwrap_or(0);
                    let stage =
                        |k: &str| ms(&m[k]).map_or("-".into(), |t| format!("+{:.1}s", (t - requested) as f64 / 1000.0));
                    vec![
                        s(&m["id"]),
                        s(&m["state"]),
                        format!("{} {}", s(&m["instance_type"]), s(&m["zone"])).trim().to_string(),
                        s(&m["capacity"]),
                        elapsed(now_ms() - requested),
                        stage("running_at_ms"),
                        stage("connected_at_ms"),
                        stage("first_job_at_ms"),
                    ]
                })
                .collect();
            for line in
                table(&["MACHINE", "STATE", "OFFER", "CAPACITY", "AGE", "RUNNING", "CONNECTED", "FIRST JOB"], &rows)
                    .lines()
            {
                let _ = writeln!(out, "  {line}");
            }
            for m in &machines {
                if !s(&m["note"]).is_empty() {
                    let _ = writeln!(out, "  {}: {}", s(&m["id"]), s(&m["note"]));
                }
            }
        }
        for e in f["recent_errors"].as_array().cloned().unwrap_or_default() {
            let at = e[0].as_i64().unwrap_or(0) * 1000;
            let _ = writeln!(out, "  {}: {}", ago(at), s(&e[1]));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpuci_protocol::agent::{Protection, Unenforced};

    fn job() -> JobSummary {
        JobSummary {
            skipped_by_condition: false,
            id: 7,
            pipeline_id: 3,
            step_key: "test".into(),
            name: "test".into(),
            state: JobState::Succeeded,
            soft_failed: false,
            reason: "exited with code 0".into(),
            attempt: 1,
            agent_id: Some("a1".into()),
            agent_name: Some("slurm-7".into()),
            gpus: vec![],
            created_at_ms: 0,
            assigned_at_ms: None,
            started_at_ms: None,
            finished_at_ms: None,
            exit_code: Some(0),
            telemetry: None,
            cost: None,
            unenforced: vec![],
        }
    }

    /// Issue 30: a soft failure reads apart from a failure in `gpuci jobs` and `gpuci jobs show`.
    #[test]
    fn a_soft_failure_says_so() {
        let mut j = job();
        (j.state, j.exit_code, j.reason) = (JobState::Failed, Some(3), "exited with code 3".into());
        assert!(jobs_table(std::slice::from_ref(&j)).contains("failed  "), "{}", jobs_table(&[j.clone()]));
        assert!(!job_detail(&j).contains("soft"));
        j.soft_failed = true;
        assert!(jobs_table(std::slice::from_ref(&j)).contains(" failed (soft) "), "{}", jobs_table(&[j.clone()]));
        let detail = job_detail(&j);
        assert!(detail.contains("state:    failed (soft)\n"), "{detail}");
        assert!(detail.contains("the pipeline does not fail"), "{detail}");
    }

    /// Issue 26: what the agent did not enforce stands out in `gpuci jobs show`, one key per
    /// line, escaped like everything an agent says; a job that lost nothing shows no block.
    #[test]
    fn job_detail_lists_what_was_not_enforced() {
        assert!(!job_detail(&job()).contains("NOT enforced"));
        let mut j = job();
        j.unenforced = vec![
            Unenforced {
                key: Protection::Limits,
                detail: "no memory, CPU or process limit is enforced (no cgroups)".into(),
            },
            Unenforced { key: Protection::DiskQuota, detail: "no disk quota\u{1b}[2J (the agent is not root)".into() },
        ];
        let text = job_detail(&j);
        assert!(
            text.contains(
                "NOT enforced:\n  limits             no memory, CPU or process limit is enforced (no cgroups)\n  disk_quota         no disk quota"
            ),
            "{text}"
        );
        assert!(!text.contains('\u{1b}'), "{text:?}");
    }
}
