//! Schedules end to end: a real `gpuci server` with `[[schedule]]`s fetches a git repository,
//! submits its pipeline with event `schedule`, a real agent runs it; each occurrence fires
//! once across restarts (kill -9), downtime costs at most one catch-up run, and a schedule
//! whose repository cannot be fetched records the reason without stopping the others.
//!
//! A schedule every minute would make slow tests: schedules here use the optional leading
//! seconds field, pinned to a wall-clock second a few seconds ahead (the same code path as
//! any cron; production accepts the seconds field too).
#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

mod common;

use common::*;
use gpuci_protocol::api::{ScheduleFire, ScheduleSummary};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

fn git(repo: &Path, args: &[&str]) {
    let out = Command::new("git")
        .arg("-C")
        .arg(repo)
        .args(["-c", "user.name=t", "-c", "user.email=t@example.invalid"])
        .args(args)
        .output()
        .expect("git");
    assert!(out.status.success(), "git {args:?}: {}", String::from_utf8_lossy(&out.stderr));
}

/// A repository on branch `main` with a pipeline and a data file its job prints.
fn repo(dir: &Path) -> PathBuf {
    let repo = dir.join("repo");
    std::fs::create_dir_all(&repo).unwrap();
    git(&repo, &["init", "-q", "-b", "main"]);
    std::fs::write(
        repo.join(".gpuci.yml"),
        r#"steps:
  - key: nightly
    command: 'echo "schedule=$GPUCI_SCHEDULE suite=$SUITE"; cat data.txt'
  - key: push-only
    if: build.event == "push"
    command: echo must not run
  - key: scheduled-main
    if: build.event == "schedule" && build.branch == "main"
    command: echo scheduled on main
"#,
    )
    .unwrap();
    std::fs::write(repo.join("data.txt"), "workspace from the repository\n").unwrap();
    git(&repo, &["add", "."]);
    git(&repo, &["commit", "-q", "-m", "pipeline"]);
    repo
}

/// A cron expression (with seconds) matching only the wall-clock second `secs_ahead` from
/// now in `zone` (until the same date next year), and that instant in ms.
fn pinned(zone: &str, secs_ahead: i64) -> (String, i64) {
    let tz = jiff::tz::db().get(zone).unwrap();
    let t = jiff::Timestamp::now().checked_add(jiff::SignedDuration::from_secs(secs_ahead)).unwrap();
    let t = jiff::Timestamp::from_second(t.as_second()).unwrap();
    let z = t.to_zoned(tz);
    (format!("{} {} {} {} {} *", z.second(), z.minute(), z.hour(), z.day(), z.month()), t.as_millisecond())
}

fn schedule(name: &str, cron: &str, tz: &str, repository: &str, extra: &str) -> String {
    format!(
        "[[schedule]]\nname = \"{name}\"\ncron = \"{cron}\"\ntimezone = \"{tz}\"\nrepository = \"{repository}\"\n{extra}\n"
    )
}

/// The server config, 0600 as a config that may hold credentials should be.
fn write_config(path: &Path, text: impl AsRef<[u8]>) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::write(path, text)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
}

fn schedules(api: &Api) -> Vec<ScheduleSummary> {
    api.get("/api/v1/schedules")
}

fn fires(api: &Api, name: &str) -> Vec<ScheduleFire> {
    schedules(api).into_iter().find(|s| s.name == name).unwrap_or_else(|| panic!("no schedule {name}")).fires
}

fn start(data_dir: &Path, config: &Path) -> Server {
    Server::start_on(
        data_dir,
        "127.0.0.1:0",
        vec!["--heartbeat".into(), "200ms".into(), "--config".into(), config.display().to_string()],
    )
}

/// The CLI against `server`; (exit code, stdout, stderr).
fn cli(server: &Server, args: &[&str]) -> (i32, String, String) {
    let out = Command::new(BIN)
        .args(args)
        .env("GPUCI_SERVER", &server.url)
        .env("GPUCI_TOKEN", &server.token)
        .output()
        .expect("gpuci");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).to_string(),
        String::from_utf8_lossy(&out.stderr).to_string(),
    )
}

