use super::*;
use proptest::prelude::*;

fn gh(text: &str) -> Result<String, RepoIdError> {
    RepoId::parse(text, DEFAULT_GITHUB_HOST).map(|r| r.to_string())
}

#[test]
fn remotes_name_their_host_and_path() {
    for (given, want) in [
        ("https://github.com/acme/x.git", "github.com/acme/x"),
        ("https://github.com/Acme/X/", "github.com/acme/x"),
        ("https://user:token@github.com/acme/x.git", "github.com/acme/x"),
        ("https://github.com:443/acme/x", "github.com/acme/x"),
        ("http://git.example.org:8080/acme/x", "git.example.org:8080/acme/x"),
        ("ssh://git@github.example.com:2222/octo/kernels.git", "github.example.com:2222/octo/kernels"),
        ("ssh://git@github.com:22/acme/x", "github.com/acme/x"),
        ("git@github.com:acme/x.git", "github.com/acme/x"),
        ("git@gitlab.com:acme/group/sub/x.git", "gitlab.com/acme/group/sub/x"),
        ("gitlab.com:acme/x", "gitlab.com/acme/x"),
        ("https://gitlab.com/acme/x", "gitlab.com/acme/x"),
        ("github.com/acme/x", "github.com/acme/x"),
        ("git.example.org:8080/acme/x", "git.example.org:8080/acme/x"),
        ("acme/x", "github.com/acme/x"),
        ("Acme/X", "github.com/acme/x"),
        ("/srv/git/Kernels/", "local:/srv/git/Kernels"),
        ("file:///srv/git/kernels", "local:/srv/git/kernels"),
        ("https://[::1]:8443/acme/x", "[::1]:8443/acme/x"),
    ] {
        assert_eq!(gh(given).as_deref(), Ok(want), "{given}");
    }
}

/// Regression (issue 27): the parser dropped everything up to the last `@`, and this remote
/// was taken for `github.com/rt/public`, whose jobs the dashboard shows to anyone.
#[test]
fn an_at_sign_in_the_path_is_path_not_a_host() {
    let r = RepoId::parse("https://other.host/team/x@github.com/rt/public.git", "github.com").unwrap();
    assert_eq!(r.host(), Some("other.host"));
    assert_eq!(r.to_string(), "other.host/team/x@github.com/rt/public");
    assert_ne!(r, RepoId::parse("https://github.com/rt/public.git", "github.com").unwrap());
    let r = RepoId::parse("git@other.host:team/x@github.com/rt/public.git", "github.com").unwrap();
    assert_eq!(r.host(), Some("other.host"));
}

#[test]
fn the_same_owner_and_name_on_two_hosts_are_two_repositories() {
    let a = RepoId::parse("https://gitlab.com/acme/x.git", "github.com").unwrap();
    let b = RepoId::parse("https://github.com/acme/x.git", "github.com").unwrap();
    assert_ne!(a, b);
    assert_eq!(b, RepoId::parse("acme/x", "github.com").unwrap(), "bare: the GitHub host");
    assert_eq!(b, RepoId::github("github.com", "acme/x").unwrap());
    // GitHub Enterprise: a bare name is on its host, not github.com.
    let ghe = RepoId::parse("acme/x", "ghe.example.com").unwrap();
    assert_eq!(ghe.to_string(), "ghe.example.com/acme/x");
    assert_ne!(ghe, b);
    assert_eq!(b.short_on("github.com"), "acme/x");
    assert_eq!(a.short_on("github.com"), "gitlab.com/acme/x");
    assert_eq!(ghe.short_on("github.com"), "ghe.example.com/acme/x");
}

#[test]
fn a_remote_as_git_reports_it_is_never_a_bare_name() {
    assert!(RepoId::parse_remote("acme/x").is_err(), "a relative path as much as a repository");
    assert_eq!(RepoId::parse_remote("git@github.com:acme/x").unwrap().to_string(), "github.com/acme/x");
    assert_eq!(RepoId::parse_remote("github.com/acme/x").unwrap().to_string(), "github.com/acme/x");
}

