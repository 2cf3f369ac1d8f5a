//! The builds list, the dashboard's landing page: one row per pipeline, newest first, with
//! what a Buildkite or GitHub Actions user looks for: repository, commit subject, branch or
//! pull request, author, trigger, state, duration, time queued, GPU-hours and cost.

use crate::pages::{enc, fmt_duration_ms, layout, short_sha, Origin, Viewer};
use gpuci_core::builds::BuildSummary;
use gpuci_core::condition::BuildFacts;
use gpuci_core::progress::PipelineState;
use maud::{html, Markup};

/// A build as the list shows it.
#[derive(Clone, Debug)]
pub struct BuildRow {
    pub id: i64,
    pub file_name: String,
    pub created_at_ms: i64,
    pub origin: Origin,
    /// What its submitter (or GitHub) said it builds; default when unknown.
    pub facts: BuildFacts,
    pub summary: BuildSummary,
}

/// What started it: the build's event, else the GitHub origin's, else a submission.
pub fn trigger(r: &BuildRow) -> String {
    match (&r.facts.event, &r.origin.event) {
        (Some(e), _) => e.as_str().to_string(),
        (None, Some(e)) => e.clone(),
        (None, None) => "manual".to_string(),
    }
}

fn state_badge(s: PipelineState) -> Markup {
    let s = s.as_str();
    html! { span class=(format!("badge s-{s}")) { (s) } }
}

/// The builds list. `next_page`: the id the next page starts below.
pub fn builds(rows: &[BuildRow], next_page: Option<i64>, viewer: &Viewer) -> Markup {
    layout(
        "Builds",
        viewer,
        "Builds",
        html! {
            h1 { "Builds" }
            @if !viewer.signed_in() { p.muted { "Showing public repositories only. " a href="/ui/login" { "Sign in" } " to see everything." } }
            div #live data-live="builds" {
                div.scroll {
                    table.builds {
                        caption { (rows.len()) " builds, newest first" }
                        thead { tr {
                            th scope="col" { "Build" } th scope="col" { "State" } th scope="col" { "Repository" }
                            th scope="col" { "Commit" } th scope="col" { "Branch / PR" } th scope="col" { "Author" }
                            th scope="col" { "Trigger" } th scope="col" { "Duration" } th scope="col" { "Queued" }
                            th scope="col" { "GPU-hours" } th scope="col" { "Cost" }
                        } }
                        tbody {
                            @for r in rows {
                                @let s = &r.summary;
                                @let sha = r.facts.commit.as_ref().or(r.origin.sha.as_ref());
                                tr id=(format!("build-{}", r.id)) data-state=(s.state.as_str()) {
                                    td { a href=(format!("/ui/pipelines/{}", r.id)) { "#" (r.id) } br; span.muted { (r.file_name) " · " (s.steps) " steps" } }
                                    td { (state_badge(s.state)) }
                                    td { @match (&r.origin.repository, &r.origin.repository_url) {
                                        (Some(repo), Some(url)) => a href=(url) rel="noopener noreferrer" { (repo) },
                                        (Some(repo), None) => span { (repo) },
                                        _ => span.muted { "—" },
                                    } }
                                    td.subject {
                                        @if let Some(subject) = &r.facts.subject { span { (crate::ansi::visible(subject)) } br; }
                                        @if let Some(sha) = sha {
                                            @match &r.origin.repository_url {
                                                Some(url) => a.sha href=(format!("{url}/commit/{}", enc(sha))) rel="noopener noreferrer" { code { (short_sha(sha)) } },
                                                None => code { (short_sha(sha)) },
                                            }
                                        }
                                    }
                                    td {
                                        @if let Some(b) = &r.facts.branch { code { (crate::ansi::visible(b)) } }
                                        @if let Some(t) = r.facts.tag.as_ref().filter(|t| !t.is_empty()) { " " code.tag { (crate::ansi::visible(t)) } }
                                        @if let Some(pr) = r.origin.pr {
                                            " "
                                            @match &r.origin.repository_url {
                                                Some(url) => a href=(format!("{url}/pull/{pr}")) rel="noopener noreferrer" { "PR #" (pr) },
                                                None => span { "PR #" (pr) },
                                            }
                                        }
                                    }
                                    td { @match &r.facts.author { Some(a) => { (crate::ansi::visible(a)) }, None => span.muted { "—" } } }
                                    td { (trigger(r)) }
                                    td.num { @match s.duration_ms { Some(d) => { (fmt_duration_ms(d)) }, None => span.muted { "—" } } }
                                    td.num { (fmt_duration_ms(s.queued_ms)) }
                                    td.num { (format!("{:.2}", s.gpu_hours)) }
                                    td.num { @match s.cost_usd { Some(c) => { "$" (format!("{c:.2}")) }, None => span.muted { "—" } } }
                                }
                            }
                        }
                    }
                }
                @if let Some(before) = next_page {
                    p { a href=(format!("/ui/?before={before}")) { "Older builds" } }
                }
            }
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pages::Role;
    use gpuci_core::condition::BuildEvent;
    use gpuci_core::job::JobState;

    fn row(facts: BuildFacts, origin: Origin) -> BuildRow {
        BuildRow {
            id: 12,
            file_name: ".gpuci.yml".into(),
            created_at_ms: 0,
            origin,
            facts,
            summary: BuildSummary {
                state: PipelineState::Ended(JobState::Failed),
                duration_ms: Some(65_000),
                queued_ms: 3_000,
                gpu_hours: 1.5,
                cost_usd: Some(4.2),
                steps: 3,
                jobs: 4,
            },
        }
    }

    #[test]
    fn a_build_row_says_what_a_ci_user_looks_for_and_escapes_it() {
        let facts = BuildFacts {
            branch: Some("feature/<b>x</b>".into()),
            event: Some(BuildEvent::Push),
            commit: Some("0123456789abcdef".into()),
            subject: Some("Fix <script>alert(1)</script> \u{202e}kernel".into()),
            author: Some("Ada".into()),
            ..Default::default()
        };
        let origin = Origin {
            repository: Some("acme/kernels".into()),
            repository_url: Some("https://github.com/acme/kernels".into()),
            pr: Some(7),
            ..Default::default()
        };
        let v = Viewer { role: Role::Reader, csrf: String::new() };
        let html = builds(&[row(facts, origin)], Some(12), &v).into_string();
        for want in
            ["#12", "acme/kernels", "0123456789", "PR #7", "Ada", "push", "1m 05s", "3 s", "1.50", "$4.20", "failed"]
        {
            assert!(html.contains(want), "{want}: {html}");
        }
        assert!(!html.contains("<script>alert") && !html.contains("<b>x"), "{html}");
        assert!(html.contains("&lt;U+202E&gt;") || html.contains("<U+202E>") || html.contains("&lt;U+202E>"), "{html}");
        assert!(html.contains("/ui/?before=12"));
    }

    #[test]
    fn the_trigger_falls_back_to_the_origin_then_manual() {
        let gh = Origin { event: Some("pull_request".into()), ..Default::default() };
        assert_eq!(trigger(&row(BuildFacts::default(), gh)), "pull_request");
        assert_eq!(trigger(&row(BuildFacts::default(), Origin::default())), "manual");
        let sched = BuildFacts { event: Some(BuildEvent::Schedule), ..Default::default() };
        assert_eq!(trigger(&row(sched, Origin::default())), "schedule");
    }
}
