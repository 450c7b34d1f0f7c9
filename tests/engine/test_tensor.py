"""Tensor parallelism (engine/tensor.py) with real rank processes on loopback: each rank a
process of its own (``helpers.tensor_ranks``), joined in an ``mx.distributed`` ring.

Greedy output at tp 2 is token-identical to one process for the llama and qwen3 fixtures,
batched, with the prompt cache in play, a cancelled sequence, penalties, logit bias and a
seed; log-probabilities agree within ``LOGPROB_TOLERANCE`` (the ranks' sums of partial
projections round differently from one process's whole ones). A rank whose peer dies
ends at once, naming it, and a ring whose ranks do not all come fails at its deadline.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from mlxceld.discovery.inventory import ring_ports
from mlxceld.engine.loading import load_local_engine
from mlxceld.roles.options import KVQuant

from helpers.models import FAMILIES, write_tiny_checkpoints
from helpers.tensor_ranks import HERE, finish, generated, start_ranks
from helpers.waiting import wait_for

LOGPROB_TOLERANCE = 1e-4  # measured: at most 2.2e-6 on the tiny fixtures
LONG = [3 + (i * 7) % 240 for i in range(600)]  # more than one prefill chunk (512)
REQUESTS: list[dict[str, Any]] = [
    {"prompt": [5, 6, 7, 8, 9], "max_tokens": 12, "temperature": 0},
    {"prompt": [5, 6, 7, 8, 9, 1], "max_tokens": 9, "temperature": 0, "logprobs": 2},
    {"prompt": [10, 11, 12], "max_tokens": 10, "temperature": 0.8, "seed": 3},
    {"prompt": [20, 21, 22, 23], "max_tokens": 10, "temperature": 0,
     "repetition_penalty": 1.3, "logit_bias": [[40, 2.0]]},
    {"prompt": LONG, "max_tokens": 6, "temperature": 0},
    {"prompt": [30, 31, 32], "max_tokens": 40, "temperature": 0, "cancel_after": 3},
]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoints(tmp_path_factory.mktemp("tp-models"))


def one_process(model: Path, rounds: int, kv: KVQuant | None = None
                ) -> list[list[dict[str, Any]]]:
    """``REQUESTS`` on one process's engine, as the ranks run them."""
    engine, _ = load_local_engine(str(model), max_batch=4, kv_quant=kv)

    async def run() -> list[list[dict[str, Any]]]:
        out = []
        try:
            for _ in range(rounds):
                out.append(list(await asyncio.gather(
                    *(generated(engine, i, r) for i, r in enumerate(REQUESTS)))))
        finally:
            await engine.aclose()
        return out

    return asyncio.run(run())


