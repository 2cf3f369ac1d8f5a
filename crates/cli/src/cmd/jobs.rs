//! `gpuci jobs`, `gpuci jobs show`, `gpuci logs`, `gpuci cancel`.

use crate::cli::{CancelArgs, JobsArgs, JobsSub, LogsArgs};
use crate::client::Client;
use crate::render::{job_detail, jobs_table, log_line};
use crate::CliResult;
use gpuci_protocol::agent::Stream;
use gpuci_protocol::api::LogEvent;
use std::io::Write;

fn print_json<T: serde::Serialize>(v: &T) -> CliResult<()> {
    println!("{}", serde_json::to_string_pretty(v).map_err(anyhow::Error::from)?);
    Ok(())
}

pub async fn jobs(a: JobsArgs) -> CliResult {
    let c = Client::from_args(&a.client)?;
    if let Some(JobsSub::Show { id }) = a.show {
        let j = c.job(id).await?;
        let report = crate::cmd::artifacts::job_test_report(&c, id).await?;
        if a.client.json {
            // The job record, with `test_report` when the job has any.
            let mut v = serde_json::to_value(&j).map_err(anyhow::Error::from)?;
            if let (Some(r), Some(obj)) = (&report, v.as_object_mut()) {
                obj.insert("test_report".into(), serde_json::to_value(r).map_err(anyhow::Error::from)?);
            }
            print_json(&v)?;
        } else {
            print!("{}", job_detail(&j));
            if let Some(r) = &report {
                print!("{}", crate::cmd::artifacts::render_test_report(r));
            }
        }
        return Ok(0);
    }
    let mut q = vec![format!("limit={}", a.limit)];
    if let Some(s) = &a.state {
        q.push(format!("state={s}"));
    }
    if let Some(p) = a.pipeline {
        q.push(format!("pipeline={p}"));
    }
    let jobs = c.jobs(&q.join("&")).await?;
    if a.client.json {
        print_json(&jobs)?;
    } else if jobs.is_empty() {
        eprintln!("no jobs");
    } else {
        print!("{}", jobs_table(&jobs));
    }
    Ok(0)
}

pub async fn logs(a: LogsArgs) -> CliResult {
    let c = Client::from_args(&a.client)?;
    let mut end = None;
    let json = a.client.json;
    c.stream::<LogEvent>(&format!("/api/v1/jobs/{}/logs?follow={}", a.job, a.follow), |ev| {
        if json {
            if let Ok(s) = serde_json::to_string(&ev) {
                println!("{s}");
            }
        }
        match ev {
            // Escaped, after a column only gpuci writes (see `gpuci logs --help`).
            LogEvent::Line(l) if !json => {
                let text = log_line(l.stream, &l.text);
                let _ = match l.stream {
                    Stream::Stderr | Stream::System => writeln!(std::io::stderr(), "{text}"),
                    Stream::Stdout => writeln!(std::io::stdout(), "{text}"),
                };
            }
            LogEvent::End { state, reason } => end = Some((state, reason)),
            _ => {}
        }
        true
    })
    .await?;
    if let (Some((state, reason)), false) = (&end, json) {
        eprintln!("job {} {state}: {}", a.job, gpuci_core::text::escape(reason));
    }
    Ok(0)
}

pub async fn cancel(a: CancelArgs) -> CliResult {
    let c = Client::from_args(&a.client)?;
    let j = c.cancel(a.job, a.reason).await?;
    if a.client.json {
        print_json(&j)?;
    } else {
        eprintln!("job {} {}: {}", j.id, j.state, gpuci_core::text::escape(&j.reason));
    }
    Ok(0)
}
