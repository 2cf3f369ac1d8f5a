//! Several coordinators at different addresses, as agents and the CLI see them (issue 29):
//! they are given every coordinator's URL (`--server A,B`) and follow the one that leads, by
//! its `/readyz`. Real processes, a real Postgres server, the leader on 127.0.0.1 and the
//! standby on 127.0.0.2.
//!
//! - The leader killed (SIGKILL) with jobs running and queued: the agent moves to the new
//!   leader by itself; every job ends once; the CLI, with the same arguments, works before
//!   and after.
//! - The leader frozen (SIGSTOP): the agent asks the others who leads once it is quiet for
//!   two heartbeats and goes to the one that took over.
//! - The leader cut off from Postgres (a TCP proxy between them that stops passing bytes, as
//!   a partition that drops packets does): the standby, connected directly, takes over; the
//!   former leader steps aside (`/readyz` 503) and, once the network heals, stops rather than
//!   lead again; the agent moves; jobs settle once; no GPU is left leased.
//!
//! Times are printed (`BENCH` lines, quoted in BENCHMARKS.md), never asserted.
#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

mod common;
#[path = "../../store/tests/common/pg.rs"]
#[allow(dead_code)] // the store suite uses more of it than these tests
mod pg;
#[path = "common/relays.rs"]
mod relays;

use common::*;
use gpuci_core::job::JobState;
use relays::*;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

const T: Duration = Duration::from_secs(60);
const SHARED: [&str; 4] = ["api-token", "registration-token", "read-token", "secrets.key"];

fn database(name: &str) -> Option<(pg::PgServer, String)> {
    let pg = pg::PgServer::start()?;
    let url = tokio::runtime::Runtime::new().unwrap().block_on(pg.create_database(name));
    Some((pg, url))
}

fn free_address(ip: &str) -> String {
    let l = std::net::TcpListener::bind((ip, 0)).unwrap_or_else(|e| panic!("binding {ip}: {e}"));
    l.local_addr().unwrap().to_string()
}

/// A `gpuci server` process; it prints its URL once it leads.
struct Coord {
    child: Child,
    listen: String,
    data_dir: PathBuf,
    printed: mpsc::Receiver<String>,
}

impl Coord {
    fn start(data_dir: &Path, listen: &str, args: &[String]) -> Coord {
        let mut child = Command::new(BIN)
            .args(["server", "--listen", listen, "--data-dir"])
            .arg(data_dir)
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn gpuci server");
        let out = child.stdout.take().unwrap();
        let (tx, printed) = mpsc::channel();
        std::thread::spawn(move || {
            let mut line = String::new();
            if BufReader::new(out).read_line(&mut line).is_ok() {
                let _ = tx.send(line.trim().to_string());
            }
        });
        Coord { child, listen: listen.to_string(), data_dir: data_dir.to_path_buf(), printed }
    }

    fn url(&self) -> String {
        format!("http://{}", self.listen)
    }

    /// Waits until it leads (prints its URL).
    fn wait_leading(&self, limit: Duration) {
        let url = self.printed.recv_timeout(limit).unwrap_or_else(|e| panic!("{} did not lead: {e}", self.listen));
        assert_eq!(url, self.url());
    }

    fn leads_now(&self) -> bool {
        self.printed.try_recv().is_ok()
    }

    fn token(&self) -> String {
        std::fs::read_to_string(self.data_dir.join("api-token")).unwrap().trim().to_string()
    }

    fn api(&self) -> Api {
        Api::new(&self.url(), &self.token())
    }

    /// A standby of this coordinator, with copies of its tokens and keys (docs/ha.md).
    fn standby(&self, dir: PathBuf, listen: &str, args: &[String]) -> Coord {
        std::fs::create_dir_all(&dir).unwrap();
        for f in SHARED {
            std::fs::copy(self.data_dir.join(f), dir.join(f)).unwrap_or_else(|e| panic!("{f}: {e}"));
        }
        let mut args = args.to_vec();
        args.push("--standby".into());
        Coord::start(&dir, listen, &args)
    }
}