@pytest.mark.parametrize("family", FAMILIES)
def test_two_ranks_generate_what_one_process_does(models: Path, family: str,
                                                  tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    procs = start_ranks(models / family, 2, REQUESTS, out, rounds=2, handoff=True)
    results = finish(procs)
    for rank, (code, text) in enumerate(results):
        assert code == 0, f"rank {rank} exited {code}:\n{text[-3000:]}"
    got = json.loads(out.read_text())
    want = one_process(models / family, rounds=2)
    for r, (tp_round, one_round) in enumerate(zip(got["rounds"], want, strict=True)):
        for i, (tp, one) in enumerate(zip(tp_round, one_round, strict=True)):
            assert tp["tokens"] == one["tokens"], f"round {r}, request {i}"
            if REQUESTS[i].get("logprobs") is not None:
                assert max(abs(a - b) for a, b in zip(tp["logprobs"], one["logprobs"],
                                                      strict=True)) < LOGPROB_TOLERANCE
    assert len(got["rounds"][0][5]["tokens"]) == 3  # cancelled; the others went on
    assert "tensor-parallel" in got["handoff"] and "tp_size 1" in got["handoff"]


def test_two_ranks_with_a_quantized_kv_cache_generate_what_one_process_does(
        kv_fixture_dir: Path, tmp_path: Path) -> None:
    """``kv_quant`` on rank 0 only: its setup op tells rank 1, whose caches quantize alike
    (else their steps' shapes would differ and the ring would break); greedy tokens are one
    process's with the same cache, batched, the prompt cache in play in the second round.
    At 4 bits, where full precision gives other tokens."""
    kv = KVQuant(4, 64, 0)
    out = tmp_path / "out.json"
    procs = start_ranks(kv_fixture_dir / "qwen3", 2, REQUESTS, out, rounds=2,
                        kv={"bits": kv.bits, "group_size": kv.group_size, "start": kv.start})
    results = finish(procs)
    for rank, (code, text) in enumerate(results):
        assert code == 0, f"rank {rank} exited {code}:\n{text[-3000:]}"
    got = json.loads(out.read_text())
    want = one_process(kv_fixture_dir / "qwen3", rounds=2, kv=kv)
    for r, (tp_round, one_round) in enumerate(zip(got["rounds"], want, strict=True)):
        for i, (tp, one) in enumerate(zip(tp_round, one_round, strict=True)):
            assert tp["tokens"] == one["tokens"], f"round {r}, request {i}"
    full = one_process(kv_fixture_dir / "qwen3", rounds=1)
    assert [one["tokens"] for one in full[0]] != [one["tokens"] for one in want[0]]


@pytest.mark.parametrize("lost", [1, 0])
def test_an_idle_rank_whose_peer_dies_fails_at_its_next_heartbeat(models: Path,
                                                                  tmp_path: Path,
                                                                  lost: int) -> None:
    """kill -9 of one rank while rank 0 idles: the other ends at once, naming the lost
    peer (rank 0 as the follower's op link closes, or at its next heartbeat; a follower
    as its op link ends)."""
    out = tmp_path / "out.json"
    procs = start_ranks(models / "llama", 2,
                        [{"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0}], out,
                        idle_s=3.0, share_deadline_s=5.0)
    try:
        wait_for(lambda: Path(f"{out}.idle").exists() or any(
            p.poll() is not None for p in procs), timeout=120.0, what="rank 0 to idle")
        assert all(p.poll() is None for p in procs), [p.poll() for p in procs]
        procs[lost].kill()
        other = procs[1 - lost]
        wait_for(lambda: other.poll() is not None, timeout=30.0,
                 what=f"rank {1 - lost} to fail once rank {lost} is gone")
    finally:
        results = finish(procs, deadline_s=10.0)
    code, text = results[1 - lost]
    assert code != 0
    if lost == 1:
        assert "tensor-parallel rank 1 (worker tp-1) is gone" in text, text[-2000:]
    else:  # its op link ended
        assert "tensor-parallel rank 1 lost rank 0" in text, text[-2000:]


def test_rank_0_ends_when_a_follower_dies_mid_step(models: Path, tmp_path: Path) -> None:
    """kill -9 of rank 1 while rank 0 generates: mlx raises in rank 0's step, or leaves it
    waiting on its stream for good, when its watchdog sees the op link close, fails the
    request in flight naming why, and ends it (status 1)."""
    out = tmp_path / "out.json"
    procs = start_ranks(models / "llama", 2,
                        [{"prompt": [5, 6, 7], "max_tokens": 100_000, "temperature": 0}],
                        out, share_deadline_s=3.0)
    try:
        wait_for(lambda: Path(f"{out}.started").exists() or any(
            p.poll() is not None for p in procs), timeout=120.0, what="the first token")
        assert all(p.poll() is None for p in procs), [p.poll() for p in procs]
        procs[1].kill()
        wait_for(lambda: procs[0].poll() is not None, timeout=30.0,
                 what="rank 0 to end once rank 1 is gone")
    finally:
        results = finish(procs, deadline_s=10.0)
    code, text = results[0]
    assert code != 0  # 1 from the watchdog; mlx may abort the teardown after it raised
    # The request in flight heard why, as a 503 (EngineUnavailable): from the watchdog, or
    # from mlx when it does raise.
    assert "EngineUnavailable: the tensor-parallel group broke: " in text, text[-2000:]
    # (mlx's own words name no rank: of a group of 2, rank 0 names its only follower). The
    # watchdog sees the link closed, or the next share's send is reset (CI saw both).
    assert ("broke: tensor-parallel rank 1 (worker tp-1) is gone: its op link closed; the "
            "daemon restarts it" in text
            or "broke: tensor-parallel rank 1 (worker tp-1) is gone: its op link failed (" in text
            or "broke: tensor-parallel rank 1 (worker tp-1) is gone: [ring] connection to a "
            "peer was lost" in text), text[-2000:]


def test_rank_0_names_a_stopped_follower_silent_within_the_bound(
        models: Path, tmp_path: Path) -> None:
    """SIGSTOP of rank 1 while rank 0 generates: no link ends and rank 0's step waits in
    the ring, but rank 1's heartbeats stop: rank 0 fails the request in flight within
    ``heartbeats.SILENCE_S`` (3 s; asserted with room for a loaded machine), a 503 naming
    the rank. Rank 1 is continued and killed by pid at the end."""
    import os
    import signal

    out = tmp_path / "out.json"
    procs = start_ranks(models / "llama", 2,
                        [{"prompt": [5, 6, 7], "max_tokens": 100_000, "temperature": 0}],
                        out)
    try:
        wait_for(lambda: Path(f"{out}.started").exists() or any(
            p.poll() is not None for p in procs), timeout=120.0, what="the first token")
        assert all(p.poll() is None for p in procs), [p.poll() for p in procs]
        os.kill(procs[1].pid, signal.SIGSTOP)
        stopped = time.monotonic()
        wait_for(lambda: procs[0].poll() is not None, timeout=30.0,
                 what="rank 0's request to fail once rank 1 is silent")
        took = time.monotonic() - stopped
    finally:
        if procs[1].poll() is None:
            os.kill(procs[1].pid, signal.SIGCONT)
            procs[1].kill()
        results = finish(procs, deadline_s=10.0)
    text = results[0][1]
    assert ("EngineUnavailable: tensor-parallel rank 1 (worker tp-1) is silent: nothing "
            "heard from it for 3 s (stopped or hung)" in text), text[-2000:]
    assert took < 3.0 + 3.0, took  # the bound, and a loaded machine's slack


def test_a_ring_whose_ranks_do_not_all_come_fails_at_its_deadline() -> None:
    """mlx waits for every rank without end: the process exits at the deadline, its log
    naming the rank that did not come."""
    hosts = [f"127.0.0.1:{p}" for p in ring_ports("127.0.0.1", 2)]
    root = str(HERE.parent.parent.parent)
    code = (f"import sys; sys.path.insert(0, {root!r})\n"
            "from mlxceld.engine.tensor import join_ring\n"
            f"join_ring(0, {hosts!r}, deadline_s=1.0)\n")
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"rank 1 ({hosts[1]})" in done.stderr and "within 1 s" in done.stderr
    assert "Timeout" in done.stderr  # faulthandler's: where it waited
    assert time.monotonic() - t0 < 30
