//! The schedules page: every `[[schedule]]` of the server's config, when it fires next (in
//! UTC and in its own time zone) and what its latest fires did. Signed-in viewers only (a
//! schedule names repositories); the admin gets a "Run now" button per schedule.

use crate::pages::{enc, fmt_time, layout, post_button, Viewer};
use gpuci_protocol::api::{ScheduleFire, ScheduleSummary};
use maud::{html, Markup};

pub fn schedules(list: &[ScheduleSummary], viewer: &Viewer, now_ms: i64) -> Markup {
    layout(
        "Schedules",
        viewer,
        "Schedules",
        html! {
            h1 { "Schedules" }
            p.muted { "Pipelines the coordinator runs on a cron schedule, from the server's configuration (" code { "[[schedule]]" } "). Each fire is recorded before it runs: a fire missed while the coordinator was down runs once when it is back." }
            @if list.is_empty() {
                p { "No schedules are configured." }
            } @else {
                div.scroll { table {
                    caption { (list.len()) " schedules" }
                    thead { tr {
                        th scope="col" { "Name" } th scope="col" { "When" } th scope="col" { "Pipeline" }
                        th scope="col" { "Next run" } th scope="col" { "Latest fires" }
                        @if viewer.may_change() { th scope="col" { span.sr-only { "Actions" } } }
                    } }
                    tbody { @for s in list {
                        tr id=(format!("schedule-{}", enc(&s.name))) {
                            th scope="row" { (crate::ansi::visible(&s.name)) @if !s.enabled { " " span.badge.s-cancelled { "disabled" } } }
                            td { code { (s.cron) } br; span.muted { (s.timezone) } }
                            td {
                                (crate::ansi::visible(&s.repository))
                                @if let Some(b) = &s.branch { " @ " (crate::ansi::visible(b)) } @else { span.muted { " (default branch)" } }
                                br; code { (crate::ansi::visible(&s.pipeline)) }
                            }
                            td { @match (s.next_run_ms, &s.next_run_local) {
                                (Some(ms), local) => {
                                    time datetime=(fmt_time(ms)) { (fmt_time(ms)) }
                                    @if let Some(l) = local { br; span.muted { (l) } }
                                    br; span.muted { "in " (crate::pages::fmt_duration_ms(ms - now_ms)) }
                                }
                                (None, _) => { span.muted { @if s.enabled { "never again" } @else { "—" } } }
                            } }
                            td { @if s.fires.is_empty() { span.muted { "none yet" } } @else {
                                ul.plain { @for f in s.fires.iter().take(5) { li { (fire(f)) } } }
                            } }
                            @if viewer.may_change() {
                                td { (post_button(&format!("/ui/schedules/{}/run", enc(&s.name)), viewer, "Run now", "")) }
                            }
                        }
                    } }
                } }
            }
        },
    )
}

fn fire(f: &ScheduleFire) -> Markup {
    html! {
        time datetime=(fmt_time(f.fired_at_ms)) { (fmt_time(f.fired_at_ms)) }
        " " span.muted { "(" (f.cause) ")" }
        " "
        @match (f.pipeline_id, &f.error) {
            (Some(p), _) => {
                a href=(format!("/ui/pipelines/{p}")) { "pipeline " (p) }
                @if let Some(state) = &f.pipeline_state { " " span class=(format!("badge s-{state}")) { (state) } }
            }
            (None, Some(e)) => { span.badge.s-failed { "no pipeline" } " " (crate::ansi::visible(e)) }
            (None, None) => { span.muted { "firing" } }
        }
        @if let Some(from) = f.skipped_from_ms {
            br; span.muted { "catch-up: occurrences since " (fmt_time(from)) " did not run" }
        }
    }
}