impl Drop for Coord {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `/readyz`'s status, or `None` when nothing answers within a second.
fn status(url: &str, path: &str) -> Option<u16> {
    let http = reqwest::blocking::Client::builder().timeout(Duration::from_secs(1)).build().unwrap();
    http.get(format!("{url}{path}")).send().ok().map(|r| r.status().as_u16())
}

/// An agent given every coordinator's URL.
fn agent(urls: &str, registration_token: &str, dir: &Path) -> Agent {
    agent_with(urls, registration_token, dir, &[])
}

fn agent_with(urls: &str, registration_token: &str, dir: &Path, extra: &[&str]) -> Agent {
    agent_logging(urls, registration_token, dir, extra, Stdio::inherit())
}

/// [`agent_with`], its log to `stderr`.
fn agent_logging(urls: &str, registration_token: &str, dir: &Path, extra: &[&str], stderr: Stdio) -> Agent {
    let iso = isolation();
    let child = Command::new(BIN)
        .args(["agent", "--server", urls, "--registration-token", registration_token])
        .args(extra)
        .arg("--data-dir")
        .arg(dir)
        .args(["--name", "ha-agent", "--slots", "2", "--simulate-gpus", "2xH100-80GB", "--isolation", iso])
        .args((iso == "none").then_some("--allow-unsandboxed"))
        .env("GPUCI_LOG", "info")
        .stdout(Stdio::null())
        .stderr(stderr)
        .spawn()
        .expect("spawn gpuci agent");
    Agent { child, data_dir: dir.to_path_buf() }
}

/// `gpuci ARGS --server URLS --token TOKEN`: its stdout; fails the test when it fails.
fn cli(urls: &str, token: &str, args: &[&str]) -> String {
    let out = Command::new(BIN).args(args).args(["--server", urls, "--token", token]).output().expect("run gpuci");
    assert!(
        out.status.success(),
        "gpuci {args:?} --server {urls}: {}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// The ids `gpuci jobs --json` lists.
fn cli_job_ids(urls: &str, token: &str) -> Vec<i64> {
    let listed: Vec<serde_json::Value> = serde_json::from_str(&cli(urls, token, &["jobs", "--json"])).unwrap();
    listed.iter().map(|j| j["id"].as_i64().unwrap()).collect()
}

/// Four one-GPU steps that print a start and a done line around `sleep`.
fn pipeline_file(dir: &Path, tag: &str, secs: u32) -> PathBuf {
    let mut yaml = String::from("steps:\n");
    for k in 0..4 {
        yaml.push_str(&format!(
            "  - key: {tag}{k}\n    gpus: 1\n    command: echo start {tag}{k} attempt $GPUCI_ATTEMPT; sleep {secs}; echo done {tag}{k}\n"
        ));
    }
    let path = dir.join(format!("{tag}.yml"));
    std::fs::write(&path, yaml).unwrap();
    path
}

/// Waits until the agent is connected to `api`'s coordinator; how long that took from `t0`.
fn agent_connected(api: &Api, t0: Instant) -> Duration {
    api.wait_agents(1, T);
    t0.elapsed()
}

/// Every job of pipeline `id` succeeded once: attempt 1, its start and done lines once each.
fn settled_once(api: &Api, id: i64) {
    let done = api.wait_pipeline(id, T);
    assert_eq!(done.state, "succeeded", "{done:#?}");
    assert_eq!(done.jobs.len(), 4, "{done:#?}");
    for j in &done.jobs {
        assert_eq!(j.attempt, 1, "{j:#?}");
        let log = api.log_text(j.id);
        assert_eq!(log.lines().filter(|l| l.contains("start ")).count(), 1, "job {} started again: {log}", j.id);
        assert_eq!(
            log.lines().filter(|l| l.contains("done ")).count(),
            1,
            "job {}: a line lost or doubled: {log}",
            j.id
        );
    }
}

/// No GPU is leased and the agent runs nothing.
fn no_lease_held(api: &Api) {
    wait_until_or(
        "every GPU free",
        T,
        || api.agents().iter().all(|a| a.running.is_empty() && a.gpus.iter().all(|g| g.state == "free")),
        || format!("{:#?}", api.agents()),
    );
}

fn args(url: &str) -> Vec<String> {
    ["--database", url, "--heartbeat", "200ms", "--lost-after", "30s"].iter().map(|s| s.to_string()).collect()
}

/// The leader killed while two jobs run and two wait; the agent and the CLI were given both
/// coordinators' URLs and keep them.
#[test]
fn given_both_urls_the_agent_and_the_cli_follow_the_leader_through_a_kill() {
    let Some((_pg, db)) = database("gpuci_failover_urls") else { return };
    let dir = tempdir();
    let leader = Coord::start(&dir.path().join("a"), &free_address("127.0.0.1"), &args(&db));
    leader.wait_leading(T);
    let standby = leader.standby(dir.path().join("b"), &free_address("127.0.0.2"), &args(&db));
    // A standby listens and says it does not lead; its process is up.
    wait_until("the standby listens", T, || status(&standby.url(), "/healthz") == Some(200));
    assert_eq!(status(&standby.url(), "/readyz"), Some(503));
    // The API is passed on to the leader (`proxy.rs`), which judges the (missing) token.
    assert_eq!(status(&standby.url(), "/api/v1/jobs"), Some(401), "a standby passes the API on to the leader");
    assert_eq!(status(&leader.url(), "/readyz"), Some(200));
    // The CLI given only the standby's address, the key pinned: the standby proves the key
    // itself and passes the request on (it answered the proof 503, and the CLI could not use
    // its address at all: outsider attack).
    let token = leader.token();
    let key = std::fs::read_to_string(leader.data_dir.join("coordinator-key.pub")).unwrap().trim().to_string();
    let listed: Vec<serde_json::Value> =
        serde_json::from_str(&cli(&standby.url(), &token, &["jobs", "--json", "--coordinator-key", &key])).unwrap();
    assert!(listed.is_empty(), "{listed:?}");

    // The standby first: the agent and the CLI pick the leader wherever it is in the list.
    let urls = format!("{},{}", standby.url(), leader.url());
    let reg = std::fs::read_to_string(leader.data_dir.join("registration-token")).unwrap().trim().to_string();
    let _agent = agent(&urls, &reg, &dir.path().join("agent"));
    leader.api().wait_agents(1, T);
    let file = pipeline_file(dir.path(), "k", 6);
    // A user's `gpuci submit --wait`, which outlives the leader.
    let mut waiting = Command::new(BIN)
        .args(["submit", file.to_str().unwrap(), "--no-upload", "--wait", "--server", &urls, "--token", &token])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run gpuci submit --wait");
    let mut said = BufReader::new(waiting.stderr.take().unwrap());
    // "pipeline N submitted (4 jobs)", after notes.
    let mut first = String::new();
    while !first.starts_with("pipeline ") {
        first.clear();
        assert!(said.read_line(&mut first).unwrap() > 0, "gpuci submit --wait said no pipeline");
    }
    let id: i64 = first.split_whitespace().nth(1).and_then(|n| n.parse().ok()).unwrap_or_else(|| panic!("{first}"));
    let said = std::thread::spawn(move || {
        let mut rest = String::new();
        let _ = std::io::Read::read_to_string(&mut said, &mut rest);
        rest
    });
    let p = leader.api().pipeline(id);
    for j in &p.jobs[..2] {
        leader.api().wait_job(j.id, "running", T, |j| j.state == JobState::Running);
    }
    assert!(cli_job_ids(&urls, &token).contains(&p.jobs[0].id));
    // And a `gpuci logs --follow` of a running job.
    let following = Command::new(BIN)
        .args(["logs", &p.jobs[0].id.to_string(), "--follow", "--server", &urls, "--token", &token])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run gpuci logs --follow");
    assert!(!standby.leads_now(), "the standby led while the leader led");

    let registered = leader.api().agents();
    let t0 = Instant::now();
    let mut leader = leader;
    let _ = leader.child.kill();
    let _ = leader.child.wait();
    standby.wait_leading(T);
    let took = t0.elapsed();
    let api = standby.api();
    let connected = agent_connected(&api, t0);
    // Its registration holds with the new leader: the same agent, not registered anew.
    let now: Vec<String> = api.agents().into_iter().map(|a| a.id).collect();
    assert_eq!(now, registered.into_iter().map(|a| a.id).collect::<Vec<_>>());
    eprintln!("BENCH failover-urls: leader killed (SIGKILL) -> standby serving: {:.2} s", took.as_secs_f64());
    eprintln!(
        "BENCH failover-urls: leader killed (SIGKILL) -> agent connected to the new leader: {:.2} s",
        connected.as_secs_f64()
    );
    settled_once(&api, id);
    no_lease_held(&api);
    // The waiting CLI followed the pipeline to its end through the takeover: it says it
    // succeeded, and showed each line once (the stream opened again starts from the top).
    let out = waiting.wait_with_output().unwrap();
    let said = said.join().unwrap();
    assert!(out.status.success(), "gpuci submit --wait: {}\n{said}", out.status);
    assert!(said.contains("pipeline succeeded"), "{said}");
    let shown = String::from_utf8_lossy(&out.stdout);
    for k in 0..4 {
        for what in [format!("start k{k} attempt 1"), format!("done k{k}")] {
            assert_eq!(
                shown.lines().filter(|l| l.ends_with(&what)).count(),
                1,
                "{what:?} shown once:\n{shown}\n{said}"
            );
        }
    }

    let out = following.wait_with_output().unwrap();
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "gpuci logs --follow: {}\n{said}", out.status);
    let shown = String::from_utf8_lossy(&out.stdout);
    let k0 = p.jobs[0].step_key.clone();
    for what in [format!("start {k0} attempt 1"), format!("done {k0}")] {
        assert_eq!(shown.lines().filter(|l| l.ends_with(&what)).count(), 1, "{what:?} shown once:\n{shown}\n{said}");
    }
    assert!(said.contains("succeeded"), "{said}");

    // The CLI, with the same arguments: the dead leader is skipped.
    let jobs = cli_job_ids(&urls, &token);
    for j in &p.jobs {
        assert!(jobs.contains(&j.id), "{jobs:?}");
    }
    let file = pipeline_file(dir.path(), "after", 0);
    let after: i64 = cli(&urls, &token, &["submit", file.to_str().unwrap(), "--no-upload"]).trim().parse().unwrap();
    settled_once(&api, after);
}

/// A TCP proxy on 127.0.0.1 in front of Postgres that can stop passing bytes on every
/// connection, old and new (a partition that drops packets: nothing is refused or closed,
/// nothing answers), and heal.
struct Partition {
    addr: std::net::SocketAddr,
    cut: tokio::sync::watch::Sender<bool>,
    _rt: tokio::runtime::Runtime,
}

impl Partition {
    fn new(upstream: std::net::SocketAddr) -> Partition {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        let listener = rt.block_on(tokio::net::TcpListener::bind("127.0.0.1:0")).unwrap();
        let addr = listener.local_addr().unwrap();
        let (cut, watch) = tokio::sync::watch::channel(false);
        rt.spawn(async move {
            while let Ok((mut down, _)) = listener.accept().await {
                let mut watch = watch.clone();
                tokio::spawn(async move {
                    // While cut, a new connection is held, unanswered, until healed, then
                    // closed: its sender learns nothing in between.
                    if *watch.borrow() {
                        let _ = watch.wait_for(|c| !*c).await;
                        return;
                    }
                    let Ok(mut up) = tokio::net::TcpStream::connect(upstream).await else { return };
                    let cut = tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut down, &mut up) => false,
                        _ = watch.wait_for(|c| *c) => true,
                    };
                    // Cut: pass no more bytes and hold both ends, unanswered; healed, close
                    // them (TCP would have given up on them by then).
                    if cut {
                        let _ = watch.wait_for(|c| !*c).await;
                    }
                    drop((down, up));
                });
            }
        });
        Partition { addr, cut, _rt: rt }
    }

