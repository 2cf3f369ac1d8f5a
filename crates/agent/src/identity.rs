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
    /// The coordinators' identity key, pinned when the agent registered (or, for an agent
    /// registered before keys existed, when it first met one that proves a key): no address
    /// that cannot prove it is sent the credential ([`crate::follow`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub coordinator_key: Option<String>,
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

/// The stored identity, when it belongs to the coordinators `server` names (a comma-separated
/// list: one URL in common is enough, as every coordinator of one database knows the agents
/// registered with any of them); `None`: register.
pub fn load(data_dir: &Path, server: &str) -> anyhow::Result<Option<Identity>> {
    let path = data_dir.join("agent.json");
    make_private(data_dir, true)?;
    make_private(&path, false)?;
    let Ok(text) = std::fs::read_to_string(&path) else { return Ok(None) };
    let id: Identity = serde_json::from_str(&text).with_context(|| format!("reading {}", path.display()))?;
    if same_coordinators(&id.server, server) {
        return Ok(Some(id));
    }
    tracing::info!(old = %id.server, new = server, "stored identity is for another coordinator; registering again");
    Ok(None)
}

/// The coordinators' key the stored identity pinned, whatever coordinators it names: a new
/// `--server` list does not unpin it (outsider finding: an agent given a list with no URL in
/// common registered anew with whatever proved any key). Moving an agent to another
/// installation takes `--coordinator-key` or removing `agent.json`.
pub fn kept_key(data_dir: &Path) -> Option<String> {
    let text = std::fs::read_to_string(data_dir.join("agent.json")).ok()?;
    serde_json::from_str::<Identity>(&text).ok()?.coordinator_key
}

/// Whether two lists of coordinator URLs (comma-separated) name one URL in common.
pub fn same_coordinators(a: &str, b: &str) -> bool {
    let urls = |s: &str| s.split(',').map(|u| u.trim().trim_end_matches('/').to_string()).collect::<Vec<_>>();
    let b = urls(b);
    urls(a).iter().any(|u| !u.is_empty() && b.contains(u))
}

/// Register with `registration_token` at the first of `targets` (best first, see [`follow`])
/// that answers; `server` (the URLs as configured) is stored with the identity.
///
/// [`follow`]: crate::follow
pub async fn register(
    data_dir: &Path,
    server: &str,
    targets: &[crate::follow::Target],
    name: &str,
    registration_token: Option<&str>,
) -> anyhow::Result<Identity> {
    let path = data_dir.join("agent.json");
    let Some(token) = registration_token else {
        bail!("this agent is not registered with {server}: pass --registration-token (or GPUCI_REGISTRATION_TOKEN), found in the coordinator's data dir as registration-token");
    };
    let mut unreachable = Unreachable { server: server.to_string(), why: "no coordinator leads now".into() };
    for t in targets {
        // A target that proved the key, over plain HTTP: the token goes over the connection
        // it proved it on (a new one, opened after the proof, went to whoever held the address
        // by then).
        if let (Some(key), true) = (t.key.as_deref(), t.base.starts_with("http://")) {
            let body = serde_json::to_vec(&RegisterRequest { name: name.to_string() })?;
            let (status, answer) =
                match crate::follow::post_proved(t, key, "/api/v1/agents/register", token, body).await {
                    Ok(a) => a,
                    Err(why) => {
                        unreachable = Unreachable { server: t.base.clone(), why };
                        continue;
                    }
                };
            if status >= 500 {
                unreachable = Unreachable { server: t.base.clone(), why: format!("answered {status}") };
                continue;
            }
            if !(200..300).contains(&status) {
                bail!("registration with {} refused ({status}): {}", t.base, String::from_utf8_lossy(&answer));
            }
            let r: RegisterResponse = serde_json::from_slice(&answer).context("reading registration answer")?;
            return registered(&path, server, t, r);
        }
        let http = t.client(reqwest::Client::builder().timeout(std::time::Duration::from_secs(30)))?;
        let resp = match http
            .post(format!("{}/api/v1/agents/register", t.base))
            .bearer_auth(token)
            .json(&RegisterRequest { name: name.to_string() })
            .send()
            .await
        {
            Ok(r) => r,
            Err(e) => {
                unreachable = Unreachable { server: t.base.clone(), why: format!("{:#}", anyhow::Error::new(e)) };
                continue;
            }
        };
        if resp.status().is_server_error() {
            // A proxy in front of a coordinator that is down answers 502/503, a standby 503:
            // as unreachable.
            unreachable = Unreachable { server: t.base.clone(), why: format!("answered {}", resp.status()) };
            continue;
        }
        if !resp.status().is_success() {
            let status = resp.status();
            let body = resp.text().await.unwrap_or_default();
            bail!("registration with {} refused ({status}): {body}", t.base);
        }
        let r: RegisterResponse = resp.json().await.context("reading registration answer")?;
        return registered(&path, server, t, r);
    }
    Err(unreachable.into())
}

/// The identity `t` answered a registration with, kept at `path`.
fn registered(path: &Path, server: &str, t: &crate::follow::Target, r: RegisterResponse) -> anyhow::Result<Identity> {
    let id = Identity {
        agent_id: r.agent_id,
        credential: r.credential,
        server: server.to_string(),
        coordinator_key: t.key.clone(),
    };
    write_private(path, &serde_json::to_string_pretty(&id)?)?;
    tracing::info!(agent = %id.agent_id, coordinator = %t.base, key = ?id.coordinator_key, "registered");
    Ok(id)
}

/// Keeps `key` as the coordinators' identity key of the stored identity (first met by an
/// agent registered before keys existed).
pub fn pin(data_dir: &Path, id: &mut Identity, key: &str) -> anyhow::Result<()> {
    id.coordinator_key = Some(key.to_string());
    write_private(&data_dir.join("agent.json"), &serde_json::to_string_pretty(id)?)?;
    tracing::warn!(key, "pinned the coordinators' identity key (first met): from now on only coordinators that prove it are sent this agent's credential");
    Ok(())
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_identity_is_kept_when_the_coordinator_list_names_its_coordinator() {
        assert!(same_coordinators("http://a:1", "http://a:1/"));
        assert!(same_coordinators("http://a:1", "http://b:2, http://a:1"));
        assert!(same_coordinators("http://a:1,http://b:2", "http://b:2"));
        assert!(!same_coordinators("http://a:1", "http://b:2,http://c:3"));
        assert!(!same_coordinators("", "http://b:2"));
    }
}
