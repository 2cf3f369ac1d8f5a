#!/usr/bin/env python3
"""Self-check for kube_api_server.py: starts it, drives it with urllib, stops it.

Run with the interpreter that has kubernetes-validate installed:
    /var/tmp/gpuci-kube-venv/bin/python selfcheck.py
Exits 0 when every check passes; kills every process it started either way.
"""

from __future__ import annotations

import base64
import json
import re
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
SERVER = os.path.join(HERE, "kube_api_server.py")
TOKEN = "selfcheck-token"
NS = "ci"
STARTED = time.monotonic()
BUDGET = 28.0
NODES = [
    {"name": "gpu-a", "labels": {"pool": "gpu"}, "gpus": 4, "cpu": "16", "memory": "64Gi",
     "taints": [{"key": "nvidia.com/gpu", "value": "true", "effect": "NoSchedule"}]},
    {"name": "gpu-b", "labels": {"pool": "gpu"}, "gpus": 1, "cpu": "8", "memory": "32Gi",
     "taints": [{"key": "nvidia.com/gpu", "value": "true", "effect": "NoSchedule"}]},
    {"name": "cpu-a", "labels": {"pool": "cpu"}, "cpu": "8", "memory": "32Gi"},
]
GPU_TOLERATION = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
STARTED_PROCS: list[subprocess.Popen] = []


def check(cond, what: str, detail=None) -> None:
    if not cond:
        raise AssertionError(what + (f": {json.dumps(detail)[:1500]}" if detail is not None else ""))


def wait_for(fn, what: str, timeout: float = 5.0):
    end = min(time.monotonic() + timeout, STARTED + BUDGET)
    last = None
    while time.monotonic() < end:
        last = fn()
        if last:
            return last
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}; last: {json.dumps(last)[:1500]}")


class Api:
    def __init__(self, port: int):
        self.base = f"http://127.0.0.1:{port}"

    def call(self, method: str, path: str, body=None, ctype="application/json", token=TOKEN,
             raw=False):
        data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.base + path, data=data, method=method)
        if token:
            req.add_header("Authorization", f"Bearer {token}")
        if data is not None:
            req.add_header("Content-Type", ctype)
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                code, text = resp.status, resp.read()
        except urllib.error.HTTPError as e:
            code, text = e.code, e.read()
        return code, (text.decode() if raw else json.loads(text))

    def pod(self, name: str):
        return self.call("GET", f"/api/v1/namespaces/{NS}/pods/{name}")[1]

    def create_pod(self, name: str, command: list[str], gpus: int = 0, **spec):
        container = {"name": "main", "image": "ghcr.io/example/job:1", "command": command}
        if gpus:
            container["resources"] = {"limits": {"nvidia.com/gpu": gpus}}
            spec.setdefault("tolerations", GPU_TOLERATION)
        env = spec.pop("env", None)
        if env:
            container["env"] = env
        spec.setdefault("restartPolicy", "Never")
        body = {"apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": name, "labels": spec.pop("labels", {"app": "selfcheck"})},
                "spec": {"containers": [container], **spec}}
        code, obj = self.call("POST", f"/api/v1/namespaces/{NS}/pods", body)
        check(code == 201, f"create pod {name} answers 201", obj)
        return obj

    def watch(self, path: str) -> list[dict]:
        """Collects the events of a watch stream in a background thread."""
        events: list[dict] = []
        req = urllib.request.Request(self.base + path,
                                     headers={"Authorization": f"Bearer {TOKEN}"})
        resp = urllib.request.urlopen(req, timeout=30)
        check(resp.headers.get("Transfer-Encoding") == "chunked", "watch is chunked")

        def read():
            try:
                for line in resp:
                    events.append(json.loads(line))
            except (OSError, ValueError):
                pass

        threading.Thread(target=read, daemon=True).start()
        return events


def start_server(tmp: str, name: str, *extra: str) -> tuple[subprocess.Popen, Api]:
    nodes = os.path.join(tmp, "nodes.json")
    with open(nodes, "w") as f:
        json.dump(NODES, f)
    err = open(os.path.join(tmp, f"{name}.stderr"), "w")
    proc = subprocess.Popen([sys.executable, SERVER, "--port", "0", "--token", TOKEN,
                             "--nodes", nodes, "--log-dir", os.path.join(tmp, name), *extra],
                            stdout=subprocess.PIPE, stderr=err)
    STARTED_PROCS.append(proc)
    ready, _, _ = select.select([proc.stdout], [], [], 15)
    check(ready, f"{name} server prints its address")
    line = proc.stdout.readline().decode()
    check(line.startswith("listening on 127.0.0.1:"), "first stdout line", line)
    return proc, Api(int(line.rsplit(":", 1)[1]))