    fn set(&self, cut: bool) {
        self.cut.send_replace(cut);
    }
}

/// The leader cut off from Postgres while jobs run: the standby (connected directly) takes
/// over; the former leader steps aside (`/readyz` 503, its agent let go) and, healed, stops
/// rather than lead again; the agent moves; every job settles once; no GPU stays leased.
#[test]
fn a_leader_cut_off_from_its_database_steps_aside_and_does_not_lead_again_when_healed() {
    let Some((_pg, db)) = database("gpuci_partition") else { return };
    // postgres://user@127.0.0.1:PORT/db: the leader's goes through the proxy.
    let port: u16 = db.rsplit_once(':').unwrap().1.split('/').next().unwrap().parse().unwrap();
    let proxy = Partition::new(std::net::SocketAddr::from(([127, 0, 0, 1], port)));
    let through_proxy = db.replace(&format!(":{port}/"), &format!(":{}/", proxy.addr.port()));
    let dir = tempdir();
    let leader = Coord::start(&dir.path().join("a"), &free_address("127.0.0.1"), &args(&through_proxy));
    leader.wait_leading(T);
    let standby = leader.standby(dir.path().join("b"), &free_address("127.0.0.2"), &args(&db));
    wait_until("the standby listens", T, || status(&standby.url(), "/healthz") == Some(200));
    let urls = format!("{},{}", leader.url(), standby.url());
    let reg = std::fs::read_to_string(leader.data_dir.join("registration-token")).unwrap().trim().to_string();
    let _agent = agent(&urls, &reg, &dir.path().join("agent"));
    leader.api().wait_agents(1, T);
    let p = leader.api().submit(&std::fs::read_to_string(pipeline_file(dir.path(), "p", 4)).unwrap());
    for j in &p.jobs[..2] {
        leader.api().wait_job(j.id, "running", T, |j| j.state == JobState::Running);
    }

    let t0 = Instant::now();
    proxy.set(true);
    standby.wait_leading(T);
    let took = t0.elapsed();
    let api = standby.api();
    let connected = agent_connected(&api, t0);
    wait_until("the former leader steps aside", T, || status(&leader.url(), "/readyz") == Some(503));
    let aside = t0.elapsed();
    eprintln!("BENCH partition: leader cut off from Postgres -> standby serving: {:.2} s", took.as_secs_f64());
    eprintln!("BENCH partition: cut -> agent connected to the new leader: {:.2} s", connected.as_secs_f64());
    eprintln!("BENCH partition: cut -> former leader's /readyz 503 (seen by then): {:.2} s", aside.as_secs_f64());
    settled_once(&api, p.id);

    // Healed: the former leader finds its claim taken and stops; it never says it leads.
    let mut leader = leader;
    proxy.set(false);
    let t1 = Instant::now();
    let exited = loop {
        assert_ne!(status(&leader.url(), "/readyz"), Some(200), "the former leader leads again after the heal");
        if let Some(s) = leader.child.try_wait().unwrap() {
            break s;
        }
        assert!(t1.elapsed() < T, "the former leader runs on after the heal");
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(!exited.success(), "{exited}");
    // The new leader keeps its agent and its work.
    no_lease_held(&api);
    api.wait_agents(1, T);
    let after = api.submit(&std::fs::read_to_string(pipeline_file(dir.path(), "q", 0)).unwrap());
    settled_once(&api, after.id);
}

/// Something else answering at a listed address (a retired coordinator's address given to
/// another host, a rogue service): it says it leads, proves a key of its own (or, `legacy`,
/// answers the identity challenge 404 like a coordinator too old to have one), and records
/// every request it is sent.
struct Impostor {
    url: String,
    heard: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
    legacy: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl Impostor {
    fn start(ip: &str) -> Impostor {
        Impostor::start_relaying(ip, None)
    }

    /// With `relay_to`: identity challenges are passed on to that coordinator (host:port)
    /// with the agent's own `Host`, and its answer passed back, as whoever holds a listed
    /// address can do without being in the middle of anything.
    fn start_relaying(ip: &str, relay_to: Option<String>) -> Impostor {
        use std::io::{Read, Write};
        let listener = std::net::TcpListener::bind((ip, 0)).unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let heard = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let legacy = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let own = gpuci_core::coordinator_identity::SigningIdentity::from_secret(&[42; 32]);
        let (h, l) = (heard.clone(), legacy.clone());
        std::thread::spawn(move || {
            for mut s in listener.incoming().flatten() {
                let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
                let mut buf = vec![0u8; 64 << 10];
                let n = s.read(&mut buf).unwrap_or(0);
                let req = String::from_utf8_lossy(&buf[..n]).to_string();
                let line = req.lines().next().unwrap_or_default().to_string();
                let host = req
                    .lines()
                    .find_map(|l| l.strip_prefix("host: ").or_else(|| l.strip_prefix("Host: ")))
                    .unwrap_or_default()
                    .trim()
                    .to_string();
                h.lock().unwrap().push(req);
                if let (true, Some(real)) = (line.starts_with("GET /api/v1/identity"), relay_to.as_deref()) {
                    let target = line.split(' ').nth(1).unwrap_or("/");
                    if let Ok(mut up) = std::net::TcpStream::connect(real) {
                        let _ = up.set_read_timeout(Some(Duration::from_secs(5)));
                        let _ = up.write_all(
                            format!("GET {target} HTTP/1.1\r\nhost: {host}\r\nconnection: close\r\n\r\n").as_bytes(),
                        );
                        let mut answer = Vec::new();
                        let _ = up.read_to_end(&mut answer);
                        let _ = s.write_all(&answer);
                    }
                    continue;
                }
                let (status, body) = if line.starts_with("GET /api/v1/identity") {
                    let nonce = line.split("nonce=").nth(1).and_then(|r| r.split([' ', '&']).next()).unwrap_or("");
                    match own.prove(nonce, &host) {
                        Ok(p) if !l.load(std::sync::atomic::Ordering::SeqCst) => {
                            (200, serde_json::to_string(&p).unwrap())
                        }
                        _ => (404, String::new()),
                    }
                } else {
                    (200, "{}".to_string())
                };
                let _ = s.write_all(
                    format!("HTTP/1.1 {status} X\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}", body.len())
                        .as_bytes(),
                );
            }
        });
        Impostor { url, heard, legacy }
    }

    /// Requests it was sent that carried a credential, or the `secret` anywhere.
    fn given_credentials(&self, secret: &str) -> Vec<String> {
        let heard = self.heard.lock().unwrap();
        heard
            .iter()
            .filter(|r| r.to_ascii_lowercase().contains("\nauthorization:") || r.contains(secret))
            .map(|r| r.lines().next().unwrap_or_default().to_string())
            .collect()
    }

    fn identity_asks(&self) -> usize {
        self.heard.lock().unwrap().iter().filter(|r| r.starts_with("GET /api/v1/identity")).count()
    }
}

/// An impostor listed before the real coordinator (both say they lead): with the key given,
/// the agent registers and connects with the real one only, and the CLI lists jobs there;
/// the impostor is asked to prove the key and is sent nothing else. An agent that pinned the
/// key when it registered (no key given) later refuses the impostor, even one answering like
/// a coordinator too old to prove a key, while the real coordinator is down. Before the proof
/// existed, the agent registered with the first address that answered `/readyz` 200.
#[test]
fn an_address_that_cannot_prove_the_coordinators_key_is_never_sent_a_credential() {
    let dir = tempdir();
    let real = Coord::start(&dir.path().join("a"), &free_address("127.0.0.1"), &[]);
    real.wait_leading(T);
    let key = std::fs::read_to_string(real.data_dir.join("coordinator-key.pub")).unwrap().trim().to_string();
    assert!(key.starts_with("ed25519:"), "{key}");
    let reg = std::fs::read_to_string(real.data_dir.join("registration-token")).unwrap().trim().to_string();
    let impostor = Impostor::start("127.0.0.2");
    let urls = format!("{},{}", impostor.url, real.url());

    // Given the key.
    let given = agent_with(&urls, &reg, &dir.path().join("agent-given"), &["--coordinator-key", &key]);
    real.api().wait_agents(1, T);
    let token = real.token();
    let out = Command::new(BIN)
        .args(["jobs", "--json", "--server", &urls, "--token", &token, "--coordinator-key", &key])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(impostor.identity_asks() >= 2, "the impostor was asked to prove the key");
    assert_eq!(impostor.given_credentials(&reg), Vec::<String>::new(), "the impostor was sent a credential");
    assert_eq!(impostor.given_credentials(&token), Vec::<String>::new());
    drop(given);

    // Pinned at registration through the real coordinator alone; later the real one is down
    // and the impostor (too old to prove a key, it says) is listed first.
    let pinned_dir = dir.path().join("agent-pinned");
    let first = agent(&real.url(), &reg, &pinned_dir);
    wait_until("the second agent connects", T, || real.api().agents().len() == 2);
    let stored: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(pinned_dir.join("agent.json")).unwrap()).unwrap();
    assert_eq!(stored["coordinator_key"], serde_json::Value::String(key.clone()), "{stored}");
    drop(first);
    drop(real);
    impostor.legacy.store(true, std::sync::atomic::Ordering::SeqCst);
    let asked_before = impostor.identity_asks();
    let later = agent(&urls, &reg, &pinned_dir);
    wait_until("the agent asks the impostor to prove the key, twice", T, || {
        impostor.identity_asks() >= asked_before + 2
    });
    drop(later);
    assert_eq!(impostor.given_credentials(&reg), Vec::<String>::new(), "the impostor was sent a credential");

    // Given a list with no URL in common with the one it registered through, the agent
    // registers anew, but only with an address that proves the key it pinned (outsider
    // finding: the new list unpinned it, and the impostor got the registration token).
    impostor.legacy.store(false, std::sync::atomic::Ordering::SeqCst);
    let asked_before = impostor.identity_asks();
    let moved = agent(&impostor.url, &reg, &pinned_dir);
    wait_until("the agent asks the impostor to prove the key, twice", T, || {
        impostor.identity_asks() >= asked_before + 2
    });
    drop(moved);
    assert_eq!(impostor.given_credentials(&reg), Vec::<String>::new(), "the impostor was sent a credential");
}

/// The leader killed (SIGKILL) while an agent streams it a 400 MB artifact: the agent sends
/// it again, from its start, to the standby that took over; the job succeeds, and the new
/// leader holds the artifact once, with the bytes the step wrote. (Before, the cut-off upload
/// was only a line in the job's log and the job was green without its artifact.)
#[test]
fn an_artifact_upload_cut_off_by_a_failover_is_stored_by_the_new_leader() {
    let Some((_pg, db)) = database("gpuci_failover_artifact") else { return };
    let dir = tempdir();
    let leader = Coord::start(&dir.path().join("a"), &free_address("127.0.0.1"), &args(&db));
    leader.wait_leading(T);
    let standby = leader.standby(dir.path().join("b"), &free_address("127.0.0.2"), &args(&db));
    wait_until("the standby listens", T, || status(&standby.url(), "/healthz") == Some(200));
    let urls = format!("{},{}", leader.url(), standby.url());
    let reg = std::fs::read_to_string(leader.data_dir.join("registration-token")).unwrap().trim().to_string();
    let _agent = agent(&urls, &reg, &dir.path().join("agent"));
    leader.api().wait_agents(1, T);
    let p = leader.api().submit(
        "steps:\n  - key: big\n    command: head -c 400000000 /dev/urandom > big.bin; sha256sum big.bin\n    artifacts: big.bin\n",
    );
    let job = p.jobs[0].id;
    // Killed once the upload is under way: its staged file at the leader has bytes.
    let staging = leader.data_dir.join("artifacts");
    let upload_under_way =
        || {
            std::fs::read_dir(&staging).into_iter().flatten().flatten().any(|e| {
                e.file_name().to_string_lossy().starts_with(".tmp-") && e.metadata().is_ok_and(|m| m.len() > 0)
            })
        };
    wait_until("the artifact upload is under way at the leader", Duration::from_secs(120), upload_under_way);
    let mut leader = leader;
    let _ = leader.child.kill();
    let _ = leader.child.wait();
    standby.wait_leading(T);
    let api = standby.api();
    let done = api.wait_job(job, "ended", Duration::from_secs(240), |j| j.state.is_terminal());
    let log = api.log_text(job);
    assert_eq!(done.state, JobState::Succeeded, "{done:#?}\n{log}");
    let written = log
        .lines()
        .find_map(|l| l.strip_suffix("  big.bin").filter(|h| h.len() == 64))
        .unwrap_or_else(|| panic!("no sha256sum line: {log}"))
        .to_string();
    let listed: Vec<serde_json::Value> = api.get(&format!("/api/v1/jobs/{job}/artifacts"));
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert_eq!(listed[0]["path"], "big.bin");
    assert_eq!(listed[0]["size"], 400_000_000u64);
    assert_eq!(listed[0]["sha256"], written.as_str(), "the stored bytes are not the step's");
    let system = api.log_system(job);
    assert!(system.iter().any(|l| l.contains("big.bin") && l.contains("again")), "no retry said: {system:?}");
}

/// Whoever holds a listed address passes the agent's identity challenge on to the real
/// coordinator with the agent's `Host`: the coordinator does not sign for a host that is not
/// its own (an address other than the one the request came in on), so the relay has no
/// proof and is sent nothing. (Outsider finding: the coordinator signed for any host, and the
/// relay was sent the registration token, the agent credential and the API token.)
#[test]
fn a_relay_at_a_listed_address_gets_no_proof_and_no_credential() {
    let dir = tempdir();
    let real = Coord::start(&dir.path().join("a"), &free_address("127.0.0.1"), &[]);
    real.wait_leading(T);
    let key = std::fs::read_to_string(real.data_dir.join("coordinator-key.pub")).unwrap().trim().to_string();
    let reg = std::fs::read_to_string(real.data_dir.join("registration-token")).unwrap().trim().to_string();
    let relay = Impostor::start_relaying("127.0.0.2", Some(real.listen.clone()));
    let urls = format!("{},{}", relay.url, real.url());
    let _agent = agent_with(&urls, &reg, &dir.path().join("agent"), &["--coordinator-key", &key]);
    real.api().wait_agents(1, T);
    let token = real.token();
    let out = Command::new(BIN)
        .args(["jobs", "--json", "--server", &urls, "--token", &token, "--coordinator-key", &key])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(relay.identity_asks() >= 2, "the relay was asked to prove the key");
    assert_eq!(relay.given_credentials(&reg), Vec::<String>::new(), "the relay was sent a credential");
    assert_eq!(relay.given_credentials(&token), Vec::<String>::new());
}

/// Regression (outsider attack): a leader frozen (SIGSTOP) past its claim kept its agents
/// until their silence limit (three heartbeats, at least 10 s), though a standby led within
/// 4–6 s: 15–19 s with nothing started or settled. An agent given both URLs now asks the
/// others who leads once its coordinator is quiet for two heartbeats (at least 2 s) and goes
/// to the one that took over; the jobs settle once.
#[test]
fn given_both_urls_an_agent_leaves_a_frozen_leader_for_the_one_that_took_over() {
    let Some((_pg, db)) = database("gpuci_failover_frozen") else { return };
    let dir = tempdir();
    let leader = Coord::start(&dir.path().join("a"), &free_address("127.0.0.1"), &args(&db));
    leader.wait_leading(T);
    let standby = leader.standby(dir.path().join("b"), &free_address("127.0.0.2"), &args(&db));
    wait_until("the standby listens", T, || status(&standby.url(), "/healthz") == Some(200));
    let urls = format!("{},{}", leader.url(), standby.url());
    let token = leader.token();
    let reg = std::fs::read_to_string(leader.data_dir.join("registration-token")).unwrap().trim().to_string();
    let agent_log = dir.path().join("agent.log");
    let log = Stdio::from(std::fs::File::create(&agent_log).unwrap());
    let agent = agent_logging(&urls, &reg, &dir.path().join("agent"), &[], log);
    leader.api().wait_agents(1, T);
    let file = pipeline_file(dir.path(), "f", 4);
    let id: i64 = cli(&urls, &token, &["submit", file.to_str().unwrap(), "--no-upload"]).trim().parse().unwrap();
    let p = leader.api().pipeline(id);
    leader.api().wait_job(p.jobs[0].id, "running", T, |j| j.state == JobState::Running);
    // A `gpuci logs --follow` whose stream the frozen leader holds open and silent.
    let following = Command::new(BIN)
        .args(["logs", &p.jobs[0].id.to_string(), "--follow", "--server", &urls, "--token", &token])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run gpuci logs --follow");

    let pid = leader.child.id().to_string();
    assert!(Command::new("kill").args(["-STOP", &pid]).status().unwrap().success());
    let t0 = Instant::now();
    standby.wait_leading(T);
    let api = standby.api();
    let connected = agent_connected(&api, t0);
    eprintln!(
        "BENCH failover-urls: leader paused (SIGSTOP) -> agent connected to the new leader: {:.2} s",
        connected.as_secs_f64()
    );
    let log = std::fs::read_to_string(&agent_log).unwrap();
    assert!(
        log.contains("leads now"),
        "the agent left the frozen leader by its silence limit, not for the one that took over:\n{log}"
    );
    settled_once(&api, id);
    no_lease_held(&api);
    // It noticed the silence, found the new leader and showed the job to its end, each line once.
    let out = following.wait_with_output().unwrap();
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "gpuci logs --follow: {}\n{said}", out.status);
    let shown = String::from_utf8_lossy(&out.stdout);
    let f0 = p.jobs[0].step_key.clone();
    for what in [format!("start {f0} attempt 1"), format!("done {f0}")] {
        assert_eq!(shown.lines().filter(|l| l.ends_with(&what)).count(), 1, "{what:?} shown once:\n{shown}\n{said}");
    }
    assert!(said.contains("succeeded"), "{said}");
    drop(agent);
    let _ = Command::new("kill").args(["-CONT", &pid]).status();
}

