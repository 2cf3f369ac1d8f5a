//! The agent's identity: registered once with the registration token, then a per-agent
//! credential kept in `<data-dir>/agent.json` (mode 0600).
//!
//! The data dir holding it is made private (0700) before the credential is read or written,
//! and a looser data dir or credential file left by an older gpuci is tightened with a
//! warning. Jobs never see the data dir at all (the sandbox hides it); the modes matter for
//! other users of the host and for jobs that run unsandboxed.

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

/// Registration could not reach the coordinator (no answer, or a 5xx): worth trying again,
/// unlike a refusal.
#[derive(Debug, thiserror::Error)]
#[error("registering with {server}: cannot reach the coordinator: {why}")]
pub struct Unreachable {
    pub server: String,
    pub why: String,
}

/// Load the stored identity for `server`, or register with `registration_token`; true when
/// registered anew (jobs held for an earlier registration are not this identity's).
pub async fn load_or_register(
    http: &reqwest::Client,
    data_dir: &Path,
    server: &str,
    name: &str,
    registration_token: Option<&str>,
) -> anyhow::Result<(Identity, bool)> {
    let path = data_dir.join("agent.json");
    make_private(data_dir, true)?;
    make_private(&path, false)?;
    if let Ok(text) = std::fs::read_to_string(&path) {
        let id: Identity = serde_json::from_str(&text).with_context(|| format!("reading {}", path.display()))?;
        if id.server == server {
            return Ok((id, false));
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
        .map_err(|e| Unreachable { server: server.to_string(), why: format!("{:#}", anyhow::Error::new(e)) })?;
    if resp.status().is_server_error() {
        // A proxy in front of a coordinator that is down answers 502/503: as unreachable.
        let why = format!("answered {}", resp.status());
        return Err(Unreachable { server: server.to_string(), why }.into());
    }
    if !resp.status().is_success() {
        let status = resp.status();
        let body = resp.text().await.unwrap_or_default();
        bail!("registration with {server} refused ({status}): {body}");
    }
    let r: RegisterResponse = resp.json().await.context("reading registration answer")?;
    let id = Identity { agent_id: r.agent_id, credential: r.credential, server: server.to_string() };
    write_private(&path, &serde_json::to_string_pretty(&id)?)?;
    tracing::info!(agent = %id.agent_id, "registered");
    Ok((id, true))
}

/// Take the group and other read/write bits off the data dir (creating it) or the credential
/// file (0755 → 0711, 0644 → 0600), with a warning when that changed an existing one.
fn make_private(path: &Path, dir: bool) -> anyhow::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    if dir {
        std::fs::create_dir_all(path).with_context(|| format!("creating {}", path.display()))?;
    }
    // A data dir with nothing in it was made just now (by the agent, with the umask's mode):
    // making it private is no news.
    let fresh = dir && std::fs::read_dir(path).map(|mut d| d.next().is_none()).unwrap_or(false);
    let meta = match std::fs::metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e).with_context(|| format!("reading the mode of {}", path.display())),
    };
    let was = meta.permissions().mode() & 0o7777;
    // A directory keeps its search bits: with job users, the data dir is 0711 so they can
    // pass through to their workspaces (never list or read).
    let now = if dir { was & !0o066 } else { was & !0o077 };
    if now != was {
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(now))
            .with_context(|| format!("setting mode {now:o} on {}", path.display()))?;
        if !fresh {
            tracing::warn!(path = %path.display(), was = %format!("{was:04o}"), now = %format!("{now:04o}"),
                "tightened permissions: this holds the agent's credential and was open to other users");
        }
    }
    Ok(())
}

fn write_private(path: &Path, contents: &str) -> anyhow::Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    if let Some(d) = path.parent() {
        std::fs::create_dir_all(d)?;
    }
    let tmp = path.with_extension("tmp");
    let mut f = std::fs::OpenOptions::new().write(true).create(true).truncate(true).mode(0o600).open(&tmp)?;
    // Explicitly: `mode` above is filtered by the umask, and a reused tmp file keeps its mode.
    f.set_permissions(<std::fs::Permissions as std::os::unix::fs::PermissionsExt>::from_mode(0o600))?;
    f.write_all(contents.as_bytes())?;
    f.sync_all()?;
    std::fs::rename(&tmp, path)?;
    Ok(())
}
