//! The pages. Each takes plain data and the viewer, and returns the whole document.

use crate::chart;
use gpuci_core::fleet::cost::CostReport;
use gpuci_core::job::JobState;
use gpuci_protocol::agent::TelemetryPoint;
use gpuci_protocol::api::{AgentSummary, FleetStatus, JobSummary, LogLine};
use maud::{html, Markup, PreEscaped, DOCTYPE};
use std::collections::BTreeMap;

/// Who is looking.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// Signed in with the API token: may cancel, retry and release.
    Admin,
    /// Signed in with the read-only token: sees everything, changes nothing.
    Reader,
    /// Not signed in: sees only the public repositories' jobs and logs.
    Anonymous,
}

#[derive(Clone, Debug)]
pub struct Viewer {
    pub role: Role,
    /// The form token that must come back with every change this viewer makes.
    pub csrf: String,
}

impl Viewer {
    pub fn signed_in(&self) -> bool {
        self.role != Role::Anonymous
    }
    pub fn may_change(&self) -> bool {
        self.role == Role::Admin
    }
}

/// Where a job's pipeline came from, as the dashboard shows it.
#[derive(Clone, Debug, Default)]
pub struct Origin {
    /// `owner/name`.
    pub repository: Option<String>,
    pub sha: Option<String>,
    pub pr: Option<u64>,
    pub event: Option<String>,
    /// GitHub's web address of the repository (`https://github.com/owner/name`).
    pub repository_url: Option<String>,
    /// The check run GitHub shows for this job.
    pub check_run_url: Option<String>,
    /// Its jobs and logs may be seen without signing in (`[dashboard] public_repositories`).
    pub public: bool,
}

/// A job as the lists show it.
#[derive(Clone, Debug)]
pub struct JobRow {
    pub job: JobSummary,
    pub origin: Origin,
    /// The fleet whose machine ran it.
    pub fleet: Option<String>,
}

/// Filters of the jobs list, as given (echoed into the form).
#[derive(Clone, Debug, Default)]
pub struct JobFilters {
    pub repository: String,
    pub state: String,
    pub fleet: String,
}

pub(crate) fn fmt_duration_ms(ms: i64) -> String {
    let s = ms.max(0) / 1000;
    match s {
        0 if ms < 1000 => format!("{} ms", ms.max(0)),
        0..=59 => format!("{s} s"),
        60..=3599 => format!("{}m {:02}s", s / 60, s % 60),
        _ => format!("{}h {:02}m", s / 3600, (s % 3600) / 60),
    }
}

pub(crate) fn fmt_time(ms: i64) -> String {
    jiff::Timestamp::from_millisecond(ms)
        .map_or_else(|_| ms.to_string(), |t| t.strftime("%Y-%m-%d %H:%M:%S UTC").to_string())
}

/// How long a job has run (or ran), or waited while queued.
pub fn job_duration(j: &JobSummary, now_ms: i64) -> String {
    match (j.started_at_ms, j.finished_at_ms) {
        (Some(s), Some(f)) => fmt_duration_ms(f - s),
        (Some(s), None) => fmt_duration_ms(now_ms - s),
        (None, Some(f)) => format!("waited {}", fmt_duration_ms(f - j.created_at_ms)),
        (None, None) => format!("waiting {}", fmt_duration_ms(now_ms - j.created_at_ms)),
    }
}

pub(crate) fn state_badge(state: JobState) -> Markup {
    let s = state.as_str();
    html! { span class=(format!("badge s-{s}")) { (s) } }
}

/// A job's state; a soft failure (its step's `soft_fail`) says so, apart from a failure.
pub(crate) fn job_badge(j: &JobSummary) -> Markup {
    if j.soft_failed {
        let s = j.state.as_str();
        html! { span class=(format!("badge s-{s} soft")) title="soft failed: this does not fail the pipeline" { (s) " (soft)" } }
    } else {
        state_badge(j.state)
    }
}

pub(crate) fn short_sha(sha: &str) -> &str {
    sha.get(..10).unwrap_or(sha)
}

/// The shell of every page: skip link, navigation, main.
pub fn layout(title: &str, viewer: &Viewer, active: &str, body: Markup) -> Markup {
    let nav: &[(&str, &str, bool)] = &[
        ("/ui/", "Builds", false),
        ("/ui/jobs", "Jobs", false),
        ("/ui/queue", "Queue", true),
        ("/ui/fleet", "Fleet", true),
        ("/ui/spend", "Spend", true),
        ("/ui/schedules", "Schedules", true),
    ];
    html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                meta name="viewport" content="width=device-width, initial-scale=1";
                meta name="referrer" content="same-origin";
                title { (title) " · gpuci" }
                link rel="stylesheet" href=(crate::CSS_PATH);
                script src=(crate::JS_PATH) defer {}
            }
            body {
                a.skip href="#main" { "Skip to content" }
                header.top {
                    a.brand href="/ui/" { "gpuci" }
                    nav aria-label="Main" {
                        ul {
                            @for (href, name, signed) in nav {
                                @if !signed || viewer.signed_in() {
                                    li { a href=(href) aria-current=[(active == *name).then_some("page")] { (name) } }
                                }
                            }
                            // The audit log is the admin's alone.
                            @if viewer.may_change() {
                                li { a href="/ui/audit" aria-current=[(active == "Audit").then_some("page")] { "Audit" } }
                            }
                        }
                    }
                    div.who {
                        @match viewer.role {
                            Role::Admin => { span { "signed in" } (post_button("/ui/logout", viewer, "Sign out", "link")) }
                            Role::Reader => { span { "signed in, read-only" } (post_button("/ui/logout", viewer, "Sign out", "link")) }
                            Role::Anonymous => { a href="/ui/login" { "Sign in" } }
                        }
                    }
                }
                main #main tabindex="-1" {
                    (body)
                }
                p #live-status.sr-only role="status" aria-live="polite" {}
            }
        }
    }
}

