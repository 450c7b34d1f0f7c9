"""bench/tp.py's daemon setups: the model split over ``--tp`` ranks behind real daemons,
as an operator starts them (``mlxceld --config FILE``: ``bench/replicas.py``'s ``Daemon``).

- across hosts (``daemons_setup(..., across=True)``): one daemon per rank, rank r's agent
  on 127.0.0.{2 + r} (its "host"). Rank 0's runs ``--tp-size N --tp-peers A1,...``
  (``[serve] tp_size``, ``tp_peers``: its router worker is rank 0,
  ``daemon/tensor_peers.py``); every other one ``--node-role tensor_parallel_rank`` (its
  ``tp-<rank>`` worker, ``daemon/tensor_rank.py``);
- one daemon (``across=False``): ``--tp-size N`` alone, its ranks in a ring on 127.0.0.1.

Each daemon has its own state dir, all share one cluster secret file (0600). Once rank
0's ``/ready`` answers 200, bench/tp.py's rounds of greedy requests go to its OpenAI port
as streamed completions (``ignore_eos``: each runs to ``--new`` tokens), timed as they
arrive (``bench/streams.py``: the time to the first text, the decode rate after it);
meanwhile the CPU seconds of each daemon and worker are read (the cores each kept busy).
Every process is ended by pid at the end, on failure too.

``ring_probe``: what one ``all_sum`` of a decode step's activations costs in a ring of
processes on the given addresses (127.0.0.1 inside one host, 127.0.0.2 and .3 across
"hosts") doing nothing else, for bench/tp.py's account of where a step's time goes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import psutil
from replicas import Daemon, cpu_seconds, wait  # the daemons as a service starts them
from streams import Stream, timed

from mlxceld.discovery.inventory import free_ports

HOSTS = [f"127.0.0.{2 + i}" for i in range(16)]  # rank r's "host"
READY_S = 300.0  # every daemon up, the group formed, both ranks loaded: ~20 s here


def _pids(d: Daemon) -> None:
    """Note every process below ``d``'s daemon (its workers: ended by pid at the end)."""
    if d.proc is not None:
        with contextlib.suppress(psutil.Error):
            d.pids |= {c.pid for c in psutil.Process(d.proc.pid).children(recursive=True)}


def _end(daemons: list[Daemon]) -> None:
    """Rank 0 first (its router ends the group), then the rank hosts; each daemon by
    SIGTERM, then any process of theirs still there by SIGKILL, by pid."""
    for d in daemons:
        with contextlib.suppress(Exception):
            _pids(d)
    for d in daemons:
        with contextlib.suppress(Exception):
            d.stop()
    for d in daemons:
        for pid in d.pids:
            with contextlib.suppress(psutil.Error, OSError):
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    os.kill(pid, signal.SIGKILL)


def _worker(d: Daemon, name: str) -> psutil.Process:
    body = d.ctl_status()  # notes the workers' pids too
    pid = next((w["pid"] for w in body.get("workers") or [] if w.get("name") == name), None)
    if not pid:
        raise SystemExit(f"no running worker {name} on daemon {d.name}: see "
                         f"{d.root / d.name / 'daemon.log'}")
    return psutil.Process(pid)


def _memory(proc: psutil.Process) -> dict[str, int]:
    """A worker's RSS and peak RSS (VmHWM), read from outside."""
    out = {"rss": proc.memory_info().rss, "peak": 0}
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                out["peak"] = int(line.split()[1]) * 1024
    return out


