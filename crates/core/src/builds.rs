//! A build (a pipeline) as the builds list shows it: its state, how long it ran, how long it
//! waited, the GPU-hours its jobs held and what they cost, and the build facts it was
//! submitted with, bounded for display. Pure functions over plain data; the coordinator
//! gathers the jobs and the dashboard renders the result.
//!
//! The rules, here and nowhere else:
//! - **State**: `crate::progress::pipeline_state` over the latest attempt of each step.
//! - **Duration**: from the first job's start to the last job's end (now, while running);
//!   none before any job started.
//! - **Queued**: from the pipeline's creation to the first job's start (to now while none
//!   has started and the build is not over; to its end when it ended without running).
//! - **GPU-hours**: every attempt's leased GPUs × its run time (to now while running).
//! - **Cost**: the sum of the jobs' known costs (fleet machines); none when no job has one.

use crate::condition::BuildFacts;
use crate::job::JobState;
use crate::progress::{pipeline_state, Attempt, PipelineState};

/// A job of the build, as the summary needs it.
#[derive(Clone, Debug)]
pub struct BuildJob<'a> {
    pub job_id: i64,
    pub step_key: &'a str,
    pub state: JobState,
    pub soft_failed: bool,
    pub skipped_by_condition: bool,
    pub started_at_ms: Option<i64>,
    pub finished_at_ms: Option<i64>,
    pub gpus: u32,
    pub cost_usd: Option<f64>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct BuildSummary {
    pub state: PipelineState,
    pub duration_ms: Option<i64>,
    pub queued_ms: i64,
    pub gpu_hours: f64,
    pub cost_usd: Option<f64>,
    /// Steps (latest attempts) and jobs (every attempt).
    pub steps: usize,
    pub jobs: usize,
}

pub fn summarize(created_at_ms: i64, jobs: &[BuildJob<'_>], now_ms: i64) -> BuildSummary {
    let state = pipeline_state(jobs.iter().map(|j| Attempt {
        step_key: j.step_key,
        job_id: j.job_id,
        state: j.state,
        soft_failed: j.soft_failed,
        skipped_by_condition: j.skipped_by_condition,
    }));
    let steps = jobs.iter().map(|j| j.step_key).collect::<std::collections::BTreeSet<_>>().len();
    let first_start = jobs.iter().filter_map(|j| j.started_at_ms).min();
    let last_end = jobs.iter().filter_map(|j| j.finished_at_ms).max();
    let running = state == PipelineState::Running;
    let end = if running { now_ms } else { last_end.unwrap_or(now_ms) };
    let duration_ms = first_start.map(|s| (end - s).max(0));
    let queued_ms = (first_start.unwrap_or(end) - created_at_ms).max(0);
    let gpu_hours = jobs
        .iter()
        .filter_map(|j| {
            let s = j.started_at_ms?;
            let e = j.finished_at_ms.unwrap_or(if j.state.is_terminal() { s } else { now_ms });
            Some(f64::from(j.gpus) * (e - s).max(0) as f64 / 3_600_000.0)
        })
        .sum();
    let costs: Vec<f64> = jobs.iter().filter_map(|j| j.cost_usd).collect();
    let cost_usd = (!costs.is_empty()).then(|| costs.iter().sum());
    BuildSummary { state, duration_ms, queued_ms, gpu_hours, cost_usd, steps, jobs: jobs.len() }
}

/// Longest branch, tag or author kept; longer is cut (with `…`).
pub const MAX_NAME_CHARS: usize = 200;
/// Longest commit subject kept.
pub const MAX_SUBJECT_CHARS: usize = 300;

fn bounded(s: &Option<String>, n: usize) -> Option<String> {
    s.as_ref().map(|s| match s.char_indices().nth(n) {
        Some((i, _)) => format!("{}…", &s[..i]),
        None => s.clone(),
    })
}

/// The facts a build is listed with: what a submitter said, cut to size, without the
/// changed paths (up to 10,000 of them: conditions need them, the list does not). A
/// submitter is not trusted to be brief.
pub fn for_list(f: &BuildFacts) -> BuildFacts {
    BuildFacts {
        branch: bounded(&f.branch, MAX_NAME_CHARS),
        tag: bounded(&f.tag, MAX_NAME_CHARS),
        event: f.event,
        commit: bounded(&f.commit, 64),
        changed: None,
        subject: bounded(&f.subject, MAX_SUBJECT_CHARS),
        author: bounded(&f.author, MAX_NAME_CHARS),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use JobState::*;

    fn j(id: i64, key: &'static str, state: JobState, run: Option<(i64, Option<i64>)>, gpus: u32) -> BuildJob<'static> {
        BuildJob {
            job_id: id,
            step_key: key,
            state,
            soft_failed: false,
            skipped_by_condition: false,
            started_at_ms: run.map(|r| r.0),
            finished_at_ms: run.and_then(|r| r.1),
            gpus,
            cost_usd: None,
        }
    }

    #[test]
    fn a_finished_build_sums_its_attempts() {
        let mut a = j(1, "a", Failed, Some((10_000, Some(20_000))), 2);
        a.cost_usd = Some(0.5);
        let mut b = j(3, "a", Succeeded, Some((30_000, Some(3_630_000))), 1);
        b.cost_usd = Some(1.25);
        let jobs = [a, j(2, "b", Succeeded, Some((12_000, Some(40_000))), 0), b];
        let s = summarize(4_000, &jobs, 9_999_999);
        assert_eq!(s.state, PipelineState::Ended(Succeeded), "the retry passed");
        assert_eq!(s.duration_ms, Some(3_630_000 - 10_000));
        assert_eq!(s.queued_ms, 6_000);
        assert!((s.gpu_hours - (2.0 * 10.0 / 3600.0 + 1.0)).abs() < 1e-9, "{}", s.gpu_hours);
        assert_eq!(s.cost_usd, Some(1.75));
        assert_eq!((s.steps, s.jobs), (2, 3));
    }

    #[test]
    fn a_running_build_counts_to_now_and_a_waiting_one_has_no_duration() {
        let s = summarize(0, &[j(1, "a", Running, Some((1_000, None)), 4)], 3_601_000);
        assert_eq!(s.state, PipelineState::Running);
        assert_eq!(s.duration_ms, Some(3_600_000));
        assert!((s.gpu_hours - 4.0).abs() < 1e-9);
        let s = summarize(0, &[j(1, "a", Queued, None, 1)], 5_000);
        assert_eq!((s.duration_ms, s.queued_ms, s.cost_usd), (None, 5_000, None));
        // Ended without running (cancelled while queued): it waited until then.
        let mut c = j(1, "a", Cancelled, None, 1);
        c.finished_at_ms = Some(2_000);
        assert_eq!(summarize(0, &[c], 50_000).queued_ms, 2_000);
    }

    #[test]
    fn listed_facts_are_bounded_and_drop_changed_paths() {
        let f = BuildFacts {
            subject: Some("x".repeat(100_000)),
            author: Some("<script>".into()),
            changed: Some(vec!["a".into(); 10]),
            ..Default::default()
        };
        let l = for_list(&f);
        assert_eq!(l.subject.as_ref().map(|s| s.chars().count()), Some(MAX_SUBJECT_CHARS + 1));
        assert_eq!(l.author.as_deref(), Some("<script>"), "text: the page escapes it");
        assert_eq!(l.changed, None);
    }
}
