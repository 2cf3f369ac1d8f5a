//! How the store's connection to Postgres is protected, in words a coordinator prints at
//! start, and whether that is weak enough to warn about.
//!
//! The URL's `sslmode`, `sslrootcert`, `sslcert` and `sslkey` are parsed by sqlx
//! (`PgConnectOptions::from_str`) with libpq's meanings; [`PostgresStore`] keeps the options
//! whole, so they reach every connection (also the leader's fenced pool). What this module
//! adds is the verdict: what the server said (`pg_stat_ssl` for the session) and what the
//! mode promised (only `verify-full` checks both the chain and the host name).
//!
//! The rule, here and nowhere else: a host on loopback or a Unix socket needs no TLS (the
//! traffic never leaves the machine). A remote host gets a warning unless the connection is
//! `verify-full`: plain text exposes the role's password and every job's sealed secrets;
//! `require` or `prefer` encrypts but lets anyone on the path impersonate the server;
//! `verify-ca` checks the chain but not the name. A warning, not a refusal: a Postgres on a
//! private link (a VPN, a compose network named `db`) without TLS is a choice an operator may
//! make, and refusing would break it at upgrade. Not silent, though.
//!
//! [`PostgresStore`]: crate::PostgresStore

use sqlx::postgres::{PgConnectOptions, PgSslMode};
use std::fmt;
use std::net::IpAddr;

/// How one database connection was made: the mode asked for and what the server reports.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DbTls {
    /// The host, or the Unix socket's path.
    pub host: String,
    /// Loopback address, `localhost` or a Unix socket: the traffic stays on this machine.
    pub local: bool,
    /// The `sslmode` in effect, as libpq spells it.
    pub sslmode: &'static str,
    /// What the server reports for the session (`pg_stat_ssl`): `Some(version)` for TLS
    /// (`"TLSv1.3"`), `None` for plain text. Unknown (the view could not be read) counts as
    /// plain text: a warning too many, never one too few.
    pub tls_version: Option<String>,
}

/// The verdict on a [`DbTls`], strongest first.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DbTlsVerdict {
    /// TLS, the server's certificate checked against the trusted roots and its name.
    Verified,
    /// TLS, the certificate's chain checked but not its name (`verify-ca`).
    ChainOnly,
    /// TLS, nothing about the server checked (`require`, `prefer`).
    Unverified,
    /// No TLS.
    Plain,
}

impl DbTls {
    pub(crate) fn new(options: &PgConnectOptions, tls_version: Option<String>) -> Self {
        let (host, local) = match options.get_socket() {
            Some(path) => (path.display().to_string(), true),
            None => (options.get_host().to_string(), is_local_host(options.get_host())),
        };
        DbTls { host, local, sslmode: mode_name(options.get_ssl_mode()), tls_version }
    }

    pub fn verdict(&self) -> DbTlsVerdict {
        match (&self.tls_version, self.sslmode) {
            (None, _) => DbTlsVerdict::Plain,
            (Some(_), "verify-full") => DbTlsVerdict::Verified,
            (Some(_), "verify-ca") => DbTlsVerdict::ChainOnly,
            (Some(_), _) => DbTlsVerdict::Unverified,
        }
    }

    /// What is wrong with this connection, and the fix, when the host is remote and the
    /// connection is less than `verify-full`; `None` otherwise.
    pub fn warning(&self) -> Option<String> {
        if self.local {
            return None;
        }
        const FIX: &str = "add `sslmode=verify-full&sslrootcert=/path/to/ca.pem` to the database URL \
                           (docs/deploy-ha.md#tls-to-postgres)";
        let what = match self.verdict() {
            DbTlsVerdict::Verified => return None,
            DbTlsVerdict::Plain => format!(
                "the connection to Postgres at {} is NOT encrypted (sslmode={}): the role's password and \
                 every job's sealed secrets cross the network readable",
                self.host, self.sslmode
            ),
            DbTlsVerdict::Unverified => format!(
                "the connection to Postgres at {} is encrypted but the server is NOT verified (sslmode={}): \
                 anyone on the path can pose as it",
                self.host, self.sslmode
            ),
            DbTlsVerdict::ChainOnly => format!(
                "the connection to Postgres at {} checks the certificate's chain but NOT its host name \
                 (sslmode=verify-ca): any certificate a trusted CA issued passes",
                self.host
            ),
        };
        Some(format!("{what}; {FIX}"))
    }
}

