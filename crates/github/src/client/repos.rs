//! Reading a repository and its issues: labels, a collaborator's permission, one file's
//! contents, the source tarball of a ref. Requests go through the client's `send`/`exchange`,
//! which own credentials, retries and rate limits.

use super::*;

/// How long a tarball download may take, start to end (512 MiB over a slow link).
const TARBALL_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(600);

impl Client {
    /// Removes `label` from an issue or pull request; a label that is not there (404) counts as removed.
    pub async fn remove_label(&self, repo: &Repo, issue_number: u64, label: &str) -> Result<(), ApiError> {
        const OP: &str = "remove label";
        let path = repo_path(OP, repo, &["issues", &issue_number.to_string(), "labels", label])?;
        let reply = self.send(OP, Method::DELETE, &path, &[], Auth::Repo(repo), NO_BODY).await?;
        if reply.status != StatusCode::NOT_FOUND {
            reply.success()?;
        }
        Ok(())
    }

    /// `username`'s role on `repo`; [`Permission::None`] when GitHub does not know them (404).
    pub async fn collaborator_permission(&self, repo: &Repo, username: &str) -> Result<Permission, ApiError> {
        const OP: &str = "get collaborator permission";
        let path = repo_path(OP, repo, &["collaborators", username, "permission"])?;
        let reply = self.send(OP, Method::GET, &path, &[], Auth::Repo(repo), NO_BODY).await?;
        if reply.status == StatusCode::NOT_FOUND {
            return Ok(Permission::None);
        }
        let resp: wire::CollaboratorPermission = reply.success()?.json()?;
        Ok(Permission::from_response(resp.role_name.as_deref(), resp.permission.as_deref()))
    }

    /// GET contents/{path}?ref=..; None on 404; decodes the base64 `content` (GitHub wraps lines with \n).
    ///
    /// Directories, symlinks, submodules and files over 1 MB (for which GitHub sends no content) are
    /// [`ApiError::UnsupportedContent`].
    pub async fn file_contents(&self, repo: &Repo, path: &str, git_ref: &str) -> Result<Option<Vec<u8>>, ApiError> {
        const OP: &str = "get repository content";
        let file_segments: Vec<&str> = path.split('/').filter(|s| !s.is_empty()).collect();
        let mut segments = vec!["contents"];
        segments.extend(&file_segments);
        let url_path = repo_path(OP, repo, &segments)?;
        let query = [("ref", git_ref.to_owned())];
        let reply = self.send(OP, Method::GET, &url_path, &query, Auth::Repo(repo), NO_BODY).await?;
        if reply.status == StatusCode::NOT_FOUND {
            return Ok(None);
        }
        let unsupported =
            |reason: String| ApiError::UnsupportedContent { operation: OP, path: path.to_owned(), reason };
        let entry = match reply.success()?.json()? {
            wire::Contents::Directory(entries) => {
                return Err(unsupported(format!("is a directory ({} entries), not a file", entries.len())))
            }
            wire::Contents::Entry(entry) => entry,
        };
        if entry.kind != "file" {
            return Err(unsupported(format!("is a {}, not a file", entry.kind)));
        }
        match (entry.encoding.as_deref(), entry.content) {
            (Some("base64"), Some(content)) => {
                decode_base64(&content).map(Some).ok_or_else(|| unsupported("content is not valid base64".into()))
            }
            (encoding, _) => Err(unsupported(format!(
                "GitHub sent no inline content (encoding {encoding:?}; files over 1 MB are not inlined)"
            ))),
        }
    }

    /// GET tarball/{ref}; follows GitHub's redirect; refuses bodies over max_bytes (ApiError variant, not transient).
    ///
    /// GitHub redirects to another host (codeload); the HTTP client drops the `Authorization` header on
    /// such a redirect, so the token never leaves for a host it was not issued for.
    pub async fn tarball(&self, repo: &Repo, git_ref: &str, max_bytes: u64) -> Result<Vec<u8>, ApiError> {
        const OP: &str = "download tarball";
        let mut segments = vec!["tarball"];
        segments.extend(git_ref.split('/'));
        let path = repo_path(OP, repo, &segments)?;
        let too_large = ApiError::TooLarge { operation: OP, limit: max_bytes };
        let transport = |source| ApiError::Transport { operation: OP, source };
        let mut resp =
            match self.exchange(OP, Method::GET, &path, &[], Auth::Repo(repo), NO_BODY, TARBALL_TIMEOUT).await? {
                Answer::Success(resp) => resp,
                Answer::Other(reply) => return reply.success().map(|_| Vec::new()),
            };
        if resp.content_length().is_some_and(|len| len > max_bytes) {
            return Err(too_large);
        }
        // Counted as it streams: a chunked response has no length to check up front.
        let mut body = Vec::new();
        while let Some(chunk) = resp.chunk().await.map_err(transport)? {
            if (body.len() + chunk.len()) as u64 > max_bytes {
                return Err(too_large);
            }
            body.extend_from_slice(&chunk);
        }
        Ok(body)
    }
}
