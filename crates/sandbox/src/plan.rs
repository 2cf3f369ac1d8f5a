//! The bubblewrap mount plan: a pure function from the spec and a view of the host's files to
//! bwrap's arguments. The plan itself is documented in the crate header; keep the two in step.

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::OsString;
use std::fs;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};

use crate::{SandboxError, SandboxSpec};

/// Host directories bound read-only (or recreated as the same symlink, for merged-/usr systems).
pub(crate) const SYSTEM_DIRS: &[&str] = &["/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/opt"];

/// The only entries of `/etc` a job sees: name resolution, users, TLS roots, the dynamic
/// linker's cache, time zone, OS identification, GPU/graphics vendor files. Everything else
/// (`shadow`, `ssh/` host keys, `sudoers`, the agent's `/etc/gpuci/`, ...) stays invisible.
/// Files are copied into the shared `/etc` view (`etcview.rs`); each directory entry is still one
/// bind mount (about 0.15–0.4 ms of start-up each), as is every entry when there is no view. So
/// the list holds what programs read at run time, not what only administration tools (ldconfig,
/// login shells) read.
/// Directories under allowed /etc entries that hold private keys; hidden by a tmpfs.
const ETC_SECRET_DIRS: &[&str] = &["/etc/ssl/private", "/etc/pki/tls/private"];

pub(crate) const ETC_ALLOW: &[&str] = &[
    "passwd",
    "group",
    "hosts",
    "nsswitch.conf",
    "resolv.conf",
    "protocols",
    "services",
    "localtime",
    "os-release",
    "lsb-release",
    "redhat-release",
    "system-release",
    "alpine-release",
    "ld.so.cache",
    "ld.so.preload",
    "alternatives",
    "ssl",
    "ca-certificates",
    "ca-certificates.conf",
    "pki",
    "crypto-policies",
    "gitconfig",
    "pip.conf",
    "ssh/ssh_config",
    "ssh/ssh_config.d",
    "ssh/ssh_known_hosts",
    "OpenCL",
    "vulkan",
    "glvnd",
    "nvidia",
];

/// sysfs parts CPU-topology code (PyTorch's cpuinfo, OpenMP, NUMA) reads. Always bound.
pub(crate) const SYS_ALWAYS: &[&str] = &["/sys/devices/system/cpu", "/sys/devices/system/node"];

/// What a path is on the host (not following a final symlink, except where noted).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    Missing,
    Dir,
    File,
    Symlink(PathBuf),
    /// A character device (followed through symlinks): major, minor.
    CharDev(u64, u64),
    Other,
}

/// The host's file system as the plan sees it; faked in tests.
pub(crate) trait HostFs {
    fn kind(&self, p: &Path) -> Kind;
    /// Like `kind` but follows symlinks.
    fn kind_follow(&self, p: &Path) -> Kind;
    /// Entries of `/sys/devices` whose names start with `pci`.
    fn pci_roots(&self) -> Vec<PathBuf>;
    /// Names in a directory, sorted; empty when it cannot be read.
    fn list_dir(&self, p: &Path) -> Vec<OsString>;
}

pub(crate) struct RealFs;

fn kind_of(m: std::io::Result<fs::Metadata>, p: &Path) -> Kind {
    match m {
        Err(_) => Kind::Missing,
        Ok(m) if m.file_type().is_symlink() => Kind::Symlink(fs::read_link(p).unwrap_or_default()),
        Ok(m) if m.is_dir() => Kind::Dir,
        Ok(m) if m.is_file() => Kind::File,
        Ok(m) if m.file_type().is_char_device() => {
            let rdev = m.rdev();
            Kind::CharDev(nix::sys::stat::major(rdev), nix::sys::stat::minor(rdev))
        }
        Ok(_) => Kind::Other,
    }
}

impl HostFs for RealFs {
    fn kind(&self, p: &Path) -> Kind {
        kind_of(fs::symlink_metadata(p), p)
    }
    fn kind_follow(&self, p: &Path) -> Kind {
        kind_of(fs::metadata(p), p)
    }
    fn pci_roots(&self) -> Vec<PathBuf> {
        let mut v: Vec<PathBuf> = fs::read_dir("/sys/devices")
            .map(|rd| {
                rd.flatten().filter(|e| e.file_name().to_string_lossy().starts_with("pci")).map(|e| e.path()).collect()
            })
            .unwrap_or_default();
        v.sort();
        v
    }
    fn list_dir(&self, p: &Path) -> Vec<OsString> {
        let mut v: Vec<OsString> =
            fs::read_dir(p).map(|rd| rd.flatten().map(|e| e.file_name()).collect()).unwrap_or_default();
        v.sort();
        v
    }
}

