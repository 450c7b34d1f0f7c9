"""A mesh the planner chose, pushed (issue 32): `mlxceld --pp-auto N --mesh M` over plain
`--pp-peer` daemons on 127.0.0.x, none told anything of tensor groups. The offer carries
each rank's group (``Offer.tp_group``): a stage's rank 0 forms its group across hosts from
the pushed cluster TOML (``Placement.tp_peers``), a rank past 0 answers its rank 0's joins
for that stage (``RankHost.assign``) and runs ``stage-tp-<rank>``. Greedy completions
through the `openai` client are mlx-lm's on the whole model. Every process ended by pid."""

from __future__ import annotations

import os
import secrets
import signal
from pathlib import Path

import openai
import pytest

from helpers.cluster import agent, coordinator, start
from helpers.daemons import READY_S, DaemonProc, Daemons
from helpers.keys import secret_file
from helpers.mesh import complete
from helpers.models import PROMPT, expected
from helpers.ports import free_port
from helpers.waiting import wait_for

UP_S = 300.0  # a bound on waiting for a bring-up on a loaded 2-core machine


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


def ctl_activate(coord: DaemonProc, model: Path, n: int, mesh: str) -> None:
    out = coord.ctl("cluster", "activate", "--model", str(model), "--stages", str(n),
                    "--mesh", mesh, timeout=UP_S)
    assert out.returncode == 0, (out.stdout, out.stderr, coord.stderr()[-3000:])


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_activate_moves_between_meshes_and_deactivate_stops_every_rank(
        daemons: Daemons, split_fixture_dir: Path) -> None:
    """`mlxctl cluster activate --mesh 2d` over four --pp-peer daemons, then `--mesh tp` of
    two (a rank past 0 may become a rank 0, a rank 0 a rank past 0 or nothing: each group
    stopped before the next plan's loads), then `--mesh pp`; each serves mlx-lm's tokens.
    `cluster deactivate` stops every rank's worker."""
    model = split_fixture_dir / "llama"
    secret = secrets.token_hex(16).encode()
    peers = [start(daemons, f"127.0.0.{i}", secret, "--pp-peer", "--model", str(model),
                   name=f"p{i}") for i in range(2, 6)]
    port = free_port("127.0.0.1")
    coord = daemons.make(name="c")
    coord.start("--cluster-secret-file", str(secret_file(coord.root, secret)),
                "--agent-addr", f"127.0.0.1:{free_port('127.0.0.1')}",
                "--cluster-peers", ",".join(agent(p) for p in peers), "--port", str(port))
    wait_for(lambda: all(r["state"] == "reachable" for r in coord.api(
        lambda c: c.cluster_nodes())["nodes"]) and len(coord.api(
            lambda c: c.cluster_nodes())["nodes"]) == 4, 30, "four peers reachable")
    want = expected(model, PROMPT, 8)
    for n, mesh, names in ((4, "2d", {"stage-0", "stage-0-tp-1", "stage-1", "stage-1-tp-1"}),
                           (2, "tp", {"stage-0", "stage-0-tp-1"}),
                           (2, "pp", {"stage-0", "stage-1"})):
        try:
            ctl_activate(coord, model, n, mesh)
            rows = {r["address"]: r for r in coord.status()["bringup"]["peers"]}
            assert {r["stage"] for r in rows.values()} == names, rows
            for p in peers:
                row = rows.get(agent(p))
                if row is not None:
                    name = "stage-tp-1" if row["stage"].endswith("-tp-1") else "stage"
                    daemons.pids.add(p.wait_worker(name, timeout=READY_S,
                                                   state="running")["pid"])
            daemons.pids.add(coord.wait_worker("router", timeout=READY_S,
                                               state="running")["pid"])
            assert wait_for(lambda: _served(port), READY_S, f"--mesh {mesh} serving",
                            every=1.0) == want
        except BaseException:
            for p in peers:
                print(p.stderr()[-2500:], [(e["kind"], e["message"]) for e in p.events()[-10:]],
                      "----", sep="\n")
            raise
        finally:
            for d in (coord, *peers):
                daemons.note(d)
    # a pipeline now: no host shows a tensor group any more
    assert all(p.status().get("tensor") is None for p in peers), [
        p.status().get("tensor") for p in peers]
    out = coord.ctl("cluster", "deactivate", timeout=60)
    assert out.returncode == 0, out.stderr
    for p in peers:
        wait_for(lambda p=p: not {w["name"] for w in p.status()["workers"]
                                  if w["state"] == "running"}, 60, "no worker left")


def _served(port: int) -> str | None:
    try:
        return complete(port)
    except openai.APIError:  # the router moving to the new plan: asked again
        return None


HEALING = """
[daemon]
peer_ping_interval_s = 0.25
peer_suspect_after_s = 1.0
peer_dead_after_s = 2.0
heal_after_s = 2.0
"""


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_mesh_that_lost_a_rank_host_is_healed_over_the_hosts_alive(
        daemons: Daemons, split_fixture_dir: Path) -> None:
    """tp 2 over two of three --pp-peer daemons; its rank host asleep (SIGSTOP: daemon and
    rank worker) past the detector's bound: the coordinator re-plans a mesh of the two hosts
    alive (``--mesh auto``: tp or a pipeline), pushes it with a new epoch and serves
    mlx-lm's tokens from it."""
    model = split_fixture_dir / "llama"
    secret = secrets.token_hex(16).encode()
    peers = [start(daemons, f"127.0.0.{i}", secret, "--pp-peer", "--model", str(model),
                   name=f"p{i}") for i in range(2, 5)]
    coord, port, _ = coordinator(daemons, secret, peers, HEALING)
    ctl_activate(coord, model, 2, "tp")
    first = coord.status()["bringup"]
    rows = {r["stage"]: r["address"] for r in first["peers"]}
    by_agent = {agent(p): p for p in peers}
    zero, one = by_agent[rows["stage-0"]], by_agent[rows["stage-0-tp-1"]]
    daemons.pids.add(zero.wait_worker("stage", timeout=READY_S, state="running")["pid"])
    rank = one.wait_worker("stage-tp-1", timeout=READY_S, state="running")["pid"]
    daemons.pids.add(rank)
    daemons.pids.add(coord.wait_worker("router", timeout=READY_S, state="running")["pid"])
    expect = expected(model, PROMPT, 8)
    assert complete(port) == expect
    asleep = [one.pid, rank]
    for pid in asleep:
        os.kill(pid, signal.SIGSTOP)
    try:
        healed = wait_for(lambda: (b := coord.status()["bringup"])["epoch"] > first["epoch"]
                          and b["state"] == "active" and b, 120, "the heal", every=0.2)
        assert rows["stage-0-tp-1"] not in {r["address"] for r in healed["peers"]}, healed
        assert wait_for(lambda: _served(port), READY_S, "mlx-lm's tokens from the healed "
                        "plan", every=1.0) == expect
    except BaseException:
        for d in (coord, zero):
            print(d.stderr()[-3000:], [(e["kind"], e["message"]) for e in d.events()[-12:]],
                  "----", sep="\n")
        raise
    finally:
        for pid in asleep:
            os.kill(pid, signal.SIGCONT)
        for d in (coord, *peers):
            daemons.note(d)
