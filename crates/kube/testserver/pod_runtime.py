#!/usr/bin/env python3
"""The test double's container runtime: what containerd and runc do to a container, acted out on
the host for one pod's first container. kube_api_server.py's kubelet starts it once per container
start; it is not meant to be run by hand.

    python -I -S pod_runtime.py SPEC_JSON STATUS_FD -- COMMAND [ARG...]

SPEC_JSON (the kubelet decides it from the pod spec, as the kubelet hands CRI a container config):
    {"home": dir, "hostname": str,
     "userns": null | {"base": first host id, "size": 65536},
     "masked_paths": [...], "readonly_paths": [...],   (empty for procMount: Unmasked)
     "capabilities": [names kept in the bounding set, e.g. "CAP_CHOWN"],
     "cgroups": [cgroup directories to join]}
STATUS_FD: a pipe to the kubelet. One line: `ok` once COMMAND is executing, or `error: <why>`
    when the container could not be made (the kubelet's StartError).

Three processes, each killed by the kernel when its parent dies (PR_SET_PDEATHSIG):
    shim   this process. Stays in the host's namespaces and cgroup: writes the user namespace's
           id maps, reports to the kubelet, relays SIGTERM and friends, and exits with the
           container's exit code (128+N for signal N).
    setup  joins the pod's cgroups; with a user namespace: a mount namespace of its own first
           (see _reachable_home), then unshare(CLONE_NEWUSER) and waits for its maps; then new
           mount, PID, UTS and IPC namespaces (owned by the user namespace when there is one).
    init   PID 1 of the new PID namespace: fresh /proc, its own /run and /dev/shm, masked and
           read-only paths, read-only /sys/fs/cgroup, hostname, capability bounding set; then
           execs COMMAND, which is PID 1 as in a container (it ignores signals it has no
           handler for; when it dies the kernel kills every process in the namespace, so nothing
           of the pod outlives it).

The network namespace is the host's (loopback reaches the test's coordinator). How each step
follows containerd and runc: README.md beside this file.
"""

from __future__ import annotations

import ctypes
import json
import os
import select
import signal
import sys
# Imported here, not lazily: inside a user namespace the interpreter's own directory (a root-only
# home such as ~root/.pyenv) may be unreadable. os.execvp needs it (os.get_exec_path).
import warnings  # noqa: F401

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000

MS_RDONLY = 0x1
MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_NOEXEC = 0x8
MS_REMOUNT = 0x20
MS_NOATIME = 0x400
MS_NODIRATIME = 0x800
MS_BIND = 0x1000
MS_REC = 0x4000
MS_PRIVATE = 0x40000
MS_RELATIME = 0x200000
MS_STRICTATIME = 0x1000000

PR_SET_PDEATHSIG = 1
PR_CAPBSET_DROP = 24
PR_CAP_AMBIENT = 47
PR_CAP_AMBIENT_CLEAR_ALL = 4
LINUX_CAPABILITY_VERSION_3 = 0x20080522

# capability(7) numbers, as runc resolves the OCI spec's names.
CAPS = ["CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_DAC_READ_SEARCH", "CAP_FOWNER", "CAP_FSETID",
        "CAP_KILL", "CAP_SETGID", "CAP_SETUID", "CAP_SETPCAP", "CAP_LINUX_IMMUTABLE",
        "CAP_NET_BIND_SERVICE", "CAP_NET_BROADCAST", "CAP_NET_ADMIN", "CAP_NET_RAW",
        "CAP_IPC_LOCK", "CAP_IPC_OWNER", "CAP_SYS_MODULE", "CAP_SYS_RAWIO", "CAP_SYS_CHROOT",
        "CAP_SYS_PTRACE", "CAP_SYS_PACCT", "CAP_SYS_ADMIN", "CAP_SYS_BOOT", "CAP_SYS_NICE",
        "CAP_SYS_RESOURCE", "CAP_SYS_TIME", "CAP_SYS_TTY_CONFIG", "CAP_MKNOD", "CAP_LEASE",
        "CAP_AUDIT_WRITE", "CAP_AUDIT_CONTROL", "CAP_SETFCAP", "CAP_MAC_OVERRIDE",
        "CAP_MAC_ADMIN", "CAP_SYSLOG", "CAP_WAKE_ALARM", "CAP_BLOCK_SUSPEND", "CAP_AUDIT_READ",
        "CAP_PERFMON", "CAP_BPF", "CAP_CHECKPOINT_RESTORE"]

