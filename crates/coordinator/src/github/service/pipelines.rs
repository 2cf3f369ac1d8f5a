//! gpuci pipelines from `push` and `pull_request` webhooks: fetch the commit's tarball, read
//! its `.gpuci.yml` and submit it. Pull requests from forks or outsiders wait for a
//! maintainer's approval label, which covers one head SHA; a new run of a pull request
//! supersedes the unfinished jobs of its previous run.

use super::Service;
use crate::brain;
use crate::brain::Command;
use crate::github::report::{Item, PipelineReport};
use crate::origin::{GithubOrigin, Origin};
use gpuci_core::pipeline::Pipeline;
use gpuci_github::{AuthorAssociation, PullRequestAction, PullRequestEvent, PushEvent, Repo};
use gpuci_store::ApprovalRecord;
use std::collections::BTreeMap;

/// The largest repository tarball gpuci downloads for a pipeline.
const MAX_TARBALL_BYTES: u64 = 512 << 20;
/// The most bytes a repository may unpack to.
const MAX_UNPACKED_BYTES: u64 = 4 << 30;

impl Service {
    pub(super) fn runs_pipelines(&self, repository: &str) -> bool {
        self.cfg.repositories.iter().any(|r| r.eq_ignore_ascii_case(repository))
    }

    pub(super) async fn push(&mut self, p: PushEvent) {
        if p.deleted || !self.runs_pipelines(&p.repository.full_name) {
            return;
        }
        let origin = GithubOrigin {
            repository: p.repository.full_name.clone(),
            sha: p.after.clone(),
            event: "push".into(),
            pr: None,
            secrets: true,
            git_ref: Some(p.git_ref.clone()),
            head_branch: None,
            base_branch: None,
            default_branch: p.default_branch.clone(),
            trusted: true,
            approved_by: None,
            subject: p.subject.clone(),
            author: p.author.clone(),
        };
        self.run_pipeline(origin, Some(p.git_ref.clone())).await;
    }

    pub(super) async fn pull_request(&mut self, p: PullRequestEvent) {
        let repository = p.base_repository.full_name.clone();
        if !self.runs_pipelines(&repository) {
            return;
        }
        let Some(repo) = Repo::parse(&repository) else { return };
        let trusted = !p.from_fork
            && matches!(
                p.author_association,
                AuthorAssociation::Owner | AuthorAssociation::Member | AuthorAssociation::Collaborator
            );
        let origin = GithubOrigin {
            repository: repository.clone(),
            sha: p.head_sha.clone(),
            event: "pull_request".into(),
            pr: Some(p.number),
            // Code from a fork never sees secrets, approved or not.
            secrets: !p.from_fork,
            git_ref: None,
            head_branch: p.head_ref.clone(),
            base_branch: p.base_ref.clone(),
            default_branch: p.default_branch.clone(),
            // Nor do its caches reach a trusted job: approval lets it run, not write for others.
            trusted,
            approved_by: None,
            subject: p.title.clone(),
            author: p.author.clone(),
        };
        let label = self.cfg.approval_label.clone();
        match p.action {
            PullRequestAction::Opened | PullRequestAction::Synchronize | PullRequestAction::Reopened => {
                if trusted {
                    return self.run_pipeline(origin, None).await;
                }
                match self.store.get_approval(&repository, p.number as i64, &p.head_sha).await {
                    Ok(Some(a)) => {
                        let origin = GithubOrigin { approved_by: Some(a.approved_by), ..origin };
                        self.run_pipeline(origin, None).await
                    }
                    Ok(None) => {
                        tracing::info!(repository = %repository, pr = p.number, sha = %p.head_sha, "pull request waits for approval");
                        let _ = self.report.send(Item::Pipeline {
                            repo,
                            sha: p.head_sha.clone(),
                            state: PipelineReport::WaitingForApproval,
                            title: format!(
                                "waiting for approval: a maintainer adds the `{label}` label to run commit {}",
                                short(&p.head_sha)
                            ),
                            summary: format!(
                                "This pull request comes from a fork or an outside contributor. gpuci runs it on GPUs only after a maintainer with write access adds the `{label}` label. The approval covers commit {} only: a new push needs a new approval.",
                                p.head_sha
                            ),
                        });
                    }
                    Err(e) => tracing::error!(error = %e, "could not read approvals"),
                }
            }
            PullRequestAction::Labeled if p.label.as_deref() == Some(label.as_str()) => {
                if trusted {
                    return;
                }
                let sender = p.sender.clone().unwrap_or_default();
                let allowed = match self.client.collaborator_permission(&repo, &sender).await {
                    Ok(perm) => perm.can_write(),
                    Err(e) => {
                        tracing::warn!(error = %e, %sender, "could not check the labeller's permission");
                        false
                    }
                };
                if !allowed {
                    tracing::warn!(repository = %repository, pr = p.number, %sender, "approval label added by someone without write access: ignored");
                    return;
                }
                let already =
                    matches!(self.store.get_approval(&repository, p.number as i64, &p.head_sha).await, Ok(Some(_)));
                let approval = ApprovalRecord {
                    repository: repository.clone(),
                    pr: p.number as i64,
                    head_sha: p.head_sha.clone(),
                    approved_by: sender.clone(),
                    approved_at_ms: brain::now_ms(),
                };
                if let Err(e) = self.store.put_approval(&approval).await {
                    return tracing::error!(error = %e, "could not record approval");
                }
                // The label is spent: the next push must be approved again.
                if let Err(e) = self.client.remove_label(&repo, p.number, &label).await {
                    tracing::warn!(error = %e, "could not remove the approval label");
                }
                if !already {
                    tracing::info!(repository = %repository, pr = p.number, sha = %p.head_sha, %sender, "pull request approved");
                    let _ = self.report.send(Item::Pipeline {
                        repo: repo.clone(),
                        sha: p.head_sha.clone(),
                        state: PipelineReport::Approved,
                        title: format!("approved by {sender} for commit {}", short(&p.head_sha)),
                        summary: format!("{sender} added the `{label}` label. The jobs report as `gpuci / <step>`."),
                    });
                    let origin = GithubOrigin { approved_by: Some(sender.clone()), ..origin };
                    self.run_pipeline(origin, None).await;
                }
            }
            _ => {}
        }
    }

