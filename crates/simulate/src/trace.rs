//! Job traces: the CSV that `gpuci simulate` replays, read strictly.
//!
//! Columns (header required, any order, other columns ignored): `job_id`, `submit_s`
//! (seconds from the trace's start), `duration_s` (run time on the GPU, without boot or
//! queueing), `pool` (the fleet that serves it), `gpus`, and optionally `group` and
//! `cancel_in_progress` (`1`: this job cancels the older jobs of its group that are queued or
//! running, as a GitHub concurrency group does), `after` (ids of jobs, separated by `;`, that
//! must end before this one is queued: a pipeline's `depends_on`; each must come earlier in
//! the file and be submitted no later) and `step` (the step's name, whose past runs give its
//! expected duration; default: the pool). `gpus = 0` is a job that needs no GPU (a build
//! step others wait on): it runs off the fleets, at once. A bad row is an error naming
//! `trace.csv:LINE: column: what`. No I/O: the caller reads the file.

use serde::Serialize;
use std::collections::BTreeMap;

/// One job of a trace.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct TraceJob {
    pub id: String,
    pub submit_s: u64,
    pub duration_s: u64,
    pub pool: String,
    pub gpus: u32,
    /// Empty: no group.
    pub group: String,
    pub cancel_in_progress: bool,
    /// Jobs (ids) that must end first; empty: queued at `submit_s`.
    pub after: Vec<String>,
    /// The step's name for its duration history; empty: the pool.
    pub step: String,
}

