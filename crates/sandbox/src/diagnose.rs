//! Why a job sandbox could not start, in words an operator can act on.
//!
//! bubblewrap reports a failure as one line on standard error (`bwrap: Can't mount proc on
//! /newroot/proc: Operation not permitted`). The line is right but names the symptom: in a
//! container, the cause is the container's settings, and the fix is in the pod spec. This
//! module maps the lines to causes; it reads nothing and starts nothing.

/// A cause of a failed sandbox start, with what fixes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Diagnosis {
    /// What is wrong, e.g. "the container masks /proc".
    pub cause: String,
    /// What to change.
    pub fix: String,
}

/// The cause behind bubblewrap's standard error `stderr`, when it is one this module knows;
/// `None` for anything else (the caller shows the line as it is).
pub fn diagnose(stderr: &str) -> Option<Diagnosis> {
    let text = stderr.to_ascii_lowercase();
    let d = |cause: &str, fix: &str| Some(Diagnosis { cause: cause.to_string(), fix: fix.to_string() });
    if text.contains("can't mount proc") {
        // mount_too_revealing(): a procfs mounted in a user namespace must not reveal what
        // an over-mount hides in an existing one. A container runtime's masked paths
        // (/proc/kcore, /proc/timer_list, /proc/acpi, ...) are such over-mounts.
        return d(
            "this host's /proc has paths masked by over-mounts (a container runtime's default masked paths), \
             so the kernel refuses a job sandbox a /proc of its own",
            "in Kubernetes run the agent's pod with spec.hostUsers: false and the container's \
             securityContext.procMount: Unmasked (the kubernetes provider's default, sandbox = \"user-namespace\"; \
             Kubernetes 1.33 or later); in Docker or Podman, --security-opt systempaths=unconfined together \
             with --userns; or run the agent outside a container",
        );
    }
    if text.contains("creating new namespace failed")
        || text.contains("no permissions to creating new namespace")
        || text.contains("no permissions to create new namespace")
        || text.contains("setting up uid map")
        || text.contains("unshare failed")
    {
        return d(
            "creating a user namespace was refused (a seccomp profile such as the container runtime's \
             RuntimeDefault without CAP_SYS_ADMIN, an AppArmor profile, kernel.apparmor_restrict_unprivileged_userns, \
             or user.max_user_namespaces=0)",
            "in Kubernetes use the kubernetes provider's default sandbox = \"user-namespace\" (hostUsers: false, \
             CAP_SYS_ADMIN added, which then holds only inside the pod's own user namespace, and AppArmor \
             Unconfined); on a host: sysctl -w user.max_user_namespaces=15000, and on Ubuntu 23.10 or later \
             sysctl -w kernel.apparmor_restrict_unprivileged_userns=0 or an AppArmor profile for bwrap",
        );
    }
    if text.contains("permission denied") && (text.contains("mount") || text.contains("make / slave")) {
        return d(
            "a mount inside the job's own user namespace was refused: a Linux security module (an AppArmor \
             profile with `deny mount`, as container runtimes' default profiles have, or an SELinux policy) \
             confines the agent",
            "in Kubernetes set the container's securityContext.appArmorProfile: {type: Unconfined} (the kubernetes \
             provider's default sandbox = \"user-namespace\" does), or give the agent an AppArmor or SELinux policy \
             that allows mounts in user namespaces it owns",
        );
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bubblewraps_own_lines_map_to_their_causes() {
        let masked = diagnose("bwrap: Can't mount proc on /newroot/proc: Operation not permitted\n").unwrap();
        assert!(masked.cause.contains("masked"), "{masked:?}");
        assert!(masked.fix.contains("hostUsers: false") && masked.fix.contains("procMount: Unmasked"));
        for line in [
            "bwrap: Creating new namespace failed: Operation not permitted",
            "bwrap: No permissions to creating new namespace, likely because the kernel does not allow non-privileged user namespaces. On e.g. debian this can be enabled with 'sysctl kernel.unprivileged_userns_clone=1'.",
            "bwrap: setting up uid map: Permission denied",
        ] {
            let d = diagnose(line).unwrap_or_else(|| panic!("{line}"));
            assert!(d.cause.contains("user namespace was refused"), "{line}: {d:?}");
            assert!(d.fix.contains("CAP_SYS_ADMIN"), "{d:?}");
        }
        let lsm = diagnose("bwrap: Failed to make / slave: Permission denied").unwrap();
        assert!(lsm.fix.contains("appArmorProfile"), "{lsm:?}");
        assert_eq!(diagnose("bwrap: execvp nosuch: No such file or directory"), None);
        assert_eq!(diagnose(""), None);
    }
}
