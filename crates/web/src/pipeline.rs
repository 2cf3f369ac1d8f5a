//! A pipeline's page: its state, "retry failed" and "cancel all" for those who may change
//! things, the dependency graph of its steps (inline SVG drawn here, no script), the
//! timeline of its jobs, and the jobs themselves.

use crate::pages::{fmt_duration_ms, job_badge, jobs_table, layout, post_button, JobRow, Viewer};
use gpuci_core::job::JobState;
use maud::{html, Markup};
use std::collections::BTreeMap;

/// What the pipeline page shows.
#[derive(Clone, Debug)]
pub struct PipelinePage {
    pub id: i64,
    pub file_name: String,
    pub state: String,
    /// Every job (every attempt), oldest first.
    pub rows: Vec<JobRow>,
    /// Each step's `depends_on`, by step key.
    pub depends_on: BTreeMap<String, Vec<String>>,
}

/// A step in the graph: its latest attempt, its column (how many steps come before it on
/// the longest path) and its row in that column.
#[derive(Clone, Debug, PartialEq)]
pub struct Node {
    pub key: String,
    pub job: i64,
    pub col: usize,
    pub row: usize,
}

/// Lays the steps out: the latest attempt of each, in columns by dependency depth. Pure;
/// bounded for any input (an unknown dependency is ignored; a cycle, which validation
/// refuses, cannot loop: depths stop growing after one pass per step).
pub fn layout_graph(rows: &[JobRow], depends_on: &BTreeMap<String, Vec<String>>) -> Vec<Node> {
    let mut latest: BTreeMap<&str, i64> = BTreeMap::new();
    let mut order: Vec<&str> = Vec::new();
    for r in rows {
        let k = r.job.step_key.as_str();
        match latest.get(k) {
            Some(id) if *id > r.job.id => {}
            Some(_) => {
                latest.insert(k, r.job.id);
            }
            None => {
                latest.insert(k, r.job.id);
                order.push(k);
            }
        }
    }
    let mut depth: BTreeMap<&str, usize> = order.iter().map(|k| (*k, 0)).collect();
    for _ in 0..order.len() {
        let mut changed = false;
        for k in &order {
            let d = depends_on
                .get(*k)
                .into_iter()
                .flatten()
                .filter_map(|dep| depth.get(dep.as_str()).map(|d| d + 1))
                .max()
                .unwrap_or(0)
                .min(order.len());
            if depth[k] != d {
                depth.insert(k, d);
                changed = true;
            }
        }
        if !changed {
            break;
        }
    }
    let mut per_col: BTreeMap<usize, usize> = BTreeMap::new();
    order
        .iter()
        .map(|k| {
            let col = depth[k];
            let row = per_col.entry(col).or_insert(0);
            let n = Node { key: (*k).to_string(), job: latest[k], col, row: *row };
            *row += 1;
            n
        })
        .collect()
}

const NODE_W: usize = 190;
const NODE_H: usize = 40;
const COL_GAP: usize = 50;
const ROW_GAP: usize = 12;
/// Characters of a step's name a node shows (the title has all of it, up to 200).
const LABEL_CHARS: usize = 24;

fn cut(s: &str, n: usize) -> String {
    match s.char_indices().nth(n) {
        Some((i, _)) => format!("{}…", &s[..i]),
        None => s.to_string(),
    }
}

