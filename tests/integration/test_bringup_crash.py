"""Crash points of the two-phase stage assignment, each on real daemons (127.0.0.1/.2/.3):
a fail point (``mlxceld.failpoints``) kills one daemon with SIGKILL at a named step (a peer
at each record it keeps, the coordinator at each decision it writes), it is started again
on the same state dir, and every node must end with the same outcome for the plan's epoch:
aborted everywhere with nothing running, or active everywhere with the router serving
mlx-lm's greedy text. Several crash points share one bring-up where their order allows.
A push that gives up on a peer lost after the activate decision (its bound shortened by
``MLXCELD_TEST_ACTIVATE_FOR_S``) keeps the decision, and the peer's query, once it is back,
pushes it on. Plus a stale offer, sent by hand over MXCL to a real peer."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import signal
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from mlxceld import __version__
from mlxceld.cluster.assignment.offers import ASSIGNMENT_VERSION, Offer
from mlxceld.cluster.assignment.push import ASSIGNMENT_CHANNEL, COORDINATOR_SPECS, sent
from mlxceld.net import connect
from mlxceld.wire.assignment_messages import DecisionQuery
from mlxceld.wire.envelope import encode_envelope, parse_envelope

from helpers import keys
from helpers.cluster import agent, start
from helpers.daemons import READY_S, DaemonProc, Daemons, alive
from helpers.keys import secret_file
from helpers.models import PROMPT, expected
from helpers.ports import free_port
from helpers.router import complete
from helpers.waiting import wait_for

log = logging.getLogger(__name__)  # each crash point's times (pytest --log-cli-level=INFO)

PEER_WAIT_S = 5.0  # MLXCELD_TEST_PEER_WAIT_S where a test waits for a peer to give up
PUSH_END_S = 120.0  # a push with two stage loads on a busy CPU
# MLXCELD_TEST_ACTIVATE_FOR_S where a push must give up on a lost peer (600 s otherwise):
# longer than a re-dial (RESEND_S), and the other peer's activation fits well inside.
ACTIVATE_FOR_S = 8.0
ASK_AFTER_S = 2.0  # MLXCELD_TEST_PEER_WAIT_S of a restarted peer that is to ask soon
DEACTIVATE_CLI_S = 90.0  # the CLI's own bound (control.client.DEACTIVATE_TIMEOUT_S) fits
SLACK_S = 30.0  # beyond a bound the daemons keep, for a busy CPU (within pytest's 120 s)


def peers_of(daemons: Daemons, secret: bytes, model: Path,
             env: dict[str, dict[str, str]] | None = None) -> list[DaemonProc]:
    """Two --pp-peer daemons on 127.0.0.2 (stage-0) and 127.0.0.3 (stage-1)."""
    return [start(daemons, f"127.0.0.{i}", secret, "--pp-peer", "--model", str(model),
                  name=f"p{i}", env=(env or {}).get(f"127.0.0.{i}")) for i in (2, 3)]


def coordinator_args(coord: DaemonProc, secret: bytes, peers: list[str], model: Path,
                     port: int, agent_port: int, pp_auto: bool = True) -> tuple[str, ...]:
    """``--pp-auto 2`` over ``peers`` (agent addresses); without ``pp_auto``, no bring-up and
    no model (so no router of its own either): it only answers its peers' queries."""
    return ("--cluster-secret-file", str(secret_file(coord.root, secret)),
            "--agent-addr", f"127.0.0.1:{agent_port}",
            "--cluster-peers", ",".join(peers),
            *(("--pp-auto", "2", "--model", str(model)) if pp_auto else ()),
            "--port", str(port))


@dataclass
class Scene:
    """One crash scene's cast: two ``--pp-peer`` daemons (``good`` on 127.0.0.2 holds
    stage-0; ``doomed`` on 127.0.0.3, stage-1, carries the fail point) and the coordinator
    ``coord`` (made, not started), with its router and agent ports."""
    daemons: Daemons
    model: Path
    secret: bytes
    good: DaemonProc
    doomed: DaemonProc
    good_agent: str
    doomed_agent: str
    coord: DaemonProc
    port: int
    agent_port: int

    @property
    def peers(self) -> list[DaemonProc]:
        return [self.good, self.doomed]

    def args(self, pp_auto: bool = True) -> tuple[str, ...]:
        """The coordinator's flags: ``coordinator_args`` over both peers (by the addresses
        known at the start: a peer may be down when this is asked)."""
        return coordinator_args(self.coord, self.secret, [self.good_agent, self.doomed_agent],
                                self.model, self.port, self.agent_port, pp_auto)

    def restart_doomed(self, env: dict[str, str] | None = None) -> None:
        restart_peer(self.doomed, self.doomed_agent, self.secret, self.model, env=env)


