//! The job's seccomp filter: what a hostile job may not ask the kernel, whatever its uid.
//!
//! Two classic BPF programs, both handed to bwrap (`--add-seccomp-fd`), which installs them as
//! the last step before it execs the job, after it set `no_new_privs`:
//!
//! 1. **Denied calls** answer `EPERM` (built with `seccompiler`, which also checks the audit
//!    architecture). The list, and why each is there:
//!    - kernel keyrings (`add_key`, `keyctl`, `request_key`): keyrings are not namespaced; a job
//!      could read or plant keys another job (or the host) uses, and keys outlive the job;
//!    - `bpf`, `perf_event_open`, `userfaultfd`, `io_uring_*`: large kernel attack surface that
//!      CI work does not need (profilers that sample the job's own processes through
//!      `perf_event_open` are the one casualty; Docker's default profile makes the same call);
//!    - module and kexec calls, `reboot`, `swapon/off`, `acct`, clock setting, `syslog`,
//!      `quotactl`, `iopl/ioperm`, `vhangup`, `open_by_handle_at`: host administration;
//!    - the whole mount family (`mount`, `umount2`, `pivot_root`, `move_mount`, `open_tree`,
//!      `fsopen`, `fsconfig`, `fsmount`, `fspick`, `mount_setattr`) and `setns`: the job's view of
//!      the host is fixed by the sandbox;
//!    - `clone` and `unshare` with `CLONE_NEWUSER`: no nested user namespace, in which a job
//!      would hold every capability and could mount its own cgroup hierarchy and lift its limits;
//!    - `ioctl(TIOCSTI)` and `ioctl(TIOCLINUX)`: typing into a terminal (bwrap's `--new-session`
//!      covers the first too).
//! 2. **`clone3` and x32-ABI calls answer `ENOSYS`** (hand-written, six instructions).
//!    `clone3` passes its flags in a struct a filter cannot read, so it cannot be checked for
//!    `CLONE_NEWUSER`; `ENOSYS` makes glibc fall back to `clone`, which is checked. x32 calls
//!    (number | `0x4000_0000`, same audit architecture as x86-64) would bypass a filter that
//!    compares exact numbers, as the first one does.
//!
//! `ptrace` and `process_vm_readv` stay allowed: debuggers on the job's own processes are
//! ordinary CI work, and the job's PID namespace and uid keep them to its own processes.

use std::collections::BTreeMap;
use std::io;

use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter, SeccompRule,
};

/// Syscalls denied outright, by name (for a container engine's profile) and number. Those that
/// exist only on some architectures are marked so.
const DENIED: &[(&str, i64)] = &[
    ("add_key", libc::SYS_add_key),
    ("keyctl", libc::SYS_keyctl),
    ("request_key", libc::SYS_request_key),
    ("bpf", libc::SYS_bpf),
    ("perf_event_open", libc::SYS_perf_event_open),
    ("userfaultfd", libc::SYS_userfaultfd),
    ("io_uring_setup", libc::SYS_io_uring_setup),
    ("io_uring_enter", libc::SYS_io_uring_enter),
    ("io_uring_register", libc::SYS_io_uring_register),
    ("kexec_load", libc::SYS_kexec_load),
    ("kexec_file_load", libc::SYS_kexec_file_load),
    ("init_module", libc::SYS_init_module),
    ("finit_module", libc::SYS_finit_module),
    ("delete_module", libc::SYS_delete_module),
    ("reboot", libc::SYS_reboot),
    ("swapon", libc::SYS_swapon),
    ("swapoff", libc::SYS_swapoff),
    ("acct", libc::SYS_acct),
    ("settimeofday", libc::SYS_settimeofday),
    ("clock_settime", libc::SYS_clock_settime),
    ("clock_adjtime", libc::SYS_clock_adjtime),
    ("syslog", libc::SYS_syslog),
    ("quotactl", libc::SYS_quotactl),
    ("vhangup", libc::SYS_vhangup),
    ("open_by_handle_at", libc::SYS_open_by_handle_at),
    ("mount", libc::SYS_mount),
    ("umount2", libc::SYS_umount2),
    ("pivot_root", libc::SYS_pivot_root),
    ("move_mount", libc::SYS_move_mount),
    ("open_tree", libc::SYS_open_tree),
    ("fsopen", libc::SYS_fsopen),
    ("fsconfig", libc::SYS_fsconfig),
    ("fsmount", libc::SYS_fsmount),
    ("fspick", libc::SYS_fspick),
    ("mount_setattr", libc::SYS_mount_setattr),
    ("setns", libc::SYS_setns),
    #[cfg(target_arch = "x86_64")]
    ("iopl", libc::SYS_iopl),
    #[cfg(target_arch = "x86_64")]
    ("ioperm", libc::SYS_ioperm),
];

