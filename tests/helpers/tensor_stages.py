"""A pipeline of two stages, one of them a tensor-parallel group of real rank processes on
loopback (``pipeline/tensor_stage.py``), and the scenario the tests run through it.

``python tests/helpers/tensor_stages.py SPEC_JSON`` runs one rank. The spec: ``rank``,
``hosts`` (each rank's ``127.0.0.1:port``), ``model`` (a checkpoint directory), ``split``
(stage A is layers [0, split), stage B [split, L)), ``tp`` ("A" or "B": the stage that
is the group), ``out`` (rank 0: a file, the scenario's tokens and what it saw as JSON;
a follower: ``OUT.rank<r>``, its steps and the sequences it held at the end),
``share_deadline_s`` (the ranks'), ``idle_s`` (rank 0 idles that long after the
prefills, ``OUT.idle`` made as it begins: its beats keep the followers). Rank 0 writes
the tokens, those of a sequence started from a prompt-cache entry (``reused``: "a"'s
prompt kept from a released sequence, the rest of it and its decode steps run from it),
the entries its store holds at the end, the outputs of a step of a sequence dropped
before it ran, the sequences still open at the end and its slice's parameter bytes; a
follower also the prompt-cache entries it mirrors. Rank 0 runs both stages in one
process, the other one whole, and closes the group when done.

``scenario`` is the steps themselves, over any way of running a group on each stage:
the test runs it over one process's unsharded stages too.
"""

from __future__ import annotations

import json
import os
import struct
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()

# Prompts (token ids) of the three sequences; "c" is dropped after its third token.
PROMPTS = {"a": [5, 6, 7, 8, 9, 10, 11, 12, 13], "b": [20, 21, 22, 23, 24], "c": [40, 41, 42]}
DECODE = 6  # decode steps after each prompt's first token
CHUNK = 4  # "a"'s prompt prefilled in chunks of this many tokens
DROP_AFTER = 3  # "c" dropped once it has this many tokens
OWNER = "127.0.0.1:19000"  # the router whose prompt-cache entries rank 0's store keeps
Runner = Callable[[list[Any]], list[Any]]  # a stage's group of Steps -> its outputs


def scenario(run_a: Runner, run_b: Runner, state: Callable[[str, str], Any],
             drop: Callable[[str], None], pause: Callable[[], None] = lambda: None
             ) -> dict[str, list[int]]:
    """Each prompt prefilled alone ("a" in chunks, only its last one sampling), then
    ``DECODE`` greedy steps of all of them at once, each a batch on both stages, "c"
    dropped midway: each sequence's tokens. ``state(stage, seq)``: the sequence's
    ``SeqState`` on stage "A" or "B" (made when first asked); ``drop(seq)``: it is
    released; ``pause``: between the prefills and the decode steps."""
    from mlxceld.pipeline.compute import Step
    from mlxceld.wire import Tensor

    def ids(tokens: list[int]) -> Tensor:
        return Tensor("tokens", "i32", (1, len(tokens)),
                      memoryview(struct.pack(f"<{len(tokens)}i", *tokens)))

    def through(seqs: list[str], xs: list[Tensor], sample: bool) -> list[Any]:
        outs = run_a([Step(s, state("A", s), 0, sample, x) for s, x in zip(seqs, xs,
                                                                         strict=True)])
        hidden = [Tensor(*out) for out in outs]
        return run_b([Step(s, state("B", s), 0, sample, h) for s, h in zip(seqs, hidden,
                                                                          strict=True)])

    tokens: dict[str, list[int]] = {s: [] for s in PROMPTS}
    for seq, prompt in PROMPTS.items():
        chunks = [prompt[i:i + CHUNK] for i in range(0, len(prompt), CHUNK)] \
            if seq == "a" else [prompt]
        for i, chunk in enumerate(chunks):
            [out] = through([seq], [ids(chunk)], i == len(chunks) - 1)
        tokens[seq].append(out.token)
    pause()
    live = list(PROMPTS)
    for _ in range(DECODE):
        outs = through(live, [ids(tokens[s][-1:]) for s in live], True)
        for seq, out in zip(live, outs, strict=True):
            tokens[seq].append(out.token)
        if "c" in live and len(tokens["c"]) >= DROP_AFTER:
            live.remove("c")
            drop("c")
    return tokens