#[test]
fn a_local_path_is_never_a_hosted_repository() {
    let local = RepoId::parse("/github.com/acme/x", "github.com").unwrap();
    assert!(local.is_local());
    assert_ne!(local, RepoId::parse("github.com/acme/x", "github.com").unwrap());
    assert_eq!(local.to_string().parse::<RepoId>(), Ok(local));
}

#[test]
fn ambiguous_remotes_are_refused() {
    for bad in [
        "",
        "https://a@b@github.com/acme/x",
        "https://github.com",
        "https://github.com/",
        "https://github.com/acme/x?ref=y",
        "https://github.com/acme/x#frag",
        "https://github.com/acme%2Fx",
        "https://github.com/acme/../x",
        "https://github.com//x",
        "https://git hub.com/acme/x",
        "https://github.com:99999/acme/x",
        "https://-bad-.com/acme/x",
        "ftp://github.com/acme/x",
        "git@github.com:2222/acme/x",
        "a@b@github.com:acme/x",
        "C:/src/x",
        "C:\\src\\x",
        "acme",
        "a/b/c",
        "./x",
        "../x",
        "~/src/x",
        "team/x@github.com/rt/public",
        "git@github.com/acme/x",
    ] {
        assert!(gh(bad).is_err(), "{bad:?} gave {:?}", gh(bad));
    }
}

#[test]
fn errors_never_repeat_a_password() {
    let e = RepoId::parse("https://user:hunter2@github.com:99999/acme/x", "github.com").unwrap_err();
    assert!(!e.to_string().contains("hunter2"), "{e}");
}

#[test]
fn patterns_cover_one_repository_or_an_owner_on_one_host() {
    let p = |t: &str| RepoPattern::parse(t, "github.com").unwrap();
    let id = |t: &str| RepoId::parse(t, "github.com").unwrap();
    assert!(p("acme/*").covers(&id("https://github.com/acme/x")));
    assert!(!p("acme/*").covers(&id("https://gitlab.com/acme/x")));
    assert!(!p("acme/*").covers(&id("https://github.com/acme-two/x")));
    assert!(p("gitlab.com/acme/*").covers(&id("git@gitlab.com:acme/sub/x.git")));
    assert!(!p("gitlab.com/acme/*").covers(&id("gitlab.com/acmex/y")));
    assert!(p("gitlab.com/*").covers(&id("gitlab.com/any/y")));
    assert!(p("acme/x").covers(&id("git@github.com:Acme/X.git")));
    assert!(!p("acme/x").covers(&id("gitlab.com/acme/x")));
    assert!(p("acme/*").covers_printed("github.com/acme/x"));
    assert!(!p("acme/*").covers_printed("acme/x"), "a printed identity has its host");
    assert_eq!(p("Acme/*").to_string(), "github.com/acme/*");
    for t in ["acme/*", "gitlab.com/*", "gitlab.com/a/b/*", "acme/x"] {
        assert!(p(t).covers(&p(t).sample()), "{t}");
    }
    for bad in ["acme/sub/*", "/srv/*", "*", "/srv/x"] {
        assert!(RepoPattern::parse(bad, "github.com").is_err(), "{bad}");
    }
}

#[test]
fn the_github_host_comes_from_the_api_address() {
    assert_eq!(github_host_of_api_url(None), "github.com");
    assert_eq!(github_host_of_api_url(Some("https://api.github.com")), "github.com");
    assert_eq!(github_host_of_api_url(Some("https://api.github.com/")), "github.com");
    assert_eq!(github_host_of_api_url(Some("https://GHE.example.com/api/v3")), "ghe.example.com");
    assert_eq!(github_host_of_api_url(Some("http://127.0.0.1:4567/api/v3")), "127.0.0.1:4567");
}