/// Regression (review finding): the CLI had the coordinator prove the installation's key on
/// one connection and sent the API token on a new one, so whoever held the address by then (a
/// killed leader's port taken during a failover) got the token, the key pinned or not. Each
/// request now goes over the connection the proof just came back on: here the address changes
/// hands after the first connection, and the CLI refuses, having sent nothing.
#[test]
fn the_cli_sends_its_token_only_over_the_connection_that_proved_the_key() {
    let dir = tempdir();
    let listen = free_address("127.0.0.1");
    let impostor = Impostor::start("127.0.0.2");
    let address = address_changing_hands("127.0.0.3", listen.clone(), impostor.url.replace("http://", ""));
    let real = Coord::start(&dir.path().join("a"), &listen, &["--public-name".into(), address.clone()]);
    real.wait_leading(T);
    let key = std::fs::read_to_string(real.data_dir.join("coordinator-key.pub")).unwrap().trim().to_string();
    let token = real.token();
    let url = format!("http://{address}");
    let out = Command::new(BIN)
        .args(["jobs", "--json", "--server", &url, "--token", &token, "--coordinator-key", &key])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(impostor.given_credentials(&token), Vec::<String>::new(), "the address's new holder got the token");
    assert!(!out.status.success(), "{stderr}");
    assert!(stderr.contains("did not prove the coordinators' identity key"), "{stderr}");
    assert!(impostor.identity_asks() >= 1, "the new holder was asked to prove the key");
}

