"""Our daemons on loopback, as a benchmark starts them (bench/pipeline.py, bench/families.py,
bench/conversation.py).

``start_cluster`` writes a cluster TOML (a coordinator on 127.0.0.1, one stage
per given 127.0.0.x, free ports, a fresh cluster secret), starts one daemon per
node with ``--distributed-config`` (each its own state dir, socket and log under
``root``), and waits, ``READY_S`` at most, for the stage workers and the router
to run and for one streamed completion to come back (``wait_answering``: 60 s of
503s at most). ``start_single`` starts one daemon that serves the whole model
itself (``mlxceld --model DIR``: its router worker holds the model) and waits
the same way; it is a ``Cluster`` without stages. ``Cluster.stop`` ends every
daemon, then whatever worker is left, by pid. ``interruptible`` turns the first
SIGINT or SIGTERM into a ``KeyboardInterrupt`` so that the callers' ``finally``
clauses run.
"""

from __future__ import annotations

import contextlib
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil
from streams import Stream, timed

READY_S = 180.0
WARMUP_PROMPT = "The quick brown fox"


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


@dataclass
class Cluster:
    """One coordinator and its stages, each a daemon with its own state dir and socket (or
    one daemon serving the model itself, without stages: ``start_single``)."""

    root: Path
    stages: list[tuple[str, int]]  # the stages' listeners, in rank order
    url: str = ""
    model_id: str = ""
    daemons: list[subprocess.Popen[bytes]] = field(default_factory=list)
    workers: list[psutil.Process] = field(default_factory=list)
    ready_rss: list[int] = field(default_factory=list)  # each worker's, once it runs
    # Made once: httpx builds an SSL context per client (tens of ms), which a timed
    # request must not pay.
    http: httpx.Client = field(default_factory=lambda: httpx.Client(timeout=600))

    def stop(self) -> None:
        """SIGTERM each daemon (it stops its workers), then SIGKILL whatever is left, by pid."""
        self.http.close()
        for p in self.daemons:
            with contextlib.suppress(psutil.Error):
                self.workers += psutil.Process(p.pid).children(recursive=True)
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.daemons:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for w in self.workers:
            with contextlib.suppress(psutil.Error):
                if w.is_running():
                    w.kill()


def write_cluster(root: Path, model: Path, splits: list[tuple[int, int]],
                  stage_hosts: list[str], draft: tuple[Path, int] | None = None
                  ) -> tuple[Path, list[tuple[str, int]]]:
    """``draft``: the last stage's draft model and k ([cluster] draft_model)."""
    import dataclasses

    from mlxceld.privatefile import write_private

    write_private(root / "secret", (secrets.token_bytes(32).hex() + "\n").encode())
    from mlxceld.cluster.clusterfile.load import dump_cluster
    from mlxceld.cluster.clusterfile.model import StageEntry, pipeline_cluster

    ports = [free_port(h) for h in stage_hosts]
    stages = [StageEntry(f"stage-{rank}", f"{host}:{port}", layers)
              for rank, (layers, host, port) in enumerate(zip(splits, stage_hosts, ports,
                                                              strict=True))]
    toml = root / "cluster.toml"
    cfg = pipeline_cluster(
        "bench", model, ("coordinator", f"127.0.0.1:{free_port('127.0.0.1')}"), stages,
        secret_file="secret", path=toml)
    if draft is not None:
        cfg = dataclasses.replace(cfg, draft_model=str(draft[0]), num_draft_tokens=draft[1])
    toml.write_text(dump_cluster(cfg))
    return toml, list(zip(stage_hosts, ports, strict=True))


def start_cluster(root: Path, model: Path, splits: list[tuple[int, int]],
                  stage_hosts: list[str], clusters: list[Cluster],
                  draft: tuple[Path, int] | None = None) -> Cluster:
    """Start the daemons (registered in ``clusters`` at once, for cleanup) and wait for
    the stage workers and the router to run and answer one completion (``draft``: the
    last stage's, as ``write_cluster``'s)."""
    root.mkdir(mode=0o700)
    toml, stages = write_cluster(root, model, splits, stage_hosts, draft)
    cluster = Cluster(root, stages)
    clusters.append(cluster)
    router_port = free_port("127.0.0.1")
    nodes: list[tuple[str, str, tuple[str, ...]]] = [
        (f"stage-{r}", h, ()) for r, h in enumerate(stage_hosts)]
    nodes.append(("coordinator", "127.0.0.1", ("--port", str(router_port))))
    for node, host, extra in nodes:
        launch(cluster, node, "--agent-addr", f"{host}:0", "--distributed-config", str(toml),
               "--node-id", node, *extra)
    for (node, _, _), proc in zip(nodes, cluster.daemons, strict=True):
        role = "router" if node == "coordinator" else "stage"
        cluster.workers.append(worker := wait_worker(root, node, role, proc))
        cluster.ready_rss.append(worker.memory_info().rss)  # a stage: its model loaded
    serving(cluster, router_port)
    return cluster


