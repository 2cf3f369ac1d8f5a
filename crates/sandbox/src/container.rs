//! `image:` jobs: the `podman run` / `docker run` command line for a [`SandboxSpec`].
//!
//! Only the argument vector is built here; the agent runs it (engines are not installed on every
//! host, and the engine, not this crate, then owns namespaces and cgroups). The same rules as the
//! bubblewrap sandbox apply: only the leased GPU nodes (`--device`), the workspace mounted at the
//! same path and used as the working directory, no network unless asked, all capabilities
//! dropped, `no-new-privileges`, the same seccomp filter (as an OCI profile the caller writes
//! with `crate::seccomp::oci_profile`), the same memory (no swap), pids and CPU limits, the
//! slot's network namespace, a read-only image with sized tmpfs scratch, and the job's
//! environment only. The environment goes through an `--env-file` the caller writes with
//! [`env_file_contents`] into a private (0600) file and deletes after start, because the engine
//! client's command line is world-readable. The container is named `gpuci-<job_id>` and labelled
//! `gpuci.job-id=<job_id>` so the agent can remove it ([`remove_argv`]) and a sweep can find
//! orphans; should the agent die first, the step's reaper removes it (`crate::reaper`).
//!
//! The step runs as `bash -eo pipefail -c SCRIPT` when the image has bash, else (busybox,
//! alpine) as `sh -e -c SCRIPT` with a note on stderr: see [`shell_argv`].
//!
//! Host set-up the engine itself may need (found running podman 4.3 as root in a VM without
//! `CAP_SYS_RESOURCE` on hybrid cgroups): crun refuses hybrid cgroups while a controller (e.g.
//! `hugetlb`) is still on the cgroup2 `unified` mount (mount it as v1:
//! `mount -t cgroup -o hugetlb cgroup /sys/fs/cgroup/hugetlb`), and root podman raises
//! `RLIMIT_NOFILE`/`RLIMIT_NPROC` to values such a host cannot grant (set `default_ulimits` under
//! `[containers]` in a `/etc/containers/containers.conf.d/*.conf` to limits the host allows).
//! Neither is passed on the command line here: on an ordinary host the engine's defaults work.
//!
//! Not done yet: CDI device names (`nvidia.com/gpu=<uuid>`) and the NVIDIA container toolkit's
//! driver-library injection; with plain `--device` the image must bring matching user-space
//! driver libraries.

use std::collections::BTreeMap;
use std::path::Path;

use crate::procscan::MARKER;
use crate::{validate_job_id, ContainerEngine, ContainerRuntime, SandboxError, SandboxSpec};

/// The name given to a job's container.
pub fn container_name(job_id: &str) -> String {
    format!("gpuci-{job_id}")
}

/// The argument vector (program first) that kills container `name` at once (SIGKILL, no grace
/// period: a job may ignore SIGTERM) and removes it with its anonymous volumes. The agent runs
/// it when a step ends, and the step's reaper (`crate::ContainerReaper`) when the agent is gone.
pub fn remove_argv(runtime: &ContainerRuntime, name: &str) -> Vec<String> {
    let mut a = vec![runtime.path.display().to_string(), "rm".into(), "--force".into()];
    if runtime.engine == ContainerEngine::Podman {
        // Docker's `rm --force` sends SIGKILL; podman's stops with SIGTERM and waits 10 s first.
        a.push("--time=0".into());
    }
    a.extend(["--volumes".into(), name.to_string()]);
    a
}

/// `KEY=VALUE` lines for `--env-file`, with the job-id marker added. Engines cannot represent
/// newlines in env-file values, so such a value is an error rather than a silently cut one.
pub fn env_file_contents(spec: &SandboxSpec) -> Result<String, SandboxError> {
    let mut env: BTreeMap<&str, &str> = spec.env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    env.insert(MARKER, &spec.job_id);
    let mut out = String::new();
    for (k, v) in env {
        if k.is_empty() || k.contains(['=', '\n', '\0']) || v.contains(['\n', '\0']) {
            return Err(SandboxError::InvalidSpec {
                job_id: spec.job_id.clone(),
                reason: format!(
                    "environment variable {k:?} cannot be passed to a container (a newline, NUL or '=' in it)"
                ),
            });
        }
        out.push_str(k);
        out.push('=');
        out.push_str(v);
        out.push('\n');
    }
    Ok(out)
}

