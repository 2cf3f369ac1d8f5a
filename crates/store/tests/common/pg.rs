//! A real, throwaway Postgres server for the store suite: `initdb` into a temp dir, `pg_ctl
//! start` on 127.0.0.1 and a free port, `pg_ctl stop -m immediate` on drop.
//!
//! Postgres refuses to run as root, so as root the server runs as `nobody` (via `runuser`),
//! owning its temp dir. Without Postgres installed, [`PgServer::start`] returns `None` and the
//! test skips with a message, except under `CI=true`, where a skip would hide a gap: it panics.
//!
//! [`PgServer::start_tls`] starts one that speaks TLS (`ssl = on` with the certificate and key
//! it is given) and lets TCP clients in over TLS only (`hostssl` in `pg_hba.conf`).

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::Command;

const USER: &str = "gpuci";
const UNPRIVILEGED: &str = "nobody";

pub struct PgServer {
    dir: tempfile::TempDir,
    bin: PathBuf,
    as_root: bool,
    port: u16,
    /// TCP only over TLS: the admin connection asks for it (`sslmode=require`).
    tls: bool,
}

/// The directory holding `initdb`, `pg_ctl` and `postgres`: on PATH, or the newest
/// `/usr/lib/postgresql/*/bin` (Debian and Ubuntu keep them there).
fn find_bin() -> Option<PathBuf> {
    let has_all = |d: &Path| ["initdb", "pg_ctl", "postgres"].iter().all(|b| d.join(b).is_file());
    if let Some(path) = std::env::var_os("PATH") {
        if let Some(d) = std::env::split_paths(&path).find(|d| has_all(d)) {
            return Some(d);
        }
    }
    let mut versions: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .ok()?
        .filter_map(|e| e.ok().map(|e| e.path().join("bin")))
        .filter(|d| has_all(d))
        .collect();
    versions.sort_by_key(|d| {
        d.parent().and_then(|v| v.file_name()).and_then(|v| v.to_str()).and_then(|v| v.parse::<u32>().ok())
    });
    versions.pop()
}

fn euid_is_root() -> bool {
    Command::new("id").arg("-u").output().is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map(|a| a.port()).expect("a free port")
}

impl PgServer {
    /// Start a server, or `None` (after saying why) when Postgres is not installed.
    pub fn start() -> Option<PgServer> {
        Self::start_with(None)
    }

    /// As [`start`](Self::start), with `ssl = on` using `cert_pem` (the server's certificate,
    /// then any intermediates) and `key_pem`, and a `pg_hba.conf` that takes TCP connections
    /// from 127.0.0.1 over TLS only (`hostssl`; a plain one finds no entry and is refused).
    #[allow(dead_code)] // postgres_tls.rs
    pub fn start_tls(cert_pem: &str, key_pem: &str) -> Option<PgServer> {
        Self::start_with(Some((cert_pem, key_pem)))
    }

    fn start_with(tls: Option<(&str, &str)>) -> Option<PgServer> {
        let Some(bin) = find_bin() else {
            let msg = "Postgres (initdb, pg_ctl, postgres) not found on PATH or in /usr/lib/postgresql/*/bin";
            if std::env::var("CI").is_ok_and(|v| v == "true") {
                panic!("{msg}; CI=true, so the Postgres store tests must run (scripts/test installs it)");
            }
            eprintln!("SKIPPED: {msg}");
            return None;
        };
        let dir = tempfile::Builder::new().prefix("gpuci-pg-").tempdir().expect("temp dir");
        let as_root = euid_is_root();
        if as_root {
            let st = Command::new("chown").arg(UNPRIVILEGED).arg(dir.path()).status().expect("chown");
            assert!(st.success(), "chown {UNPRIVILEGED} {}", dir.path().display());
        }
        let server = PgServer { dir, bin, as_root, port: free_port(), tls: tls.is_some() };
        server.run(
            "initdb",
            &["-D", &server.data(), "-U", USER, "--auth=trust", "-E", "UTF8", "--locale=C", "--no-sync"],
        );
        if let Some((cert, key)) = tls {
            server.configure_tls(cert, key);
        }
        server.pg_ctl_start();
        Some(server)
    }