/// The dependency graph as inline SVG, with the same facts as a list for screen readers.
pub fn graph(rows: &[JobRow], depends_on: &BTreeMap<String, Vec<String>>) -> Markup {
    let nodes = layout_graph(rows, depends_on);
    let by_key: BTreeMap<&str, &Node> = nodes.iter().map(|n| (n.key.as_str(), n)).collect();
    let job = |id: i64| rows.iter().find(|r| r.job.id == id).map(|r| &r.job);
    let cols = nodes.iter().map(|n| n.col + 1).max().unwrap_or(1);
    let rows_n = nodes.iter().map(|n| n.row + 1).max().unwrap_or(1);
    let w = cols * (NODE_W + COL_GAP) - COL_GAP + 2;
    let h = rows_n * (NODE_H + ROW_GAP) - ROW_GAP + 2;
    let x = |n: &Node| 1 + n.col * (NODE_W + COL_GAP);
    let y = |n: &Node| 1 + n.row * (NODE_H + ROW_GAP);
    html! {
        div.scroll {
            svg.graph width=(w) height=(h) viewBox=(format!("0 0 {w} {h}")) role="group" aria-labelledby="graph-h" {
                @for n in &nodes {
                    @for dep in depends_on.get(&n.key).into_iter().flatten() {
                        @if let Some(d) = by_key.get(dep.as_str()) {
                            @let (x1, y1, x2, y2) = (x(d) + NODE_W, y(d) + NODE_H / 2, x(n), y(n) + NODE_H / 2);
                            @let mid = (x1 + x2) / 2;
                            path.edge d=(format!("M{x1},{y1} C{mid},{y1} {mid},{y2} {x2},{y2}")) {}
                        }
                    }
                }
                @for n in &nodes {
                    @if let Some(j) = job(n.job) {
                        @let name = crate::ansi::visible(&j.name);
                        a href=(format!("/ui/jobs/{}", j.id)) {
                            g class=(format!("node s-{}", j.state.as_str())) {
                                title { (cut(&name, 200)) ": " (j.state.as_str()) }
                                rect x=(x(n)) y=(y(n)) width=(NODE_W) height=(NODE_H) rx="6" {}
                                text.name x=(x(n) + 10) y=(y(n) + 17) { (cut(&name, LABEL_CHARS)) }
                                text.st x=(x(n) + 10) y=(y(n) + 33) { (j.state.as_str()) @if j.soft_failed { " (soft)" } " · #" (j.id) }
                            }
                        }
                    }
                }
            }
        }
        ul.sr-only {
            @for n in &nodes {
                @if let Some(j) = job(n.job) {
                    li { (cut(&crate::ansi::visible(&j.name), 200)) ": " (j.state.as_str())
                        @if let Some(d) = depends_on.get(&n.key).filter(|d| !d.is_empty()) { ", after " (d.join(", ")) } }
                }
            }
        }
    }
}