pub(crate) fn post_button(action: &str, viewer: &Viewer, label: &str, class: &str) -> Markup {
    html! {
        form.inline method="post" action=(action) {
            input type="hidden" name="csrf" value=(viewer.csrf);
            button type="submit" class=(class) { (label) }
        }
    }
}

/// The sign-in page.
pub fn login(error: Option<&str>, next: &str) -> Markup {
    let viewer = Viewer { role: Role::Anonymous, csrf: String::new() };
    layout(
        "Sign in",
        &viewer,
        "",
        html! {
            h1 { "Sign in" }
            p { "Paste the API token (" code { "<data-dir>/api-token" } ") to see and change everything, or the read-only token ("
                code { "<data-dir>/read-token" } ") to look." }
            @if let Some(e) = error { p.error role="alert" { (e) } }
            form.login method="post" action="/ui/login" {
                input type="hidden" name="next" value=(next);
                label for="token" { "Token" }
                input #token type="password" name="token" autocomplete="current-password" required autofocus;
                button type="submit" { "Sign in" }
            }
        },
    )
}

/// A page that says what went wrong (404, 403).
pub fn message(title: &str, viewer: &Viewer, text: &str) -> Markup {
    layout(title, viewer, "", html! { h1 { (title) } p { (text) } })
}

pub(crate) fn origin_cell(o: &Origin) -> Markup {
    html! {
        @if let Some(repo) = &o.repository {
            @match &o.repository_url {
                Some(url) => a href=(url) rel="noopener noreferrer" { (repo) },
                None => span { (repo) },
            }
            @if let Some(pr) = o.pr {
                " "
                @match &o.repository_url {
                    Some(url) => a href=(format!("{url}/pull/{pr}")) rel="noopener noreferrer" { "#" (pr) },
                    None => span { "#" (pr) },
                }
            }
            @if let Some(sha) = &o.sha {
                " "
                @match &o.repository_url {
                    Some(url) => a.sha href=(format!("{url}/commit/{sha}")) rel="noopener noreferrer" { code { (short_sha(sha)) } },
                    None => code { (short_sha(sha)) },
                }
            }
        } @else {
            span.muted { "submitted" }
        }
    }
}

pub(crate) fn jobs_table(rows: &[JobRow], viewer: &Viewer, now_ms: i64, caption: &str) -> Markup {
    let infra = viewer.signed_in();
    let short = crate::short_gpu_ids(rows.iter().flat_map(|r| r.job.gpus.iter().map(String::as_str)));
    html! {
        div.scroll {
            table.jobs {
                caption { (caption) }
                thead { tr {
                    th scope="col" { "Job" } th scope="col" { "State" } th scope="col" { "Reason" }
                    th scope="col" { "Duration" } th scope="col" { "Origin" }
                    @if infra { th scope="col" { "Agent" } th scope="col" { "GPUs" } }
                } }
                tbody {
                    @for r in rows {
                        @let j = &r.job;
                        tr id=(format!("job-{}", j.id)) data-state=(j.state.as_str()) {
                            td { a href=(format!("/ui/jobs/{}", j.id)) { "#" (j.id) " " (crate::ansi::visible(&j.name)) }
                                @if j.attempt > 1 { span.muted { " (attempt " (j.attempt) ")" } }
                                br; a.muted href=(format!("/ui/pipelines/{}", j.pipeline_id)) { "pipeline " (j.pipeline_id) } }
                            td { (job_badge(j)) }
                            td.reason { (crate::ansi::visible(&j.reason)) }
                            td { (job_duration(j, now_ms)) }
                            td { (origin_cell(&r.origin)) }
                            @if infra {
                                td { (j.agent_name.as_deref().unwrap_or("")) @if let Some(f) = &r.fleet { br; span.muted { "fleet " (f) } } }
                                td { @for g in &j.gpus { code.uuid title=(g) { (short.get(g).map_or(g.as_str(), String::as_str)) } " " } }
                            }
                        }
                    }
                }
            }
        }
    }
}

