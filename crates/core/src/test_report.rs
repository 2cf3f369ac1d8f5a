//! JUnit XML test reports (`test_reports:` on a step): counts and failed tests, read from
//! hostile input. The rules, here and nowhere else:
//!
//! - A report is at most [`MAX_REPORT_BYTES`]; larger is refused before it is read.
//! - A `<!DOCTYPE …>` is refused outright: no entity of the file's own is ever expanded (the
//!   "billion laughs" document is a DOCTYPE), only XML's five predefined ones.
//! - Elements nest at most [`MAX_DEPTH`] deep.
//! - Counts come from the `<testcase>` elements, not from the `tests=`/`failures=` attributes
//!   a generator may get wrong: a case with `<failure>` is a failure, `<error>` an error,
//!   `<skipped>` skipped. At most [`MAX_FAILED_KEPT`] failed tests are kept, each message cut
//!   at [`MAX_MESSAGE_CHARS`] characters.

use quick_xml::events::{BytesStart, Event};
use serde::{Deserialize, Serialize};

pub const MAX_REPORT_BYTES: u64 = 64 << 20;
pub const MAX_DEPTH: usize = 64;
pub const MAX_FAILED_KEPT: usize = 100;
pub const MAX_MESSAGE_CHARS: usize = 4096;
/// Test and class names are cut at this many characters (they are stored and shown).
pub const MAX_NAME_CHARS: usize = 512;
/// The most attributes one element may have.
pub const MAX_ATTRIBUTES: usize = 256;

/// One report's (or several reports') counts and failed tests.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct TestReport {
    pub tests: u64,
    pub failures: u64,
    pub errors: u64,
    pub skipped: u64,
    /// Failed and errored tests, at most [`MAX_FAILED_KEPT`].
    #[serde(default)]
    pub failed: Vec<FailedTest>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct FailedTest {
    /// `classname` of the test case (often the module or class).
    pub classname: String,
    pub name: String,
    /// `failure` or `error`.
    pub kind: String,
    /// The `message` attribute, then the element's text.
    pub message: String,
}

impl TestReport {
    /// Adds `other`'s counts and failed tests (the kept list stays bounded).
    pub fn merge(&mut self, other: &TestReport) {
        self.tests += other.tests;
        self.failures += other.failures;
        self.errors += other.errors;
        self.skipped += other.skipped;
        let room = MAX_FAILED_KEPT.saturating_sub(self.failed.len());
        self.failed.extend(other.failed.iter().take(room).cloned());
    }

    /// `12 tests: 10 passed, 1 failed, 0 errors, 1 skipped`.
    pub fn describe(&self) -> String {
        let passed = self.tests.saturating_sub(self.failures + self.errors + self.skipped);
        format!(
            "{} tests: {passed} passed, {} failed, {} errors, {} skipped",
            self.tests, self.failures, self.errors, self.skipped
        )
    }
}

/// The value of attribute `key`, cut at [`MAX_NAME_CHARS`]. Attributes are read without the
/// parser's check for duplicates, which compares each with every earlier one: 300,000
/// attributes on one element took minutes of the coordinator's CPU (outsider attack). An
/// element with more than [`MAX_ATTRIBUTES`] is refused instead.
fn attr(e: &BytesStart, key: &[u8]) -> Result<String, String> {
    let mut found = None;
    for (n, a) in e.attributes().with_checks(false).enumerate() {
        if n >= MAX_ATTRIBUTES {
            return Err(format!("an element with more than {MAX_ATTRIBUTES} attributes"));
        }
        let a = a.map_err(|e| format!("bad attribute: {e}"))?;
        if found.is_none() && a.key.as_ref() == key {
            let v = a.unescape_value().map_err(|e| format!("bad attribute value: {e}"))?;
            found = Some(cut(&v, MAX_NAME_CHARS));
        }
    }
    Ok(found.unwrap_or_default())
}

/// `text` cut at `max` characters, saying so.
fn cut(text: &str, max: usize) -> String {
    match text.char_indices().nth(max) {
        Some((i, _)) => format!("{}…", &text[..i]),
        None => text.to_string(),
    }
}

fn push_text(into: &mut String, text: &str) {
    let room = MAX_MESSAGE_CHARS.saturating_sub(into.chars().count());
    if room > 0 {
        if !into.is_empty() && !into.ends_with('\n') {
            into.push('\n');
        }
        into.extend(text.trim().chars().take(room));
    }
}

