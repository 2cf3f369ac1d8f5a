//! The agent's identity: registered once with the registration token, then a per-agent
//! credential kept in `<data-dir>/agent.json` (mode 0600).

use anyhow::{bail, Context};
use gpuci_protocol::agent::{RegisterRequest, RegisterResponse};
use serde::{Deserialize, Serialize};
use std::io::Write;
use std::path::Path;

#[derive(Clone, Serialize, Deserialize)]
pub struct Identity {
    pub agent_id: String,
    pub credential: String,
    /// The coordinator this identity belongs to.
    pub server: String,
}

impl std::fmt::Debug for Identity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Identity").field("agent_id", &self.agent_id).field("credential", &"***").finish()
    }
}

/// Load the stored identity for `server`, or register with `registration_token`.
pub async fn load_or_register(
    http: &reqwest::Client,
    data_dir: &Path,
    server: &str,
    name: &str,
    registration_token: Option<&str>,
) -> anyhow::Result<Identity> {
    let path = data_dir.join("agent.json");
    if let Ok(text) = std::fs::read_to_string(&path) {
        let id: Identity = serde_json::from_str(&text).with_context(|| format!("reading {}", path.display()))?;
        if id.server == server {
            return Ok(id);
        }
        tracing::info!(old = %id.server, new = server, "stored identity is for another coordinator; registering again");
    }
    let Some(token) = registration_token else {
        bail!("this agent is not registered with {server}: pass --registration-token (or GPUCI_REGISTRATION_TOKEN), found in the coordinator's data dir as registration-token");
    };
    let resp = http
        .post(format!("{server}/api/v1/agents/register"))
        .bearer_auth(token)
        .json(&RegisterRequest { name: name.to_string() })
        .send()
        .await
        .with_context(|| format!("registering with {server}"))?;
    if !resp.status().is_success() {
        let status = resp.status();
        let body = resp.text().await.unwrap_or_default();
        bail!("registration with {server} refused ({status}): {body}");
    }
    let r: RegisterResponse = resp.json().await.context("reading registration answer")?;
    let id = Identity { agent_id: r.agent_id, credential: r.credential, server: server.to_string() };
    write_private(&path, &serde_json::to_string_pretty(&id)?)?;
    tracing::info!(agent = %id.agent_id, "registered");
    Ok(id)
}

fn write_private(path: &Path, contents: &str) -> anyhow::Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    if let Some(d) = path.parent() {
        std::fs::create_dir_all(d)?;
    }
    let tmp = path.with_extension("tmp");
    let mut f = std::fs::OpenOptions::new().write(true).create(true).truncate(true).mode(0o600).open(&tmp)?;
    f.write_all(contents.as_bytes())?;
    f.sync_all()?;
    std::fs::rename(&tmp, path)?;
    Ok(())
}
