"""mlx-lm, what bench/families.py measures our pipeline against: one process, and its own
pipeline of two ranks.

``greedy`` is the one generation loop of both: mlx-lm's ``stream_generate`` (argmax,
stops at EOS or ``max_tokens``), timed per yielded token. ``pipeline_problem`` says
why mlx-lm cannot pipeline a checkpoint (None when it can), by mlx-lm's own test in
``sharded_load``: the model's inner model has ``pipeline`` (its ``PipelineMixin``),
and the checkpoint has a ``model.safetensors.index.json`` to pick a rank's shards
from. ``run_pipeline`` starts two ranks with ``mlx.launch --backend ring`` on
127.0.0.1 (a hostfile naming it twice, two consecutive free ports), each running
this file with ``--rank-job``: ``sharded_load`` with the ring group (mlx-lm splits
evenly, rank 1 the first layers, rank 0 the last; both keep the embeddings, the
final norm and the head), a warm-up, then the timed runs; each rank writes what it
measured to ``rank{N}.json``. The launcher and both ranks are ended by pid when it
returns, times out (``timeout_s``) or is interrupted.

``start_server`` starts ``mlx_lm.server`` on a free port of 127.0.0.1 (what bench/serve.py
and bench/conversation.py measure our router against), ``wait_ready`` waits for a server's
``/health`` (mlx_lm.server's and our router's answer 200 once the model is loaded).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil
from loopback import free_port
from streams import Stream

INDEX = "model.safetensors.index.json"


@dataclass
class Run:
    """One greedy generation: its timings, token ids and streamed text pieces."""

    stream: Stream
    ids: list[int]
    pieces: list[str]

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    def as_json(self) -> dict[str, Any]:
        s = self.stream
        return {"ttft": s.ttft, "tokens": s.tokens, "decode_s": s.decode_s,
                "total_s": s.total_s, "ids": self.ids, "pieces": self.pieces}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Run:
        return cls(Stream(d["ttft"], d["tokens"], d["decode_s"], d["total_s"]),
                   list(d["ids"]), list(d["pieces"]))


def greedy(model: Any, tokenizer: Any, prompt: list[int], max_tokens: int) -> Run:
    """mlx-lm's ``stream_generate``, greedy: the ids it yields (the EOS that stops it not
    among them), its text pieces, the time of each."""
    from mlx_lm.generate import stream_generate

    start = time.perf_counter()
    stamps: list[float] = []
    ids: list[int] = []
    pieces: list[str] = []
    for r in stream_generate(model, tokenizer, prompt, max_tokens=max_tokens):
        if r.finish_reason == "stop":  # the EOS: not a generated token
            pieces.append(r.text)
            break
        stamps.append(time.perf_counter())
        ids.append(int(r.token))
        pieces.append(r.text)
    if not stamps:
        return Run(Stream(0.0, 0, 1e-9, time.perf_counter() - start), ids, pieces)
    return Run(Stream(stamps[0] - start, len(stamps), max(stamps[-1] - stamps[0], 1e-9),
                      stamps[-1] - start), ids, pieces)


def pipeline_problem(path: Path) -> str | None:
    """Why mlx-lm's ``sharded_load`` cannot pipeline the checkpoint at ``path``, or None."""
    from mlx_lm.utils import load_model

    model, config = load_model(path, lazy=True, strict=False)
    if not (hasattr(model, "model") and hasattr(model.model, "pipeline")):
        return f"mlx-lm has no pipeline for {config.get('model_type')}"
    if not (path / INDEX).exists():
        return f"the checkpoint has no {INDEX} for sharded_load to pick shards from"
    return None


# -- mlx_lm.server --------------------------------------------------------------------------


@dataclass
class Server:
    """An ``mlx_lm.server`` process and its OpenAI base URL (it serves its ``--model`` as
    ``default_model``)."""

    proc: subprocess.Popen[bytes]
    url: str
    model_id: str = "default_model"


def start_server(model: Path, log: Path | None, *flags: str) -> Server:
    """``mlx_lm.server --model MODEL`` on a free port of 127.0.0.1 with ``flags``, its output
    to ``log`` (None: discarded). It is not ready yet: ``wait_ready``."""
    port = free_port("127.0.0.1")
    with contextlib.ExitStack() as files:
        out = (files.enter_context(log.open("ab")) if log is not None
               else subprocess.DEVNULL)
        proc = subprocess.Popen([sys.executable, "-m", "mlx_lm.server", "--model", str(model),
                                 "--port", str(port), "--log-level", "WARNING", *flags],
                                stdin=subprocess.DEVNULL, stdout=out, stderr=out)
    return Server(proc, f"http://127.0.0.1:{port}/v1")


