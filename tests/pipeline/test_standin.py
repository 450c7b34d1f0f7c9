"""A failed stage's stand-in (``pipeline/standin.py``) over real MXCL on 127.0.0.x: a router's
link dialing the stage's port reads ``failed`` with the stage, the node and the reason, at
once; the port is free the moment the worker leaves FAILED or is removed."""

from __future__ import annotations

import asyncio
import socket
import time
from pathlib import Path

import pytest

from mlxceld.engine import EngineUnavailable
from mlxceld.net import connect
from mlxceld.pipeline import protocol as p
from mlxceld.pipeline.attaching import StageAddress
from mlxceld.pipeline.connectivity import Connectivity
from mlxceld.pipeline.links import StageLink
from mlxceld.pipeline.standin import MAX_REASON, StandIns, failure_message
from mlxceld.roles.options import EchoOptions, StageOptions
from mlxceld.supervisor.events import NOT_RESTARTED
from mlxceld.supervisor.process import WorkerSpec
from mlxceld.types import WorkerState
from mlxceld.wire import encode_envelope, parse_envelope
from mlxceld.wire.address import parse_address

from helpers.keys import keyring
from helpers.ports import free_port

SECRET = b"stand-in-test-secret-0123456789"
HOST = "127.0.0.3"
COORD = "127.0.0.1:19998"
REASON = ("stage stage-1 failed to load layers [2, 4): stage layers [2, 4) need 1 of the 2 "
          "shards, and 1 of them are missing: model-00002-of-00002.safetensors; copy them "
          "into the model directory" + NOT_RESTARTED)
ANSWERED_S = 2.0  # a dial, a handshake and one answer on loopback; generous when loaded


def stage_spec(state_dir: Path, port: int) -> WorkerSpec:
    options = StageOptions(
        model="/models/tiny", layers=(2, 4), node_id="stage-1", rank=1,
        address=f"{HOST}:{port}", coordinator=COORD, upstream="127.0.0.2:1", downstream=None,
        first="127.0.0.2:1", last=None, model_identity="0" * 64, cluster="test")
    return WorkerSpec("stage", state_dir, options, secret=SECRET)


def link_to(port: int) -> StageLink:
    return StageLink(StageAddress("stage-1", HOST, port, 1, (2, 4)), keyring=keyring(SECRET),
                     origin=parse_address(COORD), model_identity="0" * 64, cluster="test",
                     inboxes=lambda _: None, dial_budget_s=1.0,
                     connectivity=Connectivity(initial_s=0.1, max_s=0.2))


def bindable(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as asyncio's listeners
        try:
            s.bind((HOST, port))
        except OSError:
            return False
        return True


def test_the_message_names_the_stage_the_node_the_reason_and_what_to_do() -> None:
    said = failure_message("stage-1", "mac-2", REASON)
    assert said.startswith("stage stage-1 failed to load layers [2, 4): ")
    assert "missing: model-00002-of-00002.safetensors (on node mac-2" in said  # no hint
    assert NOT_RESTARTED not in said and "copy them" not in said
    assert "`mlxctl status` there" in said and "`mlxctl restart stage` there" in said
    other = failure_message("stage-1", "mac-2", "exited 5 times in 60 s; last: status 1")
    assert other.startswith("stage stage-1 failed: exited 5 times in 60 s; last: status 1")
    long = failure_message("stage-1", "mac-2", "x" * 5000)
    assert "x" * (MAX_REASON - 3) + "..." in long and "x" * MAX_REASON not in long


async def _failed_then_started(state_dir: Path) -> None:
    port = free_port(HOST)
    spec = stage_spec(state_dir, port)
    stand_ins = StandIns(keyring(SECRET), "mac-2")
    owner = asyncio.create_task(stand_ins.run())
    await asyncio.sleep(0)
    link = link_to(port)
    try:
        stand_ins.worker_changed(spec, WorkerState.FAILED, REASON)
        began = time.monotonic()
        while True:  # the stand-in's task binds at its first turn
            try:
                await link.ensure()
            except EngineUnavailable as exc:
                if link.state == "failed":
                    said = str(exc)
                    break
            assert time.monotonic() - began < ANSWERED_S, link.describe()
            await asyncio.sleep(0.05)
        assert said.startswith("stage stage-1 failed to load layers [2, 4)"), said
        assert "model-00002-of-00002.safetensors" in said and "on node mac-2" in said
        assert link.describe()["error"] == said and not link.up
        assert list(stand_ins.active()) == ["stage"]

        # Any first message gets the same answer (an upstream stage's ``act``, say).
        stream = await connect(HOST, port, keyring=keyring(SECRET), identity="127.0.0.2:1",
                               channel=1, budget_s=ANSWERED_S, local_addr=("127.0.0.2", 0))
        await stream.send(encode_envelope({"t": "act", "seq": "s", "step": 0}))
        answer = parse_envelope(await stream.recv(), p.ENGINE_SPECS)
        assert (answer.type, answer.header["code"]) == ("error", p.ERR_STAGE_FAILED)
        await stream.close()

        # Leaving FAILED (a restart: STARTING) frees the port before the call returns.
        stand_ins.worker_changed(spec, WorkerState.STARTING, "restart requested")
        assert bindable(port) and stand_ins.active() == {}

        # FAILED again, then removed (a new plan): the same.
        stand_ins.worker_changed(spec, WorkerState.FAILED, REASON)
        await asyncio.sleep(0.1)
        assert not bindable(port)
        stand_ins.worker_changed(spec, None, "removed")
        assert bindable(port)
    finally:
        await link.aclose()
        stand_ins.close()
        await asyncio.wait_for(owner, 5)


def test_a_router_reads_the_stage_failed_and_the_port_is_freed_at_once(
        state_dir: Path) -> None:
    asyncio.run(_failed_then_started(state_dir))


def test_only_stage_workers_get_a_stand_in(state_dir: Path) -> None:
    async def go() -> None:
        stand_ins = StandIns(keyring(SECRET), "mac-2")
        owner = asyncio.create_task(stand_ins.run())
        await asyncio.sleep(0)
        stand_ins.worker_changed(WorkerSpec("echo", state_dir, EchoOptions()),
                                 WorkerState.FAILED, "refused its options")
        assert stand_ins.active() == {}
        stand_ins.close()
        await asyncio.wait_for(owner, 5)

    asyncio.run(go())


@pytest.mark.parametrize("state", [WorkerState.BACKOFF, WorkerState.EXITED])
def test_no_stand_in_outside_failed(state_dir: Path, state: WorkerState) -> None:
    async def go() -> None:
        port = free_port(HOST)
        stand_ins = StandIns(keyring(SECRET), "mac-2")
        owner = asyncio.create_task(stand_ins.run())
        await asyncio.sleep(0)
        stand_ins.worker_changed(stage_spec(state_dir, port), state, "exited")
        await asyncio.sleep(0.1)
        assert stand_ins.active() == {} and bindable(port)
        stand_ins.close()
        await asyncio.wait_for(owner, 5)

    asyncio.run(go())
