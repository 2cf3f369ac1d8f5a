//! `gpuci artifacts list|download JOB`: the files a job uploaded when its step ended.
//!
//! A download writes each file under `--dir` (default: the current directory) at its path,
//! with the agent's rules for placing artifacts (`gpuci_agent::artifacts::create_in`): a
//! path that would leave the directory, or a link on the way, is refused; every file is
//! checked against its sha256. Each file is written to a temporary file beside its place
//! (`.gpuci-part-…`) and renamed into place only once its bytes match its sha256: a download
//! that is cut off or does not match leaves nothing at the file's path (outsider finding: a
//! corrupt or truncated file stayed there, and a rerun refused it as already there). Paths
//! written go to stdout, one a line; the summary to stderr.

use crate::cli::ClientArgs;
use crate::client::Client;
use crate::{CliError, CliResult};
use clap::{Args, Subcommand};
use futures::StreamExt;
use gpuci_protocol::api::ArtifactInfo;
use sha2::{Digest, Sha256};
use std::io::Write;
use std::path::PathBuf;

#[derive(Args, Debug)]
pub struct ArtifactsArgs {
    #[command(subcommand)]
    pub command: ArtifactsCommand,
    #[command(flatten)]
    pub client: ClientArgs,
}

#[derive(Subcommand, Debug)]
pub enum ArtifactsCommand {
    /// List a job's artifacts: size, sha256 and path (`--json`: the API's records).
    List { job: i64 },
    /// Download a job's artifacts, all or those matching GLOB (`dist/*.whl`, `**/*.xml`).
    Download {
        job: i64,
        glob: Option<String>,
        /// Where to put them (made if missing); default the current directory.
        #[arg(long, default_value = ".")]
        dir: PathBuf,
        /// Replace files that are already there. Without it an existing file is an error and
        /// nothing is downloaded: an artifact is the job's, and a job may name its files
        /// `.git/config` or `.envrc` (outsider finding).
        #[arg(long)]
        overwrite: bool,
    },
}

pub async fn run(a: ArtifactsArgs) -> CliResult<u8> {
    let client = Client::from_args(&a.client)?;
    match a.command {
        ArtifactsCommand::List { job } => {
            let list: Vec<ArtifactInfo> = client.get(&format!("/api/v1/jobs/{job}/artifacts")).await?;
            if a.client.json {
                println!("{}", serde_json::to_string_pretty(&list).map_err(anyhow::Error::from)?);
                return Ok(0);
            }
            if list.is_empty() {
                eprintln!("job {job} has no artifacts");
                return Ok(0);
            }
            println!("{:>10}  {:<12}  PATH", "SIZE", "SHA256");
            for f in &list {
                println!(
                    "{:>10}  {:<12}  {}",
                    gpuci_core::quantity::Bytes(f.size).to_string(),
                    &f.sha256[..12.min(f.sha256.len())],
                    f.path
                );
            }
            Ok(0)
        }
        ArtifactsCommand::Download { job, glob, dir, overwrite } => {
            download(&client, job, glob.as_deref(), &dir, overwrite).await
        }
    }
}