/// Regression: a submission whose answer was lost (the leader killed after it committed the
/// pipeline, a connection dropped) failed `gpuci submit`, and running it again made the
/// pipeline twice. The CLI now sends each submission with a key of its own and sends it again
/// until it has an answer; the coordinator makes one pipeline per key and answers the same
/// request with it. A key reused for another request is refused (409), a malformed one 422.
#[test]
fn a_submission_whose_answer_was_lost_is_sent_again_and_made_once() {
    let dir = tempdir();
    let listen = free_address("127.0.0.1");
    let address = losing_the_first_submit_answer("127.0.0.3", listen.clone(), false);
    let real = Coord::start(&dir.path().join("a"), &listen, &["--public-name".into(), address.clone()]);
    real.wait_leading(T);
    let key = std::fs::read_to_string(real.data_dir.join("coordinator-key.pub")).unwrap().trim().to_string();
    let token = real.token();
    let file = dir.path().join("once.yml");
    std::fs::write(&file, "steps:\n  - key: a\n    command: echo once\n").unwrap();
    let out = Command::new(BIN)
        .args(["submit", file.to_str().unwrap(), "--no-upload", "--server", &format!("http://{address}")])
        .args(["--token", &token, "--coordinator-key", &key])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("sending it again"), "the first answer was lost: {stderr}");
    let id: i64 = String::from_utf8_lossy(&out.stdout).trim().parse().unwrap();
    // Every pipeline made, by its jobs (one each).
    let pipelines = || {
        let jobs: Vec<serde_json::Value> = real.api().get("/api/v1/jobs");
        let mut ids: Vec<i64> = jobs.iter().map(|j| j["pipeline_id"].as_i64().unwrap()).collect();
        ids.sort();
        ids
    };
    assert_eq!(pipelines(), [id], "made once");

    // The API itself: the same request with the same key answers the same pipeline; another
    // request with it is refused; a key that is no key is refused.
    let submit = |source: &str, submission: &str| {
        let r = real
            .api()
            .raw()
            .post(format!("{}/api/v1/pipelines", real.url()))
            .bearer_auth(&token)
            .json(&serde_json::json!({ "file_name": "k.yml", "source": source, "submission": submission }))
            .send()
            .unwrap();
        (r.status().as_u16(), r.json::<serde_json::Value>().unwrap_or_default())
    };
    let once = "0123456789abcdef-once";
    let (status, first) = submit("steps:\n  - key: k\n    command: echo k\n", once);
    assert_eq!(status, 201, "{first}");
    let (status, again) = submit("steps:\n  - key: k\n    command: echo k\n", once);
    assert_eq!((status, &again["id"]), (201, &first["id"]), "{again}");
    let (status, other) = submit("steps:\n  - key: k\n    command: echo other\n", once);
    assert_eq!(status, 409, "{other}");
    assert!(other["error"].as_str().unwrap().contains("was used for another request"), "{other}");
    let (status, bad) = submit("steps:\n  - key: k\n    command: echo k\n", "short");
    assert_eq!(status, 422, "{bad}");
    assert_eq!(pipelines().len(), 2, "{:?}", pipelines());
}