fn push(args: &mut Vec<OsString>, items: &[&dyn AsRef<std::ffi::OsStr>]) {
    args.extend(items.iter().map(|i| i.as_ref().to_os_string()));
}

/// A prepared read-only `/etc` view (see `etcview.rs`): bound onto `/etc` in one mount, with
/// `binds` (allow-listed directories, `/etc/...`) bound on top of it.
pub(crate) struct EtcPlan<'a> {
    pub(crate) dir: &'a Path,
    pub(crate) binds: &'a [PathBuf],
}

/// Descriptors the spawner prepared (memfds) that bwrap reads.
#[derive(Clone, Debug, Default)]
pub(crate) struct FdArgs {
    /// Seccomp programs, one `--add-seccomp-fd` each.
    pub(crate) seccomp: Vec<i32>,
    /// `/etc/passwd` and `/etc/group` with the job user's entry added.
    pub(crate) passwd: Option<i32>,
    pub(crate) group: Option<i32>,
}

/// Arguments as bwrap's `--args FD` reads them: each followed by a NUL.
pub(crate) fn nul_joined(args: &[OsString]) -> Vec<u8> {
    use std::os::unix::ffi::OsStrExt;
    let mut buf = Vec::new();
    for a in args {
        buf.extend_from_slice(a.as_bytes());
        buf.push(0);
    }
    buf
}