async fn download(
    client: &Client,
    job: i64,
    glob: Option<&str>,
    dir: &std::path::Path,
    overwrite: bool,
) -> CliResult<u8> {
    let list: Vec<ArtifactInfo> = client.get(&format!("/api/v1/jobs/{job}/artifacts")).await?;
    let wanted: Vec<&ArtifactInfo> = match glob {
        Some(g) => {
            let p = gpuci_core::artifacts::Patterns::new(&[g.to_string()]).map_err(CliError::Input)?;
            list.iter().filter(|f| p.matches(&f.path)).collect()
        }
        None => list.iter().collect(),
    };
    if wanted.is_empty() {
        return Err(CliError::Input(match glob {
            Some(g) => format!("job {job} has no artifact matching {g:?} ({} in all)", list.len()),
            None => format!("job {job} has no artifacts"),
        }));
    }
    if !overwrite {
        let there: Vec<&str> = wanted
            .iter()
            .filter(|f| std::fs::symlink_metadata(dir.join(&f.path)).is_ok())
            .map(|f| f.path.as_str())
            .collect();
        if !there.is_empty() {
            return Err(CliError::Input(format!(
                "{} already there in {} ({}); nothing downloaded. Download into an empty --dir, or pass --overwrite",
                there.len(),
                dir.display(),
                there.iter().take(5).map(|p| format!("{p:?}")).collect::<Vec<_>>().join(", ")
            )));
        }
    }
    std::fs::create_dir_all(dir).map_err(|e| CliError::Input(format!("--dir {}: {e}", dir.display())))?;
    let mut bytes = 0;
    for (i, f) in wanted.iter().enumerate() {
        // Beside its place (the same directory, so the rename is atomic), checked by the same
        // rules; removed on every way out but the rename.
        let part = match f.path.rsplit_once('/') {
            Some((parent, _)) => format!("{parent}/.gpuci-part-{}-{i}", std::process::id()),
            None => format!(".gpuci-part-{}-{i}", std::process::id()),
        };
        let mut file = gpuci_agent::artifacts::create_in(dir, &part)
            .map_err(|e| CliError::Input(format!("artifact {:?}: refused: {e}", f.path)))?;
        let partial = Partial(dir.join(&part));
        let job_s = job.to_string();
        let resp = client.get_raw(&["api", "v1", "jobs", job_s.as_str(), "artifact"], &[("path", &f.path)]).await?;
        let mut hasher = Sha256::new();
        let mut stream = resp.bytes_stream();
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.map_err(|e| {
                anyhow::anyhow!("artifact {:?}: the download broke off ({e}); nothing written at its path", f.path)
            })?;
            hasher.update(&chunk);
            file.write_all(&chunk).map_err(|e| anyhow::anyhow!("writing {}: {e}", f.path))?;
        }
        if hex::encode(hasher.finalize()) != f.sha256 {
            return Err(CliError::Other(anyhow::anyhow!(
                "artifact {:?}: the download does not match its sha256; nothing written at its path",
                f.path
            )));
        }
        file.sync_all().map_err(|e| anyhow::anyhow!("writing {}: {e}", f.path))?;
        drop(file);
        std::fs::rename(&partial.0, dir.join(&f.path)).map_err(|e| anyhow::anyhow!("writing {}: {e}", f.path))?;
        std::mem::forget(partial);
        bytes += f.size;
        println!("{}", dir.join(&f.path).display());
    }
    eprintln!(
        "downloaded {} artifact(s), {}, into {}",
        wanted.len(),
        gpuci_core::quantity::Bytes(bytes),
        dir.display()
    );
    Ok(0)
}

/// A download's temporary file, removed when dropped (forgotten once renamed into place).
struct Partial(PathBuf);

impl Drop for Partial {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// A job's test reports for `gpuci jobs show`: counts, then each failed test with the first
/// lines of its message. Every text from the report is escaped (it is the job's).
pub fn render_test_report(r: &gpuci_protocol::api::JobTestReport) -> String {
    use gpuci_core::text::escape;
    let mut out = format!("Tests:     {}\n", r.summary.describe());
    for f in &r.files {
        if let Some(e) = &f.error {
            out.push_str(&format!("  {}: not read: {}\n", escape(&f.path), escape(e)));
        }
    }
    for t in &r.summary.failed {
        let name = if t.classname.is_empty() { t.name.clone() } else { format!("{}.{}", t.classname, t.name) };
        out.push_str(&format!("  {} {}\n", t.kind.to_uppercase(), escape(&name)));
        for line in t.message.lines().take(5) {
            out.push_str(&format!("      {}\n", escape(line)));
        }
    }
    let shown = r.summary.failed.len() as u64;
    let failed = r.summary.failures + r.summary.errors;
    if failed > shown {
        out.push_str(&format!("  … and {} more failed (not kept)\n", failed - shown));
    }
    out
}

/// The job's test reports, `None` when it has none (404).
pub async fn job_test_report(c: &Client, job: i64) -> CliResult<Option<gpuci_protocol::api::JobTestReport>> {
    match c.get(&format!("/api/v1/jobs/{job}/test-report")).await {
        Ok(r) => Ok(Some(r)),
        Err(CliError::Input(m)) if m.contains("404") => Ok(None),
        Err(e) => Err(e),
    }
}
