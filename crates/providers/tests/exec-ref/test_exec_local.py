"""Self-test of gpuci-exec-local with a dummy agent (sh + sleep), no gpuci binary needed.

    python3 -m unittest crates/providers/tests/exec-ref/test_exec_local.py
"""

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import unittest

PROGRAM = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpuci-exec-local")
MACHINE_KEYS = {"machine", "provider_id", "state", "instance_type", "zone", "capacity", "launched_at"}


def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            data = f.read()
    except OSError:
        return False
    return data[data.rindex(")") + 2] not in "ZX"


class ExecLocalTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory(prefix="gpuci-exec-local-")
        self.state_dir = os.path.join(self.tmp.name, "state")
        self.args_file = os.path.join(self.tmp.name, "args")
        # The dummy agent notes its token and arguments (the appended --data-dir among them),
        # then becomes a long sleep (exec: same pid, the group leader).
        self.agent = [
            "sh",
            "-c",
            f'echo "$GPUCI_REGISTRATION_TOKEN $*" >> "{self.args_file}"; exec sleep 1000',
            "agent",
        ]
        self.settings = {"state_dir": self.state_dir, "stop": True}

    def tearDown(self):
        # Kill every process group this test's program started (recorded pids only).
        for root, _, files in os.walk(self.state_dir):
            for name in files:
                if not name.endswith(".json"):
                    continue
                with open(os.path.join(root, name)) as f:
                    pid = json.load(f).get("pid")
                if pid and alive(pid):
                    try:
                        os.killpg(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
        self.tmp.cleanup()

    def call(self, op, settings=None, stdin=None, **fields):
        request = {
            "protocol": 1,
            "op": op,
            "coordinator": "c-test",
            "fleet": "f1",
            "settings": settings if settings is not None else self.settings,
            **fields,
        }
        p = subprocess.run(
            [PROGRAM, op],
            input=stdin if stdin is not None else json.dumps(request),
            capture_output=True,
            text=True,
            timeout=60,
        )
        lines = p.stdout.strip().splitlines()
        self.assertEqual(len(lines), 1, f"stdout: {p.stdout!r} stderr: {p.stderr}")
        return p.returncode, json.loads(lines[0])

    def create(self, machine, settings=None, instance_type="gpu_1x_t4"):
        return self.call(
            "create",
            settings=settings,
            machine=machine,
            offer={"instance_type": instance_type, "zone": "local", "price_per_hour": 0.5},
            capacity="on-demand",
            agent={
                "server": "http://127.0.0.1:1",
                "registration_token": "tok-123",
                "tags": {"gpuci.fleet": "f1", "gpuci.machine": machine},
                "name": machine,
                "command": self.agent,
                "user_data": "#!/bin/sh\n",
            },
        )

    def record(self, machine):
        with open(os.path.join(self.state_dir, "c-test", "f1", machine + ".json")) as f:
            return json.load(f)

    def wait_args(self, n):
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            if os.path.exists(self.args_file):
                with open(self.args_file) as f:
                    lines = f.read().splitlines()
                if len(lines) >= n:
                    return lines
            time.sleep(0.05)
        self.fail(f"the agent did not start {n} time(s)")

    def test_create_is_idempotent_and_listed(self):
        rc, a = self.create("m-1")
        self.assertEqual(rc, 0, a)
        self.assertEqual(set(a["machine"]), MACHINE_KEYS)
        self.assertEqual(a["machine"]["state"], "running")
        self.assertEqual(a["machine"]["instance_type"], "gpu_1x_t4")
        self.assertIsInstance(a["machine"]["launched_at"], int)
        rc, b = self.create("m-1")
        self.assertEqual(rc, 0, b)
        self.assertEqual(a, b)
        pid = self.record("m-1")["pid"]
        self.assertTrue(alive(pid))
        lines = self.wait_args(1)
        time.sleep(0.2)
        with open(self.args_file) as f:
            self.assertEqual(len(f.read().splitlines()), 1, "created twice")
        data_dir = self.record("m-1")["agent_data_dir"]
        self.assertEqual(lines[0], f"tok-123 --data-dir {data_dir}")
        self.assertTrue(os.path.isdir(data_dir))

        rc, l = self.call("list")
        self.assertEqual(rc, 0)
        self.assertEqual(l, {"machines": [a["machine"]]})
        # Another fleet sees nothing.
        p = subprocess.run(
            [PROGRAM, "list"],
            input=json.dumps({"protocol": 1, "op": "list", "coordinator": "c-test", "fleet": "f2",
                              "settings": self.settings}),
            capture_output=True, text=True, timeout=60,
        )
        self.assertEqual(json.loads(p.stdout), {"machines": []})

    def test_concurrent_creates_start_one_process(self):
        results = []
        threads = [threading.Thread(target=lambda: results.append(self.create("m-c"))) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self.assertEqual(len({json.dumps(r[1], sort_keys=True) for r in results}), 1, results)
        self.wait_args(1)
        time.sleep(0.2)
        with open(self.args_file) as f:
            self.assertEqual(len(f.read().splitlines()), 1)

    def test_delete(self):
        self.assertEqual(self.create("m-1")[0], 0)
        pid = self.record("m-1")["pid"]
        self.assertEqual(self.call("delete", machine="m-1"), (0, {}))
        self.assertFalse(alive(pid))
        self.assertEqual(self.record("m-1")["state"], "terminated")
        rc, l = self.call("list")
        self.assertEqual([m["state"] for m in l["machines"]], ["terminated"])
        # Again, and a machine that never existed: both success.
        self.assertEqual(self.call("delete", machine="m-1"), (0, {}))
        self.assertEqual(self.call("delete", machine="m-nope"), (0, {}))
        # Created again after termination: a new machine.
        rc, a = self.create("m-1")
        self.assertEqual(rc, 0)
        self.assertEqual(a["machine"]["state"], "running")
        self.assertNotEqual(self.record("m-1")["pid"], pid)

    def test_dead_agent_is_terminated(self):
        self.assertEqual(self.create("m-1")[0], 0)
        pid = self.record("m-1")["pid"]
        os.killpg(pid, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        rc, l = self.call("list")
        self.assertEqual([m["state"] for m in l["machines"]], ["terminated"])

    def test_stop_start_keeps_data_dir(self):
        self.assertEqual(self.create("m-1")[0], 0)
        self.wait_args(1)
        rec = self.record("m-1")
        marker = os.path.join(rec["agent_data_dir"], "agent.json")
        with open(marker, "w") as f:
            f.write("{}")
        rc, s = self.call("stop", machine="m-1")
        self.assertEqual(rc, 0, s)
        self.assertEqual(s["machine"]["state"], "stopped")
        self.assertFalse(alive(rec["pid"]))
        self.assertTrue(os.path.exists(marker))
        rc, l = self.call("list")
        self.assertEqual([m["state"] for m in l["machines"]], ["stopped"])
        rc, s = self.call("start", machine="m-1")
        self.assertEqual(rc, 0, s)
        self.assertEqual(s["machine"]["state"], "running")
        self.assertEqual(s["machine"]["provider_id"], rec["provider_id"])
        lines = self.wait_args(2)
        self.assertEqual(lines[0], lines[1])  # the same data dir: the same agent
        self.assertTrue(alive(self.record("m-1")["pid"]))
        self.assertEqual(self.call("delete", machine="m-1"), (0, {}))

    def test_stop_needs_setting(self):
        self.assertEqual(self.create("m-1")[0], 0)
        settings = {"state_dir": self.state_dir}
        for op in ("stop", "start"):
            rc, e = self.call(op, settings=settings, machine="m-1")
            self.assertNotEqual(rc, 0)
            self.assertEqual(e["error"]["kind"], "invalid")
        rc, e = self.call("stop", machine="m-nope")
        self.assertNotEqual(rc, 0)
        self.assertEqual(e["error"]["kind"], "not_found")

    def test_fail_create(self):
        settings = dict(self.settings, fail_create={"gpu_1x_t4": "capacity", "gpu_8x_h100": "quota"})
        rc, e = self.create("m-1", settings=settings)
        self.assertEqual(rc, 1)
        self.assertEqual(e["error"]["kind"], "capacity")
        rc, e = self.create("m-2", settings=settings, instance_type="gpu_8x_h100")
        self.assertEqual(e["error"]["kind"], "quota")
        self.assertEqual(self.call("list", settings=settings), (0, {"machines": []}))
        self.assertFalse(os.path.exists(self.args_file))
        rc, a = self.create("m-3", settings=settings, instance_type="gpu_1x_a10")
        self.assertEqual(rc, 0, a)

    def test_boot_delay_and_never_connect(self):
        settings = dict(self.settings, boot_delay_s=0.5, extra_agent_args=["--isolation", "none"])
        t0 = time.monotonic()
        self.assertEqual(self.create("m-1", settings=settings)[0], 0)
        self.assertLess(time.monotonic() - t0, 0.5 + 2)
        lines = self.wait_args(1)
        self.assertIn("--isolation none --data-dir", lines[0])
        settings = dict(self.settings, never_connect=True)
        self.assertEqual(self.create("m-2", settings=settings)[0], 0)
        self.assertTrue(alive(self.record("m-2")["pid"]))
        time.sleep(0.2)
        self.assertEqual(len(self.wait_args(1)), 1)
        self.assertEqual(self.call("delete", machine="m-2"), (0, {}))

    def test_invalid_requests(self):
        rc, e = self.call("reboot")
        self.assertEqual((rc, e["error"]["kind"]), (2, "invalid"))
        rc, e = self.call("list", stdin="{not json")
        self.assertEqual((rc, e["error"]["kind"]), (2, "invalid"))
        rc, e = self.call("list", settings={})
        self.assertEqual((rc, e["error"]["kind"]), (2, "invalid"))
        rc, e = self.call("create", machine="m-1")
        self.assertEqual((rc, e["error"]["kind"]), (2, "invalid"))
        rc, e = self.call("delete", machine="../x")
        self.assertEqual((rc, e["error"]["kind"]), (2, "invalid"))


if __name__ == "__main__":
    unittest.main()
