"""A mesh the planner chose, pushed (issue 32): `mlxceld --pp-auto N --mesh M` over plain
`--pp-peer` daemons on 127.0.0.x, none told anything of tensor groups. The offer carries
each rank's group (``Offer.tp_group``): a stage's rank 0 forms its group across hosts from
the pushed cluster TOML (``Placement.tp_peers``), a rank past 0 answers its rank 0's joins
for that stage (``RankHost.assign``) and runs ``stage-tp-<rank>``. Greedy completions
through the `openai` client are mlx-lm's on the whole model. Every process ended by pid."""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Any

import pytest

from helpers.cluster import agent, start
from helpers.daemons import READY_S, DaemonProc, Daemons
from helpers.keys import secret_file
from helpers.models import PROMPT, expected
from helpers.ports import free_port
from helpers.router import client
from helpers.waiting import wait_for

UP_S = 300.0  # a bound on waiting for a bring-up on a loaded 2-core machine


def worker(d: DaemonProc, name: str) -> dict[str, Any] | None:
    w = next((w for w in d.status()["workers"] if w["name"] == name), None)
    return w if w is not None and w["state"] == "running" else None


def complete(port: int) -> str:
    with client(f"http://127.0.0.1:{port}/v1") as c:
        text: str = c.completions.create(model="llama", prompt=PROMPT, max_tokens=8,
                                         temperature=0).choices[0].text
        return text


def bring_up(daemons: Daemons, model: Path, n: int, mesh: str
             ) -> tuple[DaemonProc, list[DaemonProc], int]:
    secret = secrets.token_hex(16).encode()
    peers = [start(daemons, f"127.0.0.{i}", secret, "--pp-peer", "--model", str(model),
                   name=f"p{i}") for i in range(2, 2 + n)]
    port = free_port("127.0.0.1")
    coord = daemons.make(name="c")
    coord.start("--cluster-secret-file", str(secret_file(coord.root, secret)),
                "--agent-addr", f"127.0.0.1:{free_port('127.0.0.1')}",
                "--cluster-peers", ",".join(agent(p) for p in peers), "--pp-auto", str(n),
                "--mesh", mesh, "--model", str(model), "--port", str(port))
    wait_for(lambda: (coord.status().get("bringup") or {}).get("state") in ("active", "failed"),
             UP_S, "the push to end")
    bringup = coord.status()["bringup"]
    assert bringup["state"] == "active", (bringup, *(p.stderr()[-2500:] for p in peers))
    daemons.pids.add(coord.wait_worker("router", timeout=READY_S, state="running")["pid"])
    return coord, peers, port


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_pp_auto_2_mesh_tp_serves_mlx_lms_tokens(daemons: Daemons,
                                                 split_fixture_dir: Path) -> None:
    """One stage, a group of 2: rank 0 on 127.0.0.2 (the lower address), rank 1 on .3."""
    model = split_fixture_dir / "llama"
    coord, (zero, one), port = bring_up(daemons, model, 2, "tp")
    daemons.pids.add(zero.wait_worker("stage", timeout=READY_S, state="running")["pid"])
    daemons.pids.add(one.wait_worker("stage-tp-1", timeout=READY_S, state="running")["pid"])
    assert complete(port) == expected(model, PROMPT, 8)
    tensor = zero.status()["tensor"]
    assert tensor["role"] == "rank0" and tensor["state"] == "formed", tensor
    assert tensor["ranks"][1]["agent"] == agent(one), tensor
    shown = one.status()["tensor"]
    assert shown["worker"] == "stage-tp-1" and shown["rank0"] == tensor["ranks"][0]["ring"]
    assert "stage" not in {w["name"] for w in one.status()["workers"]}
    rows = {p["address"]: p for p in coord.status()["bringup"]["peers"]}
    assert {rows[agent(zero)]["stage"], rows[agent(one)]["stage"]} == {"stage-0",
                                                                        "stage-0-tp-1"}
    assert all(r["state"] == "active" for r in rows.values()), rows


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_pp_auto_4_mesh_2d_serves_mlx_lms_tokens(daemons: Daemons,
                                                 split_fixture_dir: Path) -> None:
    """Two stages, each a group of 2, over four plain --pp-peer daemons (127.0.0.2 .. .5)."""
    model = split_fixture_dir / "llama"
    coord, peers, port = bring_up(daemons, model, 4, "2d")
    rows = {p["address"]: p for p in coord.status()["bringup"]["peers"]}
    named = {agent(p): rows[agent(p)]["stage"] for p in peers}
    assert sorted(named.values()) == ["stage-0", "stage-0-tp-1", "stage-1", "stage-1-tp-1"]
    for p in peers:
        name = "stage-tp-1" if named[agent(p)].endswith("-tp-1") else "stage"
        daemons.pids.add(p.wait_worker(name, timeout=READY_S, state="running")["pid"])
    assert complete(port) == expected(model, PROMPT, 8)
    by_name = {v: p for p in peers for k, v in named.items() if k == agent(p)}
    for i in (0, 1):
        tensor = by_name[f"stage-{i}"].status()["tensor"]
        assert tensor["state"] == "formed" and tensor["stage"]["node_id"] == f"stage-{i}"
        assert tensor["ranks"][1]["agent"] == agent(by_name[f"stage-{i}-tp-1"]), tensor
