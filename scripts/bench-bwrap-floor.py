# Bare bwrap start-up floor (BENCHMARKS.md, "Hardened sandbox"): the same namespaces as a gpuci job (user as an unprivileged uid,
# pid, ipc, uts, net, cgroup), /usr read-only, fresh /proc /dev /tmp; runs `true`. N runs.
import os, subprocess, sys, time, statistics
n = int(sys.argv[1]) if len(sys.argv) > 1 else 200
uid = 1500000250
def run(cmd):
    t = time.perf_counter(); subprocess.run(cmd, check=True); return (time.perf_counter() - t) * 1000
base = ["bwrap", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-net", "--unshare-cgroup-try",
        "--ro-bind", "/usr", "/usr", "--symlink", "usr/bin", "/bin", "--symlink", "usr/lib", "/lib", "--symlink", "usr/lib64", "/lib64",
        "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp", "--die-with-parent", "--new-session", "--cap-drop", "ALL", "true"]
modes = {
    "root bwrap (before: jobs as root)": base,
    "bwrap as job uid + user namespace (after)": ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", base[0], "--unshare-user"] + base[1:],
}
res = {k: [] for k in modes}
for i in range(n):                     # interleaved, so load affects both alike
    for k, cmd in modes.items():
        res[k].append(run(cmd))
for k, v in res.items():
    v.sort()
    print(f"{k}: p50 {v[len(v)//2]:.1f} ms  p99 {v[int(len(v)*0.99)-1]:.1f} ms  (n={n})")