RELAYED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
           signal.SIGUSR2)

LIBC = ctypes.CDLL(None, use_errno=True)


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                ("inheritable", ctypes.c_uint32)]


def _ok(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _b(text: str | None):
    return None if text is None else os.fsencode(text)


def mount(source: str | None, target: str, fstype: str | None, flags: int,
          data: str | None = None) -> None:
    _ok(LIBC.mount(_b(source), _b(target), _b(fstype), ctypes.c_ulong(flags), _b(data)),
        f"mount {source or fstype} on {target}")


def unshare(flags: int, what: str) -> None:
    _ok(LIBC.unshare(ctypes.c_int(flags)), f"unshare({what})")


def prctl(option: int, arg: int, arg3: int = 0) -> None:
    _ok(LIBC.prctl(ctypes.c_int(option), ctypes.c_ulong(arg), ctypes.c_ulong(arg3),
                   ctypes.c_ulong(0), ctypes.c_ulong(0)), f"prctl({option}, {arg})")


def die_with_parent(alive_fd: int) -> None:
    """PR_SET_PDEATHSIG, then make sure the parent did not die before it was set: the parent
    holds the only write end of `alive_fd`, so a hang-up there means it is gone."""
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    poller = select.poll()
    poller.register(alive_fd, select.POLLIN)
    if poller.poll(0):
        os._exit(137)
    os.close(alive_fd)


# -- the shim -------------------------------------------------------------------------------


_child: int | None = None
_pending: list[int] = []


def _relay(sig, _frame) -> None:
    """Passes a stop signal one level down, as the shim and runc pass the kubelet's to PID 1."""
    if _child is None:
        _pending.append(sig)
        return
    try:
        os.kill(_child, sig)
    except ProcessLookupError:
        pass


def _adopt(pid: int) -> None:
    global _child
    _child = pid
    while _pending:
        _relay(_pending.pop(0), None)


def _exit_code(status: int) -> int:
    return 128 + os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def _wait(pid: int) -> int:
    while True:
        try:
            _, status = os.waitpid(pid, 0)
            return _exit_code(status)
        except ChildProcessError:
            return 255


def main(argv: list[str]) -> int:
    if len(argv) < 4 or argv[2] != "--":
        print("usage: pod_runtime.py SPEC_JSON STATUS_FD -- COMMAND...", file=sys.stderr)
        return 2
    spec = json.loads(argv[0])
    status_fd = int(argv[1])
    command = argv[3:]
    os.set_inheritable(status_fd, False)
    for sig in RELAYED:
        signal.signal(sig, _relay)
    exec_r, exec_w = os.pipe()     # init -> shim: nothing (EOF at exec) or why it failed
    alive_r, alive_w = os.pipe()   # held open by the shim: the setup's PDEATHSIG check
    sync_r, sync_w = os.pipe()     # setup -> shim: "u" when its user namespace wants maps
    mapped_r, mapped_w = os.pipe()  # shim -> setup: "m" when the maps are written
    pid = os.fork()
    if pid == 0:
        _pending.clear()   # the shim relays those itself
        try:
            for fd in (exec_r, alive_w, sync_r, mapped_w, status_fd):
                os.close(fd)
            _setup(spec, command, exec_w, alive_r, sync_w, mapped_r)
        except BaseException as e:  # a forked child must never return into the shim's code
            _fail(exec_w, f"container setup: {e}")
        os._exit(128)
    _adopt(pid)
    for fd in (exec_w, alive_r, sync_w, mapped_r):
        os.close(fd)
    error = None
    if spec.get("userns") and os.read(sync_r, 1) == b"u":
        try:
            _write_id_maps(pid, spec["userns"])
            os.write(mapped_w, b"m")
        except OSError as e:
            error = f"writing the user namespace's id maps: {e}"
    os.close(sync_r)
    os.close(mapped_w)
    # EOF with nothing said: the command is executing (the pipe closed at exec). A setup or
    # init killed before that says nothing too; its exit status then tells the kubelet.
    chunks = []
    while chunk := os.read(exec_r, 4096):
        chunks.append(chunk)
    os.close(exec_r)
    error = error or b"".join(chunks).decode(errors="replace").strip() or None
    try:
        os.write(status_fd, b"ok\n" if error is None else f"error: {error}\n".encode())
    except OSError:
        pass
    os.close(status_fd)
    if error is not None:   # the kubelet writes it to the log, in runc's words
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        _wait(pid)
        return 128
    code = _wait(pid)
    os.close(alive_w)
    return code


def _write_id_maps(pid: int, userns: dict) -> None:
    """What a root-owned runtime writes for a pod of its own range (runc, as containerd asks):
    ids 0..size-1 inside are base.. on the host. As root in the parent namespace, setgroups
    need not be denied first."""
    line = f"0 {int(userns['base'])} {int(userns['size'])}\n"
    for name in ("uid_map", "gid_map"):
        with open(f"/proc/{pid}/{name}", "w") as f:
            f.write(line)


# -- the setup process ----------------------------------------------------------------------


def _fail(exec_w: int, message: str, code: int = 128) -> None:
    try:
        os.write(exec_w, message.encode())
    except OSError:
        pass
    os._exit(code)


def _setup(spec: dict, command: list[str], exec_w: int, alive_r: int, sync_w: int,
           mapped_r: int) -> None:
    try:
        die_with_parent(alive_r)
        for d in spec.get("cgroups") or []:
            # The container's processes in the pod's own cgroup before any of them exists. The
            # shim stays out of it, as containerd's shim stays out of the container's.
            with open(os.path.join(d, "cgroup.procs"), "w") as f:
                f.write(str(os.getpid()))
        userns = spec.get("userns")
        if userns:
            _reachable_home(spec["home"])
            unshare(CLONE_NEWUSER, "CLONE_NEWUSER")
            os.write(sync_w, b"u")
            if os.read(mapped_r, 1) != b"m":
                os._exit(128)   # the shim reports why
            os.setgroups([])
            os.setresgid(0, 0, 0)
            os.setresuid(0, 0, 0)
        os.close(sync_w)
        os.close(mapped_r)
        # Owned by the user namespace when there is one: its root may mount in it.
        unshare(CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWUTS | CLONE_NEWIPC,
                "CLONE_NEWNS|CLONE_NEWPID|CLONE_NEWUTS|CLONE_NEWIPC")
    except OSError as e:
        _fail(exec_w, f"container setup: {e}")
    alive_r2, alive_w2 = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(alive_w2)
            _init(spec, command, exec_w, alive_r2)
        except BaseException as e:
            _fail(exec_w, f"container init: {e}")
        os._exit(128)
    os.close(alive_r2)
    os.close(exec_w)
    _adopt(pid)
    code = _wait(pid)
    os.close(alive_w2)
    os._exit(code)


def _reachable_home(home: str) -> None:
    """The pod's home as its user namespace can reach it.

    Inside the user namespace, root is host uid `base`: directories on the way to the home that
    are closed to others (a test's 0700 temporary directory) cannot be crossed, and host-owned
    files are owned by nobody. The kubelet's answer is that a container never walks host paths:
    its volumes are mounted into its own root. Here the host's root is the container's, so a
    mount namespace of the setup's own (made while it is still host root) covers the first
    closed directory with a tmpfs that holds only the path down to the home, and binds the home
    there. Mounts made here are locked in the pod's namespace: it cannot uncover the directory.
    """
    unshare(CLONE_NEWNS, "CLONE_NEWNS")
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    home = os.path.realpath(home)
    parts = home.strip("/").split("/")
    closed = None
    for i in range(1, len(parts)):
        d = "/" + "/".join(parts[:i])
        if not os.stat(d).st_mode & 0o001:
            closed = d
            break
    if closed is None:
        return
    fd = os.open(home, os.O_PATH | os.O_DIRECTORY)
    try:
        mount("tmpfs", closed, "tmpfs", MS_NOSUID | MS_NODEV, "mode=755,size=64k")
        os.makedirs(home, mode=0o755, exist_ok=True)
        mount(f"/proc/self/fd/{fd}", home, None, MS_BIND | MS_REC)
    finally:
        os.close(fd)


# -- the container's init -------------------------------------------------------------------


def _init(spec: dict, command: list[str], exec_w: int, alive_r: int) -> None:
    try:
        die_with_parent(alive_r)
        for sig in RELAYED:
            signal.signal(sig, signal.SIG_DFL)
        # Python ignores these; a command must start with them at their defaults.
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
        signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
        # Nothing done in this namespace may reach the host's (runc: rootfsPropagation).
        mount(None, "/", None, MS_REC | MS_PRIVATE)
        mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
        # The container's own /run and /dev/shm: a container's /run is its image's and its
        # /dev/shm the pod's own tmpfs (64 MiB, the kubelet's default), never the host's. The
        # rest of the host's root is the container's (README: what the double does not do).
        mount("tmpfs", "/run", "tmpfs", MS_NOSUID | MS_NODEV, "mode=755,size=64m")
        mount("shm", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "mode=1777,size=64m")
        for path in spec.get("masked_paths") or []:
            _mask(path)
        for path in spec.get("readonly_paths") or []:
            _readonly(path)
        _readonly_cgroupfs()
        hostname = spec.get("hostname")
        if hostname:
            _ok(LIBC.sethostname(hostname.encode(), len(hostname.encode())), "sethostname")
        os.chdir(spec["home"])
        _capabilities(spec.get("capabilities") or [])
    except OSError as e:
        _fail(exec_w, f"container init: {e}")
    try:
        os.execvp(command[0], command)
    except OSError as e:
        # runc's words (exec.LookPath's for a bare name that is nowhere on PATH).
        why = ("executable file not found in $PATH" if e.errno == 2 and "/" not in command[0]
               else e.strerror or str(e))
        _fail(exec_w, f'exec: "{command[0]}": {why}')


def _mask(path: str) -> None:
    """runc's maskPath: /dev/null over a file, an empty read-only tmpfs over a directory,
    nothing where the path does not exist."""
    try:
        mount("/dev/null", path, None, MS_BIND)
    except OSError as e:
        if e.errno == 2:   # ENOENT
            return
        if e.errno != 20:  # ENOTDIR: a directory
            raise
        mount("tmpfs", path, "tmpfs", MS_RDONLY)


def _kept_flags(path: str) -> int:
    """The flags a read-only remount must repeat: a user namespace may not clear the ones it
    inherited locked (nosuid, nodev, noexec, the atime mode), as runc's readonlyPath keeps them."""
    f = os.statvfs(path).f_flag
    flags = 0
    for st, ms in ((os.ST_NOSUID, MS_NOSUID), (os.ST_NODEV, MS_NODEV), (os.ST_NOEXEC, MS_NOEXEC),
                   (os.ST_NOATIME, MS_NOATIME), (os.ST_NODIRATIME, MS_NODIRATIME),
                   (os.ST_RELATIME, MS_RELATIME)):
        if f & st:
            flags |= ms
    if not flags & (MS_NOATIME | MS_RELATIME):
        flags |= MS_STRICTATIME
    return flags


def _readonly(path: str) -> None:
    """runc's readonlyPath: bind the path onto itself, then remount that bind read-only."""
    try:
        mount(path, path, None, MS_BIND | MS_REC)
    except OSError as e:
        if e.errno == 2:
            return
        raise
    mount(None, path, None, MS_REMOUNT | MS_BIND | MS_RDONLY | _kept_flags(path))


def _readonly_cgroupfs() -> None:
    """/sys/fs/cgroup and every mount below it read-only, as a non-privileged container's
    cgroup mounts are (runc mounts them `ro` unless the container is privileged)."""
    with open("/proc/self/mountinfo") as f:
        points = [line.split()[4] for line in f]
    for p in points:
        p = p.replace("\\040", " ")
        if p == "/sys/fs/cgroup" or p.startswith("/sys/fs/cgroup/"):
            mount(None, p, None, MS_REMOUNT | MS_BIND | MS_RDONLY | _kept_flags(p))


def _capabilities(keep: list[str]) -> None:
    """The container's capability bounding set, an empty inheritable set and no ambient ones:
    the command (run as root) starts with exactly `keep` (runc's capabilities.bounding)."""
    wanted = {CAPS.index(c) for c in keep if c in CAPS}
    with open("/proc/sys/kernel/cap_last_cap") as f:
        last = int(f.read())
    for cap in range(last + 1):
        if cap not in wanted:
            prctl(PR_CAPBSET_DROP, cap)
    header = _CapHeader(LINUX_CAPABILITY_VERSION_3, 0)
    data = (_CapData * 2)()
    _ok(LIBC.capget(ctypes.byref(header), data), "capget")
    for d in data:
        d.inheritable = 0
    _ok(LIBC.capset(ctypes.byref(header), data), "capset")
    prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
