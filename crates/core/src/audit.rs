//! The audit log's vocabulary: the actions it records, how its times are written and read,
//! and how a credential is named in it without being revealed.
//!
//! The coordinator decides what to record (`gpuci_coordinator::api::audit`); the store keeps the
//! entries as plain strings. The names here are part of the stable output of `gpuci audit
//! --json` and `GET /api/v1/audit`: add new ones, never rename one.

use std::fmt;

/// What was done. Dotted names: `object.verb`; a filter on the object (`secret`) finds every
/// action on it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum AuditAction {
    /// A secret's value set or replaced (rotated) in one scope.
    SecretSet,
    /// A secret's value deleted from one scope.
    SecretRm,
    /// A new current key for secrets encrypted in pipeline files.
    SecretsKeyRotate,
    /// A named API token created.
    TokenCreate,
    /// A named API token revoked.
    TokenRevoke,
    /// A pull request head approved to run (GitHub: the approving login).
    ApprovalGrant,
    /// A job cancelled through the API or the dashboard.
    JobCancel,
    /// A job run again from the dashboard.
    JobRetry,
    /// A quarantined GPU returned to service.
    GpuRelease,
    /// A schedule fired by hand (`gpuci schedules run`).
    ScheduleRun,
    /// Steps added to a running pipeline by one of its jobs (`gpuci pipeline upload`).
    PipelineUpload,
}

impl AuditAction {
    pub const ALL: [AuditAction; 11] = [
        AuditAction::SecretSet,
        AuditAction::SecretRm,
        AuditAction::SecretsKeyRotate,
        AuditAction::TokenCreate,
        AuditAction::TokenRevoke,
        AuditAction::ApprovalGrant,
        AuditAction::JobCancel,
        AuditAction::JobRetry,
        AuditAction::GpuRelease,
        AuditAction::ScheduleRun,
        AuditAction::PipelineUpload,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            AuditAction::SecretSet => "secret.set",
            AuditAction::SecretRm => "secret.rm",
            AuditAction::SecretsKeyRotate => "secrets-key.rotate",
            AuditAction::TokenCreate => "token.create",
            AuditAction::TokenRevoke => "token.revoke",
            AuditAction::ApprovalGrant => "approval.grant",
            AuditAction::JobCancel => "job.cancel",
            AuditAction::JobRetry => "job.retry",
            AuditAction::GpuRelease => "gpu.release",
            AuditAction::ScheduleRun => "schedule.run",
            AuditAction::PipelineUpload => "pipeline.upload",
        }
    }
}

impl fmt::Display for AuditAction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A filter on actions, as a person gives it: a whole action (`secret.rm`) or the object part
/// of some (`secret`). Anything else is refused with the list, so a typo is not an empty
/// answer that reads like "nobody did that".
pub fn check_action_filter(filter: &str) -> Result<(), String> {
    let known = AuditAction::ALL.iter().any(|a| {
        let s = a.as_str();
        s == filter || s.split_once('.').is_some_and(|(object, _)| object == filter)
    });
    if known {
        return Ok(());
    }
    let names: Vec<&str> = AuditAction::ALL.iter().map(|a| a.as_str()).collect();
    Err(format!("unknown action {filter:?}: expected one of {} (or the part before the dot)", names.join(", ")))
}

/// A time in the log as UTC, RFC 3339 with milliseconds (`2026-11-28T12:00:00.123Z`).
pub fn utc(ms: i64) -> String {
    jiff::Timestamp::from_millisecond(ms)
        .map_or_else(|_| format!("{ms} ms"), |t| t.strftime("%Y-%m-%dT%H:%M:%S%.3fZ").to_string())
}

/// `--since`: an RFC 3339 time (`2026-11-28T12:00:00Z`, an offset other than `Z` allowed) or a
/// duration back from `now_ms` (`90m`, `2h`, `7d`). Milliseconds since the epoch.
pub fn parse_since(s: &str, now_ms: i64) -> Result<i64, String> {
    let s = s.trim();
    if let Ok(t) = s.parse::<jiff::Timestamp>() {
        return Ok(t.as_millisecond());
    }
    match s.parse::<crate::Duration>() {
        Ok(d) => Ok(now_ms.saturating_sub(i64::try_from(d.as_millis()).unwrap_or(i64::MAX))),
        Err(_) => Err(format!(
            "since {s:?}: expected a UTC time such as 2026-11-28T12:00:00Z or a duration back from now such as 2h or 7d"
        )),
    }
}

/// How the log names a credential it saw: `sha256:` and the first 12 hex digits of the
/// SHA-256 of the token. Stable for one token, different for the next (a rotated admin token
/// is told from the one before), and of no use to anyone who reads it.
pub fn fingerprint(sha256_hex: &str) -> String {
    format!("sha256:{}", sha256_hex.get(..12).unwrap_or(sha256_hex))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn action_filters_are_whole_actions_or_their_object() {
        for ok in ["secret", "secret.set", "secret.rm", "token", "secrets-key", "approval", "job.cancel", "gpu"] {
            assert_eq!(check_action_filter(ok), Ok(()), "{ok}");
        }
        for bad in ["", "secre", "secret.", "%", "secret.get", "SECRET"] {
            let e = check_action_filter(bad).expect_err(bad);
            assert!(e.contains("secret.set"), "{e}");
        }
    }

    #[test]
    fn times_are_utc_and_since_reads_both_forms() {
        assert_eq!(utc(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(utc(1_700_000_000_123), "2023-11-14T22:13:20.123Z");
        assert_eq!(parse_since("2023-11-14T22:13:20.123Z", 0), Ok(1_700_000_000_123));
        assert_eq!(parse_since("2023-11-14T23:13:20.123+01:00", 0), Ok(1_700_000_000_123));
        assert_eq!(parse_since("2h", 10_000_000), Ok(10_000_000 - 7_200_000));
        assert_eq!(parse_since("1d", 0), Ok(-86_400_000));
        assert!(parse_since("yesterday", 0).expect_err("refused").contains("2h"));
    }

    #[test]
    fn a_fingerprint_is_short_and_stable() {
        let h = "0123456789abcdef".repeat(4);
        assert_eq!(fingerprint(&h), "sha256:0123456789ab");
        assert_eq!(fingerprint("ab"), "sha256:ab");
    }
}
