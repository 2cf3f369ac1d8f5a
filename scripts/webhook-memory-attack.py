#!/usr/bin/env python3
"""Webhook memory attack against a gpuci server (BENCHMARKS.md, "GitHub webhook bodies").

Usage: webhook-memory-attack.py GPUCI_BINARY FIXTURES_DIR [N=30] [signed|unsigned]

Starts `gpuci server` with a `[github]` section (App key from FIXTURES_DIR/test-app-key.pem,
an unreachable API), sends N parallel 25 MB webhook bodies (with a well-formed but forged
`X-Hub-Signature-256`, or none) and prints the server's resident memory before and at its
peak (sampled every 20 ms), and the answers. Loopback only.
"""
import os, socket, subprocess, sys, tempfile, threading, time
BIN, FIXTURES = sys.argv[1], sys.argv[2]
N = int(sys.argv[3]) if len(sys.argv) > 3 else 30
SIGNED_FORM = sys.argv[4] == "signed" if len(sys.argv) > 4 else True
d = tempfile.mkdtemp()
open(f"{d}/secret", "w").write("s3cret")
os.chmod(f"{d}/secret", 0o600)
cfg = f'''[github]
api_url = "http://127.0.0.1:9"
app_id = 1
private_key_file = "{FIXTURES}/test-app-key.pem"
webhook_secret_file = "{d}/secret"
reconcile_interval = "1h"
'''
open(f"{d}/cfg.toml", "w").write(cfg)
os.chmod(f"{d}/cfg.toml", 0o600)
p = subprocess.Popen([BIN, "server", "--listen", "127.0.0.1:0", "--data-dir", f"{d}/data", "--config", f"{d}/cfg.toml"],
                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
url = p.stdout.readline().decode().strip()
addr = url.replace("http://", "").split()[0]
host, port = addr.split(":")
def rss():
    for l in open(f"/proc/{p.pid}/status"):
        if l.startswith("VmRSS"):
            return int(l.split()[1]) // 1024
time.sleep(1)
base = rss()
peak = [base]
stop = False
def sample():
    while not stop:
        peak[0] = max(peak[0], rss()); time.sleep(0.02)
size = 25 * (1 << 20) - 1
codes = []
def attack(i):
    s = socket.create_connection((host, int(port)))
    s.settimeout(120)
    sig = "sha256=" + "0" * 64
    head = f"POST /api/v1/github/webhook HTTP/1.1\r\nHost: {addr}\r\nContent-Length: {size}\r\nX-GitHub-Event: push\r\nX-GitHub-Delivery: a-{i}\r\n"
    if SIGNED_FORM:
        head += f"X-Hub-Signature-256: {sig}\r\n"
    s.sendall((head + "\r\n").encode())
    chunk = b" " * (1 << 20)
    try:
        left = size
        while left > 0:
            n = min(left, len(chunk)); s.sendall(chunk[:n]); left -= n
    except OSError:
        pass
    try:
        codes.append(s.recv(64).split(b" ")[1].decode())
    except Exception as e:
        codes.append(type(e).__name__)
t = threading.Thread(target=sample); t.start()
ts = [threading.Thread(target=attack, args=(i,)) for i in range(N)]
start = time.time()
[x.start() for x in ts]; [x.join() for x in ts]
took = time.time() - start
time.sleep(0.5); stop = True; t.join()
p.kill()
from collections import Counter
print(f"{N} parallel 25 MB bodies ({'well-formed forged signature' if SIGNED_FORM else 'no signature'}): RSS {base} MB -> peak {peak[0]} MB; answers {dict(Counter(codes))}; {took:.1f}s")
