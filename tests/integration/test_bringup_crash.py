"""Crash points of the two-phase stage assignment, each on real daemons (127.0.0.1/.2/.3):
a fail point (``mlxceld.failpoints``) kills one daemon with SIGKILL at a named step (a peer
at each record it keeps, the coordinator at each decision it writes), it is started again
on the same state dir, and every node must end with the same outcome for the plan's epoch:
aborted everywhere with nothing running, or active everywhere with the router serving
mlx-lm's greedy text. Several crash points share one bring-up where their order allows.
Plus a stale offer, sent by hand over MXCL to a real peer."""

from __future__ import annotations

import asyncio
import secrets
import signal
import time
from pathlib import Path
from typing import Any

from mlxceld import __version__
from mlxceld.cluster.assignment.offers import ASSIGNMENT_VERSION, Offer
from mlxceld.cluster.assignment.push import ASSIGNMENT_CHANNEL, COORDINATOR_SPECS, message
from mlxceld.net import connect
from mlxceld.wire.envelope import encode_envelope, parse_envelope

from helpers import keys
from helpers.cluster import agent, start
from helpers.daemons import READY_S, DaemonProc, Daemons, alive
from helpers.keys import secret_file
from helpers.models import PROMPT, expected
from helpers.ports import free_port
from helpers.router import complete
from helpers.waiting import wait_for

PEER_WAIT_S = 5.0  # MLXCELD_TEST_PEER_WAIT_S where a test waits for a peer to give up
PUSH_END_S = 120.0  # a push with two stage loads on a busy CPU


def peers_of(daemons: Daemons, secret: bytes, model: Path,
             env: dict[str, dict[str, str]] | None = None) -> list[DaemonProc]:
    """Two --pp-peer daemons on 127.0.0.2 (stage-0) and 127.0.0.3 (stage-1)."""
    return [start(daemons, f"127.0.0.{i}", secret, "--pp-peer", "--model", str(model),
                  name=f"p{i}", env=(env or {}).get(f"127.0.0.{i}")) for i in (2, 3)]


def coordinator_args(coord: DaemonProc, secret: bytes, peers: list[DaemonProc], model: Path,
                     port: int, agent_port: int, pp_auto: bool = True) -> tuple[str, ...]:
    """``--pp-auto 2`` over ``peers``; without ``pp_auto``, no bring-up and no model (so no
    router of its own either): it only answers its peers' queries."""
    return ("--cluster-secret-file", str(secret_file(coord.root, secret)),
            "--agent-addr", f"127.0.0.1:{agent_port}",
            "--cluster-peers", ",".join(agent(p) for p in peers),
            *(("--pp-auto", "2", "--model", str(model)) if pp_auto else ()),
            "--port", str(port))


def restart_peer(d: DaemonProc, address: str, secret: bytes, model: Path,
                 env: dict[str, str] | None = None) -> None:
    """``d`` started again on its state dir and agent address, as a service manager would."""
    d.start("--cluster-secret-file", str(secret_file(d.root, secret)), "--agent-addr",
            address, "--pp-peer", "--model", str(model), env=env)


def assignment(d: DaemonProc) -> dict[str, Any]:
    return d.status()["assignment"] or {}


def no_stage_or_router(d: DaemonProc) -> None:
    running = [w for w in d.status()["workers"] if w["name"] in ("stage", "router")
               and w["state"] in ("starting", "running")]
    assert not running, running


def killed(d: DaemonProc, point: str) -> None:
    """The daemon ended by its own fail point ``point`` (SIGKILL), not by a clean exit."""
    assert d.proc is not None
    assert d.proc.wait(PUSH_END_S) == -signal.SIGKILL, d.stderr()[-3000:]
    assert f"fail point {point}: killing this process (pid {d.pid})" in d.stderr()


def bringup(d: DaemonProc) -> dict[str, Any]:
    return d.status().get("bringup") or {}


def peer_row(d: DaemonProc, address: str) -> dict[str, Any]:
    return next(p for p in bringup(d)["peers"] if p["address"] == address)


def decision(coordinator: str, secret: bytes, epoch: int) -> str:
    """The coordinator's decision for ``epoch``, asked as a peer asks (``query``)."""
    return str(over_mxcl(coordinator, secret, message("query", epoch))["decision"])


def serves(coord: DaemonProc, peers: list[DaemonProc], port: int, model: Path,
           daemons: Daemons) -> None:
    """The router and every stage run, and the router answers mlx-lm's greedy text."""
    daemons.pids.add(coord.wait_worker("router", timeout=READY_S, state="running")["pid"])
    for p in peers:
        daemons.pids.add(p.wait_worker("stage", timeout=READY_S, state="running")["pid"])
    assert complete(port, "llama") == expected(model, PROMPT, 8)