def start_single(root: Path, model: Path, clusters: list[Cluster]) -> Cluster:
    """One daemon on 127.0.0.1 serving ``model`` in its own router worker (``mlxceld
    --model DIR``, no cluster), registered in ``clusters`` at once, for cleanup; waits as
    ``start_cluster`` does."""
    root.mkdir(mode=0o700)
    cluster = Cluster(root, [])
    clusters.append(cluster)
    port = free_port("127.0.0.1")
    proc = launch(cluster, "single", "--agent-addr", "127.0.0.1:0", "--model", str(model),
                  "--port", str(port))
    cluster.workers.append(worker := wait_worker(root, "single", "router", proc))
    cluster.ready_rss.append(worker.memory_info().rss)
    serving(cluster, port)
    return cluster


def launch(cluster: Cluster, node: str, *args: str) -> subprocess.Popen[bytes]:
    """Start ``node``'s daemon (no config file of the machine's; its state dir, socket and
    log under the cluster's root) and register it in ``cluster`` for cleanup."""
    root = cluster.root
    empty = root / "empty.toml"
    if not empty.exists():
        empty.write_text("")
    with (root / f"{node}.log").open("ab") as log:
        cluster.daemons.append(proc := subprocess.Popen(
            [sys.executable, "-m", "mlxceld", "--config", str(empty),
             "--state-dir", str(root / node), "--socket", str(root / f"{node}.sock"),
             "--log-level", "warning", *args],
            stdin=subprocess.DEVNULL, stdout=log, stderr=log))
    return proc


def serving(cluster: Cluster, port: int) -> None:
    """The router at ``port`` of 127.0.0.1: its model id, and one completion answered."""
    cluster.url = f"http://127.0.0.1:{port}/v1"
    cluster.model_id = cluster.http.get(f"{cluster.url}/models").json()["data"][0]["id"]
    wait_answering(cluster)


def listening(path: Path) -> bool:
    """Whether a Unix socket at ``path`` accepts a connection. Asked before httpx is: its
    transport leaks the socket of a connect that fails (a ResourceWarning)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        try:
            s.connect(str(path))
        except OSError:
            return False
        return True


def wait_worker(root: Path, node: str, role: str, proc: subprocess.Popen[bytes]
                ) -> psutil.Process:
    transport = httpx.HTTPTransport(uds=str(root / f"{node}.sock"))
    deadline = time.monotonic() + READY_S
    with httpx.Client(transport=transport, base_url="http://mlxceld", timeout=5) as ctl:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                tail = (root / f"{node}.log").read_text(errors="replace")[-3000:]
                raise SystemExit(f"the daemon of {node} exited with {proc.returncode}:\n{tail}")
            if not listening(root / f"{node}.sock"):
                time.sleep(0.2)
                continue
            with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
                for w in ctl.get("/v1/status").json()["workers"]:
                    if w["name"] == role and w["state"] == "running" and w["pid"]:
                        return psutil.Process(w["pid"])
            time.sleep(0.2)
    raise SystemExit(f"worker {role} of {node} not running after {READY_S:g} s; "
                     f"see {root / (node + '.log')}")


def wait_answering(cluster: Cluster) -> None:
    """The router connects to its stages on the first request; retry while it is 503."""
    deadline = time.monotonic() + 60
    while True:
        try:
            stream_once(cluster, WARMUP_PROMPT, 4)
            return
        except httpx.HTTPStatusError as exc:
            if exc.response.status_code != 503 or time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def stream_once(cluster: Cluster, prompt: str, max_tokens: int,
                http: httpx.Client | None = None) -> Stream:
    body = {"model": cluster.model_id, "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    with (http or cluster.http).stream("POST", f"{cluster.url}/completions", json=body) as r:
        return timed(r, start)


@contextlib.contextmanager
def interruptible() -> Iterator[None]:
    """The first SIGINT or SIGTERM unwinds as KeyboardInterrupt, so every ``finally`` runs
    (even where SIGINT was ignored at start, as for a background job of a non-interactive
    shell); later ones are ignored, so that the clean-up is not cut short."""
    signals = (signal.SIGINT, signal.SIGTERM)

    def raise_interrupt(signum: int, frame: object) -> None:
        for sig in signals:
            signal.signal(sig, signal.SIG_IGN)
        raise KeyboardInterrupt

    previous = {sig: signal.signal(sig, raise_interrupt) for sig in signals}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def in_scratch(prefix: str, work: Callable[[Path], None]) -> None:
    """``work`` given a scratch folder (removed after), ``interruptible``: interrupted, it
    says so and the process exits 130 once everything started is stopped."""
    interrupted = False
    with interruptible():
        root = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
        try:
            work(root)
        except KeyboardInterrupt:
            print("interrupted; everything started is stopped", file=sys.stderr)
            interrupted = True
        finally:
            shutil.rmtree(root, ignore_errors=True)
    if interrupted:
        sys.exit(130)


def stop_all(clusters: list[Cluster]) -> None:
    for c in clusters:
        c.stop()
    clusters.clear()
