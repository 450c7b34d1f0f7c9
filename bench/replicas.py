"""A router over replicas: aggregate tok/s of 2 replicas behind the router over 1, one run.

Real daemons on loopback, started as a service manager starts them (``mlxceld --config
FILE``), one cluster secret: two hybrid replicas (127.0.0.2 and 127.0.0.3, each its own
router worker and model, ``--max-batch`` sequences each) and two router nodes
(``node_role = "router"``) on 127.0.0.1: one over replica A alone (the baseline), one
over A and B. The same --streams concurrent greedy streams (--max-tokens each, distinct
prompts) go through each router in turn, --runs times; the median aggregate tok/s
(completion tokens of all streams over the wall time from the first request to the last
token) of each, and their ratio, are printed; and, to tell the router's cost from the
machine's, the same streams split over the two replicas' own OpenAI ports (no router).
The model is by default the ``small`` fixture (``mlxctl model fixture --preset small``),
written to a temp dir. Every process is ended by pid at the end.

    .venv/bin/python bench/replicas.py [--model DIR] [--streams 8] [--max-tokens 128]

On a machine where each MLX process gets a core of its own, the aim is a ratio of 1.6 or
more; the router itself holds no model and takes little.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
from streams import Stream, timed

PROMPT = "Once upon a time in a small village by the sea, there lived"
POLICY = """
[supervisor]
backoff_initial_s = 0.2
backoff_max_s = 1.0
stop_timeout_s = 5.0
"""


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


def toml(value: Any) -> str:
    if isinstance(value, str):
        return '"' + value + '"'
    if isinstance(value, list):
        return "[" + ", ".join(toml(v) for v in value) + "]"
    return repr(value)


@dataclass
class Daemon:
    root: Path
    name: str
    ip: str
    serve: dict[str, Any]
    agent_port: int = 0
    port: int = 0
    proc: subprocess.Popen[bytes] | None = None
    pids: set[int] = field(default_factory=set)

    def start(self, secret: Path) -> Daemon:
        home = self.root / self.name
        (home / "run").mkdir(parents=True, mode=0o700)
        self.agent_port, self.port = free_port(self.ip), free_port("127.0.0.1")
        daemon = {"state_dir": str(home / "state"), "socket": str(home / "run" / "ctl.sock"),
                  "agent_addr": f"{self.ip}:{self.agent_port}",
                  "cluster_secret_file": str(secret), "log_level": "warning"}
        serve = {"port": self.port, **self.serve}
        text = POLICY + "[daemon]\n" + "".join(f"{k} = {toml(v)}\n" for k, v in daemon.items())
        text += "[serve]\n" + "".join(f"{k} = {toml(v)}\n" for k, v in serve.items())
        config = home / "mlxceld.toml"
        config.write_text(text)
        with (home / "daemon.log").open("ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "mlxceld", "--config",
                                          str(config)], stdin=subprocess.DEVNULL,
                                         stdout=log, stderr=log)
        self.pids.add(self.proc.pid)
        return self

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def agent(self) -> str:
        return f"{self.ip}:{self.agent_port}"

    def ctl_status(self) -> dict[str, Any]:
        out = subprocess.run([sys.executable, "-m", "mlxctl", "--socket",
                              str(self.root / self.name / "run" / "ctl.sock"), "status",
                              "--json"], capture_output=True, text=True, timeout=30)
        body: dict[str, Any] = json.loads(out.stdout) if out.returncode == 0 else {}
        for w in body.get("workers") or []:
            if w.get("pid"):
                self.pids.add(w["pid"])
        return body

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.ctl_status()
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for pid in self.pids - {self.proc.pid if self.proc else -1}:  # workers: own groups
            with contextlib.suppress(psutil.Error, OSError):
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    os.killpg(pid, signal.SIGKILL)


def wait(what: str, check: Any, d: Daemon, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if d.proc is not None and d.proc.poll() is not None:
            raise SystemExit(f"{d.name} exited with {d.proc.returncode}: see "
                             f"{d.root / d.name / 'daemon.log'}")
        try:
            if check():
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{what}: not after {timeout} s")


def replicas_up(router: Daemon, n: int) -> bool:
    stats = httpx.get(f"{router.url}/router/stats", timeout=5)
    return stats.status_code == 200 and stats.json()["up"] == n


def one_stream(url: str, model: str, prompt: str, max_tokens: int) -> Stream:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as r:
        return timed(r, start)


def aggregate(urls: list[str], model: str, streams: int, max_tokens: int) -> float:
    """Tokens of ``streams`` concurrent streams (spread over ``urls`` in turn) over the
    wall time they took, together."""
    prompts = [f"{PROMPT} {i}" for i in range(streams)]
    start = time.perf_counter()
    with ThreadPoolExecutor(streams) as pool:
        done = list(pool.map(lambda i: one_stream(urls[i % len(urls)], model, prompts[i],
                                                  max_tokens), range(streams)))
    wall = time.perf_counter() - start
    return sum(s.tokens for s in done) / wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, help="default: the small fixture")
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="mxrb", dir="/tmp"))
    daemons: list[Daemon] = []
    try:
        model = args.model
        if model is None:
            from mlxceld.models import preset, write_fixture

            model = root / "small"
            write_fixture(model, preset("small"))
        model = model.absolute()
        secret = root / "cluster.secret"
        secret.write_text(secrets.token_hex(32) + "\n")
        secret.chmod(0o600)
        hybrid = {"model": str(model), "model_name": "m", "max_batch": args.max_batch}
        a = Daemon(root, "a", "127.0.0.2", {**hybrid, "host": "127.0.0.1"}).start(secret)
        b = Daemon(root, "b", "127.0.0.3", {**hybrid, "host": "127.0.0.1"}).start(secret)
        daemons += [a, b]
        for d in (a, b):
            wait(f"replica {d.name}'s router", lambda d=d: httpx.get(
                f"{d.url}/ready", timeout=5).status_code == 200, d)
        router = {"model": str(model), "model_name": "m", "node_role": "router"}
        one = Daemon(root, "r1", "127.0.0.1", {**router, "replicas": [a.agent]}).start(secret)
        two = Daemon(root, "r2", "127.0.0.1", {**router, "replicas": [a.agent, b.agent]}
                     ).start(secret)
        daemons += [one, two]
        wait("the router over A", lambda: replicas_up(one, 1), one)
        wait("the router over A and B", lambda: replicas_up(two, 2), two)
        setups = {"1 replica": [one.url], "2 replicas": [two.url],
                  # without a router: the streams split over the replicas' own ports
                  "2, no router": [a.url, b.url]}
        for urls in setups.values():  # warm up: compile, caches
            aggregate(urls, "m", args.streams, 8)
        rates: dict[str, list[float]] = {k: [] for k in setups}
        for _ in range(args.runs):  # interleaved, so that a noisy moment hits each
            for k, urls in setups.items():
                rates[k].append(aggregate(urls, "m", args.streams, args.max_tokens))
        print(f"model {model.name}, {args.streams} concurrent streams x {args.max_tokens} "
              f"tokens, max_batch {args.max_batch} per replica, {os.cpu_count()} CPUs, "
              f"median of {args.runs}")
        medians = {k: statistics.median(v) for k, v in rates.items()}
        for k, v in rates.items():
            print(f"  {k:<14} {medians[k]:8.1f} tok/s  "
                  f"(runs: {', '.join(f'{x:.1f}' for x in v)})")
        print(f"  ratio (2 replicas / 1 replica, through the router): "
              f"{medians['2 replicas'] / medians['1 replica']:.2f} (aim: 1.6 or more)")
        print(f"  the router's share: 2 replicas through it / without it: "
              f"{medians['2 replicas'] / medians['2, no router']:.2f}")
    finally:
        for d in reversed(daemons):
            d.stop()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