impl TraceJob {
    /// The name its runs are remembered under.
    pub fn step_name(&self) -> &str {
        if self.step.is_empty() {
            &self.pool
        } else {
            &self.step
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{file}:{line}: {what}")]
pub struct TraceError {
    pub file: String,
    pub line: usize,
    pub what: String,
}

const REQUIRED: [&str; 5] = ["job_id", "submit_s", "duration_s", "pool", "gpus"];

/// The most seconds a `submit_s` or `duration_s` may say: ten years (a trace is days or weeks;
/// more is a mistake, and sums of such times must not overflow).
pub const MAX_TRACE_S: u64 = 10 * 365 * 86_400;

/// Parse a trace's text; `file` names it in errors. Jobs come back in submit order (ties
/// keep the file's order).
pub fn parse_trace(file: &str, text: &str) -> Result<Vec<TraceJob>, TraceError> {
    let err = |line: usize, what: String| TraceError { file: file.to_string(), line, what };
    let mut lines = text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty() && !l.starts_with('#'));
    let Some((h, header)) = lines.next() else {
        return Err(err(1, format!("empty trace: expected a header with {}", REQUIRED.join(", "))));
    };
    let names: Vec<&str> = header.split(',').map(str::trim).collect();
    let col = |name: &str| names.iter().position(|n| *n == name);
    let mut idx = [0usize; 5];
    for (k, name) in REQUIRED.iter().enumerate() {
        idx[k] =
            col(name).ok_or_else(|| err(h + 1, format!("header: no column {name:?} (have {})", names.join(", "))))?;
    }
    let (group_col, cancel_col) = (col("group"), col("cancel_in_progress"));
    let (after_col, step_col) = (col("after"), col("step"));
    let mut jobs = Vec::new();
    let mut ids = BTreeMap::new();
    for (n, line) in lines {
        let line_no = n + 1;
        if let Some(col) = line.find('"') {
            return Err(err(
                line_no,
                format!("column {}: a quoted field; write each field without quotes or commas", col + 1),
            ));
        }
        let cells: Vec<&str> = line.split(',').map(str::trim).collect();
        let cell = |k: usize, name: &str| -> Result<&str, TraceError> {
            cells
                .get(k)
                .copied()
                .ok_or_else(|| err(line_no, format!("{name}: missing (the row has {} cells)", cells.len())))
        };
        let int = |k: usize, name: &str| -> Result<u64, TraceError> {
            let v = cell(k, name)?;
            v.parse::<u64>().map_err(|_| err(line_no, format!("{name}: expected a whole number ≥ 0, got {v:?}")))
        };
        let id = cell(idx[0], "job_id")?;
        if id.is_empty() {
            return Err(err(line_no, "job_id: empty".into()));
        }
        if ids.contains_key(id) {
            return Err(err(line_no, format!("job_id: {id:?} appears twice")));
        }
        let pool = cell(idx[3], "pool")?;
        if pool.is_empty() {
            return Err(err(line_no, "pool: empty".into()));
        }
        let gpus = int(idx[4], "gpus")?;
        let gpus =
            u32::try_from(gpus).map_err(|_| err(line_no, format!("gpus: expected 0 (no GPU) or more, got {gpus}")))?;
        let group = match group_col {
            Some(k) => cells.get(k).copied().unwrap_or(""),
            None => "",
        };
        let cancel_in_progress = match cancel_col.and_then(|k| cells.get(k).copied()).unwrap_or("") {
            "" | "0" | "false" => false,
            "1" | "true" => true,
            other => return Err(err(line_no, format!("cancel_in_progress: expected 0 or 1, got {other:?}"))),
        };
        let seconds = |k: usize, name: &str| -> Result<u64, TraceError> {
            let v = int(k, name)?;
            if v > MAX_TRACE_S {
                return Err(err(line_no, format!("{name}: {v} is more than ten years ({MAX_TRACE_S} s)")));
            }
            Ok(v)
        };
        let submit_s = seconds(idx[1], "submit_s")?;
        let after: Vec<String> = match after_col.and_then(|k| cells.get(k).copied()) {
            None | Some("") => Vec::new(),
            Some(list) => list.split(';').map(|d| d.trim().to_string()).collect(),
        };
        for dep in &after {
            match ids.get(dep.as_str()) {
                None => {
                    return Err(err(
                        line_no,
                        format!(
                            "after: {dep:?} is not a job of an earlier line (a job waits on jobs listed before it)"
                        ),
                    ))
                }
                Some(&t) if t > submit_s => {
                    return Err(err(
                        line_no,
                        format!("after: {dep:?} is submitted at {t}, after this job ({submit_s})"),
                    ))
                }
                Some(_) => {}
            }
        }
        ids.insert(id.to_string(), submit_s);
        jobs.push(TraceJob {
            id: id.to_string(),
            submit_s,
            duration_s: seconds(idx[2], "duration_s")?,
            pool: pool.to_string(),
            gpus,
            group: group.to_string(),
            cancel_in_progress,
            after,
            step: step_col.and_then(|k| cells.get(k).copied()).unwrap_or("").to_string(),
        });
    }
    jobs.sort_by_key(|j| j.submit_s); // stable: ties keep the file's order
    Ok(jobs)
}

/// A trace as CSV text, readable by [`parse_trace`].
pub fn to_csv(jobs: &[TraceJob]) -> String {
    let deps = jobs.iter().any(|j| !j.after.is_empty() || !j.step.is_empty());
    let mut out = String::from("job_id,submit_s,duration_s,pool,gpus,group,cancel_in_progress");
    out.push_str(if deps { ",after,step\n" } else { "\n" });
    for j in jobs {
        out.push_str(&format!(
            "{},{},{},{},{},{},{}",
            j.id,
            j.submit_s,
            j.duration_s,
            j.pool,
            j.gpus,
            j.group,
            u8::from(j.cancel_in_progress)
        ));
        if deps {
            out.push_str(&format!(",{},{}", j.after.join(";"), j.step));
        }
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_in_submit_order_and_ignores_other_columns() {
        let text = "job_id,extra,submit_s,duration_s,pool,gpus,group,cancel_in_progress\n\
                    b,x,20,5,t4,1,pr1,1\n\
                    a,y,10,5,t4,2,,0\n";
        let jobs = parse_trace("trace.csv", text).expect("parses");
        assert_eq!(jobs.iter().map(|j| j.id.as_str()).collect::<Vec<_>>(), ["a", "b"]);
        assert_eq!((jobs[1].group.as_str(), jobs[1].cancel_in_progress, jobs[0].gpus), ("pr1", true, 2));
        assert_eq!(parse_trace("t", &to_csv(&jobs)).expect("round trip"), jobs);
    }

    #[test]
    fn dependencies_name_earlier_jobs_and_round_trip() {
        let head = "job_id,submit_s,duration_s,pool,gpus,after,step\n";
        let jobs =
            parse_trace("t.csv", &format!("{head}b,0,60,cpu,0,,build\nt1,0,300,t4,1,b,test\nt2,0,300,t4,1,b;t1,\n"))
                .expect("parses");
        assert_eq!(jobs[2].after, ["b", "t1"]);
        assert_eq!((jobs[0].gpus, jobs[1].step_name(), jobs[2].step_name()), (0, "test", "t4"));
        assert_eq!(parse_trace("t", &to_csv(&jobs)).expect("round trip"), jobs);
        let e = |body: &str| parse_trace("t.csv", &format!("{head}{body}")).map(|_| ()).unwrap_err().to_string();
        assert_eq!(
            e("t1,0,300,t4,1,b,\nb,0,60,cpu,0,,\n"),
            "t.csv:2: after: \"b\" is not a job of an earlier line (a job waits on jobs listed before it)"
        );
        assert_eq!(
            e("b,50,60,cpu,0,,\nt1,10,300,t4,1,b,\n"),
            "t.csv:3: after: \"b\" is submitted at 50, after this job (10)"
        );
    }

    #[test]
    fn bad_rows_name_line_and_column() {
        let head = "job_id,submit_s,duration_s,pool,gpus\n";
        let e = |body: &str| parse_trace("trace.csv", &format!("{head}{body}")).map(|_| ()).unwrap_err().to_string();
        assert_eq!(e("a,10,5,t4,1\nb,-3,5,t4,1\n"), "trace.csv:3: submit_s: expected a whole number ≥ 0, got \"-3\"");
        assert_eq!(e("a,10,5,t4,-1\n"), "trace.csv:2: gpus: expected a whole number ≥ 0, got \"-1\"");
        assert_eq!(e("a,10,5\n"), "trace.csv:2: pool: missing (the row has 3 cells)");
        assert_eq!(e("a,1,1,t4,1\na,2,1,t4,1\n"), "trace.csv:3: job_id: \"a\" appears twice");
        // Times that would overflow the simulation's sums, or that no trace means.
        assert_eq!(
            e("a,18446744073709551615,100,t4,1\n"),
            "trace.csv:2: submit_s: 18446744073709551615 is more than ten years (315360000 s)"
        );
        assert_eq!(
            e("a,0,315360001,t4,1\n"),
            "trace.csv:2: duration_s: 315360001 is more than ten years (315360000 s)"
        );
        assert_eq!(
            e("\"b,c\",5,1,t4,1\n"),
            "trace.csv:2: column 1: a quoted field; write each field without quotes or commas"
        );
        let e = parse_trace("trace.csv", "id,submit_s\n").map(|_| ()).unwrap_err().to_string();
        assert!(e.starts_with("trace.csv:1: header: no column \"job_id\""), "{e}");
        let e = parse_trace("trace.csv", "").map(|_| ()).unwrap_err().to_string();
        assert!(e.starts_with("trace.csv:1: empty trace"), "{e}");
    }
}