def test_a_peer_killed_while_preparing_and_the_coordinator_after_aborting_agree(
        daemons: Daemons, split_fixture_dir: Path) -> None:
    """The peer's record says ``preparing`` (its stage loaded, no vote); the coordinator
    decides abort and dies before telling anyone. Both back: every node says abort."""
    model = split_fixture_dir / "llama"
    secret = secrets.token_hex(16).encode()
    wait = {"MLXCELD_TEST_PEER_WAIT_S": str(PEER_WAIT_S)}
    good, doomed = peers_of(daemons, secret, model, env={
        "127.0.0.2": wait, "127.0.0.3": {"MLXCELD_FAILPOINT": "peer-after-preparing", **wait}})
    doomed_agent = agent(doomed)
    coord = daemons.make(name="c")
    port, agent_port = free_port("127.0.0.1"), free_port("127.0.0.1")
    args = coordinator_args(coord, secret, [good, doomed], model, port, agent_port)
    idle = coordinator_args(coord, secret, [good, doomed], model, port, agent_port, False)
    coord.start(*args, env={"MLXCELD_FAILPOINT": "coordinator-after-abort-decision"})
    killed(doomed, "peer-after-preparing")
    killed(coord, "coordinator-after-abort-decision")
    epoch = assignment(good)["epoch"]
    orphans = doomed.recorded_pids()  # its standby stage outlived it, as workers do
    daemons.pids |= orphans
    assert orphans and all(alive(pid) for pid in orphans)

    # Back up (the coordinator without --pp-auto: no new plan), each ends the epoch aborted.
    coord.start(*idle)
    restart_peer(doomed, doomed_agent, secret, model, env=wait)
    assert decision(f"127.0.0.1:{agent_port}", secret, epoch) == "abort"
    for p, name in ((doomed, "the restarted peer"), (good, "the other peer")):
        row = wait_for(lambda p=p: (a := assignment(p)).get("state") == "aborted" and a,
                       PEER_WAIT_S + 30, f"{name} to record plan {epoch} aborted", every=0.2)
        assert row["epoch"] == epoch, row
    assert assignment(doomed)["reason"] == "restarted before voting"
    for d in (good, doomed, coord):
        no_stage_or_router(d)
    wait_for(lambda: not any(alive(pid) for pid in orphans), 20, "the orphan stage gone")


def test_a_peer_killed_between_accepted_and_commit_aborts_everywhere(
        daemons: Daemons, split_fixture_dir: Path) -> None:
    model = split_fixture_dir / "llama"
    secret = secrets.token_hex(16).encode()
    wait = {"MLXCELD_TEST_PEER_WAIT_S": str(PEER_WAIT_S)}
    good, doomed = peers_of(daemons, secret, model, env={
        "127.0.0.2": wait, "127.0.0.3": {"MLXCELD_FAILPOINT": "peer-after-accepted", **wait}})
    doomed_agent = agent(doomed)
    coord = daemons.make(name="c")
    coord.start(*coordinator_args(coord, secret, [good, doomed], model,
                                  free_port("127.0.0.1"), free_port("127.0.0.1")))
    killed(doomed, "peer-after-accepted")
    failed = wait_for(lambda: (b := bringup(coord)).get("state") == "failed" and b,
                      PUSH_END_S, "the bring-up to fail", every=0.2)
    summary = failed["summary"]
    assert f"{doomed_agent}: connection lost" in summary, summary
    wait_for(lambda: assignment(good).get("state") == "aborted", 30, "the good peer aborted")
    for d in (good, coord):
        no_stage_or_router(d)
    orphans = doomed.recorded_pids()  # its standby stage outlived it, as workers do
    daemons.pids |= orphans
    assert orphans and all(alive(pid) for pid in orphans)

    # Back up, it finds its vote, waits PEER_WAIT_S, asks the coordinator, and aborts.
    restart_peer(doomed, doomed_agent, secret, model, env=wait)
    row = wait_for(lambda: (a := assignment(doomed)).get("state") == "aborted" and a, 60,
                   "the restarted peer to abort")
    assert "the coordinator's decision is abort" in row["reason"], row
    no_stage_or_router(doomed)
    wait_for(lambda: not any(alive(pid) for pid in orphans), 20, "the orphan stage gone")