/// The jobs list with its filters.
pub fn jobs(
    rows: &[JobRow],
    filters: &JobFilters,
    repositories: &[String],
    fleets: &[String],
    next_page: Option<i64>,
    viewer: &Viewer,
    now_ms: i64,
) -> Markup {
    let states =
        ["", "queued", "assigned", "running", "succeeded", "failed", "cancelled", "timed_out", "lost", "skipped"];
    layout(
        "Jobs",
        viewer,
        "Jobs",
        html! {
            h1 { "Jobs" }
            @if !viewer.signed_in() { p.muted { "Showing public repositories only. " a href="/ui/login" { "Sign in" } " to see everything." } }
            form.filters method="get" action="/ui/jobs" role="search" aria-label="Filter jobs" {
                label { "Repository " select name="repo" {
                    option value="" { "any" }
                    @for r in repositories { option value=(r) selected[*r == filters.repository] { (r) } }
                } }
                label { "State " select name="state" {
                    @for s in states { option value=(s) selected[*s == filters.state] { @if s.is_empty() { "any" } @else { (s) } } }
                } }
                @if viewer.signed_in() {
                    label { "Fleet " select name="fleet" {
                        option value="" { "any" }
                        @for f in fleets { option value=(f) selected[*f == filters.fleet] { (f) } }
                    } }
                }
                button type="submit" { "Filter" }
            }
            div #live data-live="jobs" {
                (jobs_table(rows, viewer, now_ms, &format!("{} jobs, newest first", rows.len())))
                @if let Some(before) = next_page {
                    p { a href=(format!("/ui/jobs?repo={}&state={}&fleet={}&before={before}", enc(&filters.repository), enc(&filters.state), enc(&filters.fleet))) { "Older jobs" } }
                }
            }
        },
    )
}