/// bwrap's arguments (everything before `--`), the job's environment included.
pub(crate) fn bwrap_args(
    spec: &SandboxSpec,
    env: &BTreeMap<String, String>,
    host: &dyn HostFs,
    etc_view: Option<EtcPlan<'_>>,
    fds: &FdArgs,
) -> Result<Vec<OsString>, SandboxError> {
    let invalid = |reason: String| SandboxError::InvalidSpec { job_id: spec.job_id.clone(), reason };
    let ws = &spec.workspace;
    for h in &spec.hide_paths {
        if !h.is_absolute() {
            return Err(invalid(format!("hide path {} is not absolute", h.display())));
        }
        if ws == h {
            return Err(invalid(format!("hide path {} is the workspace itself", h.display())));
        }
    }
    // A source is dropped entirely when a hide path covers it.
    let hidden = |src: &Path| spec.hide_paths.iter().any(|h| src.starts_with(h));

    let mut a: Vec<OsString> = Vec::new();
    // Read-only sources, for deciding which hide paths need covering.
    let mut ro_sources: Vec<PathBuf> = Vec::new();

    // 1. System directories.
    for d in SYSTEM_DIRS {
        let p = Path::new(d);
        if hidden(p) {
            continue;
        }
        match host.kind(p) {
            Kind::Dir => {
                push(&mut a, &[&"--ro-bind", &p, &p]);
                ro_sources.push(p.to_path_buf());
            }
            Kind::Symlink(target) => push(&mut a, &[&"--symlink", &target, &p]),
            _ => {}
        }
    }
    // 2. The allow-listed part of /etc: the prepared view in one bind plus its directories, or
    // (no view, or a hide path reaching into /etc, which the shared view cannot honour) one bind
    // per entry.
    let etc = Path::new("/etc");
    let etc_view = etc_view.filter(|_| !spec.hide_paths.iter().any(|h| h.starts_with(etc) || etc.starts_with(h)));
    if let Some(view) = &etc_view {
        push(&mut a, &[&"--ro-bind", &view.dir, &etc]);
        for p in view.binds {
            push(&mut a, &[&"--ro-bind", p, p]);
            ro_sources.push(p.clone());
        }
    }
    for e in ETC_ALLOW.iter().filter(|_| etc_view.is_none()) {
        let p = Path::new("/etc").join(e);
        if hidden(&p) || host.kind(&p) == Kind::Missing {
            continue;
        }
        push(&mut a, &[&"--ro-bind", &p, &p]);
        ro_sources.push(p);
    }
    // Private keys inside an allowed /etc directory (the host's TLS keys under ssl/) are
    // covered by an empty tmpfs: a root job could read them through the bind otherwise.
    for p in ETC_SECRET_DIRS.iter().map(Path::new) {
        if host.kind(p) == Kind::Dir {
            push(&mut a, &[&"--tmpfs", &p]);
        }
    }
    // The job user's own passwd/group entries (tools look their uid up: ssh, Node's
    // os.userInfo(), "I have no name!" prompts), over the host's copies.
    for (fd, dest) in [(fds.passwd, "/etc/passwd"), (fds.group, "/etc/group")] {
        if let Some(fd) = fd {
            push(&mut a, &[&"--perms", &"0644", &"--ro-bind-data", &fd.to_string(), &dest]);
        }
    }
    // 3. sysfs: CPU topology always; the PCI tree NVML and CUDA read only with a GPU.
    let mut sys: Vec<PathBuf> = SYS_ALWAYS.iter().map(PathBuf::from).collect();
    if !spec.gpu_devices.is_empty() {
        sys.push(PathBuf::from("/sys/bus/pci"));
        sys.extend(host.pci_roots());
        sys.push(PathBuf::from("/sys/module/nvidia"));
    }
    for p in sys {
        if hidden(&p) || host.kind(&p) == Kind::Missing {
            continue;
        }
        push(&mut a, &[&"--ro-bind", &p, &p]);
        ro_sources.push(p);
    }
    // 4. Fresh kernel and scratch file systems, sized when the spec says so.
    push(&mut a, &[&"--proc", &"/proc", &"--dev", &"/dev"]);
    for scratch in ["/dev/shm", "/tmp", "/var/tmp"] {
        if let Some(size) = spec.scratch_size {
            push(&mut a, &[&"--size", &size.to_string()]);
        }
        push(&mut a, &[&"--tmpfs", &scratch]);
    }

    // 5. Hide paths that lie inside a read-only source: cover them.
    let cover = |a: &mut Vec<OsString>, h: &Path| match host.kind(h) {
        Kind::Dir => push(a, &[&"--tmpfs", &h]),
        Kind::Missing => {}
        _ => push(a, &[&"--ro-bind", &"/dev/null", &h]),
    };
    for h in &spec.hide_paths {
        if ro_sources.iter().any(|s| h.starts_with(s) && h != s) {
            cover(&mut a, h);
        }
    }
    // 6. The workspace, after the covers so a hidden ancestor does not hide it; 7. hide paths
    // inside the workspace.
    push(&mut a, &[&"--bind", ws, ws]);
    for h in &spec.hide_paths {
        if h.starts_with(ws) && h != ws {
            cover(&mut a, h);
        }
    }
    // 7b. Tool views: the top-level entries of a host directory (an Actions runner install)
    // appear read-only inside a writable directory of the workspace, so the tool can write
    // beside its files (`_diag`, `_work`) while the host's copy stays untouched.
    for v in &spec.tool_views {
        if !v.source.is_absolute() || !v.dest.starts_with(ws) || &v.dest == ws {
            return Err(invalid(format!(
                "tool view {} -> {}: the source must be absolute and the destination inside the workspace",
                v.source.display(),
                v.dest.display()
            )));
        }
        if hidden(&v.source) {
            return Err(invalid(format!("tool directory {} is hidden from jobs", v.source.display())));
        }
        if host.kind_follow(&v.source) != Kind::Dir {
            return Err(invalid(format!("tool directory {} does not exist", v.source.display())));
        }
        for name in host.list_dir(&v.source) {
            push(&mut a, &[&"--ro-bind", &v.source.join(&name), &v.dest.join(&name)]);
        }
    }
    // 8. Only the leased GPU nodes, plus the common nvidia nodes when any GPU is leased.
    let mut dests = BTreeSet::new();
    let device_err = |p: &Path, reason: &str| SandboxError::Device {
        job_id: spec.job_id.clone(),
        path: p.to_path_buf(),
        reason: reason.to_string(),
    };
    let common: &[PathBuf] = if spec.gpu_devices.is_empty() { &[] } else { &spec.gpu_common_devices };
    for (dev, required) in spec.gpu_devices.iter().map(|d| (d, true)).chain(common.iter().map(|d| (d, false))) {
        match host.kind_follow(dev) {
            Kind::CharDev(..) => {}
            Kind::Missing if !required => continue,
            Kind::Missing => return Err(device_err(dev, "leased device node does not exist")),
            _ => return Err(device_err(dev, "not a character device")),
        }
        let name = dev.file_name().ok_or_else(|| device_err(dev, "no file name"))?;
        let dest = Path::new("/dev").join(name);
        if !dests.insert(dest.clone()) {
            return Err(device_err(dev, "two devices with the same name"));
        }
        push(&mut a, &[&"--dev-bind", dev, &dest]);
    }
    // 9. Namespaces and process attributes.
    if spec.user.is_some() {
        // bwrap runs as the job's uid (dropped to by the spawner): it needs its own user
        // namespace, which maps that uid to itself and nothing else.
        push(&mut a, &[&"--unshare-user"]);
    }
    push(&mut a, &[&"--unshare-pid", &"--unshare-ipc", &"--unshare-uts", &"--unshare-cgroup-try"]);
    match spec.network {
        // A slot's namespace was joined before bwrap started; the host's is kept.
        crate::Network::Namespace(_) | crate::Network::Host => {}
        crate::Network::None => push(&mut a, &[&"--unshare-net"]),
    }
    for fd in &fds.seccomp {
        push(&mut a, &[&"--add-seccomp-fd", &fd.to_string()]);
    }
    push(&mut a, &[&"--hostname", &"gpuci", &"--die-with-parent", &"--new-session"]);
    // bwrap started by root keeps every capability in the sandbox unless told otherwise.
    push(&mut a, &[&"--cap-drop", &"ALL", &"--chdir", ws]);
    // 10. The environment: exactly the job's.
    push(&mut a, &[&"--clearenv"]);
    for (k, v) in env {
        push(&mut a, &[&"--setenv", k, v]);
    }
    // bwrap reads these NUL-separated (`--args FD`): a NUL inside one would make arguments of
    // its own (`--cap-add ALL`, a bind of `/`). The pipeline parser refuses NULs; this is the
    // last line.
    use std::os::unix::ffi::OsStrExt;
    if let Some(bad) = a.iter().find(|x| x.as_bytes().contains(&0)) {
        let shown: String = bad.to_string_lossy().chars().take(40).collect();
        return Err(invalid(format!("a sandbox argument contains a NUL byte ({shown:?}...)")));
    }
    Ok(a)
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpuci_core::pipeline::Resources;

    struct FakeFs(BTreeMap<PathBuf, Kind>);
    impl HostFs for FakeFs {
        fn kind(&self, p: &Path) -> Kind {
            self.0.get(p).cloned().unwrap_or(Kind::Missing)
        }
        fn kind_follow(&self, p: &Path) -> Kind {
            self.kind(p)
        }
        fn pci_roots(&self) -> Vec<PathBuf> {
            vec![PathBuf::from("/sys/devices/pci0000:00")]
        }
        fn list_dir(&self, p: &Path) -> Vec<OsString> {
            self.0
                .keys()
                .filter(|k| k.parent() == Some(p))
                .filter_map(|k| k.file_name().map(|n| n.to_os_string()))
                .collect()
        }
    }

    fn host() -> FakeFs {
        let mut m = BTreeMap::new();
        for (p, k) in [
            ("/usr", Kind::Dir),
            ("/bin", Kind::Symlink("usr/bin".into())),
            ("/lib64", Kind::Symlink("usr/lib64".into())),
            ("/opt", Kind::Dir),
            ("/opt/gpuci", Kind::Dir),
            ("/opt/gpuci/token", Kind::File),
            ("/etc/passwd", Kind::File),
            ("/etc/shadow", Kind::File),
            ("/etc/ssl", Kind::Dir),
            ("/sys/devices/system/cpu", Kind::Dir),
            ("/sys/bus/pci", Kind::Dir),
            ("/dev/nvidia0", Kind::CharDev(195, 0)),
            ("/dev/nvidia1", Kind::CharDev(195, 1)),
            ("/dev/nvidiactl", Kind::CharDev(195, 255)),
        ] {
            m.insert(PathBuf::from(p), k);
        }
        FakeFs(m)
    }

    fn spec() -> SandboxSpec {
        SandboxSpec {
            job_id: "j1".into(),
            workspace: "/var/lib/gpuci/work/j1".into(),
            argv: vec!["true".into()],
            env: BTreeMap::new(),
            isolation: crate::Isolation::Bubblewrap,
            network: crate::Network::None,
            user: None,
            scratch_size: None,
            gpu_devices: vec!["/dev/nvidia1".into()],
            gpu_common_devices: vec!["/dev/nvidiactl".into(), "/dev/nvidia-uvm".into()],
            hide_paths: vec!["/opt/gpuci".into(), "/var/lib/gpuci".into()],
            resources: Resources::default(),
            cgroups: crate::CgroupUse::Auto,
            tool_views: Vec::new(),
        }
    }

    #[test]
    fn tool_view_binds_each_entry_read_only_inside_the_workspace() {
        let mut fs = host();
        for (p, k) in [
            ("/opt/actions-runner", Kind::Dir),
            ("/opt/actions-runner/run.sh", Kind::File),
            ("/opt/actions-runner/bin", Kind::Dir),
        ] {
            fs.0.insert(PathBuf::from(p), k);
        }
        let mut sp = spec();
        sp.tool_views.push(crate::ToolView {
            source: "/opt/actions-runner".into(),
            dest: "/var/lib/gpuci/work/j1/runner".into(),
        });
        let s = render(&bwrap_args(&sp, &BTreeMap::new(), &fs, None, &FdArgs::default()).expect("plan"));
        assert!(s.contains("--ro-bind /opt/actions-runner/bin /var/lib/gpuci/work/j1/runner/bin"), "{s}");
        assert!(s.contains("--ro-bind /opt/actions-runner/run.sh /var/lib/gpuci/work/j1/runner/run.sh"), "{s}");
        // After the workspace bind, or the workspace would cover them.
        assert!(s.find("--bind /var/lib/gpuci/work/j1 ").unwrap() < s.find("runner/bin").unwrap());

        sp.tool_views[0].dest = "/elsewhere".into();
        assert!(
            bwrap_args(&sp, &BTreeMap::new(), &fs, None, &FdArgs::default()).is_err(),
            "destination outside the workspace"
        );
        sp.tool_views[0] = crate::ToolView { source: "/opt/missing".into(), dest: "/var/lib/gpuci/work/j1/r".into() };
        let e = bwrap_args(&sp, &BTreeMap::new(), &fs, None, &FdArgs::default()).expect_err("missing source");
        assert!(e.to_string().contains("does not exist"), "{e}");
    }

    fn render(args: &[OsString]) -> String {
        args.iter().map(|a| a.to_string_lossy().into_owned()).collect::<Vec<_>>().join(" ")
    }

    #[test]
    fn plan_binds_only_allowed_paths_in_order() {
        let mut env = BTreeMap::new();
        env.insert("GPUCI_SANDBOX_ID".to_string(), "j1".to_string());
        let s = render(&bwrap_args(&spec(), &env, &host(), None, &FdArgs::default()).expect("plan"));
        assert_eq!(
            s,
            "--ro-bind /usr /usr --symlink usr/bin /bin --symlink usr/lib64 /lib64 --ro-bind /opt /opt \
             --ro-bind /etc/passwd /etc/passwd --ro-bind /etc/ssl /etc/ssl \
             --ro-bind /sys/devices/system/cpu /sys/devices/system/cpu --ro-bind /sys/bus/pci /sys/bus/pci \
             --proc /proc --dev /dev --tmpfs /dev/shm --tmpfs /tmp --tmpfs /var/tmp \
             --tmpfs /opt/gpuci \
             --bind /var/lib/gpuci/work/j1 /var/lib/gpuci/work/j1 \
             --dev-bind /dev/nvidia1 /dev/nvidia1 --dev-bind /dev/nvidiactl /dev/nvidiactl \
             --unshare-pid --unshare-ipc --unshare-uts --unshare-cgroup-try --unshare-net \
             --hostname gpuci --die-with-parent --new-session --cap-drop ALL --chdir /var/lib/gpuci/work/j1 \
             --clearenv --setenv GPUCI_SANDBOX_ID j1"
        );
        assert!(!s.contains("shadow"));
        assert!(!s.contains("nvidia0"));
    }

    #[test]
    fn job_user_gets_a_user_namespace_seccomp_and_sized_scratch() {
        let mut sp = spec();
        sp.user = Some(crate::JobUser { uid: 1500000001, gid: 1500000001 });
        sp.scratch_size = Some(1 << 30);
        let fds = FdArgs { seccomp: vec![7, 8], passwd: Some(9), group: None };
        let s = render(&bwrap_args(&sp, &BTreeMap::new(), &host(), None, &fds).expect("plan"));
        assert!(s.contains("--unshare-user --unshare-pid"), "{s}");
        assert!(s.contains("--add-seccomp-fd 7 --add-seccomp-fd 8"), "{s}");
        assert!(s.contains("--perms 0644 --ro-bind-data 9 /etc/passwd"), "{s}");
        for t in ["/dev/shm", "/tmp", "/var/tmp"] {
            assert!(s.contains(&format!("--size 1073741824 --tmpfs {t} ")), "{t}: {s}");
        }
        // The passwd entry goes over the /etc binds, not under them.
        assert!(s.find("--ro-bind /etc/passwd").unwrap() < s.find("--ro-bind-data 9").unwrap());
    }

    #[test]
    fn hide_path_covering_a_system_dir_drops_it() {
        let mut sp = spec();
        sp.hide_paths = vec!["/opt".into()];
        let s = render(&bwrap_args(&sp, &BTreeMap::new(), &host(), None, &FdArgs::default()).expect("plan"));
        assert!(!s.contains("/opt"), "{s}");
    }

    #[test]
    fn hidden_file_is_covered_with_dev_null() {
        let mut sp = spec();
        sp.hide_paths = vec!["/opt/gpuci/token".into()];
        let s = render(&bwrap_args(&sp, &BTreeMap::new(), &host(), None, &FdArgs::default()).expect("plan"));
        assert!(s.contains("--ro-bind /dev/null /opt/gpuci/token"), "{s}");
    }

    #[test]
    fn missing_leased_device_is_an_error_but_missing_common_is_not() {
        let mut sp = spec();
        sp.gpu_devices = vec!["/dev/nvidia7".into()];
        let e = bwrap_args(&sp, &BTreeMap::new(), &host(), None, &FdArgs::default()).expect_err("missing device");
        assert!(e.to_string().contains("/dev/nvidia7"), "{e}");
    }

    #[test]
    fn no_gpu_means_no_nvidia_nodes_and_no_pci_tree() {
        let mut sp = spec();
        sp.gpu_devices.clear();
        sp.network = crate::Network::Host;
        let s = render(&bwrap_args(&sp, &BTreeMap::new(), &host(), None, &FdArgs::default()).expect("plan"));
        assert!(!s.contains("nvidia"), "{s}");
        assert!(!s.contains("/sys/bus/pci"), "{s}");
        assert!(!s.contains("--unshare-net"), "{s}");
    }

    #[test]
    fn etc_view_replaces_the_per_entry_binds() {
        let binds = vec![PathBuf::from("/etc/ssl")];
        let view = EtcPlan { dir: Path::new("/run/gpuci-sandbox/etc.1.0"), binds: &binds };
        let s = render(&bwrap_args(&spec(), &BTreeMap::new(), &host(), Some(view), &FdArgs::default()).expect("plan"));
        assert!(
            s.contains("--ro-bind /opt /opt --ro-bind /run/gpuci-sandbox/etc.1.0 /etc --ro-bind /etc/ssl /etc/ssl --ro-bind /sys/"),
            "{s}"
        );
        assert!(!s.contains("/etc/passwd"), "{s}");
    }

    #[test]
    fn hide_path_in_etc_falls_back_to_per_entry_binds() {
        let binds = vec![PathBuf::from("/etc/ssl")];
        for hide in ["/etc/ssl/private", "/etc", "/"] {
            let mut sp = spec();
            sp.hide_paths = vec![hide.into()];
            let view = EtcPlan { dir: Path::new("/run/gpuci-sandbox/etc.1.0"), binds: &binds };
            let s = render(&bwrap_args(&sp, &BTreeMap::new(), &host(), Some(view), &FdArgs::default()).expect("plan"));
            assert!(!s.contains("/run/gpuci-sandbox"), "{hide}: {s}");
        }
    }
}
