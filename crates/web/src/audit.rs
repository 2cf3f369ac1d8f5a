//! The audit log page: who changed what, newest first. Shown to the admin only (the
//! coordinator checks; this renders). Every field is text from the log, escaped by `maud`.

use crate::pages::{enc, layout, Viewer};
use gpuci_protocol::api::AuditEntry;
use maud::{html, Markup};

/// Filters of the audit page, as given (echoed into the form).
#[derive(Clone, Debug, Default)]
pub struct AuditFilters {
    pub since: String,
    pub action: String,
    pub actor: String,
}

pub fn audit(entries: &[AuditEntry], filters: &AuditFilters, viewer: &Viewer) -> Markup {
    layout(
        "Audit log",
        viewer,
        "Audit",
        html! {
            h1 { "Audit log" }
            p.muted { "Who set or removed secrets, rotated keys, made or revoked tokens, approved pull requests, cancelled jobs and released GPUs. Times are UTC." }
            form.filters method="get" action="/ui/audit" role="search" aria-label="Filter the audit log" {
                label { "Since " input type="text" name="since" placeholder="7d or 2026-11-28T00:00:00Z" value=(filters.since); }
                label { "Action " input type="text" name="action" placeholder="secret, token.create" value=(filters.action); }
                label { "Actor " input type="text" name="actor" placeholder="admin, a token, a GitHub login" value=(filters.actor); }
                button type="submit" { "Filter" }
            }
            @if entries.is_empty() {
                p { "No entries." }
            } @else {
                div.scroll { table {
                    caption { (entries.len()) " entries, newest first" }
                    thead { tr {
                        th scope="col" { "When (UTC)" } th scope="col" { "Actor" } th scope="col" { "Action" }
                        th scope="col" { "Object" } th scope="col" { "Outcome" }
                    } }
                    tbody { @for e in entries {
                        tr {
                            td { time datetime=(e.at) { (e.at) } }
                            td {
                                a href=(format!("/ui/audit?actor={}", enc(&e.actor))) { (crate::ansi::visible(&e.actor)) }
                                " " span.muted { "(" (e.actor_kind) @if let Some(c) = &e.credential { ", " (c) } ")" }
                            }
                            td { a href=(format!("/ui/audit?action={}", enc(&e.action))) { (e.action) } }
                            td { (crate::ansi::visible(&e.object)) }
                            td { @if e.outcome == "ok" { "ok" } @else { span.badge.s-failed { (crate::ansi::visible(&e.outcome)) } } }
                        }
                    } }
                } }
            }
        },
    )
}
