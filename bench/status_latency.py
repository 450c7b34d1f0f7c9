"""How long `mlxctl status` takes end to end, against a real daemon with two workers.

Baseline, in the same run: a bare interpreter that sends the same HTTP request
over the same Unix socket with the standard library only (the floor any Python
CLI pays). Prints the median of N runs of each and the ratio.

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

RAW = """
import socket, sys
s = socket.socket(socket.AF_UNIX)
s.connect(sys.argv[1])
s.sendall(b"GET /v1/status HTTP/1.1\\r\\nHost: x\\r\\nConnection: close\\r\\n\\r\\n")
while s.recv(65536):
    pass
"""


def timed(cmd: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="mxbench", dir="/tmp"))
    (root / "mlxceld.toml").write_text(CONFIG)
    sock = root / "ctl.sock"
    daemon = subprocess.Popen(
        [sys.executable, "-m", "mlxceld", "--config", str(root / "mlxceld.toml"),
         "--state-dir", str(root / "state"), "--socket", str(sock), "--log-level", "warning"])
    try:
        ctl = [sys.executable, "-m", "mlxctl", "--socket", str(sock), "status", "--json"]
        deadline = time.monotonic() + 30
        while True:
            out = subprocess.run(ctl, capture_output=True, text=True)
            if out.returncode == 0 and all(w["state"] == "running"
                                           for w in json.loads(out.stdout)["workers"]):
                break
            if time.monotonic() > deadline:
                raise SystemExit(f"daemon not ready: {out.stderr}")
            time.sleep(0.2)
        ours, base = [], []
        for _ in range(args.runs):  # interleaved, so both see the same machine noise
            ours.append(timed(ctl[:-1]))
            base.append(timed([sys.executable, "-c", RAW, str(sock)]))
        m_ours, m_base = statistics.median(ours), statistics.median(base)
        print(f"runs: {args.runs}")
        print(f"mlxctl status (end to end):       median {m_ours * 1000:7.1f} ms")
        print(f"baseline (bare python + raw GET): median {m_base * 1000:7.1f} ms")
        print(f"ratio ours/baseline: {m_ours / m_base:.2f}")
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(timeout=30)
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
