//! A job's workspace: filled before the job, its cached paths restored and saved, removed
//! after, all off the async threads (a job decides how many files it leaves).

use super::*;

/// Removes a workspace off the async threads: a job decides how many files it leaves, and
/// two jobs' million-file workspaces removed on the runtime's workers stalled the agent's
/// heartbeat for most of a minute (outsider attack), so the coordinator declared it lost.
pub(super) async fn remove_workspace(workspace: &Path) -> std::io::Result<()> {
    let ws = workspace.to_path_buf();
    tokio::task::spawn_blocking(move || crate::fstree::remove_tree(&ws))
        .await
        .unwrap_or_else(|e| Err(std::io::Error::other(e.to_string())))
}

/// Bring the step's cached paths into the new workspace from the caches its scope may read
/// (`crate::cache` carries out what the coordinator decided). Off the async threads: a
/// restore from another scope copies the tree.
pub(super) async fn restore_cache(a: &Assignment, ctx: &JobContext, workspace: &std::path::Path, out: &Emitter) {
    if a.step.cache.is_empty() || a.cache.is_none() {
        return;
    }
    let (store, scope, paths) = (ctx.caches.clone(), a.cache.clone(), a.step.cache.clone());
    let ws = workspace.to_path_buf();
    let lines = tokio::task::spawn_blocking(move || store.restore(&scope, &paths, &ws))
        .await
        .unwrap_or_else(|e| vec![format!("cache: restore failed: {e}")]);
    for line in lines {
        out.system(line);
    }
}

/// Keep the job's cached paths under its scope's save key (none: the job only reads).
pub(super) async fn save_cache(a: &Assignment, ctx: &JobContext, workspace: &std::path::Path, out: &Emitter) {
    if a.step.cache.is_empty() || a.cache.is_none() {
        return;
    }
    let (store, scope, paths, trusted) = (ctx.caches.clone(), a.cache.clone(), a.step.cache.clone(), a.trusted);
    let ws = workspace.to_path_buf();
    let lines = tokio::task::spawn_blocking(move || store.save(&scope, trusted, &paths, &ws))
        .await
        .unwrap_or_else(|e| vec![format!("cache: save failed: {e}")]);
    for line in lines {
        out.system(line);
    }
}

/// Unpack upload `id` (downloaded, or from the cache) into the new, empty workspace.
pub(super) async fn fill_workspace(
    id: &str,
    ctx: &JobContext,
    out: &Emitter,
    workspace: &std::path::Path,
) -> Result<(), crate::workspace::WorkspaceError> {
    let short = id.get(..12).unwrap_or(id);
    let Some(source) = &ctx.uploads else {
        return Err(crate::workspace::WorkspaceError::Download {
            id: id.to_string(),
            reason: "this agent has no coordinator to download uploads from".into(),
        });
    };
    let archive = source.fetch(id).await?;
    tracing::debug!(upload = short, "start: upload fetched");
    let (id2, ws) = (id.to_string(), workspace.to_path_buf());
    let files = tokio::task::spawn_blocking(move || crate::workspace::unpack(&id2, &archive, &ws))
        .await
        .map_err(|e| crate::workspace::WorkspaceError::Unpack { id: id.to_string(), reason: e.to_string() })??;
    out.system(format!("workspace: {files} files from upload {short}"));
    Ok(())
}