def daemons_setup(model: Path, tp: int, args: argparse.Namespace, prompts: list[list[str]],
                  *, across: bool) -> dict[str, Any]:
    """Start the group (``across``: one daemon per rank, each on its own IP; else one
    daemon with ``--tp-size`` alone, its ranks in a ring on 127.0.0.1), run the rounds
    on rank 0's OpenAI port, end every process. Rank 0's report: per round (median TTFT,
    summed decode tok/s), the texts per round and stream, each rank's memory and the
    cores each process kept busy."""
    root = Path(tempfile.mkdtemp(prefix="mxtp", dir="/tmp"))
    daemons: list[Daemon] = []
    try:
        secret = root / "cluster.secret"
        fd = os.open(secret, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32) + "\n")
        base = {"model": str(model), "model_name": "m", "max_batch": args.streams}
        for rank in range(1, tp if across else 1):
            daemons.append(Daemon(root, f"rank{rank}", HOSTS[rank],
                                  {**base, "node_role": "tensor_parallel_rank"}).start(secret))
        group = {"tp_size": tp} | ({"tp_peers": [d.agent for d in daemons]} if across else {})
        zero = Daemon(root, "rank0", HOSTS[0], {**base, **group})
        daemons.insert(0, zero.start(secret))
        wait(f"rank 0's /ready (the group of {tp} formed and loaded)",
             lambda: httpx.get(f"{zero.url}/ready", timeout=5).status_code == 200, zero,
             timeout=READY_S)
        workers = {"rank 0 (router)": _worker(zero, "router")}
        workers |= {f"rank {r}": _worker(daemons[r] if across else zero, f"tp-{r}")
                    for r in range(1, tp)}
        watched = {**workers, **{f"daemon {d.name}": psutil.Process(d.proc.pid)
                                 for d in daemons if d.proc}}
        for d in daemons:
            _pids(d)
        before = {k: cpu_seconds(p) for k, p in watched.items()}
        start = time.perf_counter()
        rounds, texts = [], []
        for round_prompts in prompts:
            with ThreadPoolExecutor(len(round_prompts)) as pool:
                got = list(pool.map(lambda p: _one(zero.url, p, args.new), round_prompts))
            for s in got:
                if s.tokens != args.new:
                    raise SystemExit(f"a stream on rank 0's OpenAI port gave {s.tokens} "
                                     f"tokens, not {args.new} (ignore_eos)")
            rounds.append((statistics.median(s.ttft for s in got),
                           sum(s.decode_tps for s in got)))
            texts.append([s.text for s in got])
        wall = time.perf_counter() - start
        cores = {k: (cpu_seconds(p) - before[k]) / wall for k, p in watched.items()}
        memory = [{"rank": r, **_memory(p)} for r, p in enumerate(workers.values())]
        return {"rounds": rounds, "texts": texts, "memory": memory, "cores": cores}
    finally:
        _end(daemons)
        shutil.rmtree(root, ignore_errors=True)


def _one(url: str, prompt: str, new: int) -> Stream:
    body = {"model": "m", "prompt": prompt, "max_tokens": new, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as r:
        return timed(r, start)


# -- the ring's cost ---------------------------------------------------------------------


def ring_probe(hosts: list[str], shape: list[int], count: int) -> float:
    """The median seconds of one ``all_sum`` of a bfloat16 array of ``shape`` in a ring
    of ``len(hosts)`` processes bound to those IPs (each waits for the result)."""
    ring = [f"{h}:{p}" for h in hosts for p in free_ports(h, 1)]
    procs = [subprocess.Popen([sys.executable, __file__, "--probe",
                               json.dumps({"rank": r, "ring": ring, "shape": shape,
                                           "count": count})],
                              stdout=subprocess.PIPE, text=True) for r in range(len(hosts))]
    try:
        out, _ = procs[0].communicate(timeout=120)
        for p in procs[1:]:
            p.wait(timeout=60)
        if any(p.returncode for p in procs):
            raise SystemExit(f"the ring probe over {ring} failed: "
                             f"{[p.returncode for p in procs]}")
        return float(json.loads(out.strip().splitlines()[-1])["s"])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def _probe(spec: dict[str, Any]) -> None:
    import mlx.core as mx

    from mlxceld.engine.ring import join_ring

    group = join_ring(spec["rank"], spec["ring"])
    x = mx.ones(spec["shape"], dtype=mx.bfloat16)
    took = []
    for i in range(spec["count"] + 20):  # the first 20: warm-up
        t0 = time.perf_counter()
        mx.eval(mx.distributed.all_sum(x, group=group))
        if i >= 20:
            took.append(time.perf_counter() - t0)
    print(json.dumps({"s": statistics.median(took)}), flush=True)


if __name__ == "__main__" and sys.argv[1:2] == ["--probe"]:
    from mlxceld.workers.runtime import exit_at_once
    _probe(json.loads(sys.argv[2]))
    exit_at_once(0)  # as bench/tp.py's workers: mlx's threads can abort the teardown
