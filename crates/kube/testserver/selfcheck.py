#!/usr/bin/env python3
"""Self-check for kube_api_server.py: starts it, drives it with urllib, stops it.

Run with the interpreter that has kubernetes-validate installed:
    /var/tmp/gpuci-kube-venv/bin/python selfcheck.py
Exits 0 when every check passes; kills every process it started either way.
"""

from __future__ import annotations

import base64
import json
import os
import select
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
    api.create_pod("survivor", ["sh", "-c", "echo pid=$$$$; exec sleep 300"])
    wait_for(lambda: api.pod("survivor")["status"]["phase"] == "Running", "survivor Running")
    log = wait_for(lambda: api.call("GET", f"{pods}/survivor/log", raw=True)[1], "survivor log")
    pid = int(log.split("pid=")[1].split()[0])
    check(pid_alive(pid), "survivor is alive before shutdown")
    stop_server(proc)
    check(not pid_alive(pid), f"pod process {pid} killed at shutdown")


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
    api.create_pod("forks", ["sh", "-c", "sleep 300 & echo child=$$!; wait"])
    log = os.path.join(tmp, "killed", f"{NS}_forks.log")
    wait_for(lambda: os.path.exists(log) and "child=" in open(log).read(), "forks log")
    child = int(open(log).read().split("child=")[1].split()[0])
    check(pid_alive(child), "the pod's child runs")
    proc.kill()
    proc.wait()
    wait_for(lambda: not pid_alive(child), "the pod's child dies with a SIGKILLed server")


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
            rbac_and_expiry_checks(tmp)
            sigkill_check(tmp)
            parent_death_check(tmp)
        except AssertionError as e:
            print(f"FAIL: {e}", file=sys.stderr)
            for name in ("main", "rbac", "killed"):
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