fn segment() -> impl Strategy<Value = String> {
    "[a-zA-Z0-9][a-zA-Z0-9_.@~+-]{0,8}"
        .prop_filter("no dot segments or .git", |s| s != "." && s != ".." && !s.to_ascii_lowercase().ends_with(".git"))
}

fn host() -> impl Strategy<Value = String> {
    prop::collection::vec("[a-z0-9]([a-z0-9-]{0,5}[a-z0-9])?", 2..4).prop_map(|l| l.join("."))
}

proptest! {
    /// Parsing is stable: an identity reads back as itself, from its printed form and from
    /// every remote form that names it.
    #[test]
    fn parsing_is_stable(h in host(), port in prop::option::of(1u16..), path in prop::collection::vec(segment(), 1..4)) {
        let path = path.join("/");
        let hp = match port { Some(p) => format!("{h}:{p}"), None => h.clone() };
        let id = RepoId::parse(&format!("https://{hp}/{path}.git"), "github.com").unwrap();
        prop_assert_eq!(RepoId::parse(&id.to_string(), "github.com").unwrap(), id.clone());
        prop_assert_eq!(id.to_string().parse::<RepoId>().unwrap(), id.clone());
        prop_assert_eq!(RepoId::parse(&format!("ssh://git@{hp}/{path}"), "github.com").map(|r| r.path().to_string()), Ok(id.path().to_string()));
        // scp-like with a user and a path starting with digits is refused (port or path?).
        if port.is_none() && !path.split('/').next().unwrap_or("").bytes().all(|b| b.is_ascii_digit()) {
            prop_assert_eq!(RepoId::parse(&format!("git@{h}:{path}.git"), "github.com").unwrap(), id.clone());
        }
        prop_assert_eq!(RepoId::parse(&format!("https://u:p@{hp}/{path}/"), "github.com").unwrap(), id);
    }

    /// Two different authorities never give the same identity, whatever the path holds
    /// (an `@` and another host's name included).
    #[test]
    fn different_authorities_never_give_one_identity(
        h1 in host(), h2 in host(), user in prop::option::of("[a-z]{1,4}"),
        p1 in prop::collection::vec(segment(), 1..4), p2 in prop::collection::vec(segment(), 1..4),
    ) {
        prop_assume!(h1 != h2);
        let userinfo = user.map(|u| format!("{u}@")).unwrap_or_default();
        // The second path may embed the first host, the way a look-alike remote would.
        let p2 = format!("{}@{h1}/{}", p2.join("/"), p1.join("/"));
        let a = RepoId::parse(&format!("https://{userinfo}{h1}/{}", p1.join("/")), "github.com");
        let b = RepoId::parse(&format!("https://{userinfo}{h2}/{p2}"), "github.com");
        if let (Ok(a), Ok(b)) = (a, b) {
            prop_assert_ne!(a.host(), b.host());
            prop_assert_ne!(a, b);
        }
    }

    /// Whatever the text, a parsed identity prints as something that parses back to it.
    #[test]
    fn any_accepted_text_prints_stably(text in "[a-zA-Z0-9:/@._~+-]{1,40}") {
        if let Ok(id) = RepoId::parse(&text, "github.com") {
            prop_assert_eq!(id.to_string().parse::<RepoId>().unwrap(), id);
        }
    }
}

/// Outsider finding: `.GIT` kept its suffix (it was stripped before lowercasing), so one
/// repository was two, and the printed form parsed back to something else.
#[test]
fn the_git_suffix_goes_in_any_case_and_the_printed_form_parses_back_to_itself() {
    for remote in ["https://github.com/acme/x.GIT", "https://github.com/acme/x.git/", "https://github.com/Acme/X"] {
        assert_eq!(gh(remote).unwrap(), "github.com/acme/x", "{remote}");
    }
    let printed = gh("https://github.com/acme/x.GIT").unwrap();
    assert_eq!(gh(&format!("https://{printed}")).unwrap(), printed);
}