const CLONE_NEWUSER: u64 = libc::CLONE_NEWUSER as u64;
#[allow(clippy::unnecessary_cast)] // the ioctl number's type differs between libcs
const TIOCSTI: u64 = libc::TIOCSTI as u64;
const TIOCLINUX: u64 = 0x541C;

#[derive(Debug, thiserror::Error)]
pub enum SeccompError {
    #[error("building the job's seccomp filter: {0}")]
    Build(#[from] seccompiler::BackendError),
    #[error("seccomp filter: architecture {0} is not supported (x86_64, aarch64)")]
    Arch(&'static str),
}

/// The filters as bwrap reads them: raw `struct sock_filter` arrays, native byte order.
pub(crate) fn programs() -> Result<Vec<Vec<u8>>, SeccompError> {
    // Compiled once per process: every job (and every waiting process made for one) gets the
    // same programs, and compiling them was a measurable part of a busy agent's CPU per job.
    static COMPILED: std::sync::OnceLock<Vec<Vec<u8>>> = std::sync::OnceLock::new();
    if let Some(p) = COMPILED.get() {
        return Ok(p.clone());
    }
    let p = vec![to_bytes(&denied_program()?), to_bytes(&enosys_program())];
    Ok(COMPILED.get_or_init(|| p).clone())
}

fn denied_program() -> Result<BpfProgram, SeccompError> {
    let arch = std::env::consts::ARCH.try_into().map_err(|_| SeccompError::Arch(std::env::consts::ARCH))?;
    let mut rules: BTreeMap<i64, Vec<SeccompRule>> = DENIED.iter().map(|&(_, nr)| (nr, Vec::new())).collect();
    let flag_set = |arg: u8, flag: u64| -> Result<SeccompRule, SeccompError> {
        Ok(SeccompRule::new(vec![SeccompCondition::new(
            arg,
            SeccompCmpArgLen::Qword,
            SeccompCmpOp::MaskedEq(flag),
            flag,
        )?])?)
    };
    let arg_is = |arg: u8, value: u64| -> Result<SeccompRule, SeccompError> {
        // ioctl request numbers are 32-bit; the upper half of the register may hold garbage.
        Ok(SeccompRule::new(vec![SeccompCondition::new(arg, SeccompCmpArgLen::Dword, SeccompCmpOp::Eq, value)?])?)
    };
    // clone's flags are its first argument on x86_64 and aarch64 alike.
    rules.insert(libc::SYS_clone, vec![flag_set(0, CLONE_NEWUSER)?]);
    rules.insert(libc::SYS_unshare, vec![flag_set(0, CLONE_NEWUSER)?]);
    rules.insert(libc::SYS_ioctl, vec![arg_is(1, TIOCSTI)?, arg_is(1, TIOCLINUX)?]);
    let filter = SeccompFilter::new(rules, SeccompAction::Allow, SeccompAction::Errno(libc::EPERM as u32), arch)?;
    Ok(filter.try_into()?)
}

// Classic BPF opcodes (linux/bpf_common.h, linux/seccomp.h).
const BPF_LD_W_ABS: u16 = 0x20;
const BPF_JMP_JEQ_K: u16 = 0x15;
const BPF_JMP_JGE_K: u16 = 0x35;
const BPF_RET_K: u16 = 0x06;
const SECCOMP_RET_ALLOW: u32 = 0x7fff_0000;
const SECCOMP_RET_ERRNO: u32 = 0x0005_0000;
/// `struct seccomp_data`: `nr` at offset 0.
const OFFSET_NR: u32 = 0;
const X32_SYSCALL_BIT: u32 = 0x4000_0000;

fn insn(code: u16, jt: u8, jf: u8, k: u32) -> seccompiler::sock_filter {
    seccompiler::sock_filter { code, jt, jf, k }
}

/// `clone3` and (on x86_64) every x32 number → `ENOSYS`; everything else passes to the next
/// filter. The architecture is checked by the first program, which the kernel also runs.
fn enosys_program() -> BpfProgram {
    let enosys = SECCOMP_RET_ERRNO | libc::ENOSYS as u32;
    let mut p = vec![insn(BPF_LD_W_ABS, 0, 0, OFFSET_NR)];
    if cfg!(target_arch = "x86_64") {
        p.push(insn(BPF_JMP_JGE_K, 2, 0, X32_SYSCALL_BIT));
    }
    p.push(insn(BPF_JMP_JEQ_K, 1, 0, libc::SYS_clone3 as u32));
    p.push(insn(BPF_RET_K, 0, 0, SECCOMP_RET_ALLOW));
    p.push(insn(BPF_RET_K, 0, 0, enosys));
    p
}

fn to_bytes(p: &[seccompiler::sock_filter]) -> Vec<u8> {
    let mut out = Vec::with_capacity(p.len() * 8);
    for i in p {
        out.extend_from_slice(&i.code.to_ne_bytes());
        out.push(i.jt);
        out.push(i.jf);
        out.extend_from_slice(&i.k.to_ne_bytes());
    }
    out
}

/// The same policy as an OCI seccomp profile (JSON), for `image:` steps: podman/docker
/// `--security-opt seccomp=FILE`. Without it a container ran under the engine's default
/// profile, which lets a job make a user namespace and mount in it, and reach the keyring its
/// uid shares with the slot's other jobs (outsider attack). Only the native architecture is
/// listed: a call through another ABI (32-bit `int 0x80`, x32) gets the engine's bad-arch
/// answer, never the allow.
pub fn oci_profile() -> Result<String, SeccompError> {
    let arch = match std::env::consts::ARCH {
        "x86_64" => "SCMP_ARCH_X86_64",
        "aarch64" => "SCMP_ARCH_AARCH64",
        other => return Err(SeccompError::Arch(other)),
    };
    let names: Vec<String> = DENIED.iter().map(|(n, _)| format!("\"{n}\"")).collect();
    let eperm = libc::EPERM;
    let masked = |names: &str, flag: u64| {
        format!(
            r#"{{"names":[{names}],"action":"SCMP_ACT_ERRNO","errnoRet":{eperm},"args":[{{"index":0,"value":{flag},"valueTwo":{flag},"op":"SCMP_CMP_MASKED_EQ"}}]}}"#
        )
    };
    let ioctl = |request: u64| {
        format!(
            r#"{{"names":["ioctl"],"action":"SCMP_ACT_ERRNO","errnoRet":{eperm},"args":[{{"index":1,"value":{request},"valueTwo":0,"op":"SCMP_CMP_EQ"}}]}}"#
        )
    };
    let rules = [
        format!(r#"{{"names":[{}],"action":"SCMP_ACT_ERRNO","errnoRet":{eperm}}}"#, names.join(",")),
        masked(r#""clone","unshare""#, CLONE_NEWUSER),
        ioctl(TIOCSTI),
        ioctl(TIOCLINUX),
        format!(r#"{{"names":["clone3"],"action":"SCMP_ACT_ERRNO","errnoRet":{}}}"#, libc::ENOSYS),
    ];
    Ok(format!(r#"{{"defaultAction":"SCMP_ACT_ALLOW","architectures":["{arch}"],"syscalls":[{}]}}"#, rules.join(",")))
}

/// Writes each program into its own sealed memfd (close-on-exec, rewound) for bwrap's
/// `--add-seccomp-fd`. Public for benchmarks that hold a bare bwrap to the same filter.
pub fn memfds() -> io::Result<Vec<std::fs::File>> {
    use std::io::{Seek, Write};
    let progs = programs().map_err(io::Error::other)?;
    progs
        .into_iter()
        .map(|bytes| {
            let mut f = crate::host::sealable_memfd(c"gpuci-seccomp")?;
            f.write_all(&bytes)?;
            f.rewind()?;
            crate::host::seal(&f)?;
            Ok(f)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_container_profile_is_json_and_denies_what_the_filter_denies() {
        let text = oci_profile().expect("profile");
        let v: serde_json::Value = serde_json::from_str(&text).expect("valid JSON");
        assert_eq!(v["defaultAction"], "SCMP_ACT_ALLOW");
        let rules = v["syscalls"].as_array().expect("syscalls");
        let denied: Vec<&str> = rules[0]["names"].as_array().unwrap().iter().map(|n| n.as_str().unwrap()).collect();
        for name in ["keyctl", "add_key", "mount", "fsopen", "open_tree", "setns", "bpf", "userfaultfd"] {
            assert!(denied.contains(&name), "{name} not denied");
        }
        let unshare = &rules[1];
        assert_eq!(unshare["args"][0]["value"], CLONE_NEWUSER);
        assert_eq!(rules.last().unwrap()["names"][0], "clone3");
    }

    #[test]
    fn both_programs_build_and_end_in_a_return() {
        let progs = programs().expect("filters build on this architecture");
        assert_eq!(progs.len(), 2);
        for p in &progs {
            assert!(!p.is_empty() && p.len() % 8 == 0);
        }
        let e = enosys_program();
        // Every path of the hand-written program ends in a return within bounds.
        for (i, ins) in e.iter().enumerate() {
            if ins.code & 0x07 == 0x05 {
                assert!(
                    i + 1 + (ins.jt as usize) < e.len() && i + 1 + (ins.jf as usize) < e.len(),
                    "jump out of bounds at {i}"
                );
            }
        }
        assert_eq!(e.last().map(|i| i.code), Some(BPF_RET_K));
    }
}