def test_the_coordinator_killed_before_deciding_leaves_peers_to_abort_by_deadline(
        daemons: Daemons, split_fixture_dir: Path) -> None:
    model = split_fixture_dir / "llama"
    secret = secrets.token_hex(16).encode()
    wait = {"MLXCELD_TEST_PEER_WAIT_S": str(PEER_WAIT_S)}
    peers = peers_of(daemons, secret, model, env={"127.0.0.2": wait, "127.0.0.3": wait})
    coord = daemons.make(name="c")
    coord.start(*coordinator_args(coord, secret, peers, model, free_port("127.0.0.1"),
                                  free_port("127.0.0.1")),
                env={"MLXCELD_FAILPOINT": "coordinator-before-decision"})
    killed(coord, "coordinator-before-decision")
    died = time.monotonic()
    assert [assignment(p)["state"] for p in peers] == ["accepted", "accepted"]  # voted
    for p in peers:
        daemons.note(p)  # their standby stages, for cleanup should the test fail
        row = wait_for(lambda p=p: (a := assignment(p)).get("state") == "aborted" and a,
                       PEER_WAIT_S + 30, f"{agent(p)} to abort")
        assert "no word from the coordinator" in row["reason"], row
        assert "cannot be asked" in row["reason"], row
    assert time.monotonic() - died >= PEER_WAIT_S  # not before their deadline
    for p in peers:
        no_stage_or_router(p)


def test_the_coordinator_killed_after_its_commit_decision_finishes_after_restart(
        daemons: Daemons, split_fixture_dir: Path) -> None:
    model = split_fixture_dir / "llama"
    secret = secrets.token_hex(16).encode()
    peers = peers_of(daemons, secret, model)  # the documented 60 s wait: time to restart
    coord = daemons.make(name="c")
    port = free_port("127.0.0.1")
    args = coordinator_args(coord, secret, peers, model, port, free_port("127.0.0.1"))
    coord.start(*args, env={"MLXCELD_FAILPOINT": "coordinator-after-commit-decision"})
    killed(coord, "coordinator-after-commit-decision")
    assert [assignment(p)["state"] for p in peers] == ["accepted", "accepted"]  # no commit
    coord.start(*args)  # no fail point: it finds "commit" and re-sends it
    wait_for(lambda: (coord.status().get("bringup") or {}).get("state") in ("active",
                                                                            "failed"),
             PUSH_END_S, "the resumed push to end")
    bringup = coord.status()["bringup"]
    assert bringup["state"] == "active", (bringup, coord.stderr()[-3000:])
    assert "every stage of 2 is active" in bringup["summary"]
    daemons.pids.add(coord.wait_worker("router", timeout=READY_S, state="running")["pid"])
    for p in peers:
        assert assignment(p)["state"] == "active"
        daemons.pids.add(p.wait_worker("stage", timeout=READY_S, state="running")["pid"])
    text = complete(port, "llama")
    assert text == expected(model, PROMPT, 8)


def over_mxcl(node: str, secret: bytes, payload: bytes, me: str = "") -> dict[str, Any]:
    """Send ``payload`` to ``node``'s agent on channel 2 as ``me`` (127.0.0.9:PORT); its
    answer."""
    keyring = keys.keyring(secret)
    me = me or f"127.0.0.9:{free_port('127.0.0.9')}"

    async def go() -> dict[str, Any]:
        host, _, port = node.rpartition(":")
        stream = await connect(host, int(port), keyring=keyring, identity=me,
                               channel=ASSIGNMENT_CHANNEL, budget_s=5.0,
                               local_addr=("127.0.0.9", 0))
        try:
            async with asyncio.timeout(10):
                await stream.send(payload)
                return dict(parse_envelope(await stream.recv(), COORDINATOR_SPECS).header)
        finally:
            await stream.close("done")

    return asyncio.run(go())


def offer_by_hand(peer: str, secret: bytes, epoch: int) -> dict[str, Any]:
    """Send a stage offer of ``epoch`` to ``peer`` from 127.0.0.9 over MXCL; its answer."""
    me = f"127.0.0.9:{free_port('127.0.0.9')}"
    offer = Offer(epoch=epoch, assignment_version=ASSIGNMENT_VERSION,
                  package_version=__version__, cluster="mlxcel-cluster", model_identity="ab" * 32,
                  stage=0, layers=(0, 4), node_id="stage-0", port=1, coordinator=me, toml="")
    return over_mxcl(peer, secret, encode_envelope(offer.header()), me)


def test_a_stale_epoch_offer_is_refused_naming_both_epochs(daemons: Daemons) -> None:
    secret = secrets.token_hex(16).encode()
    peer = start(daemons, "127.0.0.2", secret, "--pp-peer", name="p")  # no model
    first = offer_by_hand(agent(peer), secret, 1000)
    assert (first["t"], first["code"], first["final"]) == ("refused", "model", True), first
    assert assignment(peer)["epoch"] == 1000  # the newest epoch it has seen, durable
    for old in (999, 1000):
        answer = offer_by_hand(agent(peer), secret, old)
        assert (answer["t"], answer["code"], answer["epoch"]) == ("refused", "stale_epoch",
                                                                   old), answer
        assert answer["reason"] == (f"plan epoch {old} is not newer than epoch 1000, the "
                                    "newest this node has seen"), answer
    assert "offer 999 from 127.0.0.9:" in peer.stderr()  # logged, with the reason
