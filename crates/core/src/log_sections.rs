//! Collapsible sections in a job's log, marked by the job's own output the way Buildkite and
//! GitHub Actions mark them, so a pipeline moved from either keeps its sections:
//!
//! - Buildkite: a line `--- title` opens a collapsed section, `+++ title` an expanded one
//!   (`~~~ title` too, collapsed); a section lasts until the next marker.
//! - GitHub Actions: `::group::title` opens a collapsed section, `::endgroup::` ends it.
//!
//! Sections do not nest (neither system nests them): a marker that opens a section ends the
//! one before. An unterminated section lasts to the end of the log. The marker must start the
//! line (a `\r` before it is allowed: progress bars); `---` alone (a YAML document separator)
//! is not a marker. Titles are text, cut to [`MAX_TITLE_CHARS`]; whoever shows them escapes
//! them (they are the job's output, and the job is hostile).

/// The longest title shown; the rest is cut (with `…`).
pub const MAX_TITLE_CHARS: usize = 200;

/// What a log line says about sections.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Marker {
    /// A section starts at this line, titled `title`; shown folded when `collapsed`.
    Open { title: String, collapsed: bool },
    /// The current section ends (`::endgroup::`); this line belongs to it.
    Close,
}

fn title(raw: &str) -> String {
    let t = raw.trim();
    match t.char_indices().nth(MAX_TITLE_CHARS) {
        Some((cut, _)) => format!("{}…", &t[..cut]),
        None => t.to_string(),
    }
}

/// The marker a line is, if any.
pub fn marker(line: &str) -> Option<Marker> {
    let l = line.trim_start_matches('\r').trim_end_matches(['\r', '\n']);
    for (prefix, collapsed) in [("--- ", true), ("~~~ ", true), ("+++ ", false)] {
        if let Some(rest) = l.strip_prefix(prefix) {
            let t = title(rest);
            return (!t.is_empty()).then_some(Marker::Open { title: t, collapsed });
        }
    }
    if let Some(rest) = l.strip_prefix("::group::") {
        let t = title(rest);
        return Some(Marker::Open { title: if t.is_empty() { "group".into() } else { t }, collapsed: true });
    }
    (l.trim_end() == "::endgroup::").then_some(Marker::Close)
}

/// For each line, the index of the line that opened its section (itself for a marker that
/// opens one), or `None` outside any section.
pub fn sections<'a>(lines: impl IntoIterator<Item = &'a str>) -> Vec<Option<usize>> {
    let mut open = None;
    let mut out = Vec::new();
    for (i, l) in lines.into_iter().enumerate() {
        match marker(l) {
            Some(Marker::Open { .. }) => {
                open = Some(i);
                out.push(open);
            }
            Some(Marker::Close) => {
                out.push(open);
                open = None;
            }
            None => out.push(open),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn open(t: &str, collapsed: bool) -> Option<Marker> {
        Some(Marker::Open { title: t.into(), collapsed })
    }

    #[test]
    fn buildkite_and_actions_markers() {
        assert_eq!(marker("--- :hammer: Build"), open(":hammer: Build", true));
        assert_eq!(marker("+++ Tests"), open("Tests", false));
        assert_eq!(marker("~~~ Setup\r\n"), open("Setup", true));
        assert_eq!(marker("\r--- after a progress bar"), open("after a progress bar", true));
        assert_eq!(marker("::group::Install deps"), open("Install deps", true));
        assert_eq!(marker("::group::"), open("group", true));
        assert_eq!(marker("::endgroup::"), Some(Marker::Close));
    }

    #[test]
    fn look_alikes_are_plain_lines() {
        for l in ["---", "--- ", "---title", " --- indented", "a --- b", "::endgroup:: and more", "++ x", "::group"] {
            assert_eq!(marker(l), None, "{l:?}");
        }
    }

    #[test]
    fn hostile_titles_are_bounded_and_kept_as_text() {
        let long = format!("--- {}", "é".repeat(100_000));
        let Some(Marker::Open { title, .. }) = marker(&long) else { panic!() };
        assert_eq!(title.chars().count(), MAX_TITLE_CHARS + 1);
        assert!(title.ends_with('…'));
        // Text, not markup: the caller escapes it.
        assert_eq!(marker("::group::<script>x</script>"), open("<script>x</script>", true));
    }

    #[test]
    fn sections_do_not_nest_and_an_unterminated_one_runs_to_the_end() {
        let log = ["before", "--- a", "1", "::group::b", "2", "::endgroup::", "after", "+++ c", "3"];
        assert_eq!(sections(log), [None, Some(1), Some(1), Some(3), Some(3), Some(3), None, Some(7), Some(7)]);
    }
}