def scene(daemons: Daemons, fixtures: Path, failpoint: str | None = None,
          wait_s: float | None = None) -> Scene:
    """Both peers started (the doomed one with ``failpoint``; both with
    ``MLXCELD_TEST_PEER_WAIT_S=wait_s`` when given), the coordinator made."""
    model = fixtures / "llama"
    secret = secrets.token_hex(16).encode()
    wait = {} if wait_s is None else {"MLXCELD_TEST_PEER_WAIT_S": str(wait_s)}
    doomed_env = {**({} if failpoint is None else {"MLXCELD_FAILPOINT": failpoint}), **wait}
    good, doomed = peers_of(daemons, secret, model,
                            env={"127.0.0.2": wait, "127.0.0.3": doomed_env})
    return Scene(daemons, model, secret, good, doomed, agent(good), agent(doomed),
                 daemons.make(name="c"), free_port("127.0.0.1"), free_port("127.0.0.1"))


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


def host_down(d: DaemonProc, point: str) -> None:
    """``d`` killed at ``point`` (``killed``), then its workers with SIGKILL too, as when
    its host loses power: nothing of it is left to adopt."""
    killed(d, point)
    workers = d.recorded_pids()
    assert workers, "no worker of the peer was recorded"
    for pid in workers:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)
    wait_for(lambda: not any(alive(pid) for pid in workers), 20, "its workers gone")


def bringup(d: DaemonProc) -> dict[str, Any]:
    return d.status().get("bringup") or {}


def peer_row(d: DaemonProc, address: str) -> dict[str, Any]:
    return next(p for p in bringup(d)["peers"] if p["address"] == address)


def decision(coordinator: str, secret: bytes, epoch: int) -> str:
    """The coordinator's decision for ``epoch``, asked as a peer asks (``query``)."""
    return str(over_mxcl(coordinator, secret, sent(DecisionQuery(epoch)))["decision"])


def serves(sc: Scene) -> None:
    """The router and every stage run, and the router answers mlx-lm's greedy text."""
    sc.daemons.pids.add(sc.coord.wait_worker("router", timeout=READY_S,
                                             state="running")["pid"])
    for p in sc.peers:
        sc.daemons.pids.add(p.wait_worker("stage", timeout=READY_S, state="running")["pid"])
    assert complete(sc.port, "llama") == expected(sc.model, PROMPT, 8)


@pytest.mark.slow
def test_a_peer_killed_while_preparing_and_the_coordinator_after_aborting_agree(
        daemons: Daemons, split_fixture_dir: Path) -> None:
    """The peer's record says ``preparing`` (its stage loaded, no vote); the coordinator
    decides abort and dies before telling anyone. Both back: every node says abort."""
    sc = scene(daemons, split_fixture_dir, "peer-after-preparing", wait_s=PEER_WAIT_S)
    good, doomed, coord = sc.good, sc.doomed, sc.coord
    coord.start(*sc.args(), env={"MLXCELD_FAILPOINT": "coordinator-after-abort-decision"},
                wait=False)  # it may die before it answers its control socket
    killed(doomed, "peer-after-preparing")
    killed(coord, "coordinator-after-abort-decision")
    epoch = assignment(good)["epoch"]
    orphans = doomed.recorded_pids()  # its standby stage outlived it, as workers do
    daemons.pids |= orphans
    assert orphans and all(alive(pid) for pid in orphans)

    # Back up (the coordinator without --pp-auto: no new plan), each ends the epoch aborted.
    back = time.monotonic()
    coord.start(*sc.args(pp_auto=False))
    sc.restart_doomed(env={"MLXCELD_TEST_PEER_WAIT_S": str(PEER_WAIT_S)})
    assert decision(f"127.0.0.1:{sc.agent_port}", sc.secret, epoch) == "abort"
    for p, name in ((doomed, "the restarted peer"), (good, "the other peer")):
        row = wait_for(lambda p=p: (a := assignment(p)).get("state") == "aborted" and a,
                       PEER_WAIT_S + 30, f"{name} to record plan {epoch} aborted", every=0.2)
        assert row["epoch"] == epoch, row
    log.info("peer-after-preparing + coordinator-after-abort-decision: every node aborted "
             "plan %d %.1f s after the restarts", epoch, time.monotonic() - back)
    assert assignment(doomed)["reason"] == "restarted before voting"
    for d in (good, doomed, coord):
        no_stage_or_router(d)
    wait_for(lambda: not any(alive(pid) for pid in orphans), 20, "the orphan stage gone")


