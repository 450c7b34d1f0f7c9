"""A 2 x 2 mesh from ONE cluster TOML (issue 32): ``pipeline_parallel_size = 2``,
``tensor_parallel_size = 2``, a coordinator and four ``pipeline_tensor_parallel`` nodes
(spelled also ``pp_tp`` and ``2d``, the aliases), five daemons on 127.0.0.2 .. .6, each
started with only ``--distributed-config FILE --node-id ID`` beside its own ports and state
dir (the model and the cluster secret come from the file). Each stage's rank 0 (.3, .4)
runs its ``stage`` worker as rank 0 of a group across hosts (``Placement.tp_peers``,
formed by ``daemon/stage_peers.py`` as ``--pp-peer --tp-peers`` does), its rank 1 (.5,
.6) as ``--node-role tensor_parallel_rank``, whose ``stage-tp-1`` worker runs over the
stage's layers. The file names the model as its own draft (``[cluster] draft_model``):
the last stage's rank 0 drafts, its counters in ``mlxctl status``. Greedy completions
through the ``openai`` client are mlx-lm's on the whole model, and again after a rank
killed with SIGKILL (its stage's ring breaks, the stage restarts and its rank host is
asked again, as the flags' mesh does); every daemon exits 0 on SIGTERM. A file whose
ranks are wrong is refused at start with exit 2 naming the file, the node and the key.
Every process is ended by pid."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import openai
import pytest

from helpers.daemons import FAST_POLICY, READY_S, DaemonProc, Daemons
from helpers.keys import secret_file
from helpers.models import PROMPT, expected
from helpers.ports import free_port
from helpers.router import greedy
from helpers.waiting import wait_for

SECRET = b"the mesh's secret from its file, 32 bytes+"
COORD, STAGES, RANKS = "127.0.0.2", ("127.0.0.3", "127.0.0.4"), ("127.0.0.5", "127.0.0.6")
# Bring-up of five daemons, two formations across hosts, four model processes and a
# router on a loaded 2-core machine. A bound on waiting, not what is asserted about time.
UP_S = 240.0


def write_mesh(root: Path, model: Path, addresses: dict[str, str]) -> Path:
    """The mesh's file: stage 1's nodes first (the stages' order is their layers'), rank
    0's address its stage listener, rank 1's its agent."""
    secret_file(root, SECRET)
    nodes = [("coordinator", "coordinator", None, None),
             ("stage-1-tp-1", "2d", [2, 4], 1), ("stage-1", "pp_tp", [2, 4], 0),
             ("stage-0", "pipeline_tensor_parallel", [0, 2], 0),
             ("stage-0-tp-1", "pipeline_tensor_parallel", [0, 2], 1)]
    text = (f'[cluster]\nname = "mesh"\nmodel = "{model}"\nsecret_file = "cluster.secret"\n'
            "pipeline_parallel_size = 2\ntensor_parallel_size = 2\n"
            f'draft_model = "{model}"\n')  # itself: the last stage's rank 0 drafts
    for node, role, layers, rank in nodes:
        text += f'\n[[nodes]]\nid = "{node}"\naddress = "{addresses[node]}"\nrole = "{role}"\n'
        if layers is not None:
            text += f"layers = {layers}\nrank = {rank}\n"
    path = root / "mesh.toml"
    path.write_text(text)
    return path


def running(d: DaemonProc, name: str) -> dict[str, Any] | None:
    w = next((w for w in d.status()["workers"] if w["name"] == name), None)
    return w if w is not None and w["state"] == "running" else None


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_mesh_from_one_file_serves_mlx_lms_greedy_text(
        daemons: Daemons, split_fixture_dir: Path, tmp_path: Path) -> None:
    model = split_fixture_dir / "llama"
    addresses = {"coordinator": f"{COORD}:{free_port(COORD)}",
                 "stage-0": f"{STAGES[0]}:{free_port(STAGES[0])}",
                 "stage-1": f"{STAGES[1]}:{free_port(STAGES[1])}",
                 "stage-0-tp-1": f"{RANKS[0]}:{free_port(RANKS[0])}",
                 "stage-1-tp-1": f"{RANKS[1]}:{free_port(RANKS[1])}"}
    path = write_mesh(tmp_path, model, addresses)
    port = free_port(COORD)
    ranks = [daemons.make(FAST_POLICY, name=f"r{i}").start(
        "--distributed-config", str(path), "--node-id", node, "--agent-addr", addresses[node])
        for i, node in enumerate(("stage-0-tp-1", "stage-1-tp-1"))]
    stages = [daemons.make(FAST_POLICY, name=f"s{i}").start(
        "--distributed-config", str(path), "--node-id", node, "--agent-addr", f"{ip}:0")
        for i, (node, ip) in enumerate(zip(("stage-0", "stage-1"), STAGES, strict=True))]
    coord = daemons.make(FAST_POLICY, name="c").start(
        "--distributed-config", str(path), "--node-id", "coordinator",
        "--agent-addr", f"{COORD}:0", "--host", COORD, "--port", str(port))
    everyone = (coord, *stages, *ranks)

    def served() -> str | None:
        try:
            return greedy(f"http://{COORD}:{port}", PROMPT, 8, model="llama")
        except openai.APIError:
            return None

    try:
        for s, r in zip(stages, ranks, strict=True):
            wait_for(lambda s=s: running(s, "stage"), UP_S, "the stage worker, once its "
                     "group formed across hosts", every=0.5)
            wait_for(lambda r=r: running(r, "stage-tp-1"), READY_S, "the rank host's rank",
                     every=0.5)
        wait_for(lambda: running(coord, "router"), READY_S, "the coordinator's router",
                 every=0.5)
        got = wait_for(served, READY_S, "a completion through the mesh", every=1.0)
    except BaseException:
        for d in everyone:
            print(d.stderr()[-3000:], "----", sep="\n")
        raise
    finally:
        for d in everyone:
            daemons.note(d)
    assert got == expected(model, PROMPT, 8)  # with the draft: the model's own tokens
    wait_for(lambda: "stage: speculative decoding:" in stages[1].ctl("status").stdout
             and " of 0 draft tokens" not in stages[1].ctl("status").stdout, 20.0,
             "the last stage's rank 0's draft counters in mlxctl status")
    assert "speculative decoding" not in stages[0].ctl("status").stdout

    for i, (s, r) in enumerate(zip(stages, ranks, strict=True)):
        tensor = s.status()["tensor"]
        assert tensor["role"] == "rank0" and tensor["state"] == "formed", tensor
        assert tensor["stage"] == {"layers": [2 * i, 2 * i + 2], "node_id": f"stage-{i}"}
        assert tensor["ranks"][1]["agent"] == addresses[f"stage-{i}-tp-1"], tensor
        assert (running(s, "stage") or {}).get("stats", {}).get("tensor") == {
            "rank": 0, "size": 2}
        assert "stage-tp-1" not in {w["name"] for w in s.status()["workers"]}
        shown = r.status()["tensor"]
        assert shown["worker"] == "stage-tp-1" and shown["stage"]["layers"] == [2 * i,
                                                                                2 * i + 2]
        assert {w["name"] for w in r.status()["workers"]} == {"stage-tp-1"}
        assert "tensor.formed" in [e["kind"] for e in s.events()]
    assert (coord.status()["cluster"] or {})["stages"] == 2

    # A rank killed: its stage's ring breaks, the stage restarts, its rank host is asked
    # again (the placement's group kept by daemon/stage_peers.py), and the mesh serves the
    # same tokens again.
    before = (running(stages[1], "stage") or {})["pid"]
    os.kill((running(ranks[1], "stage-tp-1") or {})["pid"], signal.SIGKILL)
    try:
        wait_for(lambda: (w := running(stages[1], "stage")) and w["pid"] != before, UP_S,
                 "the stage restarted after its ring broke", every=0.5)
        assert wait_for(served, UP_S, "a completion once the group is back",
                        every=1.0) == got
    except BaseException:
        for d in (stages[1], ranks[1]):
            print(d.stderr()[-4000:], [(e["kind"], e["message"]) for e in d.events()[-12:]],
                  "----", sep="\n")
        raise
    finally:
        for d in everyone:
            daemons.note(d)
    assert "tensor.rejoin" in [e["kind"] for e in stages[1].events()]

    # Stopped as a service manager stops them: every daemon exits 0.
    for d in everyone:
        assert d.terminate() == 0, d.stderr()[-2000:]


def test_a_wrong_mesh_file_is_refused_at_start_naming_the_node_and_key(
        daemons: Daemons, split_fixture_dir: Path, tmp_path: Path) -> None:
    addresses = {"coordinator": f"{COORD}:19000", "stage-0": f"{STAGES[0]}:19100",
                 "stage-1": f"{STAGES[1]}:19100", "stage-0-tp-1": f"{RANKS[0]}:19000",
                 "stage-1-tp-1": f"{RANKS[1]}:19000"}
    path = write_mesh(tmp_path, split_fixture_dir / "llama", addresses)
    path.write_text(path.read_text().replace("layers = [2, 4]\nrank = 1",
                                             "layers = [2, 4]\nrank = 2"))
    d = daemons.make(name="bad")
    d.start("--distributed-config", str(path), "--node-id", "stage-0", wait=False)
    assert d.proc is not None
    assert d.proc.wait(timeout=60) == 2, d.stderr()
    out = d.stderr()
    assert "Traceback" not in out, out
    assert (f"{path}: node 'stage-1-tp-1': 'rank' is 2, but 'cluster.tensor_parallel_size' "
            "is 2 (ranks 0 .. 1)") in out, out
