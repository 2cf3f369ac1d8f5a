//! Reading a repository: labels, a collaborator's permission, file contents, the source tarball.

use super::*;

#[tokio::test]
async fn label_names_are_url_encoded_and_a_missing_label_is_fine() {
    let s = start_stub().await;
    let client = pat_client(&s.base);
    client.remove_label(&kernels(), 42, "needs gpu/ci: ok?").await.expect("removed");
    client.remove_label(&kernels(), 42, "absent").await.expect("404 means not there");
    let err = client.remove_label(&kernels(), 42, "..").await.expect_err("dot segment");
    assert!(matches!(err, ApiError::InvalidArgument { .. }), "{err:?}");
    let paths: Vec<_> = s.github.requests().into_iter().map(|r| r.path).collect();
    assert_eq!(
        paths,
        [
            "/repos/gpu-lab/kernels/issues/42/labels/needs%20gpu%2Fci%3A%20ok%3F",
            "/repos/gpu-lab/kernels/issues/42/labels/absent"
        ]
    );
    assert_all_documented(&s.github);
}

#[tokio::test]
async fn collaborator_permission_reads_role_name_then_permission() {
    let s = start_stub().await;
    let client = pat_client(&s.base);
    let repo = kernels();
    for (user, expected) in [
        ("admin-user", Permission::Admin),
        ("maintainer", Permission::Maintain),
        ("triager", Permission::Triage),
        ("custom-role", Permission::Write),
        ("reader", Permission::Read),
        ("stranger", Permission::None),
    ] {
        assert_eq!(client.collaborator_permission(&repo, user).await.expect("permission"), expected, "{user}");
    }
    assert!(client.collaborator_permission(&repo, "maintainer").await.expect("permission").can_write());
    assert!(!client.collaborator_permission(&repo, "triager").await.expect("permission").can_write());
    assert_all_documented(&s.github);
}

#[tokio::test]
async fn file_contents_decodes_wrapped_base64_and_maps_404_to_none() {
    let s = start_stub().await;
    let client = pat_client(&s.base);
    let repo = kernels();
    assert!(github_base64(&gpuci_yml()).trim_end().contains('\n'), "the fixture must be wrapped like GitHub's");
    let file = client.file_contents(&repo, ".gpuci/pipeline.yml", SHA).await.expect("contents");
    assert_eq!(file, Some(gpuci_yml()));
    assert_eq!(client.file_contents(&repo, ".gpuci/missing.yml", "main").await.expect("404"), None);
    let err = client.file_contents(&repo, ".gpuci", "main").await.expect_err("directory");
    assert!(matches!(err, ApiError::UnsupportedContent { .. }) && !err.is_transient(), "{err:?}");

    let first = &s.github.requests()[0];
    assert_eq!(first.path, "/repos/gpu-lab/kernels/contents/.gpuci/pipeline.yml");
    assert_eq!(first.query.as_deref(), Some(&*format!("ref={SHA}")));
    assert_all_documented(&s.github);
}

#[tokio::test]
async fn tarball_follows_the_redirect_without_the_token_and_enforces_the_cap() {
    let s = start_stub().await;
    let client = pat_client(&s.base);
    let repo = kernels();
    let tar = client.tarball(&repo, SHA, TARBALL_BYTES as u64).await.expect("tarball at the limit");
    assert_eq!(tar.len(), TARBALL_BYTES);

    let err = client.tarball(&repo, SHA, TARBALL_BYTES as u64 - 1).await.expect_err("over the limit");
    assert!(matches!(err, ApiError::TooLarge { limit, .. } if limit == TARBALL_BYTES as u64 - 1), "{err:?}");
    assert!(!err.is_transient());
    let err = client.tarball(&repo, "chunked", 2500).await.expect_err("over the limit while streaming");
    assert!(matches!(err, ApiError::TooLarge { .. }), "{err:?}");
    assert_eq!(client.tarball(&repo, "chunked", 1 << 20).await.expect("chunked").len(), TARBALL_BYTES);

    let github = s.github.requests();
    assert_eq!(github[0].path, format!("/repos/gpu-lab/kernels/tarball/{SHA}"));
    assert_eq!(bearer(&github[0]), PAT);
    let codeload = s.codeload.requests();
    assert_eq!(codeload.len(), 4);
    assert!(
        codeload.iter().all(|r| !r.headers.contains_key("authorization")),
        "the token must not follow the redirect to another host"
    );
    assert_all_documented(&s.github);
}
