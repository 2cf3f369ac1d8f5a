//! `gpuci schedules` (list) and `gpuci schedules run NAME` (fire now). Data on stdout (a
//! table, or `--json`: the API's bodies as they are); what a person needs to know on stderr.

use crate::cli::{SchedulesArgs, SchedulesCommand};
use crate::client::Client;
use crate::{render, CliError, CliResult};
use gpuci_protocol::api::{ScheduleFire, ScheduleSummary};

pub async fn run(a: SchedulesArgs) -> CliResult {
    let c = Client::from_args(&a.client)?;
    match a.command.unwrap_or(SchedulesCommand::List) {
        SchedulesCommand::List => {
            let list: Vec<ScheduleSummary> = c.get("/api/v1/schedules").await?;
            if a.client.json {
                println!("{}", serde_json::to_string_pretty(&list).map_err(anyhow::Error::from)?);
            } else if list.is_empty() {
                eprintln!("no schedules ([[schedule]] in the server config; see docs/schedules.md)");
            } else {
                print!("{}", table(&list));
            }
            Ok(0)
        }
        SchedulesCommand::Run { name } => {
            let fire = c.run_schedule(&name).await?;
            if a.client.json {
                println!("{}", serde_json::to_string(&fire).map_err(anyhow::Error::from)?);
            }
            match (fire.pipeline_id, &fire.error) {
                (Some(p), _) => {
                    if !a.client.json {
                        println!("{p}");
                    }
                    eprintln!("schedule {name} fired: pipeline {p} (gpuci jobs --pipeline {p})");
                    Ok(0)
                }
                (None, Some(e)) => Err(CliError::Input(format!("schedule {name} fired, but submitted nothing: {e}"))),
                (None, None) => {
                    eprintln!("schedule {name} fired (fire {}); its pipeline is not submitted yet", fire.id);
                    Ok(0)
                }
            }
        }
    }
}

/// A UTC time to the second, as people read it.
fn utc(ms: i64) -> String {
    gpuci_core::audit::utc(ms - ms.rem_euclid(1000)).replace(".000Z", "Z")
}

fn last_run(f: Option<&ScheduleFire>) -> (String, String) {
    let Some(f) = f else { return ("never".into(), "-".into()) };
    let when = format!("{} ({})", utc(f.fired_at_ms), f.cause);
    let what = match (f.pipeline_id, &f.error, &f.pipeline_state) {
        (Some(p), _, Some(state)) => format!("pipeline {p} {state}"),
        (Some(p), _, None) => format!("pipeline {p}"),
        (None, Some(e), _) => format!("failed: {}", e.chars().take(120).collect::<String>()),
        (None, None, _) => "firing".into(),
    };
    (when, what)
}

fn table(list: &[ScheduleSummary]) -> String {
    let rows: Vec<Vec<String>> = list
        .iter()
        .map(|s| {
            let next = match (&s.next_run_local, s.next_run_ms) {
                (Some(local), Some(ms)) => format!("{local} ({})", utc(ms)),
                _ if !s.enabled => "disabled".into(),
                _ => "never".into(),
            };
            let (when, what) = last_run(s.fires.first());
            vec![s.name.clone(), s.cron.clone(), s.timezone.clone(), next, when, what]
        })
        .collect();
    render::table(&["NAME", "CRON", "TIMEZONE", "NEXT RUN (LOCAL, UTC)", "LAST RUN", "RESULT"], &rows)
}
