//! Test reports (`test_reports:` on a step): when an agent uploads one of the step's report
//! files as an artifact, the coordinator reads it (`gpuci_core::test_report::parse_junit`:
//! bounded size and depth, no DOCTYPE, no entity of the file's own) off the async threads and
//! records the reading; `GET /api/v1/jobs/{id}/test-report` ([`crate::api::artifacts`]) and
//! the GitHub check run show
//! the counts and failed tests of all of a job's reports together.

use crate::artifacts::Artifacts;
use gpuci_core::test_report::{parse_junit, TestReport, MAX_REPORT_BYTES};
use gpuci_protocol::api::{JobTestReport, TestReportFile};
use gpuci_protocol::JobId;
use gpuci_store::{ArtifactRecord, Store, TestReportRecord};

/// Reads the stored artifact `a` as a JUnit report and records the reading; returns what
/// the agent says in the job's log.
pub async fn read(store: &dyn Store, artifacts: &Artifacts, a: &ArtifactRecord) -> gpuci_store::Result<String> {
    let parsed = if a.size > MAX_REPORT_BYTES {
        Err(format!(
            "{} is over the cap of {} for a test report; not read",
            gpuci_core::quantity::Bytes(a.size),
            gpuci_core::quantity::Bytes(MAX_REPORT_BYTES)
        ))
    } else {
        // Read whole (it is under the report cap), then parsed off the async threads.
        match artifacts.open(&a.sha256).await {
            Ok(None) => Err("no stored file".to_string()),
            Err(e) => Err(format!("reading it: {e}")),
            Ok(Some(blob)) => {
                use tokio::io::AsyncReadExt;
                let mut bytes = Vec::with_capacity(usize::try_from(a.size).unwrap_or(0));
                match blob.body.take(MAX_REPORT_BYTES).read_to_end(&mut bytes).await {
                    Err(e) => Err(format!("reading it: {e}")),
                    Ok(_) => tokio::task::spawn_blocking(move || parse_junit(&bytes))
                        .await
                        .unwrap_or_else(|e| Err(e.to_string())),
                }
            }
        }
    };
    let (record, note) = match parsed {
        Ok(r) => (
            TestReportRecord {
                job_id: a.job_id,
                path: a.path.clone(),
                report_json: serde_json::to_string(&r).ok(),
                error: None,
            },
            format!("test report: {}", r.describe()),
        ),
        Err(e) => (
            TestReportRecord { job_id: a.job_id, path: a.path.clone(), report_json: None, error: Some(e.clone()) },
            format!("test report not read: {e}"),
        ),
    };
    store.put_test_report(&record).await?;
    Ok(note)
}

/// A job's reports read together; `None` when it has none.
pub async fn of_job(store: &dyn Store, job: JobId) -> gpuci_store::Result<Option<JobTestReport>> {
    let rows = store.job_test_reports(job).await?;
    if rows.is_empty() {
        return Ok(None);
    }
    let mut out = JobTestReport::default();
    for r in rows {
        let parsed = r.report_json.as_deref().and_then(|j| serde_json::from_str::<TestReport>(j).ok());
        if let Some(p) = &parsed {
            out.summary.merge(p);
        }
        let error = r.error.or_else(|| parsed.is_none().then(|| "the stored reading is damaged".to_string()));
        out.files.push(TestReportFile { path: r.path, error });
    }
    Ok(Some(out))
}

/// Longest test-report section in a check run summary (GitHub takes 65,535 characters in all).
const MAX_SUMMARY_CHARS: usize = 60_000;

/// The job's reports as Markdown for a GitHub check run summary. Names and messages are the
/// job's text: names go in code spans with backticks removed, messages in fenced blocks that
/// they cannot close, so a report cannot add links, images or mentions to the check.
pub fn markdown(r: &JobTestReport) -> String {
    let code = |s: &str| s.replace('`', "'").replace(['\n', '\r'], " ");
    let mut out = format!("\n\n### Tests\n\n**{}**\n", r.summary.describe());
    for f in r.files.iter().filter(|f| f.error.is_some()) {
        // The reason quotes the hostile file (an element's name): inside a code span, like
        // the path, or it renders as a link, an image or a mention (outsider attack).
        out.push_str(&format!("\n- `{}` not read: `{}`\n", code(&f.path), code(f.error.as_deref().unwrap_or(""))));
    }
    for t in &r.summary.failed {
        let name = if t.classname.is_empty() { t.name.clone() } else { format!("{}.{}", t.classname, t.name) };
        let block = format!(
            "\n**{}** `{}`\n\n````text\n{}\n````\n",
            t.kind,
            code(&name),
            t.message.replace("```", "'''").chars().take(2000).collect::<String>()
        );
        if out.chars().count() + block.chars().count() > MAX_SUMMARY_CHARS {
            out.push_str("\n(more failed tests: see `gpuci jobs show`)\n");
            break;
        }
        out.push_str(&block);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpuci_core::test_report::FailedTest;

    #[test]
    fn the_summary_cannot_be_broken_out_of_by_a_hostile_message() {
        let r = JobTestReport {
            summary: TestReport {
                tests: 2,
                failures: 1,
                failed: vec![FailedTest {
                    classname: "a`b".into(),
                    name: "t\n[x](http://evil)".into(),
                    kind: "failure".into(),
                    message: "````\n![img](http://evil/x.png)\n```".into(),
                }],
                ..Default::default()
            },
            files: vec![],
        };
        let md = markdown(&r);
        assert!(md.contains("2 tests: 1 passed, 1 failed"));
        assert!(md.contains("`a'b.t [x](http://evil)`"), "{md}");
        // Only our own fences: the opening and the closing one.
        assert_eq!(md.matches("````").count(), 2, "{md}");
        assert!(!md.contains("```\n![img]"), "{md}");
    }

    #[test]
    fn a_reason_quoting_the_report_stays_inside_a_code_span() {
        let hostile =
            "the root element is <[click-me](https://evil.example/phish)![img](https://evil.example/t.png)@octocat>";
        let r = JobTestReport {
            summary: TestReport::default(),
            files: vec![gpuci_protocol::api::TestReportFile { path: "rep/md.xml".into(), error: Some(hostile.into()) }],
        };
        let md = markdown(&r);
        let line = md.lines().find(|l| l.contains("not read")).expect("the file's line");
        // Everything after the path sits in one code span: no link, image or mention renders.
        let reason = line.split_once("not read: ").unwrap().1;
        assert!(reason.starts_with('`') && reason.ends_with('`') && reason.matches('`').count() == 2, "{line}");
    }
}
