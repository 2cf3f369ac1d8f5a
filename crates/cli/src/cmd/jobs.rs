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
    let client = Client::from_args(&a.client)?;
    let mut end = None;
    let json = a.client.json;
    // The last line shown: a stream opened again (`--follow` through a failover) goes on after it.
    let mut last = 0i64;
    let mut following = super::Following::new(&client);
    loop {
        let c = following
            .next(|secs| format!("lost job {}'s log and found no coordinator to follow it from for {secs} s", a.job))
            .await?;
        let mut heard = false;
        let path = format!("/api/v1/jobs/{}/logs?follow={}&after={last}", a.job, a.follow);
        let ended = c
            .stream::<LogEvent>(&path, |ev| {
                if let LogEvent::Line(l) = &ev {
                    if l.seq <= last {
                        return true;
                    }
                    last = l.seq;
                }
                heard = true;
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
            .await;
        // Without --follow a stream ends when the lines stored so far are sent; with it, at
        // the job's end. One that broke before (a failover, a restart) is opened again.
        let why = match ended {
            Ok(()) if !a.follow || end.is_some() => break,
            Err(e) if !a.follow || matches!(e, crate::CliError::Input(_)) => return Err(e),
            Err(e) => format!("{e:#}"),
            Ok(()) => "the stream ended".to_string(),
        };
        following.lost(heard);
        eprintln!("lost job {}'s log from {} ({why}); following it again after line {last}", a.job, c.base());
    }
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
