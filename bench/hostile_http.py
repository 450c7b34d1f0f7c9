"""Hostile clients against a real router, measured: what a flood of connections and a
prompt of MBs do to ``/health``, to a completion, to the router's log and memory.

It starts a real daemon serving the ``tiny`` llama fixture (context ``--context``
tokens, 2,048 by default) on loopback with the default ``[serve]`` bounds, then:

1. quiet: ``GET /health`` every 0.05 s for 2 s, each on a fresh connection, from a
   process of its own;
2. flood: ``--idle`` connections that never send a byte and ``--slow`` ones sending
   a request head a byte a second, opened as fast as the kernel takes them, then held
   ``--hold`` s (past the 10 s head deadline); ``/health`` every 0.2 s (5 s timeout
   each) while they open and while they are held, and one completion (4 tokens, 60 s
   timeout) once they are open. Reported: /health's median and worst, its failures,
   the completion's time, the router's descriptors at their most, its log's growth
   (rotated files included), and whether the router is still the same process;
3. a prompt of ``--mb`` MB (``/v1/completions``, 120 s timeout) while ``/health``
   is asked every 0.05 s: its status and time, /health's worst, and the router's
   RSS before, at its most, and 2 s after.

``--python PATH`` runs the daemon (and so its workers) with another interpreter, e.g.
the venv of a worktree of main, to compare before and after:

    git worktree add --detach /tmp/mx-main main && make -C /tmp/mx-main install
    .venv/bin/python bench/hostile_http.py --python /tmp/mx-main/.venv/bin/python
    .venv/bin/python bench/hostile_http.py
"""

from __future__ import annotations

import argparse
import contextlib
import json
import resource
import selectors
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

from mlxceld.models import preset, write_fixture

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from helpers.probe import HealthProbe  # the tests' probe, one copy