impl fmt::Display for DbTls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let place = if self.local { "local" } else { "remote" };
        let Some(version) = &self.tls_version else {
            return write!(f, "not encrypted (sslmode={}, {place} host)", self.sslmode);
        };
        let checked = match self.verdict() {
            DbTlsVerdict::Verified => "server certificate and host name verified",
            DbTlsVerdict::ChainOnly => "server certificate verified, host name not",
            DbTlsVerdict::Unverified | DbTlsVerdict::Plain => "server not verified",
        };
        write!(f, "encrypted ({version}), {checked} (sslmode={}, {place} host)", self.sslmode)
    }
}

fn mode_name(mode: PgSslMode) -> &'static str {
    match mode {
        PgSslMode::Disable => "disable",
        PgSslMode::Allow => "allow",
        PgSslMode::Prefer => "prefer",
        PgSslMode::Require => "require",
        PgSslMode::VerifyCa => "verify-ca",
        PgSslMode::VerifyFull => "verify-full",
    }
}

fn is_local_host(host: &str) -> bool {
    let bare = host.trim_start_matches('[').trim_end_matches(']');
    host.eq_ignore_ascii_case("localhost")
        || host.starts_with('/')
        || bare.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::str::FromStr;

    fn tls(url: &str, version: Option<&str>) -> DbTls {
        DbTls::new(&PgConnectOptions::from_str(url).expect("url"), version.map(str::to_string))
    }

    #[test]
    fn loopback_and_sockets_are_local_and_never_warned_about() {
        for url in [
            "postgres://u@127.0.0.1/db",
            "postgres://u@127.0.0.2:5433/db",
            "postgres://u@localhost/db",
            "postgres://u@[::1]/db",
            "postgres://u@db.example.org/db?host=/var/run/postgresql",
        ] {
            let t = tls(url, None);
            assert!(t.local, "{url}");
            assert_eq!(t.warning(), None, "{url}");
        }
    }

    #[test]
    fn a_remote_host_is_warned_about_unless_verify_full() {
        let plain = tls("postgres://u:pw@db.example.org/gpuci", None);
        assert_eq!(plain.verdict(), DbTlsVerdict::Plain);
        let w = plain.warning().expect("plain text to a remote host is warned about");
        assert!(w.contains("NOT encrypted") && w.contains("sslmode=verify-full"), "{w}");
        assert!(!w.contains("pw"), "{w}");

        let require = tls("postgres://u@10.0.0.5/gpuci?sslmode=require", Some("TLSv1.3"));
        assert_eq!(require.verdict(), DbTlsVerdict::Unverified);
        assert!(require.warning().expect("warned").contains("NOT verified"));

        let ca = tls("postgres://u@db/gpuci?sslmode=verify-ca", Some("TLSv1.3"));
        assert_eq!(ca.verdict(), DbTlsVerdict::ChainOnly);
        assert!(ca.warning().expect("warned").contains("host name"));

        let full = tls("postgres://u@db.example.org/gpuci?sslmode=verify-full&sslrootcert=/ca.pem", Some("TLSv1.3"));
        assert_eq!(full.verdict(), DbTlsVerdict::Verified);
        assert_eq!(full.warning(), None);
        assert_eq!(
            full.to_string(),
            "encrypted (TLSv1.3), server certificate and host name verified (sslmode=verify-full, remote host)"
        );
    }

    #[test]
    fn what_the_server_reports_decides_encryption_not_the_mode() {
        // `prefer` against a server without TLS ends in plain text.
        assert_eq!(tls("postgres://u@db/gpuci?sslmode=prefer", None).verdict(), DbTlsVerdict::Plain);
        assert_eq!(tls("postgres://u@db/gpuci?sslmode=prefer", Some("TLSv1.3")).verdict(), DbTlsVerdict::Unverified);
    }
}