    pub(super) async fn run_pipeline(&mut self, origin: GithubOrigin, git_ref: Option<String>) {
        let Some(repo) = Repo::parse(&origin.repository) else { return };
        let file = self.cfg.pipeline_file.clone();
        let fail = |title: String, summary: String| Item::Pipeline {
            repo: repo.clone(),
            sha: origin.sha.clone(),
            state: PipelineReport::Failed,
            title,
            summary,
        };
        let bytes = match self.client.file_contents(&repo, &file, &origin.sha).await {
            Ok(Some(b)) => b,
            Ok(None) => {
                return tracing::debug!(repository = %origin.repository, sha = %origin.sha, "no {file}; nothing to run")
            }
            Err(e) => {
                tracing::warn!(error = %e, "could not read {file}");
                let _ = self.report.send(fail(format!("gpuci could not read {file}"), e.to_string()));
                return;
            }
        };
        let text = String::from_utf8_lossy(&bytes).into_owned();
        let mut pipeline = match gpuci_core::pipeline::parse(&file, &text) {
            Ok(p) => p,
            Err(errors) => {
                let summary = errors.to_string();
                let first = summary.lines().next().unwrap_or_default().to_string();
                let _ = self.report.send(fail(format!("{file} is invalid: {first}"), format!("```\n{summary}\n```")));
                return;
            }
        };
        let tgz = match self.client.tarball(&repo, &origin.sha, MAX_TARBALL_BYTES).await {
            Ok(t) => match tokio::task::spawn_blocking(move || strip_top_dir(&t)).await {
                Ok(r) => r,
                Err(e) => Err(e.to_string()),
            },
            Err(e) => Err(e.to_string()),
        };
        // Taken after the download (a pin holds upload garbage collection back) and held
        // until the pipeline naming the upload is committed (`crate::uploads`).
        let pin = self.uploads.pin().await;
        let upload = match tgz {
            Ok(tgz) => self.uploads.put(&pin, tgz).await.map_err(|e| e.to_string()),
            Err(e) => Err(e),
        };
        let upload = match upload {
            Ok(id) => id,
            Err(e) => {
                tracing::warn!(error = %e, "could not fetch the repository");
                let _ = self
                    .report
                    .send(fail(format!("gpuci could not fetch {}@{}", origin.repository, short(&origin.sha)), e));
                return;
            }
        };
        if let Some(pr) = origin.pr {
            supersede_per_pull_request(&mut pipeline, &origin.repository, pr);
        }
        let mut env = BTreeMap::from([
            ("GITHUB_REPOSITORY".to_string(), origin.repository.clone()),
            ("GITHUB_SHA".to_string(), origin.sha.clone()),
            ("GITHUB_EVENT_NAME".to_string(), origin.event.clone()),
        ]);
        if let Some(r) = git_ref {
            env.insert("GITHUB_REF".into(), r);
        }
        if let Some(pr) = origin.pr {
            env.insert("GITHUB_PR_NUMBER".into(), pr.to_string());
        }
        let build = Origin::Github(origin.clone()).build_facts();
        let json = Origin::Github(origin.clone()).to_json();
        let result = self
            .ask(|reply| Command::Submit {
                sub: Box::new(crate::brain::Submission {
                    file_name: format!("{}@{}:{file}", origin.repository, short(&origin.sha)),
                    source: text,
                    pipeline,
                    extra_env: env,
                    workspace_upload: Some(upload),
                    repository: Some(format!("github.com/{}", origin.repository.to_ascii_lowercase())),
                    origin: Some(json),
                    build,
                    once: None,
                }),
                reply,
            })
            .await;
        drop(pin);
        match result {
            Ok((p, jobs)) => {
                tracing::info!(pipeline = p.id, repository = %origin.repository, sha = %origin.sha, event = %origin.event, "pipeline started from GitHub");
                self.origins.insert(p.id, Some(Origin::Github(origin)));
                for j in jobs {
                    let summary = crate::convert::job_summary(&j, None);
                    self.job_changed(&summary).await;
                }
            }
            Err(e) => {
                let _ = self.report.send(fail("gpuci could not start the pipeline".into(), e.to_string()));
            }
        }
    }
}