CONFIG = """
[supervisor]
health_interval_s = 1.0
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@dataclass
class Probe(HealthProbe):
    """``GET /health`` on 127.0.0.1 from a process of its own (the tests' probe), and a
    summary of what it saw."""

    def summary(self) -> str:
        if not self.took:
            return "no probe"
        failed = (f", {len(self.failed)} failed ({', '.join(sorted(set(self.failed)))})"
                  if self.failed else "")
        slow = sum(t >= 1.0 for t in self.took)
        return (f"{len(self.took)} probes, median {statistics.median(self.took) * 1000:.0f} ms, "
                f"worst {max(self.took) * 1000:.0f} ms, {slow} of 1 s or more{failed}")


@dataclass
class Watch:
    """Samples a process's descriptors and RSS every 0.1 s in a thread; keeps the most."""

    proc: psutil.Process
    fds: int = 0
    rss: int = 0
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        while not self.stop.is_set():
            with contextlib.suppress(psutil.Error):
                self.fds = max(self.fds, self.proc.num_fds())
                self.rss = max(self.rss, self.proc.memory_info().rss)
            self.stop.wait(0.1)

    @contextlib.contextmanager
    def running(self) -> Iterator[Watch]:
        thread = threading.Thread(target=self.run, daemon=True)
        thread.start()
        try:
            yield self
        finally:
            self.stop.set()
            thread.join(5)


def open_connections(port: int, count: int, into: list[socket.socket]) -> None:
    """``count`` more non-blocking connections in ``into``, 64 at a time, each connected or
    given up on (10 s) before the next batch."""
    with selectors.DefaultSelector() as selector:
        while count > 0:
            for _ in range(min(64, count)):
                s = socket.socket()
                into.append(s)
                s.setblocking(False)
                s.connect_ex(("127.0.0.1", port))
                selector.register(s, selectors.EVENT_WRITE)
                count -= 1
            deadline = time.monotonic() + 10
            while selector.get_map() and time.monotonic() < deadline:
                for key, _ in selector.select(1):
                    selector.unregister(key.fileobj)
            for left in list(selector.get_map().values()):
                selector.unregister(left.fileobj)


def in_thread(job: Callable[[], object]) -> tuple[threading.Thread, list[object]]:
    out: list[object] = []
    thread = threading.Thread(target=lambda: out.append(job()), daemon=True)
    thread.start()
    return thread, out


def timed_post(url: str, body: dict[str, object], timeout: float) -> str:
    began = time.monotonic()
    try:
        r = httpx.post(url, json=body, timeout=timeout)
        what = f"HTTP {r.status_code}"
        if r.status_code != 200:
            what += f" ({r.json().get('error', {}).get('message', '')[:90]})"
    except httpx.HTTPError as exc:
        what = type(exc).__name__
    return f"{what} in {time.monotonic() - began:.2f} s"


class Router:
    def __init__(self, python: str, work: Path, context: int) -> None:
        self.work = work
        model = work / "llama"
        write_fixture(model, preset("tiny", family="llama", context=context))
        (work / "mlxceld.toml").write_text(CONFIG)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.socket = work / "ctl.sock"
        self.python = python
        self._stderr = (work / "daemon.log").open("wb")
        self.daemon = subprocess.Popen(
            [python, "-m", "mlxceld", "--config", str(work / "mlxceld.toml"),
             "--state-dir", str(work / "state"), "--socket", str(self.socket),
             "--agent-addr", "127.0.0.1:0", "--model", str(model), "--port", str(self.port)],
            cwd=work, stdout=subprocess.DEVNULL, stderr=self._stderr)
        self.pid = self._wait_router()
        self.log = work / "state" / "logs" / "router.log"

    def log_bytes(self) -> tuple[int, int]:
        """The router's log and its rotated ones: bytes in all, and how many files."""
        files = list(self.log.parent.glob("router.log*"))
        return sum(f.stat().st_size for f in files), len(files)

    def worker(self) -> dict[str, object]:
        """The router's row in ``mlxctl workers --json``."""
        out = subprocess.run([self.python, "-m", "mlxctl", "--socket", str(self.socket),
                              "workers", "--json"], capture_output=True, text=True,
                             cwd=self.work, check=True)
        row: dict[str, object] = next(w for w in json.loads(out.stdout)["workers"]
                                      if w["name"] == "router")
        return row

    def restarted(self) -> str:
        """What became of the router since the last look (and its pid updated)."""
        row = self.worker()
        if row["pid"] == self.pid:
            return f"the same router (pid {self.pid}), {row['restarts']} restarts"
        was, self.pid = self.pid, self._wait_router()
        return f"the router was replaced: pid {was} -> {self.pid}, {row['restarts']} restarts"

    def _wait_router(self) -> int:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if self.daemon.poll() is not None:
                raise SystemExit(f"the daemon exited {self.daemon.returncode}; see "
                                 f"{self.work / 'daemon.log'}")
            out = subprocess.run([self.python, "-m", "mlxctl", "--socket", str(self.socket),
                                  "workers", "--json"], capture_output=True, text=True,
                                 cwd=self.work)
            if out.returncode == 0:
                for w in json.loads(out.stdout)["workers"]:
                    if w["name"] == "router" and w["state"] == "running":
                        with contextlib.suppress(httpx.HTTPError):
                            if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                                return int(w["pid"])
            time.sleep(0.5)
        raise SystemExit("the router was not running after 180 s")

    def stop(self) -> None:
        self.daemon.send_signal(signal.SIGTERM)
        try:
            self.daemon.wait(60)
        except subprocess.TimeoutExpired:
            self.daemon.kill()
            self.daemon.wait()
        self._stderr.close()


def quiet(router: Router) -> None:
    probe = Probe("127.0.0.1", router.port, 0.05)
    with probe.running():
        time.sleep(2)
    print(f"quiet: /health {probe.summary()}")


def flood(router: Router, idle: int, slow: int, hold: float) -> None:
    worker = psutil.Process(router.pid)
    log_before, files_before = router.log_bytes()
    sockets: list[socket.socket] = []
    dripping = threading.Event()
    head = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 200
    slow_ones: list[socket.socket] = []

    def drip() -> None:
        for i in range(len(head)):
            for s in slow_ones:
                with contextlib.suppress(OSError):
                    s.send(head[i:i + 1])
            if dripping.wait(1):
                return

    opening, holding = Probe("127.0.0.1", router.port, 0.2), Probe("127.0.0.1", router.port, 0.2)
    with Watch(worker).running() as watch:
        try:
            began = time.monotonic()
            with opening.running():
                open_connections(router.port, idle, sockets)
                open_connections(router.port, slow, slow_ones)
            sockets += slow_ones
            opened = time.monotonic() - began
            threading.Thread(target=drip, daemon=True).start()
            with holding.running():
                completion, done = in_thread(lambda: timed_post(
                    f"{router.url}/v1/completions",
                    {"model": "llama", "prompt": "The quick brown fox", "max_tokens": 4}, 60))
                time.sleep(hold)
                completion.join(60)
        finally:
            dripping.set()
            for s in sockets:
                s.close()
    log_after, files_after = router.log_bytes()
    print(f"flood: {idle} idle + {slow} slowloris connections (opened in {opened:.1f} s), "
          f"held {hold:.0f} s")
    print(f"  /health while they open: {opening.summary()}")
    print(f"  /health while they are held: {holding.summary()}")
    print(f"  completion: {done[0] if done else 'no answer in 60 s'}")
    rotated = f" (rotated into {files_after} files)" if files_after > files_before else ""
    print(f"  router: at most {watch.fds} descriptors; its log grew "
          f"{log_after - log_before} bytes{rotated}")
    print(f"  after: {router.restarted()}")


def large_prompt(router: Router, mb: float) -> None:
    worker = psutil.Process(router.pid)
    time.sleep(2)
    before = worker.memory_info().rss
    prompt = ("lorem ipsum dolor sit amet " * int(mb * 40_000))[:int(mb * 1_000_000)]
    probe = Probe("127.0.0.1", router.port, 0.05)
    with Watch(worker).running() as watch, probe.running():
        sender, answer = in_thread(lambda: timed_post(
            f"{router.url}/v1/completions",
            {"model": "llama", "prompt": prompt, "max_tokens": 4}, 120))
        sender.join(130)
        time.sleep(0.5)
    time.sleep(2)
    after = worker.memory_info().rss
    print(f"prompt of {mb:g} MB: {answer[0] if answer else 'no answer in 120 s'}")
    print(f"  /health {probe.summary()}")
    print(f"  router RSS: {before >> 20} MiB before, {watch.rss >> 20} MiB at most, "
          f"{after >> 20} MiB 2 s after")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", default=sys.executable,
                        help="the interpreter to run the daemon with (another checkout's venv)")
    parser.add_argument("--idle", type=int, default=2100)
    parser.add_argument("--slow", type=int, default=500)
    parser.add_argument("--hold", type=float, default=15.0)
    parser.add_argument("--mb", type=float, default=4.0)
    parser.add_argument("--context", type=int, default=2048,
                        help="the model's context; 131072 takes a 4 MB prompt to its tokenizer")
    parser.add_argument("--keep", action="store_true", help="keep the state dir and logs")
    args = parser.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = args.idle + args.slow + 256
    if soft != resource.RLIM_INFINITY and soft < needed:
        if hard != resource.RLIM_INFINITY and hard < needed:
            raise SystemExit(f"{needed} descriptors are needed; the hard file limit is {hard}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))
    work = Path(tempfile.mkdtemp(prefix="mxhostile", dir="/tmp"))
    router = Router(args.python, work, args.context)
    try:
        print(f"router pid {router.pid} on {router.url}, daemon run by {args.python}")
        quiet(router)
        flood(router, args.idle, args.slow, args.hold)
        quiet(router)
        large_prompt(router, args.mb)
    finally:
        router.stop()
        if args.keep:
            print(f"kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