/// Reads one JUnit XML report. `Err` says why it is not one (with the byte offset).
pub fn parse_junit(bytes: &[u8]) -> Result<TestReport, String> {
    if bytes.len() as u64 > MAX_REPORT_BYTES {
        return Err(format!("the report is {} bytes, over the cap of {MAX_REPORT_BYTES}", bytes.len()));
    }
    let mut reader = quick_xml::Reader::from_reader(bytes);
    reader.config_mut().trim_text(true);
    let mut report = TestReport::default();
    let mut depth = 0usize;
    let mut saw_root = false;
    // The test case being read, and whether the text we are in belongs to its failure.
    let mut case: Option<FailedTest> = None;
    let mut in_failure = false;
    let mut buf = Vec::new();
    loop {
        let at = reader.buffer_position();
        let event = reader.read_event_into(&mut buf).map_err(|e| format!("not well-formed XML at byte {at}: {e}"))?;
        match event {
            Event::DocType(_) => {
                return Err(format!("a DOCTYPE at byte {at}: test reports may not declare entities; refused"));
            }
            Event::Start(e) | Event::Empty(e) if depth == 0 && saw_root => {
                return Err(format!(
                    "a second root element <{}> at byte {at}",
                    cut(&String::from_utf8_lossy(e.name().as_ref()), 64)
                ));
            }
            Event::Start(ref e) | Event::Empty(ref e) => {
                let empty = matches!(event, Event::Empty(_));
                if depth == 0 {
                    saw_root = true;
                    let root = e.name();
                    if root.as_ref() != b"testsuites" && root.as_ref() != b"testsuite" {
                        return Err(format!(
                            "the root element is <{}>, not <testsuites> or <testsuite>: not a JUnit report",
                            cut(&String::from_utf8_lossy(root.as_ref()), 64)
                        ));
                    }
                }
                if !empty {
                    depth += 1;
                    if depth > MAX_DEPTH {
                        return Err(format!("elements nest deeper than {MAX_DEPTH} levels at byte {at}"));
                    }
                }
                match e.name().as_ref() {
                    b"testcase" => {
                        report.tests += 1;
                        let c = FailedTest {
                            classname: attr(e, b"classname")?,
                            name: attr(e, b"name")?,
                            ..Default::default()
                        };
                        if !empty {
                            case = Some(c);
                        }
                    }
                    kind @ (b"failure" | b"error") => {
                        if let Some(c) = case.as_mut() {
                            if c.kind.is_empty() {
                                c.kind = String::from_utf8_lossy(kind).into_owned();
                            }
                            push_text(&mut c.message, &attr(e, b"message")?);
                            in_failure = !empty;
                        }
                    }
                    b"skipped" => {
                        if let Some(c) = case.as_mut() {
                            if c.kind.is_empty() {
                                c.kind = "skipped".into();
                            }
                        }
                    }
                    _ => {}
                }
            }
            Event::End(e) => {
                depth = depth.saturating_sub(1);
                match e.name().as_ref() {
                    b"failure" | b"error" => in_failure = false,
                    b"testcase" => {
                        if let Some(c) = case.take() {
                            match c.kind.as_str() {
                                "failure" => report.failures += 1,
                                "error" => report.errors += 1,
                                "skipped" => report.skipped += 1,
                                _ => {}
                            }
                            if (c.kind == "failure" || c.kind == "error") && report.failed.len() < MAX_FAILED_KEPT {
                                report.failed.push(c);
                            }
                        }
                    }
                    _ => {}
                }
            }
            Event::Text(t) if in_failure => {
                let text = t.unescape().map_err(|e| format!("bad text at byte {at}: {e}"))?;
                if let Some(c) = case.as_mut() {
                    push_text(&mut c.message, &text);
                }
            }
            Event::CData(t) if in_failure => {
                if let Some(c) = case.as_mut() {
                    push_text(&mut c.message, &String::from_utf8_lossy(&t));
                }
            }
            Event::Eof => break,
            _ => {}
        }
        buf.clear();
    }
    if !saw_root {
        return Err("no root element: not a JUnit report".into());
    }
    if depth != 0 {
        return Err("the document ends inside an element".into());
    }
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_come_from_test_cases_and_failures_keep_their_messages() {
        let xml = br#"<?xml version="1.0"?>
<testsuites>
  <testsuite name="gpu" tests="99" failures="0">
    <testcase classname="tests.test_kernels" name="test_add" time="0.1"/>
    <testcase classname="tests.test_kernels" name="test_mul">
      <failure message="assert 3 == 4" type="AssertionError">x = 3
      y = 4 &amp; more</failure>
    </testcase>
    <testcase classname="tests.test_io" name="test_read"><error message="OSError"/></testcase>
    <testcase classname="tests.test_io" name="test_skip"><skipped message="no GPU"/></testcase>
  </testsuite>
</testsuites>"#;
        let r = parse_junit(xml).expect("parses");
        assert_eq!((r.tests, r.failures, r.errors, r.skipped), (4, 1, 1, 1));
        assert_eq!(r.failed.len(), 2);
        assert_eq!(r.failed[0].name, "test_mul");
        assert_eq!(r.failed[0].kind, "failure");
        assert!(r.failed[0].message.starts_with("assert 3 == 4\nx = 3"), "{:?}", r.failed[0].message);
        assert!(r.failed[0].message.contains("y = 4 & more"));
        assert_eq!(r.failed[1].kind, "error");
        assert_eq!(r.describe(), "4 tests: 1 passed, 1 failed, 1 errors, 1 skipped");
    }

    #[test]
    fn billion_laughs_is_refused_without_expanding_anything() {
        let xml = br#"<?xml version="1.0"?>
<!DOCTYPE lolz [<!ENTITY lol "lol"><!ENTITY lol2 "&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;">
<!ENTITY lol3 "&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;">]>
<testsuite><testcase name="x"><failure message="&lol3;"/></testcase></testsuite>"#;
        let e = parse_junit(xml).unwrap_err();
        assert!(e.contains("DOCTYPE"), "{e}");
    }

    #[test]
    fn an_undeclared_entity_is_an_error_not_an_expansion() {
        let e = parse_junit(br#"<testsuite><testcase name="x"><failure message="&xxe;"/></testcase></testsuite>"#)
            .unwrap_err();
        assert!(e.contains("attribute"), "{e}");
    }

    #[test]
    fn deep_nesting_and_wrong_roots_and_broken_documents_are_refused() {
        let deep = format!("<testsuite>{}{}</testsuite>", "<a>".repeat(100), "</a>".repeat(100));
        assert!(parse_junit(deep.as_bytes()).unwrap_err().contains("deeper than 64"));
        assert!(parse_junit(b"<html><body/></html>").unwrap_err().contains("not a JUnit report"));
        assert!(parse_junit(b"<testsuite><testcase>").is_err());
        assert!(parse_junit(b"").unwrap_err().contains("no root"));
        assert!(parse_junit(b"<testsuite/><testsuite/>").unwrap_err().contains("second root"));
    }

    #[test]
    fn an_oversized_report_is_refused_by_the_cap() {
        let big = vec![b' '; (MAX_REPORT_BYTES + 1) as usize];
        assert!(parse_junit(&big).unwrap_err().contains("over the cap"));
    }

    #[test]
    fn the_failed_list_and_messages_stay_bounded() {
        let mut xml = String::from("<testsuite>");
        for i in 0..500 {
            xml.push_str(&format!("<testcase name=\"t{i}\"><failure>{}</failure></testcase>", "x".repeat(10_000)));
        }
        xml.push_str("</testsuite>");
        let r = parse_junit(xml.as_bytes()).unwrap();
        assert_eq!((r.tests, r.failures), (500, 500));
        assert_eq!(r.failed.len(), MAX_FAILED_KEPT);
        assert!(r.failed.iter().all(|f| f.message.chars().count() <= MAX_MESSAGE_CHARS));
    }

    #[test]
    fn an_element_with_very_many_attributes_is_refused_quickly() {
        let mut xml = String::from("<testsuite><testcase");
        for i in 0..300_000 {
            xml.push_str(&format!(" a{i}=\"\""));
        }
        xml.push_str("/></testsuite>");
        // Before: minutes of CPU comparing each attribute with every earlier one.
        let err = parse_junit(xml.as_bytes()).expect_err("refused");
        assert!(err.contains("attributes"), "{err}");
    }

    #[test]
    fn long_names_are_cut() {
        let long = "n".repeat(600_000);
        let xml =
            format!("<testsuite><testcase classname=\"{long}\" name=\"{long}\"><failure/></testcase></testsuite>");
        let r = parse_junit(xml.as_bytes()).unwrap();
        assert_eq!(r.failed.len(), 1);
        assert!(r.failed[0].name.chars().count() <= MAX_NAME_CHARS + 1);
        assert!(r.failed[0].classname.chars().count() <= MAX_NAME_CHARS + 1);
        let err = parse_junit(format!("<{long}/>").as_bytes()).unwrap_err();
        assert!(err.len() < 300, "{}", err.len());
    }
}