/// Regression (outsider attack): when the connection a coordinator had just proved its key on
/// closed before the request went out, the CLI's pooled client sent the token on a new
/// connection that proved nothing (11–13 of 30 runs through a relay that closed after each
/// proof), key pinned or not. A token-bearing request now goes over a connection of its own,
/// right after the proof on it: with the proved connection gone, the request fails instead.
#[test]
fn the_cli_never_sends_its_token_on_a_connection_that_proved_nothing() {
    let dir = tempdir();
    let listen = free_address("127.0.0.1");
    let (address, unproved) = closing_after_each_proof("127.0.0.3", listen.clone(), true);
    let real = Coord::start(&dir.path().join("a"), &listen, &["--public-name".into(), address.clone()]);
    real.wait_leading(T);
    let key = std::fs::read_to_string(real.data_dir.join("coordinator-key.pub")).unwrap().trim().to_string();
    let token = real.token();
    for pinned in [true, false] {
        for _ in 0..5 {
            let mut cmd = Command::new(BIN);
            cmd.args(["jobs", "--json", "--server", &format!("http://{address}"), "--token", &token]);
            if pinned {
                cmd.args(["--coordinator-key", &key]);
            }
            let out = cmd.output().unwrap();
            assert!(!out.status.success(), "the request had no proved connection to go on");
        }
    }
    assert_eq!(
        *unproved.lock().unwrap(),
        Vec::<String>::new(),
        "a credential went on a connection that proved nothing"
    );
}