/// A new run of a pull request cancels the unfinished jobs of its previous run, step by step
/// (a concurrency group per pull request and step, newest wins), unless a step names its own
/// concurrency group.
fn supersede_per_pull_request(pipeline: &mut Pipeline, repository: &str, pr: u64) {
    for step in pipeline.steps.iter_mut().filter(|s| s.concurrency.is_none()) {
        step.concurrency = Some(gpuci_core::pipeline::Concurrency {
            group: format!("github:{}#{pr}/{}", repository.to_ascii_lowercase(), step.key),
            cancel_in_progress: true,
        });
    }
}

fn short(sha: &str) -> &str {
    &sha[..sha.len().min(7)]
}

/// GitHub's tarball has one top-level directory (`owner-repo-sha/`); a workspace is the
/// repository's root. Re-pack without it, refusing archives that unpack past the limit.
fn strip_top_dir(tgz: &[u8]) -> Result<Vec<u8>, String> {
    use flate2::read::GzDecoder;
    use flate2::write::GzEncoder;
    let mut input = tar::Archive::new(GzDecoder::new(tgz));
    let mut out = tar::Builder::new(GzEncoder::new(Vec::new(), flate2::Compression::fast()));
    let mut total: u64 = 0;
    let strip = |p: &std::path::Path| -> Option<std::path::PathBuf> {
        let rest: std::path::PathBuf = p.components().skip(1).collect();
        (!rest.as_os_str().is_empty()).then_some(rest)
    };
    for entry in input.entries().map_err(|e| format!("reading the tarball: {e}"))? {
        let mut entry = entry.map_err(|e| format!("reading the tarball: {e}"))?;
        let kind = entry.header().entry_type();
        if kind.is_pax_global_extensions() || kind.is_pax_local_extensions() || kind.is_gnu_longname() {
            continue;
        }
        let path = entry.path().map_err(|e| format!("tarball entry: {e}"))?.into_owned();
        let Some(rel) = strip(&path) else { continue };
        total += entry.size();
        if total > MAX_UNPACKED_BYTES {
            return Err(format!("the repository unpacks to more than {} GiB", MAX_UNPACKED_BYTES >> 30));
        }
        let mut header = entry.header().clone();
        if kind.is_hard_link() {
            let target = entry.link_name().ok().flatten().and_then(|t| strip(&t));
            let Some(target) = target else { continue };
            out.append_link(&mut header, &rel, &target).map_err(|e| e.to_string())?;
        } else if kind.is_symlink() {
            let Some(target) = entry.link_name().ok().flatten().map(|t| t.into_owned()) else { continue };
            out.append_link(&mut header, &rel, &target).map_err(|e| e.to_string())?;
        } else {
            out.append_data(&mut header, &rel, &mut entry).map_err(|e| e.to_string())?;
        }
    }
    let gz = out.into_inner().map_err(|e| e.to_string())?;
    gz.finish().map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tarball_top_directory_is_stripped() {
        let mut b = tar::Builder::new(flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast()));
        for (path, data) in
            [("octo-gpu-abc1234/.gpuci.yml", "steps: []\n"), ("octo-gpu-abc1234/src/a.py", "print(1)\n")]
        {
            let mut h = tar::Header::new_gnu();
            h.set_size(data.len() as u64);
            h.set_mode(0o644);
            h.set_cksum();
            b.append_data(&mut h, path, data.as_bytes()).unwrap();
        }
        let tgz = b.into_inner().unwrap().finish().unwrap();
        let out = strip_top_dir(&tgz).unwrap();
        let mut a = tar::Archive::new(flate2::read::GzDecoder::new(&out[..]));
        let names: Vec<String> =
            a.entries().unwrap().map(|e| e.unwrap().path().unwrap().display().to_string()).collect();
        assert_eq!(names, vec![".gpuci.yml", "src/a.py"]);
    }
}
