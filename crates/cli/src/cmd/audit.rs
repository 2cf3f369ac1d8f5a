//! `gpuci audit` (the audit log) and `gpuci token` (named API tokens). Both need the admin
//! token. Data on stdout (a table, or `--json`: the API's entries as they are); what a person
//! needs to know on stderr.

use crate::cli::{AuditArgs, TokenArgs, TokenCommand};
use crate::client::Client;
use crate::{render, CliError, CliResult};

pub async fn run(a: AuditArgs) -> CliResult {
    // Checked here too, so a typo is told before a request is made.
    if let Some(action) = &a.action {
        gpuci_core::audit::check_action_filter(action).map_err(CliError::Input)?;
    }
    let mut query: Vec<(&str, String)> = vec![("limit", a.limit.to_string())];
    query.extend(a.since.clone().map(|s| ("since", s)));
    query.extend(a.action.clone().map(|s| ("action", s)));
    query.extend(a.actor.clone().map(|s| ("actor", s)));
    let entries = Client::from_args(&a.client)?.audit(&query).await?;
    if a.client.json {
        println!("{}", serde_json::to_string_pretty(&entries).map_err(anyhow::Error::from)?);
        return Ok(0);
    }
    if entries.is_empty() {
        eprintln!("no audit entries{}", if query.len() > 1 { " match these filters" } else { "" });
        return Ok(0);
    }
    let rows: Vec<Vec<String>> = entries
        .iter()
        .map(|e| {
            let who = match &e.credential {
                Some(c) => format!("{} ({}, {c})", e.actor, e.actor_kind),
                None => format!("{} ({})", e.actor, e.actor_kind),
            };
            vec![e.at.clone(), who, e.action.clone(), e.object.clone(), e.outcome.clone()]
        })
        .collect();
    print!("{}", render::table(&["WHEN (UTC)", "ACTOR", "ACTION", "OBJECT", "OUTCOME"], &rows));
    Ok(0)
}

pub async fn token(a: TokenArgs) -> CliResult {
    let c = Client::from_args(&a.client)?;
    match a.command {
        TokenCommand::Create { name } => {
            let t = c.create_token(&name).await?;
            if a.client.json {
                println!("{}", serde_json::to_string(&t).map_err(anyhow::Error::from)?);
            } else {
                println!("{}", t.token);
                eprintln!(
                    "token {name} created ({}); it is shown only now: store it (GPUCI_TOKEN) where it is used",
                    t.credential
                );
            }
        }
        TokenCommand::List => {
            let list: Vec<gpuci_protocol::api::TokenInfo> = c.get("/api/v1/tokens").await?;
            if a.client.json {
                println!("{}", serde_json::to_string_pretty(&list).map_err(anyhow::Error::from)?);
            } else if list.is_empty() {
                eprintln!("no named tokens (gpuci token create NAME)");
            } else {
                let rows: Vec<Vec<String>> = list
                    .iter()
                    .map(|t| {
                        vec![
                            t.name.clone(),
                            t.credential.clone(),
                            gpuci_core::audit::utc(t.created_at_ms),
                            t.created_by.clone(),
                            t.revoked_at_ms.map_or("live".into(), |r| format!("revoked {}", gpuci_core::audit::utc(r))),
                        ]
                    })
                    .collect();
                print!("{}", render::table(&["NAME", "CREDENTIAL", "CREATED (UTC)", "BY", "STATE"], &rows));
            }
        }
        TokenCommand::Revoke { name } => {
            c.revoke_token(&name).await?;
            eprintln!("token {name} revoked");
        }
    }
    Ok(0)
}