/// Regression (the agent's side of the CLI's finding): an agent proved the coordinators' key on
/// one connection and sent its registration token, then its credential (the channel's
/// handshake), on new ones; whoever held the address by then got them. Both now go over the
/// connection the key was just proved on: through a relay that notes every connection on
/// which a credential came before a proof, the agent registers and connects, and none is noted.
#[test]
fn an_agent_sends_its_tokens_only_over_connections_that_proved_the_key() {
    let dir = tempdir();
    let listen = free_address("127.0.0.1");
    let (address, unproved) = closing_after_each_proof("127.0.0.3", listen.clone(), false);
    let real = Coord::start(&dir.path().join("a"), &listen, &["--public-name".into(), address.clone()]);
    real.wait_leading(T);
    let key = std::fs::read_to_string(real.data_dir.join("coordinator-key.pub")).unwrap().trim().to_string();
    let reg = std::fs::read_to_string(real.data_dir.join("registration-token")).unwrap().trim().to_string();
    let _agent =
        agent_with(&format!("http://{address}"), &reg, &dir.path().join("agent"), &["--coordinator-key", &key]);
    real.api().wait_agents(1, T);
    assert_eq!(
        *unproved.lock().unwrap(),
        Vec::<String>::new(),
        "a credential went on a connection that proved nothing"
    );
}