@pytest.mark.slow
def test_a_peer_killed_between_accepted_and_commit_aborts_everywhere(
        daemons: Daemons, split_fixture_dir: Path) -> None:
    sc = scene(daemons, split_fixture_dir, "peer-after-accepted", wait_s=PEER_WAIT_S)
    good, doomed, coord = sc.good, sc.doomed, sc.coord
    coord.start(*sc.args())
    killed(doomed, "peer-after-accepted")
    died = time.monotonic()
    epoch = assignment(good)["epoch"]
    failed = wait_for(lambda: (b := bringup(coord)).get("state") == "failed" and b,
                      PUSH_END_S, "the bring-up to fail", every=0.2)
    summary = failed["summary"]
    assert failed["epoch"] == epoch, failed
    # Lost before every vote was in (aborted at once) or after (re-dialled for the commit
    # window, then aborted), as the other peer's load goes.
    assert f"{sc.doomed_agent}: connection lost" in summary, summary
    assert decision(agent(coord), sc.secret, epoch) == "abort"
    row = wait_for(lambda: (a := assignment(good)).get("state") == "aborted" and a, 30,
                   "the good peer aborted")
    assert row["epoch"] == epoch, row
    log.info("peer-after-accepted: plan %d aborted by the coordinator and the other peer "
             "%.1f s after the peer died", epoch, time.monotonic() - died)
    for d in (good, coord):
        no_stage_or_router(d)
    orphans = doomed.recorded_pids()  # its standby stage outlived it, as workers do
    daemons.pids |= orphans
    assert orphans and all(alive(pid) for pid in orphans)

    # Back up, it finds its vote, waits PEER_WAIT_S, asks the coordinator, and aborts.
    back = time.monotonic()
    sc.restart_doomed(env={"MLXCELD_TEST_PEER_WAIT_S": str(PEER_WAIT_S)})
    row = wait_for(lambda: (a := assignment(doomed)).get("state") == "aborted" and a, 60,
                   "the restarted peer to abort")
    assert row["epoch"] == epoch, row
    assert "the coordinator's decision is abort" in row["reason"], row
    log.info("peer-after-accepted: the restarted peer aborted plan %d %.1f s after its "
             "restart", epoch, time.monotonic() - back)
    no_stage_or_router(doomed)
    wait_for(lambda: not any(alive(pid) for pid in orphans), 20, "the orphan stage gone")


@pytest.mark.slow
def test_the_coordinator_killed_before_deciding_leaves_peers_to_abort_by_deadline(
        daemons: Daemons, split_fixture_dir: Path) -> None:
    sc = scene(daemons, split_fixture_dir, wait_s=PEER_WAIT_S)
    peers, coord = sc.peers, sc.coord
    coord.start(*sc.args(), env={"MLXCELD_FAILPOINT": "coordinator-before-decision"}, wait=False)
    killed(coord, "coordinator-before-decision")
    died = time.monotonic()
    assert [assignment(p)["state"] for p in peers] == ["accepted", "accepted"]  # voted
    for p in peers:
        daemons.note(p)  # their standby stages, for cleanup should the test fail
        row = wait_for(lambda p=p: (a := assignment(p)).get("state") == "aborted" and a,
                       PEER_WAIT_S + 30, f"{agent(p)} to abort")
        assert "no word from the coordinator" in row["reason"], row
        assert "cannot be asked" in row["reason"], row
    took = time.monotonic() - died
    assert took >= PEER_WAIT_S  # not before their deadline
    log.info("coordinator-before-decision: both peers aborted %.1f s after it died (their "
             "wait: %g s)", took, PEER_WAIT_S)
    for p in peers:
        no_stage_or_router(p)


