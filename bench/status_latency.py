"""How long `mlxctl status`, `workers` and `logs NAME` take end to end, against a real daemon
with two workers.

Baseline, in the same run: a bare interpreter that sends the same HTTP request over the
same Unix socket with the standard library only (the floor any Python CLI pays). For each
command it prints the median of N runs of ours and of the baseline, and their ratio. The
runs are interleaved (ours, baseline, ours, ...) so both see the same machine noise.

    .venv/bin/python bench/status_latency.py [--runs 20]
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CONFIG = """
[workers.alpha]
role = "echo"
[workers.beta]
role = "echo"
"""

# (what we run after `mlxctl --socket S`, the request the baseline sends for it)
COMMANDS = (
    (["status"], "/v1/status"),
    (["workers"], "/v1/workers"),
    (["logs", "alpha"], "/v1/workers/alpha/logs?lines=50&follow=0"),
)

RAW = """
import socket, sys
s = socket.socket(socket.AF_UNIX)
s.connect(sys.argv[1])
s.sendall(f"GET {sys.argv[2]} HTTP/1.1\\r\\nHost: x\\r\\nConnection: close\\r\\n\\r\\n".encode())
while s.recv(65536):
    pass
"""


def timed(cmd: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def wait_ready(ctl: list[str]) -> None:
    deadline = time.monotonic() + 30
    while True:
        out = subprocess.run([*ctl, "status", "--json"], capture_output=True, text=True)
        if out.returncode == 0 and all(w["state"] == "running"
                                       for w in json.loads(out.stdout)["workers"]):
            return
        if time.monotonic() > deadline:
            raise SystemExit(f"daemon not ready: {out.stderr}")
        time.sleep(0.2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="mxbench", dir="/tmp"))
    (root / "mlxceld.toml").write_text(CONFIG)
    sock = root / "ctl.sock"
    daemon = subprocess.Popen(
        [sys.executable, "-m", "mlxceld", "--config", str(root / "mlxceld.toml"),
         "--state-dir", str(root / "state"), "--socket", str(sock), "--log-level", "warning",
         "--agent-addr", "127.0.0.1:0"])
    try:
        ctl = [sys.executable, "-m", "mlxctl", "--socket", str(sock)]
        wait_ready(ctl)
        print(f"runs: {args.runs} each (median; baseline: bare python, raw GET on the socket)")
        print(f"{'command':<16}{'ours ms':>10}{'baseline ms':>14}{'ratio':>8}")
        for argv, path in COMMANDS:
            ours, base = [], []
            for _ in range(args.runs):
                ours.append(timed([*ctl, *argv]))
                base.append(timed([sys.executable, "-c", RAW, str(sock), path]))
            m_ours, m_base = statistics.median(ours), statistics.median(base)
            print(f"{' '.join(argv):<16}{m_ours * 1000:>10.1f}{m_base * 1000:>14.1f}"
                  f"{m_ours / m_base:>8.2f}")
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(timeout=30)
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