#[test]
fn a_scheduled_pipeline_runs_once_on_the_agent_and_a_restart_neither_repeats_nor_loses_it() {
    let dir = tempdir();
    let repo = repo(dir.path());
    let repo_s = repo.display().to_string();
    let config = dir.path().join("server.toml");
    // Tokyo has no DST: the pinned wall time is one instant. (DST is the pure function's to
    // get right: crates/core/src/schedule_tests.rs.)
    let (nightly_cron, nightly_at) = pinned("Asia/Tokyo", 8);
    let base = format!(
        "{}{}{}",
        schedule("nightly", &nightly_cron, "Asia/Tokyo", &repo_s, "branch = \"main\"\nenv = { SUITE = \"full\" }"),
        schedule("broken", &nightly_cron, "Asia/Tokyo", "/nonexistent/gpuci-test-repo", ""),
        schedule("by-hand", "0 0 1 1 *", "Europe/Berlin", &repo_s, "enabled = false"),
    );
    write_config(&config, &base).unwrap();
    let mut server = start(&dir.path().join("server"), &config);
    let api = server.api();
    // Listed before it fires: next run in Tokyo time and as an instant.
    let listed = schedules(&api);
    let nightly = listed.iter().find(|s| s.name == "nightly").unwrap();
    assert_eq!(nightly.next_run_ms, Some(nightly_at), "{nightly:?}");
    assert!(nightly.next_run_local.as_deref().unwrap().ends_with("+09:00"), "{nightly:?}");
    let by_hand = listed.iter().find(|s| s.name == "by-hand").unwrap();
    assert_eq!((by_hand.enabled, by_hand.next_run_ms), (false, None));
    let _agent = Agent::start(&server, &dir.path().join("agent"), "a1", &["--isolation", isolation()]);
    api.wait_agents(1, Duration::from_secs(60));

    // It fires once, at its occurrence; the pipeline runs on the agent from the repository.
    wait_until_or(
        "the nightly schedule to submit its pipeline",
        Duration::from_secs(60),
        || fires(&api, "nightly").first().is_some_and(|f| f.pipeline_id.is_some()),
        || format!("{:?}", fires(&api, "nightly")),
    );
    let fire = fires(&api, "nightly").remove(0);
    assert_eq!((fire.cause.as_str(), fire.scheduled_at_ms, fire.error.as_deref()), ("cron", nightly_at, None));
    assert!(fire.fired_at_ms >= nightly_at, "never early: {fire:?}");
    let pipeline = api.wait_pipeline(fire.pipeline_id.unwrap(), Duration::from_secs(120));
    assert_eq!(pipeline.state, "succeeded", "{pipeline:?}");
    let job = |key: &str| pipeline.jobs.iter().find(|j| j.step_key == key).unwrap().clone();
    let log = api.log_text(job("nightly").id);
    assert!(log.contains("schedule=nightly suite=full"), "{log}");
    assert!(log.contains("workspace from the repository"), "the workspace is the repository's: {log}");
    assert!(job("push-only").skipped_by_condition, "event is schedule, not push");
    assert!(api.log_text(job("scheduled-main").id).contains("scheduled on main"));

    // The broken schedule recorded why, and did not keep the other from firing.
    wait_until_or(
        "the broken schedule to record its failure",
        Duration::from_secs(30),
        || fires(&api, "broken").first().is_some_and(|f| f.error.is_some()),
        || format!("{:?}", fires(&api, "broken")),
    );
    let failed = fires(&api, "broken").remove(0);
    assert_eq!(failed.pipeline_id, None);
    let why = failed.error.unwrap();
    assert!(why.contains("fetching /nonexistent/gpuci-test-repo"), "{why}");

    // The CLI: the table and --json.
    let (code, out, err) = cli(&server, &["schedules"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("nightly") && out.contains("Asia/Tokyo") && out.contains("disabled"), "{out}");
    assert!(out.contains(&format!("pipeline {} succeeded", fire.pipeline_id.unwrap())), "{out}");
    assert!(out.contains("failed: fetching /nonexistent/gpuci-test-repo"), "{out}");
    let (code, out, _) = cli(&server, &["schedules", "--json"]);
    assert_eq!(code, 0);
    let parsed: Vec<ScheduleSummary> = serde_json::from_str(&out).unwrap();
    assert_eq!(parsed.len(), 3);

    // Fire a disabled schedule by hand: its pipeline is submitted at once.
    let (code, out, err) = cli(&server, &["schedules", "run", "by-hand"]);
    assert_eq!(code, 0, "{err}");
    let manual: i64 = out.trim().parse().unwrap_or_else(|_| panic!("{out}"));
    assert_eq!(api.wait_pipeline(manual, Duration::from_secs(120)).state, "succeeded");
    assert_eq!(fires(&api, "by-hand")[0].cause, "manual");
    // Firing by hand is on the record, with who did it and what it submitted.
    let (code, out, err) = cli(&server, &["audit", "--action", "schedule.run", "--json"]);
    assert_eq!(code, 0, "{err}");
    let entries: Vec<serde_json::Value> = serde_json::from_str(&out).unwrap();
    assert_eq!(entries.len(), 1, "{out}");
    assert_eq!(entries[0]["actor"], "admin");
    assert_eq!(entries[0]["object"], format!("schedule by-hand (pipeline {manual})"));
    assert_eq!(entries[0]["outcome"], "ok");
    let (code, _, err) = cli(&server, &["schedules", "run", "no-such"]);
    assert_ne!(code, 0);
    assert!(err.contains("no schedule \"no-such\""), "{err}");

    // kill -9 and start again, with a barrier schedule added: once it has fired, the
    // restarted coordinator has looked at every schedule; nightly's occurrence is past and
    // recorded, so it must not fire again.
    let (barrier_cron, _) = pinned("UTC", 8);
    write_config(&config, format!("{base}{}", schedule("barrier", &barrier_cron, "UTC", &repo_s, ""))).unwrap();
    server.restart_hard();
    let api = server.api();
    wait_until_or(
        "the barrier schedule to fire",
        Duration::from_secs(60),
        || !fires(&api, "barrier").is_empty(),
        || format!("{:?}", schedules(&api)),
    );
    let after = fires(&api, "nightly");
    assert_eq!(after.len(), 1, "fired once across the restart: {after:?}");
    assert_eq!(after[0].pipeline_id, fire.pipeline_id);
    assert_eq!(fires(&api, "broken").len(), 1, "a failed fire is not retried either");
}

#[test]
fn after_downtime_exactly_one_missed_run_fires() {
    let dir = tempdir();
    let repo = repo(dir.path());
    let repo_s = repo.display().to_string();
    let config = dir.path().join("server.toml");
    // Three occurrences in one minute, all while the coordinator is down.
    let sec = jiff::Timestamp::now().as_second().rem_euclid(60);
    if sec > 40 {
        std::thread::sleep(Duration::from_secs((61 - sec) as u64));
    }
    let (first, first_at) = pinned("UTC", 10);
    let last_at = first_at + 2000;
    let mut fields: Vec<&str> = first.split(' ').collect();
    let s0: i64 = fields[0].parse().unwrap();
    let seconds = format!("{},{},{}", s0, s0 + 1, s0 + 2);
    fields[0] = &seconds;
    let cron = fields.join(" ");
    write_config(&config, schedule("catchup", &cron, "UTC", &repo_s, "")).unwrap();
    let data = dir.path().join("server");
    let mut server = start(&data, &config);
    // The schedule is armed before the coordinator serves: stopping now, it is owed the runs
    // that come due while it is down.
    assert!(fires(&server.api(), "catchup").is_empty());
    server.kill9();
    while jiff::Timestamp::now().as_millisecond() < last_at + 1000 {
        std::thread::sleep(Duration::from_millis(100));
    }
    let mut server = start(&data, &config);
    let api = server.api();
    wait_until_or(
        "the missed run to fire",
        Duration::from_secs(30),
        || fires(&api, "catchup").first().is_some_and(|f| f.pipeline_id.is_some() || f.error.is_some()),
        || format!("{:?}", fires(&api, "catchup")),
    );
    let f = fires(&api, "catchup");
    assert_eq!(f.len(), 1, "{f:?}");
    assert_eq!((f[0].scheduled_at_ms, f[0].skipped_from_ms), (last_at, Some(first_at)), "the latest runs: {f:?}");
    assert!(f[0].pipeline_id.is_some(), "{f:?}");

    // Restarted again (with a barrier): nothing more is owed.
    let (barrier_cron, _) = pinned("UTC", 8);
    std::fs::write(
        &config,
        format!(
            "{}{}",
            schedule("catchup", &cron, "UTC", &repo_s, ""),
            schedule("barrier", &barrier_cron, "UTC", &repo_s, "")
        ),
    )
    .unwrap();
    server.restart_hard();
    let api = server.api();
    wait_until("the barrier schedule to fire", Duration::from_secs(60), || !fires(&api, "barrier").is_empty());
    assert_eq!(fires(&api, "catchup").len(), 1);
}

#[test]
fn a_bad_schedule_is_refused_at_start_with_file_line_column_and_field() {
    let dir = tempdir();
    let config = dir.path().join("server.toml");
    std::fs::write(
        &config,
        "[[schedule]]\nname = \"n\"\ncron = \"0 3 * * *\"\ntimezone = \"Europe/Berln\"\nrepository = \"/r\"\n",
    )
    .unwrap();
    let out = Command::new(BIN)
        .args(["server", "--listen", "127.0.0.1:0", "--data-dir"])
        .arg(dir.path().join("server"))
        .arg("--config")
        .arg(&config)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    let want = format!("{}:4:12: schedule[0] (n): timezone: \"Europe/Berln\" is not a time zone", config.display());
    assert!(err.contains(&want), "{err}");
}

#[test]
fn a_schedule_disabled_over_its_time_owes_nothing_when_enabled_again() {
    let dir = tempdir();
    let repo = repo(dir.path());
    let repo_s = repo.display().to_string();
    let config = dir.path().join("server.toml");
    let (cron, at) = pinned("UTC", 6);
    write_config(&config, schedule("was-off", &cron, "UTC", &repo_s, "enabled = false")).unwrap();
    let data = dir.path().join("server");
    let mut server = start(&data, &config);
    // Its time passes while it is disabled (and the coordinator runs).
    while jiff::Timestamp::now().as_millisecond() < at + 1500 {
        std::thread::sleep(Duration::from_millis(100));
    }
    server.kill9();
    // Enabled again, with a barrier: once that has fired, was-off has been looked at.
    let (barrier_cron, _) = pinned("UTC", 8);
    std::fs::write(
        &config,
        format!(
            "{}{}",
            schedule("was-off", &cron, "UTC", &repo_s, ""),
            schedule("barrier", &barrier_cron, "UTC", &repo_s, "")
        ),
    )
    .unwrap();
    let server = start(&data, &config);
    let api = server.api();
    wait_until("the barrier schedule to fire", Duration::from_secs(60), || !fires(&api, "barrier").is_empty());
    assert!(fires(&api, "was-off").is_empty(), "no catch-up for a time it was disabled over");
}

#[test]
fn the_dashboard_lists_schedules_and_the_admin_runs_one_by_hand() {
    let dir = tempdir();
    let repo = repo(dir.path());
    let config = dir.path().join("server.toml");
    let text = format!(
        "{}{}",
        schedule("by-hand", "0 0 1 1 *", "Europe/Berlin", &repo.display().to_string(), "enabled = false"),
        schedule("weekly", "30 6 * * 1", "Asia/Tokyo", &repo.display().to_string(), "branch = \"main\""),
    );
    write_config(&config, &text).unwrap();
    let server = start(&dir.path().join("server"), &config);
    let api = server.api();
    let http = reqwest::blocking::Client::builder().redirect(reqwest::redirect::Policy::none()).build().unwrap();
    let page = |token: Option<&str>| {
        let mut r = http.get(format!("{}/ui/schedules", server.url));
        if let Some(t) = token {
            r = r.bearer_auth(t);
        }
        r.send().unwrap()
    };
    // A schedule names repositories: not for anonymous viewers.
    let anon = page(None);
    assert!(anon.status().is_redirection(), "{}", anon.status());
    assert!(anon.headers()["location"].to_str().unwrap().contains("/ui/login"));

    let html = page(Some(&server.token)).text().unwrap();
    for want in ["by-hand", "Europe/Berlin", "disabled", "weekly", "30 6 * * 1", "+09:00", "Run now", "none yet"] {
        assert!(html.contains(want), "the schedules page lacks {want:?}:\n{html}");
    }

    // "Run now" fires it and goes to its pipeline; the fire is listed as manual.
    let r = http
        .post(format!("{}/ui/schedules/by-hand/run", server.url))
        .bearer_auth(&server.token)
        .form(&[("csrf", "")])
        .send()
        .unwrap();
    assert!(r.status().is_redirection(), "{}: {}", r.status(), r.text().unwrap_or_default());
    let to = r.headers()["location"].to_str().unwrap().to_string();
    let fire = fires(&api, "by-hand").remove(0);
    assert_eq!(fire.cause, "manual");
    let id = fire.pipeline_id.expect("a pipeline");
    assert_eq!(to, format!("/ui/pipelines/{id}"));
    assert!(page(Some(&server.token)).text().unwrap().contains(&format!("pipeline {id}")));
    // An unknown schedule: 404 with the names configured.
    let r = http
        .post(format!("{}/ui/schedules/nope/run", server.url))
        .bearer_auth(&server.token)
        .form(&[("csrf", "")])
        .send()
        .unwrap();
    assert_eq!(r.status(), 404);
}