/// Regression (outsider attack): a leader frozen just after a submission reached it held
/// `gpuci submit` for as long as it stayed frozen (396 s). Each sending now waits 20 s for its
/// answer, then goes again (its key makes that safe): here the first answer never comes, and
/// the command ends with the one pipeline.
#[test]
fn a_submission_whose_answer_never_comes_is_sent_again_and_made_once() {
    let dir = tempdir();
    let listen = free_address("127.0.0.1");
    let address = losing_the_first_submit_answer("127.0.0.4", listen.clone(), true);
    let real = Coord::start(&dir.path().join("a"), &listen, &["--public-name".into(), address.clone()]);
    real.wait_leading(T);
    let key = std::fs::read_to_string(real.data_dir.join("coordinator-key.pub")).unwrap().trim().to_string();
    let file = dir.path().join("held.yml");
    std::fs::write(&file, "steps:\n  - key: a\n    command: echo once\n").unwrap();
    let out = Command::new(BIN)
        .args(["submit", file.to_str().unwrap(), "--no-upload", "--server", &format!("http://{address}")])
        .args(["--token", &real.token(), "--coordinator-key", &key])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("no answer within 20 s"), "{stderr}");
    let id: i64 = String::from_utf8_lossy(&out.stdout).trim().parse().unwrap();
    let jobs: Vec<serde_json::Value> = real.api().get("/api/v1/jobs");
    let pipelines: Vec<i64> = jobs.iter().map(|j| j["pipeline_id"].as_i64().unwrap()).collect();
    assert_eq!(pipelines, [id], "made once");
}