/// Percent-encodes a query value.
pub fn enc(s: &str) -> String {
    let mut out = String::new();
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-_.~/*".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// One log line as the job page lists it (also sent live).
/// The most of one line a page shows (the raw log has all of it).
pub const MAX_LINE_SHOWN: usize = 4096;

pub fn log_line(l: &LogLine) -> Markup {
    let system = matches!(l.stream, gpuci_protocol::agent::Stream::System);
    let mut cut = l.text.len().min(MAX_LINE_SHOWN);
    while !l.text.is_char_boundary(cut) {
        cut -= 1;
    }
    let (shown, rest) = l.text.split_at(cut);
    let class = match l.stream {
        gpuci_protocol::agent::Stream::Stdout => "l",
        gpuci_protocol::agent::Stream::Stderr => "l err",
        gpuci_protocol::agent::Stream::System => "l sys",
    };
    // Sections are the job's own markers (`--- title`, `::group::title`): gpuci's lines never
    // open or close one. The title is text, cut and escaped like the rest of the line.
    let section = if system { None } else { gpuci_core::log_sections::marker(shown) };
    let (sec, folded) = match &section {
        Some(gpuci_core::log_sections::Marker::Open { collapsed, .. }) => (Some("open"), *collapsed),
        Some(gpuci_core::log_sections::Marker::Close) => (Some("close"), false),
        None => (None, false),
    };
    let class = match (sec, folded) {
        (Some("open"), true) => format!("{class} sec folded"),
        (Some("open"), false) => format!("{class} sec"),
        _ => class.to_string(),
    };
    let ts = jiff::Timestamp::from_microsecond(l.ts_us).ok();
    html! {
        li id=(format!("L{}", l.seq)) class=(class) data-sec=[sec] {
            a.ln href=(format!("#L{}", l.seq)) aria-label=(format!("line {}", l.seq)) { (l.seq) }
            @if let Some(t) = ts {
                time.ts datetime=(t.to_string()) title=(t.strftime("%Y-%m-%d %H:%M:%S%.3f UTC").to_string()) { (t.strftime("%H:%M:%S").to_string()) }
            }
            // gpuci's own lines carry a mark no colour escape can draw.
            @match &section {
                Some(gpuci_core::log_sections::Marker::Open { title, .. }) => {
                    // Shown (and made a control) by the script; without it every line shows.
                    span.t { button.sec-toggle type="button" hidden aria-expanded=(if folded { "false" } else { "true" }) { (crate::ansi::visible(title)) } span.sec-title { (crate::ansi::visible(title)) } }
                }
                _ => {
                    span.t { @if system { span.sysmark { "gpuci" } " " } (crate::ansi::to_html(shown))
                        @if !rest.is_empty() { span.cut { " … " (rest.len()) " more bytes (the raw log has the whole line)" } } }
                }
            }
        }
    }
}

/// The job page.
#[derive(Clone, Debug)]
pub struct JobPage {
    pub row: JobRow,
    pub lines: Vec<LogLine>,
    /// Lines before the first shown (the page shows the last part of a long log).
    pub skipped_lines: i64,
    pub points: Vec<TelemetryPoint>,
    pub memory_total: Option<u64>,
    /// Whether a newer attempt of this step exists.
    pub retried_by: Option<i64>,
    /// What the job stored (`artifacts:`), by path.
    pub artifacts: Vec<gpuci_protocol::api::ArtifactInfo>,
    /// Its JUnit reports read together (`test_reports:`), if it had any.
    pub tests: Option<gpuci_protocol::api::JobTestReport>,
}

pub fn job(p: &JobPage, viewer: &Viewer, now_ms: i64) -> Markup {
    let j = &p.row.job;
    let last_seq = p.lines.last().map_or(0, |l| l.seq);
    let live = !j.state.is_terminal();
    layout(
        &format!("#{} {}", j.id, crate::ansi::visible(&j.name)),
        viewer,
        "Jobs",
        html! {
            h1 { "#" (j.id) " " (crate::ansi::visible(&j.name)) " " span #job-state { (job_badge(j)) } }
            p.reason #job-reason { (crate::ansi::visible(&j.reason)) }
            dl.facts {
                dt { "Pipeline" } dd { a href=(format!("/ui/pipelines/{}", j.pipeline_id)) { (j.pipeline_id) } " · step " code { (j.step_key) } " · attempt " (j.attempt) }
                dt { "Origin" } dd { (origin_cell(&p.row.origin))
                    @if let Some(c) = &p.row.origin.check_run_url { " · " a href=(c) rel="noopener noreferrer" { "check run" } } }
                dt { "Submitted" } dd { (fmt_time(j.created_at_ms)) }
                dt { "Duration" } dd #job-duration { (job_duration(j, now_ms)) }
                @if viewer.signed_in() {
                    dt { "Agent" } dd { (j.agent_name.as_deref().unwrap_or("—")) @if let Some(f) = &p.row.fleet { " · fleet " (f) } }
                    dt { "GPUs" } dd { @if j.gpus.is_empty() { "none" } @for g in &j.gpus { code.uuid { (g) } " " } }
                }
                @if let Some(c) = &j.cost { dt { "Cost" } dd {
                    @match c.overhead_usd {
                        Some(o) => {
                            "$" (format!("{:.4}", c.usd + o)) ": $" (format!("{:.4}", c.usd)) " while it ran, $" (format!("{:.4}", o))
                            " its share of the machine's boot and idle" @if j.finished_at_ms.is_none() { " so far" }
                        }
                        None => { "$" (format!("{:.4}", c.usd)) }
                    }
                    " (" (c.fleet) ", machine " (c.machine) ", $" (format!("{:.2}", c.price_per_hour)) "/h)"
                } }
                @if let Some(code) = j.exit_code { dt { "Exit code" } dd { (code) } }
                // What its agent ran it without (its operator's opt-outs, issue 26).
                @if !j.unenforced.is_empty() {
                    dt { strong { "NOT enforced" } }
                    dd #job-unenforced { ul.unenforced { @for u in &j.unenforced { li { code { (u.key.as_str()) } " " (crate::ansi::visible(&u.detail)) } } } }
                }
            }
            @if viewer.may_change() {
                div.actions {
                    @if live { (post_button(&format!("/ui/jobs/{}/cancel", j.id), viewer, "Cancel job", "danger")) }
                    @if !live && p.retried_by.is_none() { (post_button(&format!("/ui/jobs/{}/retry", j.id), viewer, "Retry", "")) }
                    @if let Some(n) = p.retried_by { p.muted { "Retried as " a href=(format!("/ui/jobs/{n}")) { "#" (n) } } }
                }
            }
            @if !j.gpus.is_empty() || !p.points.is_empty() {
                section aria-labelledby="gpu-h" {
                    h2 #gpu-h { "GPU" }
                    div #charts { (chart::charts(&p.points, p.memory_total)) }
                    @if let Some(t) = &j.telemetry {
                        p.muted { "Peak memory " (chart::gib(t.peak_memory_bytes as f64)) ", mean utilisation " (format!("{:.0}", t.mean_utilization_pct)) " %, "
                            (format!("{:.1}", t.gpu_seconds)) " GPU-seconds, " (t.samples) " samples." }
                    }
                }
            }
            @if let Some(t) = &p.tests {
                section aria-labelledby="tests-h" {
                    h2 #tests-h { "Tests" }
                    p #tests-summary { strong { (t.summary.describe()) } }
                    @for f in t.files.iter().filter(|f| f.error.is_some()) {
                        p.muted { code { (crate::ansi::visible(&f.path)) } " not read: " (crate::ansi::visible(f.error.as_deref().unwrap_or(""))) }
                    }
                    @if !t.summary.failed.is_empty() {
                        ul.failed-tests { @for f in &t.summary.failed {
                            li {
                                span class="badge s-failed" { (f.kind) } " "
                                code { @if !f.classname.is_empty() { (crate::ansi::visible(&f.classname)) "." } (crate::ansi::visible(&f.name)) }
                                @if !f.message.is_empty() { pre.test-message { (crate::ansi::visible(&f.message)) } }
                            }
                        } }
                    }
                }
            }
            @if !p.artifacts.is_empty() {
                section aria-labelledby="artifacts-h" {
                    h2 #artifacts-h { "Artifacts" }
                    div.scroll { table {
                        caption { (p.artifacts.len()) " files, by path" }
                        thead { tr { th scope="col" { "Path" } th scope="col" { "Size" } th scope="col" { "sha256" } } }
                        tbody { @for a in &p.artifacts {
                            tr {
                                td { a href=(format!("/api/v1/jobs/{}/artifact?path={}", j.id, enc(&a.path))) download { (crate::ansi::visible(&a.path)) } }
                                td { (gpuci_core::quantity::Bytes(a.size).to_string()) }
                                td { code title=(a.sha256) { (a.sha256.get(..12).unwrap_or(&a.sha256)) } }
                            }
                        } }
                    } }
                    p.muted { "Or: " code { "gpuci artifacts download " (j.id) } }
                }
            }
            section aria-labelledby="log-h" {
                h2 #log-h { "Log" }
                div.logbar role="search" {
                    label for="log-search" { "Search the log" }
                    input #log-search type="search" autocomplete="off" placeholder="text in the log";
                    span #log-count aria-live="polite" {}
                    label.follow { input #log-follow type="checkbox" checked; " follow" }
                }
                @if p.skipped_lines > 0 {
                    p.muted { (p.skipped_lines) " earlier lines not shown. " a href=(format!("/api/v1/jobs/{}/logs", j.id)) { "Whole log (NDJSON)" } }
                }
                ol.log #log data-job=(j.id) data-after=(last_seq) data-live=(if live { "1" } else { "0" }) data-state=(j.state.as_str()) aria-label="Log lines" {
                    @for l in &p.lines { (log_line(l)) }
                }
                @if p.lines.is_empty() && !live { p.muted { "No output." } }
            }
        },
    )
}

/// The charts alone (sent live while a job runs).
pub fn charts_fragment(points: &[TelemetryPoint], memory_total: Option<u64>) -> Markup {
    chart::charts(points, memory_total)
}

/// A job's state and reason, sent live.
pub fn state_fragment(j: &JobSummary) -> String {
    job_badge(j).into_string()
}

/// Hosts and their GPUs, and the fleets.
pub fn fleet(
    agents: &[AgentSummary],
    utilization: &BTreeMap<String, (Option<u32>, u64)>,
    fleets: &[FleetStatus],
    viewer: &Viewer,
    now_ms: i64,
) -> Markup {
    layout(
        "Fleet",
        viewer,
        "Fleet",
        html! {
            h1 { "Fleet" }
            div #live data-live="fleet" {
                section aria-labelledby="hosts-h" {
                    h2 #hosts-h { "Hosts" }
                    @if agents.is_empty() { p.muted { "No agent has registered yet." } }
                    @for a in agents {
                        article.host id=(format!("agent-{}", a.id)) aria-labelledby=(format!("agent-h-{}", a.id)) {
                            h3 id=(format!("agent-h-{}", a.id)) { (a.name) " " span class=(format!("badge a-{}", a.state)) { (a.state) }
                                span.muted { " " (a.hostname) " · " (a.slots) " slots · " (a.running.len()) " running · " (a.gpu_backend) " · " (a.isolation) } }
                            @if !a.reason.is_empty() { p.reason { (a.reason) } }
                            @if let Some(seen) = a.last_seen_ms { p.muted { "last seen " (fmt_duration_ms(now_ms - seen)) " ago" } }
                            @if !a.gpus.is_empty() {
                                div.scroll { table.gpus {
                                    caption { "GPUs of " (a.name) }
                                    thead { tr { th scope="col" { "GPU" } th scope="col" { "Model" } th scope="col" { "Memory" } th scope="col" { "Driver / CUDA" }
                                        th scope="col" { "Health" } th scope="col" { "State" } th scope="col" { "Utilisation now" } } }
                                    tbody {
                                        @for g in &a.gpus {
                                            tr id=(format!("gpu-{}", g.info.uuid)) data-state=(g.state) {
                                                td { (g.info.index) " " code.uuid title=(g.info.uuid) { (g.info.uuid) } }
                                                td { (g.info.name) @if g.info.simulated { " " span.badge.sim { "simulated" } } }
                                                td { (g.info.memory.to_string()) }
                                                td { (g.info.driver_version.to_string()) " / " (g.info.cuda_driver_version.as_ref().map(|v| v.to_string()).unwrap_or_else(|| "—".into())) }
                                                td { @match &g.health {
                                                    Some(gpuci_protocol::agent::GpuHealth::Healthy) => span.badge.g-free { "healthy" },
                                                    Some(gpuci_protocol::agent::GpuHealth::Unhealthy { reason }) => { span.badge.g-quarantined { "unhealthy" } br; span.reason { (reason) } },
                                                    None => span.muted { "not checked yet" },
                                                } }
                                                td {
                                                    span class=(format!("badge g-{}", g.state)) { (g.state) }
                                                    @if let Some(job) = g.job_id { " " a href=(format!("/ui/jobs/{job}")) { "job " (job) } }
                                                    @if let Some(r) = &g.reason { br; span.reason { (r) } }
                                                    @if g.state == "quarantined" && viewer.may_change() {
                                                        (post_button(&format!("/ui/gpus/{}/release", enc(&g.info.uuid)), viewer, "Release", ""))
                                                    }
                                                }
                                                td { @match utilization.get(&g.info.uuid) {
                                                    Some((u, mem)) => { (u.map_or("—".to_string(), |u| format!("{u} %"))) " · " (chart::gib(*mem as f64)) },
                                                    None => { "—" },
                                                } }
                                            }
                                        }
                                    }
                                } }
                            }
                        }
                    }
                }
                section aria-labelledby="fleets-h" {
                    h2 #fleets-h { "Fleets" }
                    @if fleets.is_empty() { p.muted { "No fleet is configured (" code { "[[fleet]]" } " in the server's config file)." } }
                    @for f in fleets {
                        article.fleet aria-labelledby=(format!("fleet-h-{}", f.name)) {
                            h3 id=(format!("fleet-h-{}", f.name)) { (f.name) span.muted { " " (f.provider) " · " (f.count) " of max " (f.max) " · wants " (f.wanted) " · min idle " (f.min_idle) } }
                            @if let Some(u) = &f.unavailable { p.error { "Unavailable: " (u) } }
                            p.reason { (f.why) }
                            p { "Spend today: $" (format!("{:.2}", f.spend_today_usd))
                                @if let Some(b) = f.daily_budget_usd { " of $" (format!("{b:.2}")) @if f.budget_reached { " " span.badge.s-failed { "budget reached" } } } }
                            @if !f.machines.is_empty() {
                                div.scroll { table {
                                    caption { "Machines of " (f.name) }
                                    thead { tr { th scope="col" { "Machine" } th scope="col" { "State" } th scope="col" { "Type" } th scope="col" { "Capacity" } } }
                                    tbody { @for m in &f.machines {
                                        tr { td { code { (m.id) } } td { span class=(format!("badge m-{}", m.state)) { (m.state) } } td { (m.instance_type) } td { (m.capacity) " " (m.zone) } }
                                    } }
                                } }
                            }
                            @if !f.recent_errors.is_empty() {
                                details { summary { (f.recent_errors.len()) " recent provider errors" }
                                    ul { @for (at, e) in &f.recent_errors { li { (fmt_time(*at as i64 * 1000)) ": " (e) } } } }
                            }
                        }
                    }
                }
            }
        },
    )
}

/// Jobs listed per reason on the queue page (the oldest; the count says how many more).
const QUEUE_GROUP_ROWS: usize = 50;

/// Queued jobs grouped by why they wait, the longest wait first.
pub fn queue(rows: &[JobRow], viewer: &Viewer, now_ms: i64) -> Markup {
    let mut groups: BTreeMap<&str, Vec<&JobRow>> = BTreeMap::new();
    for r in rows {
        groups.entry(r.job.reason.as_str()).or_default().push(r);
    }
    for g in groups.values_mut() {
        g.sort_by_key(|r| r.job.created_at_ms);
    }
    let mut groups: Vec<(&str, Vec<&JobRow>)> = groups.into_iter().collect();
    groups.sort_by_key(|(_, v)| v.iter().map(|r| r.job.created_at_ms).min().unwrap_or(now_ms));
    layout(
        "Queue",
        viewer,
        "Queue",
        html! {
            h1 { "Queue" }
            div #live data-live="queue" {
                p { (rows.len()) " jobs waiting in " (groups.len()) " groups." }
                @for (reason, jobs) in &groups {
                    @let oldest = jobs.iter().map(|r| r.job.created_at_ms).min().unwrap_or(now_ms);
                    section.group {
                        h2 { span.count { (jobs.len()) } " waiting: " span.reason { (crate::ansi::visible(reason)) } }
                        p.muted { "longest wait " (fmt_duration_ms(now_ms - oldest)) }
                        ul {
                            @for r in jobs.iter().take(QUEUE_GROUP_ROWS) {
                                li { a href=(format!("/ui/jobs/{}", r.job.id)) { "#" (r.job.id) " " (crate::ansi::visible(&r.job.name)) } " · " (origin_cell(&r.origin))
                                    " · waiting " (fmt_duration_ms(now_ms - r.job.created_at_ms)) }
                            }
                        }
                        @if jobs.len() > QUEUE_GROUP_ROWS { p.muted { "and " (jobs.len() - QUEUE_GROUP_ROWS) " more" } }
                    }
                }
            }
        },
    )
}

/// Spend per day, fleet and repository, against budgets.
pub fn spend(
    report: &CostReport,
    fleets: &[FleetStatus],
    budgets: &[(String, f64, f64)],
    days: u32,
    viewer: &Viewer,
) -> Markup {
    let mut per_day: BTreeMap<&str, f64> = BTreeMap::new();
    for r in &report.rows {
        *per_day.entry(r.day.as_str()).or_insert(0.0) += r.usd;
    }
    layout(
        "Spend",
        viewer,
        "Spend",
        html! {
            h1 { "Spend" }
            p { "Last " (days) " days (UTC): $" (format!("{:.2}", report.total_usd)) " in all, of which $" (format!("{:.2}", report.overhead_usd))
                " is the fleets' overhead (boot, idle, GPUs no job leased). Static agents cost nothing here." }
            form.filters method="get" action="/ui/spend" { label { "Days " input type="number" name="days" min="1" max="366" value=(days); } button type="submit" { "Show" } }
            div #live data-live="spend" {
                section aria-labelledby="budgets-h" {
                    h2 #budgets-h { "Budgets today" }
                    @if fleets.iter().all(|f| f.daily_budget_usd.is_none()) && budgets.is_empty() { p.muted { "No budget is set." } }
                    ul.budgets {
                        @for f in fleets { @if let Some(b) = f.daily_budget_usd {
                            li { "Fleet " strong { (f.name) } ": " (meter(f.spend_today_usd, b)) }
                        } }
                        @for (repo, spent, daily) in budgets {
                            li { "Repository " strong { (repo) } ": " (meter(*spent, *daily)) }
                        }
                    }
                }
                section aria-labelledby="days-h" {
                    h2 #days-h { "By day" }
                    div.scroll { table {
                        caption { "Spend per UTC day" }
                        thead { tr { th scope="col" { "Day" } th scope="col" { "USD" } } }
                        tbody { @for (d, usd) in per_day.iter().rev() { tr { td { (d) } td.num { (format!("{usd:.2}")) } } } }
                    } }
                }
                section aria-labelledby="rows-h" {
                    h2 #rows-h { "By day, fleet and repository" }
                    div.scroll { table {
                        caption { "Each row: what one repository's jobs (or a fleet's overhead) cost on one day" }
                        thead { tr { th scope="col" { "Day" } th scope="col" { "Fleet" } th scope="col" { "Repository" } th scope="col" { "GPU-hours" } th scope="col" { "USD" } } }
                        tbody { @for r in report.rows.iter().rev() {
                            tr { td { (r.day) } td { (r.fleet) } td { (r.repository.as_deref().unwrap_or("(overhead)")) }
                                td.num { (format!("{:.2}", r.gpu_hours)) } td.num { (format!("{:.2}", r.usd)) } }
                        } }
                    } }
                }
            }
        },
    )
}

fn meter(spent: f64, budget: f64) -> Markup {
    let pct = if budget > 0.0 { (spent / budget * 100.0).min(100.0) } else { 100.0 };
    html! {
        "$" (format!("{spent:.2}")) " of $" (format!("{budget:.2}")) " "
        meter min="0" max=(format!("{budget}")) value=(format!("{}", spent.min(budget))) aria-label=(format!("{pct:.0} % of the daily budget")) {}
        @if spent >= budget { " " span.badge.s-failed { "reached" } }
    }
}

/// Marks the string as HTML we built ourselves (fragments sent over the live stream).
pub fn trusted(s: String) -> PreEscaped<String> {
    PreEscaped(s)
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpuci_protocol::agent::Stream;

    fn summary(id: i64, name: &str, reason: &str) -> JobSummary {
        JobSummary {
            skipped_by_condition: false,
            id,
            pipeline_id: 1,
            step_key: "k".into(),
            name: name.into(),
            state: JobState::Queued,
            soft_failed: false,
            reason: reason.into(),
            attempt: 1,
            agent_id: None,
            agent_name: Some("ws-1".into()),
            gpus: vec!["GPU-abc".into()],
            created_at_ms: 0,
            assigned_at_ms: None,
            started_at_ms: None,
            finished_at_ms: None,
            exit_code: None,
            telemetry: None,
            cost: None,
            unenforced: vec![],
        }
    }

    #[test]
    fn job_controlled_text_is_escaped_everywhere() {
        let admin = Viewer { role: Role::Admin, csrf: "c".into() };
        let row = JobRow {
            job: summary(1, "<img src=x onerror=alert(1)>", "<script>x</script>"),
            origin: Origin::default(),
            fleet: None,
        };
        let html = jobs(std::slice::from_ref(&row), &JobFilters::default(), &[], &[], None, &admin, 1000).into_string();
        assert!(!html.contains("<img src=x"), "{html}");
        assert!(!html.contains("<script>x"), "{html}");
        let line = LogLine { seq: 1, ts_us: 0, stream: Stream::Stdout, text: "</li><script>alert(1)</script>".into() };
        let page = JobPage {
            row,
            lines: vec![line],
            skipped_lines: 0,
            points: vec![],
            memory_total: None,
            retried_by: None,
            artifacts: vec![],
            tests: None,
        };
        let html = job(&page, &admin, 1000).into_string();
        assert!(html.contains("&lt;/li&gt;&lt;script&gt;"), "{html}");
    }

    /// Issue 26: the job page lists what its agent did not enforce, escaped like everything
    /// an agent says; a job that lost nothing shows no such list.
    #[test]
    fn the_job_page_lists_what_was_not_enforced() {
        use gpuci_protocol::agent::{Protection, Unenforced};
        let v = Viewer { role: Role::Reader, csrf: String::new() };
        let mut row = JobRow { job: summary(1, "t", "r"), origin: Origin::default(), fleet: None };
        let page = |row: JobRow| JobPage {
            row,
            lines: vec![],
            skipped_lines: 0,
            points: vec![],
            memory_total: None,
            retried_by: None,
            artifacts: vec![],
            tests: None,
        };
        assert!(!job(&page(row.clone()), &v, 0).into_string().contains("NOT enforced"));
        row.job.unenforced = vec![
            Unenforced { key: Protection::Limits, detail: "no memory limit (no cgroups)".into() },
            Unenforced { key: Protection::DiskQuota, detail: "<script>alert(1)</script>".into() },
        ];
        let html = job(&page(row), &v, 0).into_string();
        assert!(html.contains("NOT enforced"), "{html}");
        assert!(html.contains("<code>limits</code> no memory limit (no cgroups)"), "{html}");
        assert!(html.contains("<code>disk_quota</code> &lt;script&gt;"), "{html}");
        assert!(!html.contains("<script>alert"), "{html}");
    }

    #[test]
    fn a_huge_line_is_cut_and_gpucis_lines_carry_a_mark_no_escape_can_draw() {
        let text = format!("\u{1b}[1;38;2;210;168;255m{}", "\"".repeat(100_000));
        let html = log_line(&LogLine { seq: 1, ts_us: 0, stream: Stream::Stdout, text }).into_string();
        assert!(html.len() < 40_000, "{} bytes", html.len());
        assert!(html.contains("more bytes"));
        assert!(!html.contains("sysmark"));
        let own = log_line(&LogLine { seq: 2, ts_us: 0, stream: Stream::System, text: "log cut".into() }).into_string();
        assert!(own.contains("class=\"sysmark\""));
    }

    /// Sections and timestamps: a marker line becomes a header with its title as text (a
    /// hostile title stays escaped and bounded); gpuci's own lines never open one.
    #[test]
    fn section_markers_become_headers_and_lines_carry_their_time() {
        let line = |seq: i64, stream: Stream, text: &str| {
            log_line(&LogLine { seq, ts_us: 1_700_000_000_123_456, stream, text: text.into() }).into_string()
        };
        let h = line(1, Stream::Stdout, "--- :hammer: Build");
        assert!(h.contains("data-sec=\"open\"") && h.contains("folded") && h.contains(":hammer: Build"), "{h}");
        assert!(h.contains("<time class=\"ts\" datetime=\"2023-11-14T22:13:20.123456Z\""), "{h}");
        let h = line(2, Stream::Stdout, "+++ Tests");
        assert!(h.contains("data-sec=\"open\"") && !h.contains("folded"), "{h}");
        assert!(line(3, Stream::Stdout, "::endgroup::").contains("data-sec=\"close\""));
        let evil = format!("::group::<img src=x onerror=alert(1)>{}", "A".repeat(50_000));
        let h = line(4, Stream::Stderr, &evil);
        assert!(!h.contains("<img") && h.contains("&lt;img"), "{h}");
        assert!(h.len() < 2_000, "{} bytes", h.len());
        assert!(!line(5, Stream::System, "--- not a section").contains("data-sec"));
        assert!(!line(6, Stream::Stdout, "---").contains("data-sec"), "a YAML separator is a line");
    }

    #[test]
    fn anonymous_viewers_see_no_agents_gpus_or_buttons() {
        let anon = Viewer { role: Role::Anonymous, csrf: String::new() };
        let row = JobRow { job: summary(1, "t", "r"), origin: Origin::default(), fleet: None };
        let html = jobs(std::slice::from_ref(&row), &JobFilters::default(), &[], &[], None, &anon, 0).into_string();
        assert!(!html.contains("ws-1") && !html.contains("GPU-abc"), "{html}");
        let page = JobPage {
            row,
            lines: vec![],
            skipped_lines: 0,
            points: vec![],
            memory_total: None,
            retried_by: None,
            artifacts: vec![],
            tests: None,
        };
        let html = job(&page, &anon, 0).into_string();
        assert!(!html.contains("Cancel job") && !html.contains("ws-1"), "{html}");
        let reader = Viewer { role: Role::Reader, csrf: "c".into() };
        assert!(!job(&page, &reader, 0).into_string().contains("Cancel job"));
    }

    #[test]
    fn the_queue_groups_by_reason_oldest_first() {
        let v = Viewer { role: Role::Reader, csrf: String::new() };
        let mut a = summary(1, "a", "no connected agent has tag queue=cuda");
        a.created_at_ms = 5_000;
        let mut b = summary(2, "b", "needs 2 GPUs; best host has 1 free");
        b.created_at_ms = 1_000;
        let mut c = summary(3, "c", "no connected agent has tag queue=cuda");
        c.created_at_ms = 6_000;
        let rows: Vec<JobRow> =
            [a, b, c].into_iter().map(|job| JobRow { job, origin: Origin::default(), fleet: None }).collect();
        let html = queue(&rows, &v, 10_000).into_string();
        let first = html.find("needs 2 GPUs").expect("group b");
        let second = html.find("no connected agent").expect("group a");
        assert!(first < second);
        assert!(html.contains("2 jobs") || html.contains(">2<"));
    }
}