@pytest.mark.slow
def test_the_coordinator_killed_at_commit_then_at_activate_and_a_committed_peer_end_active(
        daemons: Daemons, split_fixture_dir: Path) -> None:
    """Three deaths in one bring-up: the coordinator right after writing commit (it must
    resume that plan, not push a new one: the epoch is checked at every step), again right
    after writing activate, then a peer's host (daemon and workers) whose record says
    ``committed`` as that activate reaches it. The coordinator re-dials the lost peer, and
    once it is back every node is active in the first plan's epoch, and the router serves."""
    # The documented 60 s wait between phases: time enough for every restart here.
    sc = scene(daemons, split_fixture_dir, "peer-after-committed")
    good, doomed, coord = sc.good, sc.doomed, sc.coord
    args = sc.args()
    coord.start(*args, env={"MLXCELD_FAILPOINT": "coordinator-after-commit-decision"},
                wait=False)
    killed(coord, "coordinator-after-commit-decision")
    epoch = assignment(good)["epoch"]
    assert [(assignment(p)["epoch"], assignment(p)["state"]) for p in (good, doomed)] == [
        (epoch, "accepted")] * 2  # commit written, not sent
    daemons.note(good)

    # It resumes plan `epoch` (a coordinator that had lost its commit would push a new one).
    coord.start(*args, env={"MLXCELD_FAILPOINT": "coordinator-after-activate-decision"},
                wait=False)  # it dies within a second: maybe before its socket answers
    killed(coord, "coordinator-after-activate-decision")
    assert [(assignment(p)["epoch"], assignment(p)["state"]) for p in (good, doomed)] == [
        (epoch, "committed")] * 2

    coord.start(*args)  # re-sends activate: the good peer activates, the doomed one dies
    host_down(doomed, "peer-after-committed")
    lost = wait_for(lambda: (r := peer_row(coord, sc.doomed_agent))["state"] == "unreachable"
                    and r, 30, "the coordinator to report the peer unreachable", every=0.2)
    assert bringup(coord)["state"] == "pushing", bringup(coord)  # not failed: it re-dials
    assert "connection lost" in lost["reason"], lost

    back = time.monotonic()
    sc.restart_doomed()
    done = wait_for(lambda: (b := bringup(coord)).get("state") in ("active", "failed") and b,
                    PUSH_END_S, "the resumed push to end", every=0.2)
    agreed = time.monotonic() - back
    assert (done["state"], done["epoch"]) == ("active", epoch), (done, coord.stderr()[-3000:])
    assert "every stage of 2 is active" in done["summary"]
    assert peer_row(coord, sc.doomed_agent)["steps"][-2:] == ["unreachable", "active"]
    for p in (good, doomed):
        assert (assignment(p)["epoch"], assignment(p)["state"]) == (epoch, "active")
    assert decision(agent(coord), sc.secret, epoch) == "active"
    serves(sc)
    log.info("coordinator-after-commit/activate-decision + peer-after-committed: plan %d "
             "active everywhere %.1f s after the peer's restart, served after %.1f s", epoch,
             agreed, time.monotonic() - back)