def stop_server(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError("server did not exit within 5 s of SIGTERM") from None
    check(code == 0, "server exits 0 on SIGTERM", code)
    check(proc.stdout.read() == b"", "stdout carries only the listening line")


def pod_pids(marker: str) -> list[int]:
    """Host pids of the processes whose environment carries SELFCHECK_POD=<marker>: a pod's
    processes as the host sees them (inside its PID namespace, its command is PID 1)."""
    want = f"SELFCHECK_POD={marker}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if want in f.read().split(b"\0") and pid_alive(int(entry)):
                    found.append(int(entry))
        except OSError:
            pass
    return found


def pid_alive(pid: int) -> bool:
    """True while the process exists and is not a zombie (PID 1 may be slow to reap)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def main_checks(tmp: str) -> None:
    proc, api = start_server(tmp, "main")
    pods = f"/api/v1/namespaces/{NS}/pods"
    secrets = f"/api/v1/namespaces/{NS}/secrets"

    # auth, version, discovery, nodes
    code, body = api.call("GET", "/api/v1/pods", token=None)
    check(code == 401 and body["reason"] == "Unauthorized" and body["kind"] == "Status",
          "401 without a token", body)
    check(api.call("GET", "/version")[1]["gitVersion"] == "v1.30.0", "version")
    names = {r["name"] for r in api.call("GET", "/api/v1")[1]["resources"]}
    check({"pods", "pods/log", "secrets", "nodes"} <= names, "discovery lists resources", names)
    nodes = api.call("GET", "/api/v1/nodes")[1]
    caps = {n["metadata"]["name"]: n["status"]["capacity"].get("nvidia.com/gpu") for n in nodes["items"]}
    check(caps == {"gpu-a": "4", "gpu-b": "1", "cpu-a": None}, "node GPU capacity", caps)

    listing = api.call("GET", pods)[1]
    check(listing["kind"] == "PodList" and listing["items"] == [], "empty PodList", listing)
    events = api.watch(f"{pods}?watch=true&resourceVersion={listing['metadata']['resourceVersion']}"
                       "&allowWatchBookmarks=true&timeoutSeconds=25")

    # secrets: create, 409, 422
    code, secret = api.call("POST", secrets, {"apiVersion": "v1", "kind": "Secret",
                                              "metadata": {"name": "creds"},
                                              "stringData": {"token": "s3cret"}})
    check(code == 201 and secret["data"] == {"token": base64.b64encode(b"s3cret").decode()}
          and "stringData" not in secret and secret["type"] == "Opaque", "secret created", secret)
    code, body = api.call("POST", secrets, {"metadata": {"name": "creds"}, "data": {}})
    check(code == 409 and body == {"kind": "Status", "apiVersion": "v1", "metadata": {},
                                   "status": "Failure", "message": 'secrets "creds" already exists',
                                   "reason": "AlreadyExists",
                                   "details": {"name": "creds", "kind": "secrets"}, "code": 409},
          "409 AlreadyExists", body)
    code, body = api.call("POST", secrets, {"metadata": {"name": "bad"}, "data": {"k": "!!"}})
    check(code == 422 and body["reason"] == "Invalid"
          and body["details"]["causes"][0]["field"] == "data[k]", "422 for bad base64", body)

    # pod validation
    bad = {"metadata": {"name": "bad"}, "spec": {"containers": [
        {"name": "main", "image": "x", "resources": {"limits": {"nvidia.com/gpu": 1},
                                                     "requests": {"nvidia.com/gpu": 2}}}]}}
    code, body = api.call("POST", pods, bad)
    check(code == 422 and body["message"].startswith('Pod "bad" is invalid: ')
          and body["details"]["causes"][0]["field"] == "spec.containers[0].resources.requests[nvidia.com/gpu]",
          "422 for GPU requests != limits", body)
    bad["spec"]["containers"][0] = {"name": "main", "image": "x", "bogus": 1}
    code, body = api.call("POST", pods, bad)
    check(code == 422 and body["details"]["causes"][0]["field"] == "spec.containers[0].bogus",
          "422 for an unknown field (strict schema)", body)
    code, body = api.call("POST", pods, b"{not json")
    check(code == 400 and body["reason"] == "BadRequest", "400 for malformed JSON", body)
    code, body = api.call("GET", pods + "?labelSelector=a%20in%20(")
    check(code == 400 and body["reason"] == "BadRequest", "400 for a bad labelSelector", body)
    code, body = api.call("GET", pods + "/nope")
    check(code == 404 and body["message"] == 'pods "nope" not found', "404 NotFound", body)
    code, body = api.call("POST", "/api/v1/nodes", {"metadata": {"name": "x"}})
    check(code == 405 and body["reason"] == "MethodNotAllowed", "405 on read-only nodes", body)

    # scheduling failures
    api.create_pod("no-fit", ["true"], gpus=8)
    body = {"metadata": {"name": "no-toleration"}, "spec": {"nodeSelector": {"pool": "gpu"},
            "containers": [{"name": "main", "image": "x", "resources": {"limits": {"nvidia.com/gpu": 1}}}]}}
    check(api.call("POST", pods, body)[0] == 201, "create no-toleration")

    def scheduled_condition(name):
        conds = api.pod(name)["status"].get("conditions") or []
        return next((c for c in conds if c["type"] == "PodScheduled"), None)

    cond = wait_for(lambda: scheduled_condition("no-fit"), "no-fit Unschedulable")
    check(cond["status"] == "False" and cond["reason"] == "Unschedulable" and cond["message"] ==
          "0/3 nodes are available: 3 Insufficient nvidia.com/gpu. preemption: 0/3 nodes are "
          "available: 3 No preemption victims found for incoming pod.", "insufficient GPUs", cond)
    cond = wait_for(lambda: scheduled_condition("no-toleration"), "no-toleration Unschedulable")
    check(cond["message"] == "0/3 nodes are available: 1 node(s) didn't match Pod's node "
          "affinity/selector, 2 node(s) had untolerated taint {nvidia.com/gpu: true}. preemption: "
          "0/3 nodes are available: 3 Preemption is not helpful for scheduling.",
          "taint and selector", cond)
    for name in ("no-fit", "no-toleration"):
        code, body = api.call("DELETE", f"{pods}/{name}")
        check(code == 200 and body["kind"] == "Pod", f"delete pending {name}", body)

    # a GPU pod runs to completion with its secret, GPUs and downward API
    api.create_pod("gpu-job", ["sh", "-c", 'echo "gpus=$NVIDIA_VISIBLE_DEVICES secret=$MY_SECRET '
                               'pod=$POD_NAME port=$KUBERNETES_SERVICE_PORT"'], gpus=2,
                   env=[{"name": "MY_SECRET", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "token"}}},
                        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}])
    pod = wait_for(lambda: (p := api.pod("gpu-job"))["status"]["phase"] == "Succeeded" and p,
                   "gpu-job Succeeded")
    gpus = pod["metadata"]["annotations"]["testserver.gpuci/gpus"]
    term = pod["status"]["containerStatuses"][0]["state"]["terminated"]
    check(len(gpus.split(",")) == 2 and term["exitCode"] == 0 and term["reason"] == "Completed",
          "gpu-job terminated", pod["status"])
    log = api.call("GET", f"{pods}/gpu-job/log", raw=True)[1]
    check(log.strip() == f"gpus={gpus} secret=s3cret pod=gpu-job port={api.base.rsplit(':', 1)[1]}",
          "gpu-job log", log)
    api.create_pod("fails", ["sh", "-c", "exit 3"])
    pod = wait_for(lambda: (p := api.pod("fails"))["status"]["phase"] == "Failed" and p, "fails")
    term = pod["status"]["containerStatuses"][0]["state"]["terminated"]
    check(term["exitCode"] == 3 and term["reason"] == "Error", "exit code 3", term)

    # a missing secret holds the container until it exists
    api.create_pod("needs-secret", ["sh", "-c", "echo $LATER"],
                   env=[{"name": "LATER", "valueFrom": {"secretKeyRef": {"name": "later", "key": "v"}}}])

    def waiting(name):
        st = api.pod(name)["status"].get("containerStatuses") or [{}]
        return st[0].get("state", {}).get("waiting")

    w = wait_for(lambda: (w := waiting("needs-secret")) and w["reason"] == "CreateContainerConfigError" and w,
                 "CreateContainerConfigError")
    check(w["message"] == 'secret "later" not found', "missing secret message", w)
    api.call("POST", secrets, {"metadata": {"name": "later"}, "stringData": {"v": "now"}})
    wait_for(lambda: api.pod("needs-secret")["status"]["phase"] == "Succeeded", "needs-secret runs")
    body = {"metadata": {"name": "bad-image"}, "spec": {"restartPolicy": "Never", "containers": [
        {"name": "main", "image": "registry.example/does-not-exist:1", "command": ["true"]}]}}
    api.call("POST", pods, body)
    wait_for(lambda: (w := waiting("bad-image")) and w["reason"] == "ImagePullBackOff", "ImagePullBackOff")

    # long-running GPU pods: never sharing a GPU; delete, evict, node loss.
    # (The kubelet expands $(VAR) and turns $$ into $ in command/args, so a shell $$ is $$$$.)
    loop = ["sh", "-c", 'trap "echo got TERM; exit 0" TERM; echo pid=$$$$; while :; do sleep 0.05; done']
    a = api.create_pod("runner-a", loop, gpus=2)
    api.create_pod("runner-b", loop, gpus=2)
    api.create_pod("runner-c", loop, gpus=1)
    for name in ("runner-a", "runner-b", "runner-c"):
        wait_for(lambda: api.pod(name)["status"]["phase"] == "Running", f"{name} Running")
    placed = {n: (p["spec"]["nodeName"], p["metadata"]["annotations"]["testserver.gpuci/gpus"])
              for n in ("runner-a", "runner-b", "runner-c") for p in [api.pod(n)]}
    check(placed["runner-a"][0] == placed["runner-b"][0] == "gpu-a" and placed["runner-c"][0] == "gpu-b"
          and not set(placed["runner-a"][1].split(",")) & set(placed["runner-b"][1].split(",")),
          "placement and disjoint GPUs", placed)
    owned = {"metadata": {"name": "runner-a-token", "ownerReferences": [
        {"apiVersion": "v1", "kind": "Pod", "name": "runner-a", "uid": a["metadata"]["uid"]}]},
        "stringData": {"t": "x"}}
    check(api.call("POST", secrets, owned)[0] == 201, "owned secret created")
    code, body = api.call("PATCH", f"{pods}/runner-a", {"metadata": {"labels": {"patched": "yes"}}},
                          ctype="application/merge-patch+json")
    check(code == 200 and body["metadata"]["labels"]["patched"] == "yes", "merge patch", body)

    code, body = api.call("DELETE", f"{pods}/runner-a", {"kind": "DeleteOptions",
                                                         "apiVersion": "v1", "gracePeriodSeconds": 5})
    check(code == 200 and body["metadata"].get("deletionTimestamp")
          and body["metadata"]["deletionGracePeriodSeconds"] == 5, "graceful delete", body)
    wait_for(lambda: api.call("GET", f"{pods}/runner-a")[0] == 404, "runner-a removed")
    check("got TERM" in open(os.path.join(tmp, "main", f"{NS}_runner-a.log")).read(), "SIGTERM seen")
    wait_for(lambda: api.call("GET", f"{secrets}/runner-a-token")[0] == 404, "owned secret collected")

    code, body = api.call("POST", f"/_test/evict/{NS}/runner-b")
    check(code == 200, "evict answers 200", body)
    pod = wait_for(lambda: (p := api.pod("runner-b"))["status"]["phase"] == "Failed" and p, "evicted")
    check(pod["status"]["reason"] == "Evicted"
          and pod["status"]["message"] == "The node was low on resource: memory. ", "eviction", pod["status"])

    code, body = api.call("DELETE", "/_test/nodes/gpu-b")
    check(code == 200, "node removed", body)
    wait_for(lambda: api.call("GET", f"{pods}/runner-c")[0] == 404, "runner-c deleted with its node")
    check(len(api.call("GET", "/api/v1/nodes")[1]["items"]) == 2, "two nodes left")

    # selectors and pagination
    running = api.call("GET", f"{pods}?fieldSelector=status.phase%3DSucceeded")[1]["items"]
    check(sorted(p["metadata"]["name"] for p in running) == ["gpu-job", "needs-secret"],
          "fieldSelector", [p["metadata"]["name"] for p in running])
    unlabelled = api.call("GET", f"{pods}?labelSelector=app%20notin%20(selfcheck)")[1]["items"]
    check([p["metadata"]["name"] for p in unlabelled] == ["bad-image"], "labelSelector notin",
          [p["metadata"]["name"] for p in unlabelled])
    page = api.call("GET", f"{pods}?limit=2")[1]
    rest = api.call("GET", f"{pods}?limit=100&continue={page['metadata']['continue']}")[1]
    all_names = [p["metadata"]["name"] for p in api.call("GET", pods)[1]["items"]]
    check([p["metadata"]["name"] for p in page["items"] + rest["items"]] == all_names
          and "continue" not in rest["metadata"], "limit/continue pagination", page["metadata"])

    # the watch saw it all
    wait_for(lambda: any(e["type"] == "BOOKMARK" for e in events), "a bookmark")
    seen = [(e["type"], e["object"]["metadata"]["name"]) for e in events if e["type"] != "BOOKMARK"]
    for expected in [("ADDED", "gpu-job"), ("MODIFIED", "gpu-job"), ("DELETED", "runner-a"),
                     ("DELETED", "runner-c")]:
        check(expected in seen, f"watch saw {expected}", seen)
    lost = [e["object"]["status"].get("reason") for e in events
            if e["type"] == "MODIFIED" and e["object"]["metadata"]["name"] == "runner-c"]
    check("NodeLost" in lost, "runner-c marked NodeLost before deletion", lost)
    rvs = [int(e["object"]["metadata"]["resourceVersion"]) for e in events]
    check(rvs == sorted(rvs), "watch resourceVersions increase", rvs)
    requests = api.call("GET", "/_test/requests")[1]
    check({"verb": "watch", "resource": "pods", "subresource": None, "namespace": NS, "code": 200}.items()
          <= next(r for r in requests if r["verb"] == "watch").items(), "requests log", requests[:3])
    check(any(r["subresource"] == "log" and r["verb"] == "get" for r in requests), "log request recorded")

    # shutting down kills the pods it started
    api.create_pod("survivor", ["sh", "-c", "echo pid=$$$$; exec sleep 300"],
                   env=[{"name": "SELFCHECK_POD", "value": "survivor"}])
    wait_for(lambda: api.pod("survivor")["status"]["phase"] == "Running", "survivor Running")
    log = wait_for(lambda: api.call("GET", f"{pods}/survivor/log", raw=True)[1], "survivor log")
    check(log.strip() == "pid=1", "the pod's command is PID 1 of its own PID namespace", log)
    alive = pod_pids("survivor")
    check(alive, "survivor is alive before shutdown")
    stop_server(proc)
    check(not [p for p in alive if pid_alive(p)], f"pod processes {alive} killed at shutdown")


# What a pod's command reports about the container it runs in. (`$$$$` is the shell's `$$`
# after the kubelet's expansion; `$(...)` naming no variable is left as it is.)
PROBE = r"""
echo pid=$$$$
echo uid=$(id -u)
echo hostname=$(cat /proc/sys/kernel/hostname)
echo map=$(cat /proc/self/uid_map)
echo capbnd=$(grep CapBnd /proc/self/status | cut -f2)
echo masks=$(awk '$5 ~ "^/(proc|sys)/" && $5 !~ "^/sys/fs/cgroup" {n++} END {print n+0}' /proc/self/mountinfo)
echo timer_list=$(cat /proc/timer_list 2>/dev/null | wc -c)
echo proc_sys=$(awk '$5 == "/proc/sys" {print substr($6, 1, 2)}' /proc/self/mountinfo)
echo cgroupfs_rw=$(awk '$5 ~ "^/sys/fs/cgroup" && $6 !~ "^ro" {n++} END {print n+0}' /proc/self/mountinfo)
memcg=$(awk -F: '$2 ~ /(^|,)memory(,|$)/ {print $3}' /proc/self/cgroup)
if [ -n "$memcg" ]; then cgdir=/sys/fs/cgroup/memory$memcg; limit=memory.limit_in_bytes
else memcg=$(awk -F: '$1 == "0" {print $3}' /proc/self/cgroup); cgdir=/sys/fs/cgroup$memcg; limit=memory.max; fi
echo memcg=$memcg
echo memlimit=$(cat $cgdir/$limit)
mkdir $cgdir/probe 2>/dev/null && rmdir $cgdir/probe && echo cgroup_writable=yes || echo cgroup_writable=no
touch "$HOME/probe" && echo home=$(stat -c %u "$HOME")
if command -v bwrap >/dev/null; then
  bwrap --unshare-all --ro-bind / / --proc /proc --dev /dev true && echo bwrap=ok || echo bwrap=failed
  if command -v setpriv >/dev/null; then
    setpriv --reuid 60000 --regid 60000 --clear-groups bwrap --unshare-all --ro-bind / / --proc /proc --dev /dev true && echo bwrap60000=ok || echo bwrap60000=failed
  fi
fi
echo done
"""
CAP_SYS_ADMIN, CAP_MKNOD, CAP_SYS_PTRACE = 21, 27, 19


def probe_report(api: Api, name: str) -> dict:
    pod = wait_for(lambda: (p := api.pod(name))["status"]["phase"] in ("Succeeded", "Failed") and p,
                   f"{name} finished", timeout=15)
    log = api.call("GET", f"/api/v1/namespaces/{NS}/pods/{name}/log", raw=True)[1]
    check(pod["status"]["phase"] == "Succeeded" and "done" in log, f"{name} ran its probe", log)
    out = dict(line.split("=", 1) for line in log.splitlines() if "=" in line)
    out["log"] = log
    return out


def runtime_checks(tmp: str) -> None:
    """The kubelet acts out the container runtime's security settings (README: Containers)."""
    if os.geteuid() != 0:
        print("note: not root, so pods are plain processes; container checks skipped", file=sys.stderr)
        return
    proc, api = start_server(tmp, "runtime")
    pods = f"/api/v1/namespaces/{NS}/pods"
    stderr = open(os.path.join(tmp, "runtime.stderr")).read()
    cgroups = "pod cgroups (memory limit, pids) under" in stderr
    if not cgroups:
        print("note: this host's cgroups are not writable; pod memory limits not checked",
              file=sys.stderr)
    bwrap = shutil.which("bwrap") is not None
    if not bwrap:
        print("note: bubblewrap is not installed; nested sandboxes not checked", file=sys.stderr)
    host_mounts = open("/proc/self/mountinfo").read()
    # Mounts under /proc and /sys (but cgroupfs) the host has already: a pod sees them too.
    host_masks = sum(1 for line in host_mounts.splitlines()
                     if re.match(r"/(proc|sys)/", line.split()[4])
                     and not line.split()[4].startswith("/sys/fs/cgroup"))
    limits = {"limits": {"memory": "64Mi"}}

    def create(name, command, host_users=None, sc=None, env=None):
        container = {"name": "main", "image": "x", "command": command, "resources": limits,
                     "env": env or []}
        if sc is not None:
            container["securityContext"] = sc
        spec = {"restartPolicy": "Never", "containers": [container]}
        if host_users is not None:
            spec["hostUsers"] = host_users
        return api.call("POST", pods, {"metadata": {"name": name}, "spec": spec})

    # procMount: Unmasked needs a user namespace of the pod's own, as the API server says.
    for host_users in (None, True):
        code, body = create("unmasked-on-host", ["true"], host_users, {"procMount": "Unmasked"})
        check(code == 422 and body["reason"] == "Invalid" and body["message"] ==
              'Pod "unmasked-on-host" is invalid: spec.containers[0].securityContext.procMount: '
              'Invalid value: "Unmasked": `hostUsers` must be false to use `Unmasked`'
              and body["details"]["causes"][0]["field"] == "spec.containers[0].securityContext.procMount",
              f"422 for procMount Unmasked with hostUsers {host_users}", body)

    body = {"metadata": {"name": "userns-host-net"}, "spec": {"hostUsers": False, "hostNetwork": True,
            "containers": [{"name": "main", "image": "x"}]}}
    code, body = api.call("POST", pods, body)
    check(code == 422 and body["message"] == 'Pod "userns-host-net" is invalid: spec.hostNetwork: '
          'Forbidden: when `pod.Spec.HostUsers` is false', "422 for hostUsers false with hostNetwork", body)

    # The fields gpuci's pods use pass the schema of the version the server validates.
    userns_sc = {"procMount": "Unmasked", "capabilities": {"add": ["SYS_ADMIN"]},
                 "seccompProfile": {"type": "RuntimeDefault"}, "appArmorProfile": {"type": "Unconfined"}}
    for name, host_users, sc in (("masked", None, None), ("userns", False, userns_sc),
                                 ("plain", None, {"privileged": True})):
        code, body = create(name, ["sh", "-c", PROBE], host_users, sc)
        check(code == 201, f"create {name}", body)
    code, body = create("no-such", ["no-such-command-anywhere"])
    check(code == 201, "create no-such", body)

    # Default: namespaces, masked and read-only /proc paths, read-only cgroupfs, a default
    # container's bounding set; a nested sandbox cannot have a /proc of its own.
    m = probe_report(api, "masked")
    caps = int(m["capbnd"], 16)
    check(m["pid"] == "1" and m["uid"] == "0" and m["hostname"] == "masked"
          and m["map"].split() == ["0", "0", "4294967295"], "masked: namespaces", m)
    check(not caps & (1 << CAP_SYS_ADMIN) and not caps & (1 << CAP_SYS_PTRACE)
          and caps & (1 << CAP_MKNOD), "masked: a default container's bounding set", m)
    check(int(m["masks"]) > host_masks and m["proc_sys"] == "ro" and m["cgroupfs_rw"] == "0"
          and m["cgroup_writable"] == "no", "masked: masked and read-only paths", m)
    if os.path.exists("/proc/timer_list"):
        check(m["timer_list"] == "0", "masked: /proc/timer_list reads empty", m)
    if bwrap:
        check(m["bwrap"] == "failed" and "Can't mount proc on /newroot/proc: Operation not permitted"
              in m["log"], "masked: bwrap cannot mount a fresh /proc", m)
    if cgroups:
        check(m["memlimit"] == str(64 << 20) and m["memcg"].endswith("/kube-double/" +
              api.pod("masked")["metadata"]["uid"]), "masked: the pod's own memory cgroup", m)

    # hostUsers: false and procMount: Unmasked: root in a user namespace of the pod's own, no
    # masks; a nested sandbox works as root and as a mapped uid.
    u = probe_report(api, "userns")
    first, base, size = (int(x) for x in u["map"].split())
    check(u["pid"] == "1" and u["uid"] == "0" and first == 0 and size == 65536
          and base >= 100000 and (base - 100000) % 65536 == 0, "userns: its own id range", u)
    check(int(u["capbnd"], 16) & (1 << CAP_SYS_ADMIN) and u["masks"] == str(host_masks)
          and u["proc_sys"] != "ro", "userns: SYS_ADMIN added, nothing masked", u)
    check(u["home"] == "0" and u["cgroup_writable"] == "no" and u["cgroupfs_rw"] == "0",
          "userns: owns its home, not the cgroupfs", u)
    if bwrap:
        check(u["bwrap"] == "ok" and u.get("bwrap60000", "ok") == "ok", "userns: bwrap works", u)
    if cgroups:
        check(u["memlimit"] == str(64 << 20), "userns: the pod's own memory cgroup", u)

    # privileged: a plain process on the host, in its cgroup.
    pl = probe_report(api, "plain")
    check(pl["pid"] != "1" and pl["map"].split() == ["0", "0", "4294967295"] and pl["masks"] == str(host_masks)
          and int(pl["capbnd"], 16) & (1 << CAP_SYS_ADMIN), "privileged: a plain process", pl)
    if cgroups:
        check(pl["memlimit"] == str(64 << 20), "privileged: the pod's own memory cgroup", pl)

    finished = [api.pod(n)["metadata"]["uid"] for n in ("masked", "userns", "plain")]
    cg = [os.path.join(b, uid) for b in pod_cgroup_bases(stderr) for uid in finished]
    wait_for(lambda: not [d for d in cg if os.path.exists(d)], "finished pods' cgroups removed")
    pod = wait_for(lambda: (p := api.pod("no-such"))["status"]["phase"] == "Failed" and p, "no-such fails")
    term = pod["status"]["containerStatuses"][0]["state"]["terminated"]
    check(term["reason"] == "StartError" and term["exitCode"] == 128 and term["message"].endswith(
          'exec: "no-such-command-anywhere": executable file not found in $PATH'), "StartError", term)

    # Deleted, a pod leaves no process (setsid ones included), no cgroup and no mount behind.
    # SIGTERM reaches the command (PID 1) when it has a handler: relayed, and in a user namespace
    # too; without one, PID 1 ignores it and the grace period ends in SIGKILL.
    for name, host_users, sc, trap in (("long", None, None, ""),
                                       ("long-userns", False, userns_sc,
                                        'trap "echo got TERM; exit 0" TERM; ')):
        code, body = create(name, ["sh", "-c", trap + "setsid sleep 300 & sleep 300 & echo up; wait"],
                            host_users, sc, env=[{"name": "SELFCHECK_POD", "value": name}])
        check(code == 201, f"create {name}", body)
    for name in ("long", "long-userns"):
        wait_for(lambda: api.pod(name)["status"]["phase"] == "Running", f"{name} Running")
        running = wait_for(lambda: len(p := pod_pids(name)) >= 5 and p, f"{name}'s processes")
        uid = api.pod(name)["metadata"]["uid"]
        cg = [os.path.join(d, uid) for d in pod_cgroup_bases(stderr)]
        check(all(os.path.isdir(d) for d in cg), f"{name}: its cgroups exist", cg)
        code, body = api.call("DELETE", f"{pods}/{name}", {"gracePeriodSeconds": 1})
        check(code == 200, f"delete {name}", body)
        wait_for(lambda: api.call("GET", f"{pods}/{name}")[0] == 404, f"{name} removed")
        wait_for(lambda: not [p for p in running if pid_alive(p)], f"{name}: no process left")
        wait_for(lambda: not [d for d in cg if os.path.exists(d)], f"{name}: no cgroup left")
        log = open(os.path.join(tmp, "runtime", f"{NS}_{name}.log")).read()
        check(("got TERM" in log) == (name == "long-userns"), f"{name}: SIGTERM relayed to PID 1", log)

    # The container's init killed from the host, or its shim: the pod ends with 137 and
    # nothing of it is left. A crashing container is restarted in fresh namespaces.
    for name in ("kill-init", "kill-shim"):
        code, body = create(name, ["sh", "-c", "setsid sleep 300 & sleep 300 & echo up; wait"],
                            env=[{"name": "SELFCHECK_POD", "value": name}])
        check(code == 201, f"create {name}", body)
    code, body = api.call("POST", pods, {"metadata": {"name": "crashloop"}, "spec": {
        "restartPolicy": "OnFailure", "containers": [
            {"name": "main", "image": "x", "command": ["sh", "-c", "echo pid=$$$$; exit 1"]}]}})
    check(code == 201, "create crashloop", body)
    for name in ("kill-init", "kill-shim"):
        wait_for(lambda: api.pod(name)["status"]["phase"] == "Running", f"{name} Running")
        running = wait_for(lambda: len(p := pod_pids(name)) >= 5 and p, f"{name}'s processes")
        if name == "kill-init":
            victim = next(p for p in running if nspid(p)[-1:] == [1] and len(nspid(p)) == 2)
        else:
            victim = next(p for p in running if ppid(p) == proc.pid)
        os.kill(victim, signal.SIGKILL)
        pod = wait_for(lambda: (p := api.pod(name))["status"]["phase"] == "Failed" and p, f"{name} Failed")
        term = pod["status"]["containerStatuses"][0]["state"]["terminated"]
        check(term["exitCode"] == 137, f"{name}: SIGKILL is exit code 137", term)
        wait_for(lambda: not [p for p in running if pid_alive(p)], f"{name}: no process left")
    pod = wait_for(lambda: (p := api.pod("crashloop"))["status"]["containerStatuses"][0]["restartCount"] >= 2
                   and p, "crashloop restarted")
    check("pid=1\npid=1\n" in api.call("GET", f"{pods}/crashloop/log", raw=True)[1],
          "each restart in a PID namespace of its own")
    api.call("DELETE", f"{pods}/crashloop", {"gracePeriodSeconds": 0})
    check(open("/proc/self/mountinfo").read() == host_mounts, "no pod mount reached the host")
    stop_server(proc)


def nspid(pid: int) -> list[int]:
    """The pid in each PID namespace the process is in, outermost first."""
    with open(f"/proc/{pid}/status") as f:
        line = next(x for x in f if x.startswith("NSpid:"))
    return [int(x) for x in line.split()[1:]]


def ppid(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def pod_cgroup_bases(server_stderr: str) -> list[str]:
    for line in server_stderr.splitlines():
        if "pod cgroups (memory limit, pids) under " in line:
            return line.split(" under ", 1)[1].split(", ")
    return []


def rbac_and_expiry_checks(tmp: str) -> None:
    role = os.path.join(tmp, "role.yaml")
    with open(role, "w") as f:
        f.write("apiVersion: rbac.authorization.k8s.io/v1\nkind: Role\nmetadata: {name: r}\n"
                "rules:\n- apiGroups: ['']\n  resources: [pods]\n  verbs: [get, list, watch]\n"
                "- apiGroups: ['']\n  resources: [secrets]\n  verbs: [create, patch]\n")
    proc, api = start_server(tmp, "rbac", "--rbac", role, "--rbac-user", "ci-bot",
                             "--history-limit", "10")
    code, body = api.call("POST", f"/api/v1/namespaces/{NS}/pods", {"metadata": {"name": "x"}})
    check(code == 403 and body["message"] == 'pods is forbidden: User "ci-bot" cannot create '
          'resource "pods" in API group "" in the namespace "ci"', "403 Forbidden", body)
    code, body = api.call("GET", "/api/v1/nodes")
    check(code == 403 and body["message"].endswith("at the cluster scope"), "cluster scope 403", body)
    old = api.call("GET", f"/api/v1/namespaces/{NS}/pods")[1]["metadata"]["resourceVersion"]
    for i in range(12):
        code, _ = api.call("POST", f"/api/v1/namespaces/{NS}/secrets", {"metadata": {"name": f"s{i}"}})
        check(code == 201, "create secret under rbac")
    events = api.watch(f"/api/v1/namespaces/{NS}/pods?watch=1&resourceVersion={old}")
    wait_for(lambda: events, "410 event")
    check(events[0]["type"] == "ERROR" and events[0]["object"]["code"] == 410
          and events[0]["object"]["reason"] == "Expired", "410 Expired", events)
    stop_server(proc)


def sigkill_check(tmp: str) -> None:
    """A SIGKILLed server still takes its pods' whole process groups with it (its watchdog)."""
    proc, api = start_server(tmp, "killed")
    # A namespaced pod's `setsid` child leaves the process group, and still dies with the pod's
    # PID namespace; a plain (privileged) pod's processes die with their process group.
    for name, shell, sc in (("forks", "sleep 300 & setsid sleep 300 & echo started; wait", None),
                            ("forks-plain", "sleep 300 & echo started; wait", {"privileged": True})):
        container = {"name": "main", "image": "x", "command": ["sh", "-c", shell],
                     "env": [{"name": "SELFCHECK_POD", "value": name}]}
        if sc:
            container["securityContext"] = sc
        code, body = api.call("POST", f"/api/v1/namespaces/{NS}/pods",
                              {"metadata": {"name": name}, "spec": {"restartPolicy": "Never",
                                                                    "containers": [container]}})
        check(code == 201, f"create {name}", body)
    children = []
    for name, least in (("forks", 3), ("forks-plain", 2)):
        log = os.path.join(tmp, "killed", f"{NS}_{name}.log")
        wait_for(lambda: os.path.exists(log) and "started" in open(log).read(), f"{name} log")
        children += wait_for(lambda: len(p := pod_pids(name)) >= least and p, f"{name}'s children run")
    bases = pod_cgroup_bases(open(os.path.join(tmp, "killed.stderr")).read())
    cgroups = [os.path.join(b, api.pod(n)["metadata"]["uid"]) for b in bases
               for n in ("forks", "forks-plain")]
    check(all(os.path.isdir(d) for d in cgroups), "the pods' cgroups exist", cgroups)
    proc.kill()
    proc.wait()
    wait_for(lambda: not [p for p in children if pid_alive(p)],
             "every pod process dies with a SIGKILLed server")
    wait_for(lambda: not [d for d in cgroups if os.path.exists(d)],
             "the watchdog removes the pods' cgroups")


def parent_death_check(tmp: str) -> None:
    """A server whose parent dies exits by itself."""
    nodes = os.path.join(tmp, "nodes.json")
    shell = subprocess.Popen(["sh", "-c", '"$@" & echo server=$!; wait', "sh", sys.executable,
                              SERVER, "--token", TOKEN, "--nodes", nodes, "--log-dir",
                              os.path.join(tmp, "orphan")], stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL)
    STARTED_PROCS.append(shell)
    pid = None
    for _ in range(2):
        ready, _, _ = select.select([shell.stdout], [], [], 15)
        check(ready, "orphan test output")
        line = shell.stdout.readline().decode()
        if line.startswith("server="):
            pid = int(line.split("=")[1])
        elif line.startswith("listening on"):
            continue
    check(pid is not None, "server pid")
    shell.kill()
    shell.wait()
    wait_for(lambda: not pid_alive(pid), "orphaned server exits", timeout=5)


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="kube-testserver-") as tmp:
        try:
            main_checks(tmp)
            runtime_checks(tmp)
            rbac_and_expiry_checks(tmp)
            sigkill_check(tmp)
            parent_death_check(tmp)
        except AssertionError as e:
            print(f"FAIL: {e}", file=sys.stderr)
            for name in ("main", "runtime", "rbac", "killed"):
                path = os.path.join(tmp, f"{name}.stderr")
                if os.path.exists(path):
                    print(f"--- {name} server stderr (tail) ---", file=sys.stderr)
                    print("".join(open(path).readlines()[-40:]), file=sys.stderr)
            return 1
        finally:
            for proc in STARTED_PROCS:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
    print(f"selfcheck passed in {time.monotonic() - STARTED:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