/// The pipeline page.
pub fn pipeline(p: &PipelinePage, viewer: &Viewer, now_ms: i64) -> Markup {
    let (id, rows) = (p.id, p.rows.as_slice());
    let start = rows.iter().map(|r| r.job.created_at_ms).min().unwrap_or(now_ms);
    let end = rows.iter().map(|r| r.job.finished_at_ms.unwrap_or(now_ms)).max().unwrap_or(now_ms).max(start + 1);
    let span = (end - start) as f64;
    let pct = |a: i64, b: i64| -> (f64, f64) {
        let l = (a - start) as f64 / span * 100.0;
        let w = ((b - a).max(0) as f64 / span * 100.0).max(0.3);
        (l, w)
    };
    let nodes = layout_graph(rows, &p.depends_on);
    let latest: Vec<&gpuci_protocol::api::JobSummary> =
        nodes.iter().filter_map(|n| rows.iter().find(|r| r.job.id == n.job)).map(|r| &r.job).collect();
    let failed = latest
        .iter()
        .any(|j| matches!(j.state, JobState::Failed | JobState::TimedOut | JobState::Lost) && !j.soft_failed);
    let active = rows.iter().any(|r| !r.job.state.is_terminal());
    layout(
        &format!("Pipeline {id}"),
        viewer,
        "Builds",
        html! {
            h1 { "Pipeline " (id) " " span.muted { (p.file_name) } }
            div #live data-live="pipeline" {
                p { "State: " strong #pipeline-state { (p.state) } " · " (rows.len()) " jobs · " (fmt_duration_ms(end - start)) }
                @if viewer.may_change() && (failed || active) {
                    div.actions {
                        @if failed { (post_button(&format!("/ui/pipelines/{id}/retry-failed"), viewer, "Retry failed", "")) }
                        @if active { (post_button(&format!("/ui/pipelines/{id}/cancel"), viewer, "Cancel all", "danger")) }
                    }
                }
                section aria-labelledby="graph-h" {
                    h2 #graph-h { "Steps" }
                    (graph(rows, &p.depends_on))
                }
                section aria-labelledby="tl" {
                    h2 #tl { "Timeline" }
                    p.legend { span.k.waiting { "waiting" } " " span.k.assigned { "assigned" } " " span.k.running { "running" } }
                    ol.timeline {
                        @for r in rows {
                            @let j = &r.job;
                            @let assigned = j.assigned_at_ms.or(j.started_at_ms).unwrap_or(j.finished_at_ms.unwrap_or(now_ms));
                            @let started = j.started_at_ms.unwrap_or(j.finished_at_ms.unwrap_or(now_ms));
                            @let ended = j.finished_at_ms.unwrap_or(now_ms);
                            @let words = format!("waited {}, assigned {}, ran {}",
                                fmt_duration_ms(assigned.min(started) - j.created_at_ms),
                                fmt_duration_ms(started - assigned.min(started)),
                                if j.started_at_ms.is_some() { fmt_duration_ms(ended - started) } else { "not at all".into() });
                            li {
                                a.tl-name href=(format!("/ui/jobs/{}", j.id)) { "#" (j.id) " " (crate::ansi::visible(&j.name)) }
                                " " (job_badge(j))
                                span.sr-only { ": " (words) }
                                div.tl-track aria-hidden="true" title=(words) {
                                    @let (l, w) = pct(j.created_at_ms, assigned.min(started));
                                    span.seg.waiting style=(format!("left:{l:.2}%;width:{w:.2}%")) {}
                                    @if j.assigned_at_ms.is_some() || j.started_at_ms.is_some() {
                                        @let (l, w) = pct(assigned.min(started), started);
                                        span.seg.assigned style=(format!("left:{l:.2}%;width:{w:.2}%")) {}
                                    }
                                    @if j.started_at_ms.is_some() {
                                        @let (l, w) = pct(started, ended);
                                        span.seg.running style=(format!("left:{l:.2}%;width:{w:.2}%")) {}
                                    }
                                }
                            }
                        }
                    }
                }
                (jobs_table(rows, viewer, now_ms, "Jobs of this pipeline"))
            }
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pages::{Origin, Role};
    use gpuci_protocol::api::JobSummary;

    fn row(id: i64, key: &str, name: &str, state: JobState) -> JobRow {
        JobRow {
            job: JobSummary {
                skipped_by_condition: false,
                id,
                pipeline_id: 1,
                step_key: key.into(),
                name: name.into(),
                state,
                soft_failed: false,
                reason: String::new(),
                attempt: 1,
                agent_id: None,
                agent_name: None,
                gpus: vec![],
                created_at_ms: 0,
                assigned_at_ms: None,
                started_at_ms: None,
                finished_at_ms: None,
                exit_code: None,
                telemetry: None,
                cost: None,
                unenforced: vec![],
            },
            origin: Origin::default(),
            fleet: None,
        }
    }

    fn deps(d: &[(&str, &[&str])]) -> BTreeMap<String, Vec<String>> {
        d.iter().map(|(k, v)| (k.to_string(), v.iter().map(|s| s.to_string()).collect())).collect()
    }

    #[test]
    fn steps_go_in_columns_by_depth_with_their_latest_attempt() {
        let rows = [
            row(1, "build", "build", JobState::Succeeded),
            row(2, "test", "test", JobState::Failed),
            row(3, "lint", "lint", JobState::Succeeded),
            row(4, "deploy", "deploy", JobState::Skipped),
            row(5, "test", "test", JobState::Succeeded),
        ];
        let d = deps(&[("test", &["build"]), ("deploy", &["test", "lint"])]);
        let n = layout_graph(&rows, &d);
        let at = |k: &str| n.iter().find(|n| n.key == k).map(|n| (n.col, n.row, n.job)).unwrap();
        assert_eq!(at("build"), (0, 0, 1));
        assert_eq!(at("lint"), (0, 1, 3));
        assert_eq!(at("test"), (1, 0, 5), "the retry is the node");
        assert_eq!(at("deploy"), (2, 0, 4));
    }

    #[test]
    fn a_cycle_or_unknown_dependency_stays_bounded() {
        let rows = [row(1, "a", "a", JobState::Queued), row(2, "b", "b", JobState::Queued)];
        let n = layout_graph(&rows, &deps(&[("a", &["b"]), ("b", &["a", "ghost"])]));
        assert_eq!(n.len(), 2);
        assert!(n.iter().all(|n| n.col <= 2), "{n:?}");
    }

    #[test]
    fn names_are_escaped_and_cut_and_buttons_need_the_admin() {
        let evil = format!("<script>alert(1)</script>{}", "x".repeat(10_000));
        let rows = vec![row(1, "a", &evil, JobState::Failed), row(2, "b", "b", JobState::Running)];
        let p = PipelinePage {
            id: 7,
            file_name: ".gpuci.yml".into(),
            state: "running".into(),
            rows,
            depends_on: BTreeMap::new(),
        };
        let admin = Viewer { role: Role::Admin, csrf: "c".into() };
        let html = pipeline(&p, &admin, 0).into_string();
        assert!(!html.contains("<script>alert"), "{html}");
        assert!(html.contains("/ui/pipelines/7/retry-failed") && html.contains("/ui/pipelines/7/cancel"));
        let reader = Viewer { role: Role::Reader, csrf: String::new() };
        let html = pipeline(&p, &reader, 0).into_string();
        assert!(!html.contains("retry-failed") && !html.contains("Cancel all"));
    }
}