@pytest.mark.slow
def test_a_peer_killed_once_active_and_the_coordinator_once_active_end_active(
        daemons: Daemons, split_fixture_dir: Path) -> None:
    """The peer records active and switches its stage on, then its host dies (daemon and
    workers) before it answers; the coordinator re-dials it, and once it is back (it asks
    first, then serves), writes active and dies before starting its router. Back up, it
    serves the plan it decided, in that plan's epoch."""
    sc = scene(daemons, split_fixture_dir, "peer-after-active")
    good, doomed, coord = sc.good, sc.doomed, sc.coord
    args = sc.args()
    coord.start(*args, env={"MLXCELD_FAILPOINT": "coordinator-after-active-decision"})
    host_down(doomed, "peer-after-active")
    epoch = assignment(good)["epoch"]
    wait_for(lambda: peer_row(coord, sc.doomed_agent)["state"] == "unreachable", 30,
             "the coordinator to report the peer unreachable", every=0.2)
    assert bringup(coord)["state"] == "pushing"

    back = time.monotonic()
    sc.restart_doomed()
    killed(coord, "coordinator-after-active-decision")
    agreed = time.monotonic() - back
    for p in (good, doomed):
        assert (assignment(p)["epoch"], assignment(p)["state"]) == (epoch, "active")
    daemons.note(good)
    daemons.note(doomed)
    again = time.monotonic()
    coord.start(*args)
    done = wait_for(lambda: (b := bringup(coord)).get("state") in ("active", "failed") and b,
                    PUSH_END_S, "the plan to be served again", every=0.2)
    assert (done["state"], done["epoch"]) == ("active", epoch), (done, coord.stderr()[-3000:])
    assert decision(agent(coord), sc.secret, epoch) == "active"
    serves(sc)
    log.info("peer-after-active + coordinator-after-active-decision: plan %d active "
             "everywhere %.1f s after the peer's restart; served %.1f s after the "
             "coordinator's", epoch, agreed, time.monotonic() - again)


def plan_decision(d: DaemonProc, epoch: int) -> str | None:
    """``d``'s decision for ``epoch`` as its plans table holds it, read-only (not asked over
    MXCL: a ``query`` answered ``activate`` would push the plan on, ``peer_asked``)."""
    db = f"file:{d.state_dir / 'state.db'}?mode=ro"
    with contextlib.closing(sqlite3.connect(db, uri=True)) as conn:
        row = conn.execute("select decision from plans where epoch = ?", (epoch,)).fetchone()
    assert row is not None, f"no plan {epoch} in {d.state_dir}"
    return None if row[0] is None else str(row[0])


@pytest.mark.slow
def test_a_push_stalled_on_a_lost_peer_is_pushed_on_by_its_query_when_it_is_back(
        daemons: Daemons, split_fixture_dir: Path) -> None:
    """The coordinator decides activate; a peer's host dies (daemon and workers) as the
    activate reaches it (its record: ``committed``) and stays down past the push's bound
    (``MLXCELD_TEST_ACTIVATE_FOR_S``, 600 s otherwise): the push ends stalled, the bring-up
    failed, the decision ``activate`` kept. Back up, the peer waits its phase, asks
    (``query``), hears activate and activates; the coordinator, asked, pushes on: every
    node active in the first plan's epoch, and the router serves."""
    sc = scene(daemons, split_fixture_dir, "peer-after-committed")
    good, doomed, coord = sc.good, sc.doomed, sc.coord
    args = sc.args()
    coord.start(*args, env={"MLXCELD_TEST_ACTIVATE_FOR_S": str(ACTIVATE_FOR_S)})
    host_down(doomed, "peer-after-committed")
    down = time.monotonic()
    epoch = assignment(good)["epoch"]
    daemons.note(good)

    # The activate decision was sent before the peer died: the push ends within its bound.
    stalled = wait_for(lambda: (b := bringup(coord)).get("state") in ("active", "failed")
                       and b, ACTIVATE_FOR_S + SLACK_S, "the push to give up on the lost "
                       f"peer ({ACTIVATE_FOR_S:g} s after the activate decision)", every=0.2)
    gave_up = time.monotonic() - down
    assert (stalled["state"], stalled["epoch"]) == ("failed", epoch), stalled
    assert stalled["summary"].startswith(
        f"plan {epoch} is decided active, but 1 of 2 stage(s) did not answer active: "
        f"{sc.doomed_agent}: connection lost"), stalled["summary"]
    assert f"not active {ACTIVATE_FOR_S:g} s after the decision; the decision stands" in \
        stalled["summary"], stalled["summary"]
    row = peer_row(coord, sc.doomed_agent)
    assert row["state"] == "failed" and row["steps"][-2:] == ["unreachable", "failed"], row
    assert row["reason"].endswith(f"not active {ACTIVATE_FOR_S:g} s after the decision"), row
    assert peer_row(coord, agent(good))["state"] == "active"
    assert plan_decision(coord, epoch) == "activate"  # the decision stands
    shown = coord.ctl("status")  # what the operator sees
    assert f"bring-up: failed: plan {epoch} is decided active" in shown.stdout, shown
    assert f"{sc.doomed_agent}" in shown.stdout and "failed: connection lost" in shown.stdout
    assert (assignment(good)["epoch"], assignment(good)["state"]) == (epoch, "active")
    no_stage_or_router(coord)  # nothing served over a plan with a stage missing
    log.info("stalled push: the coordinator gave up on the lost peer %.1f s after it died "
             "(its bound: %g s after the activate decision)", gave_up, ACTIVATE_FOR_S)

    back = time.monotonic()
    sc.restart_doomed(env={"MLXCELD_TEST_PEER_WAIT_S": str(ASK_AFTER_S)})
    # It asks ASK_AFTER_S after its start (CONNECT_S + FRAME_S at most), and the push it
    # sets off ends within ACTIVATE_FOR_S, active or stalled again (then not waited out).
    done = wait_for(lambda: (b := bringup(coord)) != stalled and b.get("state") in (
        "active", "failed") and b, ASK_AFTER_S + ACTIVATE_FOR_S + SLACK_S,
        "the peer to ask and the coordinator to push the plan on", every=0.2)
    agreed = time.monotonic() - back
    assert (done["state"], done["epoch"]) == ("active", epoch), (done, coord.stderr()[-3000:])
    assert "every stage of 2 is active" in done["summary"], done
    for p in (good, doomed):
        assert (assignment(p)["epoch"], assignment(p)["state"]) == (epoch, "active")
    assert plan_decision(coord, epoch) == "active"
    assert f"resuming stage assignment {epoch} (committed)" in doomed.stderr()
    assert f"plan {epoch}: a peer asks about it and it is decided activate: pushing on" in \
        coord.stderr()
    assert f"plan {epoch}: resuming the push, a peer asked about it (activate)" in \
        coord.stderr()
    # the resumed push shows each stage as the first did: its id and layers, from the plan
    assert [(r["stage"], r["address"]) for r in done["peers"]] == [
        ("stage-0", agent(good)), ("stage-1", sc.doomed_agent)], done["peers"]
    assert all(r["layers"] for r in done["peers"]), done["peers"]
    serves(sc)
    log.info("stalled push: plan %d active everywhere %.1f s after the peer's restart (it "
             "asks after %g s)", epoch, agreed, ASK_AFTER_S)