/// Run `script` with bash (`-eo pipefail`) when the image has it, else with `sh -e`, saying so
/// on stderr. Whether an image has bash cannot be known before it runs, and a bare
/// "executable file `bash` not found" from the runtime would fail every busybox/alpine step.
pub fn shell_argv(script: &str) -> Vec<String> {
    const PICK: &str = "if command -v bash >/dev/null 2>&1; then exec bash -eo pipefail -c \"$1\"; fi; \
        echo 'gpuci: bash is not in this image; running the step with sh -e (no pipefail)' >&2; \
        exec sh -e -c \"$1\"";
    ["sh", "-c", PICK, "gpuci-step", script].iter().map(|s| s.to_string()).collect()
}

/// The full argument vector (program first) that runs `spec.argv` in `image`.
pub fn run_argv(
    runtime: &ContainerRuntime,
    image: &str,
    spec: &SandboxSpec,
    env_file: &Path,
    seccomp_profile: &Path,
    may_pull: bool,
) -> Result<Vec<String>, SandboxError> {
    validate_job_id(&spec.job_id)?;
    let invalid = |reason: String| SandboxError::InvalidSpec { job_id: spec.job_id.clone(), reason };
    // A registry reference only: a transport (`oci-archive:/path`) would have the engine, as
    // root, open a host path the job names.
    if let Err(why) = gpuci_core::image::check_reference(image) {
        return Err(invalid(format!("invalid image {image:?}: {why}")));
    }
    if spec.argv.is_empty() {
        return Err(invalid("argv is empty".to_string()));
    }
    let ws = spec.workspace.to_str().ok_or_else(|| invalid("workspace path is not UTF-8".to_string()))?;
    if ws.contains(',') || ws.contains(':') {
        return Err(invalid(format!("workspace {ws} contains ':' or ',' which break --volume")));
    }
    let mut a: Vec<String> = vec![runtime.path.display().to_string(), "run".into(), "--rm".into()];
    let mut push = |items: &[&str]| a.extend(items.iter().map(|s| s.to_string()));
    let name = container_name(&spec.job_id);
    let label = format!("gpuci.job-id={}", spec.job_id);
    // A pull is the engine's own work, as root, in the host's network: a job that names the
    // registry can have it fetch a 2.6 MB layer that unpacks to 2.5 GiB on the host's disk,
    // scan the host's loopback ports, or follow a redirect to any address (outsider attack).
    // Only a job the caller trusts pulls; the others run images already on the host.
    let pull = if may_pull { "--pull=missing" } else { "--pull=never" };
    push(&["--name", &name, "--label", &label, "--init", pull]);
    push(&["--cap-drop=ALL", "--security-opt=no-new-privileges", "--ipc=private"]);
    // gpuci's own filter (`crate::seccomp::oci_profile`), not the engine's default.
    push(&[&format!("--security-opt=seccomp={}", seccomp_profile.display())]);
    match &spec.network {
        crate::Network::None => push(&["--network=none"]),
        // The slot's own network namespace, as bubblewrap jobs get: never the engine's shared
        // bridge, where every container on the host reached every other (outsider attack).
        crate::Network::Namespace(fd) => match runtime.engine {
            ContainerEngine::Podman => {
                use std::os::fd::AsRawFd;
                push(&[&format!("--network=ns:/proc/{}/fd/{}", std::process::id(), fd.as_raw_fd())]);
            }
            ContainerEngine::Docker => {
                return Err(invalid(
                    "docker cannot join a job slot's network namespace (podman can): run image steps with \
                     podman, or give the step `network: none`"
                        .to_string(),
                ))
            }
        },
        crate::Network::Host => push(&["--network=host"]),
    }
    // Nothing of the job is written to the engine's storage on the host's disk, where no
    // quota holds (outsider attack: 3 GiB written to /tmp of an image, past a 2 GiB slot
    // disk): the image is read-only, and the places a job may write besides its workspace
    // are tmpfs, whose pages count against the job's memory limit.
    push(&["--read-only"]);
    // No logs kept by the engine (its log file is on the host's disk and grew at 100 MB/s
    // while gpuci cut the job's log at its cap; outsider attack): the output reaches the agent
    // through the attached client only.
    push(&["--log-driver=none"]);
    if runtime.engine == ContainerEngine::Podman {
        // An image's `VOLUME`s as tmpfs (memory), not anonymous volumes on the host's disk
        // that outlive the job (outsider attack: 3 GiB past a 2 GiB slot disk, left behind).
        push(&["--image-volume=tmpfs"]);
    }
    let scratch = spec.scratch_size.map_or(String::new(), |b| format!(",size={b}"));
    for dir in ["/tmp", "/var/tmp", "/run"] {
        push(&[&format!("--tmpfs={dir}:rw,nosuid,nodev,mode=1777{scratch}")]);
    }
    if let Some(u) = spec.user {
        // The job's process is the job user in the container too, never root.
        push(&[&format!("--user={}:{}", u.uid, u.gid)]);
    }
    if let Some(mem) = spec.resources.memory {
        // memory-swap equal to memory: no swap.
        push(&[&format!("--memory={}b", mem.0), &format!("--memory-swap={}b", mem.0)]);
    }
    if let Some(p) = spec.resources.pids {
        push(&[&format!("--pids-limit={p}")]);
    }
    if let Some(m) = spec.resources.cpu_millis {
        push(&[&format!("--cpus={}.{:03}", m / 1000, m % 1000)]);
    }
    if !spec.gpu_devices.is_empty() {
        for d in spec.gpu_devices.iter().chain(&spec.gpu_common_devices) {
            let src = d.to_str().ok_or_else(|| invalid(format!("device {} is not UTF-8", d.display())))?;
            let name = d.file_name().and_then(|n| n.to_str()).unwrap_or_default();
            push(&[&format!("--device={src}:/dev/{name}:rwm")]);
        }
    }
    push(&[&format!("--volume={ws}:{ws}:rw"), &format!("--workdir={ws}")]);
    push(&[&format!("--env-file={}", env_file.display()), "--", image]);
    a.extend(spec.argv.iter().cloned());
    Ok(a)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{ContainerEngine, Resources};
    use gpuci_core::quantity::Bytes;

    fn spec() -> SandboxSpec {
        let mut s =
            SandboxSpec::new("j7", "/var/lib/gpuci/work/j7", vec!["bash".into(), "-c".into(), "nvidia-smi".into()]);
        s.gpu_devices = vec!["/dev/nvidia1".into()];
        s.gpu_common_devices = vec!["/dev/nvidiactl".into(), "/dev/nvidia-uvm".into()];
        s.resources = Resources { memory: Some(Bytes::from_mib(8192)), cpu_millis: Some(1500), pids: Some(512) };
        s.env.insert("TOKEN".into(), "secret".into());
        s
    }

    #[test]
    fn podman_argv_has_only_leased_devices_limits_and_no_env_values() {
        let rt = ContainerRuntime { engine: ContainerEngine::Podman, path: "/usr/bin/podman".into() };
        let argv = run_argv(
            &rt,
            "ghcr.io/org/cuda:12",
            &spec(),
            Path::new("/run/gpuci/j7.env"),
            Path::new("/run/gpuci/j7.seccomp.json"),
            true,
        )
        .expect("argv");
        assert_eq!(
            argv.join(" "),
            "/usr/bin/podman run --rm --name gpuci-j7 --label gpuci.job-id=j7 --init --pull=missing \
             --cap-drop=ALL --security-opt=no-new-privileges --ipc=private \
             --security-opt=seccomp=/run/gpuci/j7.seccomp.json --network=none --read-only \
             --log-driver=none --image-volume=tmpfs \
             --tmpfs=/tmp:rw,nosuid,nodev,mode=1777 --tmpfs=/var/tmp:rw,nosuid,nodev,mode=1777 \
             --tmpfs=/run:rw,nosuid,nodev,mode=1777 \
             --memory=8589934592b --memory-swap=8589934592b --pids-limit=512 --cpus=1.500 \
             --device=/dev/nvidia1:/dev/nvidia1:rwm --device=/dev/nvidiactl:/dev/nvidiactl:rwm \
             --device=/dev/nvidia-uvm:/dev/nvidia-uvm:rwm \
             --volume=/var/lib/gpuci/work/j7:/var/lib/gpuci/work/j7:rw --workdir=/var/lib/gpuci/work/j7 \
             --env-file=/run/gpuci/j7.env -- ghcr.io/org/cuda:12 bash -c nvidia-smi"
        );
        assert!(!argv.iter().any(|a| a.contains("secret")));
    }

    /// Regression (outsider attack): with the slot's network, an image step got the engine's
    /// shared bridge, where jobs of other slots (and host services on 0.0.0.0) were reachable.
    /// Podman joins the slot's namespace; docker cannot, and says so.
    #[test]
    fn no_gpu_no_devices_and_the_slot_network() {
        let mut s = spec();
        s.gpu_devices.clear();
        let netns: std::os::fd::OwnedFd = std::fs::File::open("/dev/null").unwrap().into();
        let fd = std::os::fd::AsRawFd::as_raw_fd(&netns);
        s.network = crate::Network::Namespace(std::sync::Arc::new(netns));
        let podman = ContainerRuntime { engine: ContainerEngine::Podman, path: "/usr/bin/podman".into() };
        let argv = run_argv(&podman, "python:3.12", &s, Path::new("/x.env"), Path::new("/x.json"), true).expect("argv");
        assert!(!argv.iter().any(|a| a.starts_with("--device")), "{argv:?}");
        let joined = format!("--network=ns:/proc/{}/fd/{fd}", std::process::id());
        assert_eq!(argv.iter().filter(|a| a.starts_with("--network")).collect::<Vec<_>>(), vec![&joined]);
        let docker = ContainerRuntime { engine: ContainerEngine::Docker, path: "/usr/bin/docker".into() };
        let err = run_argv(&docker, "python:3.12", &s, Path::new("/x.env"), Path::new("/x.json"), true)
            .expect_err("docker cannot join");
        assert!(err.to_string().contains("network: none"), "{err}");
    }

    /// Regression (outsider attack): an image step wrote 3 GiB into the image's `/tmp`, on the
    /// engine's storage on the host's disk, past its 2 GiB slot disk. The image is read-only;
    /// its scratch directories are sized tmpfs (memory).
    #[test]
    fn the_image_is_read_only_and_its_scratch_is_sized_tmpfs() {
        let rt = ContainerRuntime { engine: ContainerEngine::Podman, path: "/usr/bin/podman".into() };
        let mut s = spec();
        s.scratch_size = Some(1 << 30);
        let argv = run_argv(&rt, "python:3.12", &s, Path::new("/x.env"), Path::new("/x.json"), true).expect("argv");
        assert!(argv.contains(&"--read-only".to_string()), "{argv:?}");
        for dir in ["/tmp", "/var/tmp", "/run"] {
            let tmpfs = format!("--tmpfs={dir}:rw,nosuid,nodev,mode=1777,size=1073741824");
            assert!(argv.contains(&tmpfs), "{tmpfs} missing: {argv:?}");
        }
    }

    #[test]
    fn shell_argv_uses_bash_when_present_else_sh() {
        let run = |path: &str| {
            let argv = shell_argv("echo start; false | true; echo after-pipe");
            let out = std::process::Command::new("/bin/sh")
                .args(&argv[1..])
                .env_clear()
                .env("PATH", path)
                .output()
                .expect("run sh");
            (
                out.status.code(),
                String::from_utf8_lossy(&out.stdout).into_owned(),
                String::from_utf8_lossy(&out.stderr).into_owned(),
            )
        };
        if Path::new("/bin/bash").exists() {
            // bash with pipefail: the failing pipe ends the script.
            assert_eq!(run("/bin:/usr/bin"), (Some(1), "start\n".to_string(), String::new()));
        }
        // No bash on PATH: sh -e runs it (no pipefail) and says so.
        let dir = tempfile::tempdir().expect("tempdir");
        std::os::unix::fs::symlink("/bin/sh", dir.path().join("sh")).expect("symlink");
        let (code, stdout, stderr) = run(dir.path().to_str().expect("utf-8"));
        assert_eq!((code, stdout.as_str()), (Some(0), "start\nafter-pipe\n"));
        assert!(stderr.contains("bash is not in this image"), "{stderr}");
    }

    #[test]
    fn removal_kills_at_once() {
        let podman = ContainerRuntime { engine: ContainerEngine::Podman, path: "/usr/bin/podman".into() };
        assert_eq!(
            remove_argv(&podman, "gpuci-j7").join(" "),
            "/usr/bin/podman rm --force --time=0 --volumes gpuci-j7"
        );
        let docker = ContainerRuntime { engine: ContainerEngine::Docker, path: "/usr/bin/docker".into() };
        assert_eq!(remove_argv(&docker, "gpuci-j7").join(" "), "/usr/bin/docker rm --force --volumes gpuci-j7");
    }

    #[test]
    fn only_a_trusted_job_pulls() {
        let rt = ContainerRuntime { engine: ContainerEngine::Podman, path: "/usr/bin/podman".into() };
        let argv = |trusted| run_argv(&rt, "python:3.12", &spec(), Path::new("/x.env"), Path::new("/x.json"), trusted);
        assert!(argv(true).expect("argv").contains(&"--pull=missing".to_string()));
        let untrusted = argv(false).expect("argv");
        assert!(untrusted.contains(&"--pull=never".to_string()) && !untrusted.contains(&"--pull=missing".to_string()));
    }

    #[test]
    fn image_that_looks_like_a_flag_is_rejected() {
        let rt = ContainerRuntime { engine: ContainerEngine::Docker, path: "/usr/bin/docker".into() };
        assert!(run_argv(&rt, "--privileged", &spec(), Path::new("/x.env"), Path::new("/x.json"), true).is_err());
    }

    #[test]
    fn env_file_has_marker_and_rejects_newlines() {
        let mut s = spec();
        assert_eq!(env_file_contents(&s).expect("env"), "GPUCI_SANDBOX_ID=j7\nTOKEN=secret\n");
        s.env.insert("BAD".into(), "a\nb".into());
        assert!(env_file_contents(&s).is_err());
    }
}