def start_stage_ranks(model: Path, split: int, tp: str, out: Path, **more: Any
                      ) -> list[Any]:
    """Both ranks of the group (the spec in the module docstring; ``more``: its other
    keys, ``idle_s``, ``share_deadline_s``)."""
    import subprocess

    from mlxceld.discovery.inventory import ring_ports

    hosts = [f"127.0.0.1:{p}" for p in ring_ports("127.0.0.1", 2)]
    procs = []
    for rank in range(2):
        spec = {"rank": rank, "hosts": hosts, "model": str(model), "split": split,
                "tp": tp, "out": str(out), **more}
        procs.append(subprocess.Popen([sys.executable, str(HERE), json.dumps(spec)],
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    return procs


__all__ = ["CHUNK", "DECODE", "DROP_AFTER", "PROMPTS", "scenario", "start_stage_ranks"]


def _main(spec: dict[str, Any]) -> int:
    from mlxceld.engine.sampling import greedy
    from mlxceld.engine.tensor import join_ring
    from mlxceld.models.slicing import load_stage
    from mlxceld.pipeline.compute import SeqState, Step, run_group
    from mlxceld.pipeline.kvstore import StageCache, cloned, held_tokens
    from mlxceld.pipeline.messages import Forget
    from mlxceld.pipeline.tensor_stage import (
        StageLeader,
        load_tensor_stage,
        run_stage_follower,
    )
    from mlxceld.wire import Tensor
    from mlxceld.wire.transport_messages import Attach

    group = join_ring(spec["rank"], spec["hosts"])
    layers = json.loads((Path(spec["model"]) / "config.json").read_text())["num_hidden_layers"]
    bounds = {"A": (0, spec["split"]), "B": (spec["split"], layers)}
    deadline = spec.get("share_deadline_s", 60.0)
    if spec["rank"] > 0:
        seen: list[Any] = []
        run_stage_follower(spec["model"], *bounds[spec["tp"]], group, made=seen.append,
                           share_deadline_s=deadline, hosts=spec["hosts"])
        Path(f"{spec['out']}.rank{spec['rank']}").write_text(json.dumps(
            {"steps": seen[0].steps, "sequences": seen[0].sequences,
             "entries": seen[0].cache.entries}))
        return 0

    tp = load_tensor_stage(spec["model"], *bounds[spec["tp"]], group)
    whole_name = "B" if spec["tp"] == "A" else "A"
    whole = load_stage(spec["model"], *bounds[whole_name])
    leader = StageLeader(tp, group, deadline_s=deadline, hosts=spec["hosts"])
    states: dict[tuple[str, str], SeqState] = {}

    def state(stage: str, seq: str) -> SeqState:
        if (stage, seq) not in states:
            sampler = greedy if stage == "B" else None
            if stage == spec["tp"]:
                states[stage, seq] = SeqState(leader.caches(), sampler)
                leader.open(seq, states[stage, seq])
            else:
                states[stage, seq] = SeqState(whole.make_cache(), sampler)
        return states[stage, seq]

    left: list[Any] = []
    cache = StageCache("tp", 1 << 30, journal=leader)  # rank 0's store, mirrored
    cache.attached(OWNER, Attach("m", "c", cache="epoch"))
    reused: list[int] = []

    def through(seq: str, tokens: list[int], states: dict[str, SeqState],
                snap: bool = False) -> Any:
        """One step of ``seq`` through both stages (its states on each), sampling."""
        x = Tensor("tokens", "i32", (1, len(tokens)),
                   memoryview(struct.pack(f"<{len(tokens)}i", *tokens)))
        for name in "AB":
            step = Step(seq, states[name], 0, True, x)
            x = (leader.run_group([step], snap={seq} if snap else ())
                 if name == spec["tp"] else run_group(whole, [step]))[0]
            x = Tensor(*x) if name == "A" else x
        return x

    def reuse() -> None:
        """"a"'s prompt run by "r", which is released and kept as an entry of 6 tokens;
        "q" starts from it, runs the rest of the prompt (its caches copied after it:
        ``keep_prompt``'s snap, kept too) and decodes: "a"'s tokens, on every rank."""
        prompt, n = PROMPTS["a"], 6
        r = {name: SeqState(leader.caches() if name == spec["tp"] else whole.make_cache(),
                            greedy if name == "B" else None) for name in "AB"}
        leader.open("r", r[spec["tp"]])
        through("r", prompt, r)
        leader.drop("r", park=True)
        assert cache.put(OWNER, "e", r[spec["tp"]].cache, n, ("r", False)).kept
        q = {name: SeqState(leader.caches(), greedy if name == "B" else None)
             if name == spec["tp"] else SeqState(cloned(r[name].cache, n),
                                                 greedy if name == "B" else None)
             for name in "AB"}
        q[spec["tp"]].reuse = cache.reuse(OWNER, ("e", n))
        leader.open("q", q[spec["tp"]], None, (OWNER, "e", n))
        reused.append(through("q", prompt[n:], q, snap=True).token)
        held = held_tokens(q[spec["tp"]].cache)
        assert cache.put(OWNER, "p", cloned(q[spec["tp"]].cache, held), held,
                         ("q", True)).kept
        for _ in range(DECODE):
            reused.append(through("q", reused[-1:], q).token)
        leader.drop("q")
        cache.forget(OWNER, Forget(("e",)))

    def pause() -> None:
        reuse()
        # A step of a sequence dropped while it waited is left out on every rank.
        stale = SeqState(leader.caches(), None)
        leader.open("s", stale)
        leader.drop("s")
        left.extend(leader.run_group([Step("s", stale, 0, True, Tensor(
            "tokens", "i32", (1, 1), memoryview(struct.pack("<i", 5))))]))
        if spec.get("idle_s"):
            Path(spec["out"] + ".idle").touch()
            time.sleep(spec["idle_s"])

    def runner(name: str) -> Runner:
        if name == spec["tp"]:
            return lambda g: leader.run_group(g)
        return lambda g: run_group(whole, g)

    tokens = scenario(runner("A"), runner("B"), state, leader.drop, pause)
    leader.drop("a")
    leader.drop("b")
    held = leader.sequences
    leader.close()
    Path(spec["out"]).write_text(json.dumps({"tokens": tokens, "reused": reused,
                                             "held": held, "nbytes": tp.nbytes,
                                             "left": left, "entries": cache.said(OWNER)
                                             .entries}))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    # as a worker exits (workers/runtime.exit_at_once): no interpreter teardown, which a
    # thread's mlx streams ending at the same time can abort (SIGABRT)
    from mlxceld.workers.runtime import exit_at_once

    exit_at_once(_main(json.loads(sys.argv[1])))
