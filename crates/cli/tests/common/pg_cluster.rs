//! A throwaway Postgres server for whole-system tests that run `gpuci server --database`.
//!
//! The store suite has the same thing in `crates/store/tests/common/pg.rs`, but that file
//! creates each database through `sqlx`, which this crate's tests do not depend on, so it does
//! not compile here. This one hands out the new cluster's own `postgres` database instead
//! (nothing else uses the cluster). Once `sqlx` is a dev-dependency of this crate, tests
//! should include that file with `#[path]` and this one can go.
//!
//! As there: Postgres refuses to run as root, so as root it runs as `nobody` (via `runuser`);
//! without Postgres installed, [`PgCluster::start`] returns `None` after saying why, except
//! under `CI=true`, where a skip would hide a gap: it panics.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;

const USER: &str = "gpuci";
const UNPRIVILEGED: &str = "nobody";

pub struct PgCluster {
    dir: tempfile::TempDir,
    bin: PathBuf,
    as_root: bool,
    /// `postgres://gpuci@127.0.0.1:PORT/postgres`.
    pub url: String,
}

/// The directory holding `initdb`, `pg_ctl` and `postgres`: on PATH, or the newest
/// `/usr/lib/postgresql/*/bin`.
fn find_bin() -> Option<PathBuf> {
    let has_all = |d: &Path| ["initdb", "pg_ctl", "postgres"].iter().all(|b| d.join(b).is_file());
    if let Some(d) = std::env::var_os("PATH").and_then(|p| std::env::split_paths(&p).find(|d| has_all(d))) {
        return Some(d);
    }
    let mut dirs: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .ok()?
        .flatten()
        .filter_map(|e| Some((e.file_name().to_str()?.parse().ok()?, e.path().join("bin"))))
        .filter(|(_, d)| has_all(d))
        .collect();
    dirs.sort();
    dirs.pop().map(|(_, d)| d)
}

impl PgCluster {
    pub fn start() -> Option<PgCluster> {
        let Some(bin) = find_bin() else {
            let msg = "Postgres (initdb, pg_ctl, postgres) not found on PATH or in /usr/lib/postgresql/*/bin";
            if std::env::var("CI").is_ok_and(|v| v == "true") {
                panic!("{msg}; CI=true, so the Postgres chaos test must run (scripts/test installs it)");
            }
            eprintln!("SKIPPED: {msg}");
            return None;
        };
        let dir = tempfile::Builder::new().prefix("gpuci-pg-").tempdir().expect("temp dir");
        let as_root = nix::unistd::geteuid().is_root();
        if as_root {
            let st = Command::new("chown").arg(UNPRIVILEGED).arg(dir.path()).status().expect("chown");
            assert!(st.success(), "chown {UNPRIVILEGED} {}", dir.path().display());
        }
        let port = std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).expect("free port").port();
        let url = format!("postgres://{USER}@127.0.0.1:{port}/postgres");
        let pg = PgCluster { dir, bin, as_root, url };
        let data = pg.data();
        pg.run("initdb", &["-D", &data, "-U", USER, "--auth=trust", "-E", "UTF8", "--locale=C", "--no-sync"]);
        let sockets = pg.dir.path().display().to_string();
        let log = pg.dir.path().join("server.log").display().to_string();
        let opts = format!("-c listen_addresses=127.0.0.1 -p {port} -k {sockets}");
        pg.run("pg_ctl", &["-D", &data, "-l", &log, "-o", &opts, "-w", "-t", "60", "start"]);
        Some(pg)
    }

    fn data(&self) -> String {
        self.dir.path().join("data").display().to_string()
    }

    fn command(&self, tool: &str) -> Command {
        let exe = self.bin.join(tool);
        if self.as_root {
            let mut c = Command::new("runuser");
            c.args(["-u", UNPRIVILEGED, "--"]).arg(exe);
            c
        } else {
            Command::new(exe)
        }
    }

    fn run(&self, tool: &str, args: &[&str]) {
        let out = self.command(tool).args(args).current_dir(self.dir.path()).output().expect(tool);
        assert!(
            out.status.success(),
            "{tool} {args:?} failed: {}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

impl Drop for PgCluster {
    fn drop(&mut self) {
        let data = self.data();
        let _ = self.command("pg_ctl").args(["-D", &data, "-m", "immediate", "-w", "stop"]).output();
    }
}