@pytest.mark.slow
def test_a_deactivation_ends_a_push_that_re_dials_a_lost_peer(
        daemons: Daemons, split_fixture_dir: Path) -> None:
    """A peer's host dies as the activate reaches it, and the push re-dials it (for
    ACTIVATE_FOR_S, 600 s: the default here). `mlxctl cluster deactivate` does not wait
    that out, nor is it refused as a bring-up in progress: it ends the push, decides
    deactivated, stops the other peer's stage and names the lost one (exit 1)."""
    sc = scene(daemons, split_fixture_dir, "peer-after-committed")
    good, doomed, coord = sc.good, sc.doomed, sc.coord
    coord.start(*sc.args())
    host_down(doomed, "peer-after-committed")
    daemons.note(good)
    wait_for(lambda: (b := bringup(coord)).get("state") == "pushing" and any(
        p["address"] == sc.doomed_agent and p["state"] == "unreachable" for p in b["peers"]),
        PUSH_END_S, "the coordinator re-dialling the lost peer")
    epoch = bringup(coord)["epoch"]

    began = time.monotonic()
    gone = coord.ctl("cluster", "deactivate", timeout=DEACTIVATE_CLI_S)
    took = time.monotonic() - began
    assert gone.returncode == 1, (gone.stdout, gone.stderr)
    assert f"plan {epoch} deactivated: 1 of 2 stage(s) stopped" in gone.stderr, gone.stderr
    assert sc.doomed_agent in gone.stderr
    assert f"plan {epoch}: a deactivation ends its push (decided activate)" in coord.stderr()
    assert plan_decision(coord, epoch) == "deactivated"
    assert bringup(coord)["state"] == "deactivated"
    wait_for(lambda: assignment(good).get("state") == "deactivated", SLACK_S,
             "the reachable peer told of the deactivation")
    no_stage_or_router(good)
    no_stage_or_router(coord)
    log.info("deactivation during a re-dialling push: %.1f s", took)


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
    return over_mxcl(peer, secret, encode_envelope(offer.to_wire()), me)


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