    /// Write the certificate and key into the data dir (the key 0600 and owned by the server's
    /// user, or Postgres refuses it), turn `ssl` on and replace `pg_hba.conf`.
    fn configure_tls(&self, cert: &str, key: &str) {
        use std::os::unix::fs::PermissionsExt;
        let data = self.dir.path().join("data");
        let write = |name: &str, text: &str, mode: u32| {
            let path = data.join(name);
            std::fs::write(&path, text).unwrap_or_else(|e| panic!("writing {}: {e}", path.display()));
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).expect("chmod");
            if self.as_root {
                let st = Command::new("chown").arg(UNPRIVILEGED).arg(&path).status().expect("chown");
                assert!(st.success(), "chown {UNPRIVILEGED} {}", path.display());
            }
        };
        write("server.crt", cert, 0o644);
        write("server.key", key, 0o600);
        write("pg_hba.conf", "local all all trust\nhostssl all all 127.0.0.1/32 trust\n", 0o600);
        let conf = data.join("postgresql.conf");
        let mut text = std::fs::read_to_string(&conf).expect("postgresql.conf");
        text.push_str("\nssl = on\nssl_cert_file = 'server.crt'\nssl_key_file = 'server.key'\n");
        std::fs::write(&conf, text).expect("postgresql.conf");
    }

    fn data(&self) -> String {
        self.dir.path().join("data").display().to_string()
    }

    /// Run one of the Postgres binaries, as `nobody` when we are root; panic with its output
    /// when it fails.
    fn run(&self, tool: &str, args: &[&str]) {
        let exe = self.bin.join(tool);
        let mut cmd = if self.as_root {
            let mut c = Command::new("runuser");
            c.args(["-u", UNPRIVILEGED, "--"]).arg(&exe);
            c
        } else {
            Command::new(&exe)
        };
        let out = cmd.args(args).current_dir(self.dir.path()).output().expect(tool);
        assert!(
            out.status.success(),
            "{tool} {args:?} failed: {}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }

    fn pg_ctl_start(&self) {
        let sockets = self.dir.path().display().to_string();
        let log = self.dir.path().join("server.log").display().to_string();
        let opts = format!("-c listen_addresses=127.0.0.1 -p {} -k {sockets}", self.port);
        // -w: return once the server accepts connections.
        self.run("pg_ctl", &["-D", &self.data(), "-l", &log, "-o", &opts, "-w", "-t", "60", "start"]);
    }

    /// Stop as a crash would (`-m immediate`: no shutdown checkpoint), then start again.
    /// Committed data must survive through WAL recovery.
    pub fn crash_and_restart(&self) {
        self.run("pg_ctl", &["-D", &self.data(), "-m", "immediate", "-w", "stop"]);
        self.pg_ctl_start();
    }

    /// Create a fresh database and return its URL.
    pub async fn create_database(&self, name: &str) -> String {
        use sqlx::Connection;
        let mut admin = sqlx::PgConnection::connect(&self.url("postgres")).await.expect("connect to postgres db");
        sqlx::query(&format!("CREATE DATABASE \"{name}\"")).execute(&mut admin).await.expect("CREATE DATABASE");
        admin.close().await.expect("close");
        self.url(name)
    }

    fn url(&self, db: &str) -> String {
        if self.tls {
            self.url_with(db, "sslmode=require")
        } else {
            format!("postgres://{USER}@127.0.0.1:{}/{db}", self.port)
        }
    }

    /// The URL of database `db` at `host` (an address or name that reaches 127.0.0.1) with
    /// the query string `query` (`sslmode=...&sslrootcert=...`).
    #[allow(dead_code)] // postgres_tls.rs
    pub fn url_at(&self, host: &str, db: &str, query: &str) -> String {
        format!("postgres://{USER}@{host}:{}/{db}?{query}", self.port)
    }

    fn url_with(&self, db: &str, query: &str) -> String {
        self.url_at("127.0.0.1", db, query)
    }
}

impl Drop for PgServer {
    fn drop(&mut self) {
        let exe = self.bin.join("pg_ctl");
        let data = self.data();
        let args = ["-D", data.as_str(), "-m", "immediate", "-w", "stop"];
        let _ = if self.as_root {
            Command::new("runuser").args(["-u", UNPRIVILEGED, "--"]).arg(&exe).args(args).output()
        } else {
            Command::new(&exe).args(args).output()
        };
    }
}