def wait_ready(url: str, proc: subprocess.Popen[bytes], what: str, timeout: float = 600) -> None:
    """Wait for ``url``'s server to answer ``/health`` with 200: both mlx_lm.server and our
    router do only once the model is loaded."""
    health = url.removesuffix("/v1") + "/health"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{what} exited with {proc.returncode}")
        try:
            if httpx.get(health, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass  # not up yet
        time.sleep(0.5)
    raise SystemExit(f"{what} not ready after {timeout} s")


# -- the two ranks --------------------------------------------------------------------------


class PipelineFailed(RuntimeError):
    """mlx-lm's pipeline did not run to its end (the message says why, with its log)."""


@dataclass
class Rank:
    rank: int
    layers: tuple[int, int]
    weights: int  # parameter bytes the rank holds
    rss: int  # after the runs
    peak_rss: int | None  # VmHWM (Linux); None elsewhere
    runs: list[Run]


def free_port_pair(host: str = "127.0.0.1", tries: int = 50) -> int:
    """A port p with p and p + 1 both free on ``host`` (the ring backend listens on
    consecutive ports from ``--starting-port``)."""
    for _ in range(tries):
        with socket.socket() as a:
            a.bind((host, 0))
            port: int = a.getsockname()[1]
            if port >= 65535:
                continue
            with socket.socket() as b:
                try:
                    b.bind((host, port + 1))
                except OSError:
                    continue
                return port
    raise RuntimeError(f"no two consecutive free ports on {host} in {tries} tries")


def end_tree(proc: subprocess.Popen[bytes], grace_s: float = 5.0) -> None:
    """End ``proc`` and every process under it, each by its pid: SIGTERM, then SIGKILL
    after ``grace_s``."""
    try:
        tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    except psutil.Error:
        tree = []
    for p in tree:
        with contextlib.suppress(psutil.Error):
            p.terminate()
    _, alive = psutil.wait_procs(tree, timeout=grace_s)
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(alive, timeout=grace_s)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=grace_s)
    if proc.stdin is not None:
        proc.stdin.close()


def run_pipeline(path: Path, prompt: list[int], max_tokens: int, runs: int, root: Path,
                 timeout_s: float, procs: list[subprocess.Popen[bytes]]) -> list[Rank]:
    """mlx-lm's pipeline of two ranks over ``path``: ``runs`` timed greedy generations
    after one warm-up, in rank order. ``procs`` holds the launcher while it runs (the
    caller's clean-up ends it on an interrupt)."""
    root.mkdir(parents=True, exist_ok=True)
    hostfile = root / "hosts.json"
    hostfile.write_text(json.dumps([{"ssh": "127.0.0.1", "ips": ["127.0.0.1"]}] * 2))
    launch = Path(sys.executable).with_name("mlx.launch")
    job = root / "job.json"
    job.write_text(json.dumps({"model": str(path), "prompt": prompt,
                               "max_tokens": max_tokens, "runs": runs, "out": str(root)}))
    log = root / "launch.log"
    with log.open("wb") as out:
        # stdin a pipe we never write: the launcher polls its stdin, and /dev/null (always
        # readable) would make that a busy loop on our CPUs.
        proc = subprocess.Popen(
            [str(launch), "--backend", "ring", "--hostfile", str(hostfile),
             "--starting-port", str(free_port_pair()), "--",
             sys.executable, __file__, "--rank-job", str(job)],
            stdin=subprocess.PIPE, stdout=out, stderr=out, start_new_session=True,
            env={**os.environ, "TMPDIR": str(root)})  # its pid files and hostfiles: ours
    procs.append(proc)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise PipelineFailed(f"mlx-lm's pipeline on {path.name} did not finish within "
                             f"{timeout_s:g} s:\n{tail(log)}") from None
    finally:
        end_tree(proc)
        procs.remove(proc)
    ranks = []
    for r in range(2):
        out_file = root / f"rank{r}.json"
        if proc.returncode != 0 or not out_file.exists():
            raise PipelineFailed(f"rank {r} wrote no result (mlx.launch exited "
                                 f"{proc.returncode}):\n{tail(log)}")
        d = json.loads(out_file.read_text())
        ranks.append(Rank(r, tuple(d["layers"]), d["weights"], d["rss"], d["peak_rss"],
                          [Run.from_json(x) for x in d["runs"]]))
    return ranks


def tail(log: Path) -> str:
    """The end of the launcher's log, without the ring backend's repeated socket lines."""
    lines = [line for line in log.read_text(errors="replace").splitlines()
             if not line.startswith("[ring]")]
    return "\n".join(lines[-30:])


def peak_rss(pid: int) -> int | None:
    """A process's peak RSS: VmHWM from /proc (Linux); None where there is none."""
    status = Path(f"/proc/{pid}/status")
    with contextlib.suppress(OSError):
        for line in status.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return None


def rank_job(job_file: str) -> None:
    """In one rank (started by mlx.launch): load this rank's layers, warm up, time."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import sharded_load

    job = json.loads(Path(job_file).read_text())
    group = mx.distributed.init(strict=True, backend="ring")
    model, tokenizer = sharded_load(job["model"], pipeline_group=group)
    inner = model.model
    leaves = dict(tree_flatten(model.parameters())).values()
    weights = sum(v.nbytes for v in leaves if hasattr(v, "nbytes"))

    def barrier() -> None:
        """Both ranks here: stream_generate leaves one step in flight when it stops, and a
        rank that went on (or exited) while the other still ran it would break the ring."""
        mx.eval(mx.distributed.all_sum(mx.array(1.0), group=group, stream=mx.cpu))

    greedy(model, tokenizer, job["prompt"], 4)  # warm up
    barrier()
    runs = []
    for _ in range(job["runs"]):
        runs.append(greedy(model, tokenizer, job["prompt"], job["max_tokens"]))
        barrier()
    proc = psutil.Process()
    result = {"layers": [inner.start_idx, inner.end_idx], "weights": weights,
              "rss": proc.memory_info().rss, "peak_rss": peak_rss(proc.pid),
              "runs": [r.as_json() for r in runs]}
    out = Path(job["out"]) / f"rank{group.rank()}.json"
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(result))
    tmp.rename(out)
    barrier()  # neither exits while the other still writes


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--rank-job":
        rank_job(sys.argv[2])
    else:
        raise SystemExit("usage: mlxlm.py --rank-job JOB.json (started by mlx.launch; "
                         "see bench/families.py)")
