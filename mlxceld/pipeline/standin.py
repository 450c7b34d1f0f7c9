"""A failed stage's stand-in: its host answers the stage's port with the failure.

A stage worker that cannot load (a missing or truncated shard, a config mlx-lm cannot
load) exits with its reason, and its supervisor marks it failed and does not restart
it (``supervisor/states.py``). Nothing would then listen on the stage's port, and its
router could only say "nothing accepts connections". So while the worker is failed,
its daemon listens on the stage's address itself (``StandIns``, told of each stage
worker's transitions by the supervisor) and answers every authenticated connection on
channel 1 (the stage protocol, ``protocol.py``) at once: the first message, whatever
it is (``attach`` from a router, ``act`` from the upstream stage), gets ``error`` with
code ``stage_failed`` and a message naming the stage, the node it failed on, the reason
and the next step; then the stand-in closes the stream. The router's link reads it as
the state ``failed`` (``links.py``): ``GET /ready`` and every request say it at once
(a 503 naming the stage and the reason, no connect time-out), and so does `mlxctl
status` on the coordinator (the router's stats).

Why the stage's port rather than the agent channel: the router already dials it (and
re-dials it every ``connectivity.RETRY_MAX_S`` at most while it is down), a cluster
written by hand (``--distributed-config``) names stage addresses but not the stage
hosts' agents, and the answer is the stage protocol's own ``error`` message: no new
field, no new message, the frames of PROTOCOL.md unchanged.

The stand-in lives exactly as long as the worker is failed: it starts when the worker
enters FAILED and closes its listening socket at once (``Listener.stop_accepting``,
before the supervisor spawns anything) when the worker leaves FAILED (`mlxctl restart
stage`, the supervisor starting it again) or is removed (a new plan, a deactivation, a
reload without it), so the next stage worker finds its port free. A port the stand-in
cannot bind (someone else took it) is logged and left alone.

How soon the router knows: a request dials a link that is down itself, and the stand-in
answers within a network round trip; in the background the link is re-dialed at most
``connectivity.RETRY_MAX_S`` (5 s) apart, after the attempt then in flight (at most
``attaching.DIAL_BUDGET_S`` + ``attaching.ATTACH_TIMEOUT_S``, 10 s; one waiting on the loading
worker's port ends when the worker exits), so ``GET /ready`` names the failure within
15 s of it, usually within 5 s. Once the worker serves again, the same bound holds for
the router's attaching it.

Bounds: the first message must come within ``ANSWER_S`` (a silent connection is
closed); the listener's own bounds (pending pool, handshake time-out, established cap)
are ``net/listener.py``'s. The reason sent is at most ``MAX_REASON`` characters.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Final

from mlxceld.net import ConnectionClosed, Listener, MxclStream
from mlxceld.pipeline import protocol as p
from mlxceld.roles.options import StageOptions
from mlxceld.supervisor.events import NOT_RESTARTED
from mlxceld.supervisor.process import WorkerSpec
from mlxceld.types import WorkerState
from mlxceld.wire import SecretStore, encode_envelope
from mlxceld.wire.address import parse_address
from mlxceld.wire.transport_messages import CodedError

log = logging.getLogger(__name__)

ANSWER_S: Final = 5.0  # a connection that sends nothing for this long is closed
MAX_REASON: Final = 300  # characters of the worker's reason in the answer


def failure_message(node_id: str, host_node: str, reason: str) -> str:
    """What a failed stage's stand-in answers: the stage, where, why (short: a worker
    that could not load says its error, and its hint stays in `mlxctl status` on its
    host), what to do."""
    if reason.endswith(NOT_RESTARTED):  # "MESSAGE; HINT" (workers/runtime.py), then that
        reason = reason.removesuffix(NOT_RESTARTED).split("; ", 1)[0]
    reason = reason.strip() or "no reason recorded"
    if len(reason) > MAX_REASON:
        reason = reason[:MAX_REASON - 3] + "..."
    said = reason if reason.startswith(f"stage {node_id} ") else \
        f"stage {node_id} failed: {reason}"
    return (f"{said} (on node {host_node}, where it is not restarted: fix it there, "
            "`mlxctl status` there says how, then run `mlxctl restart stage` there)")


class StageStandIn:
    """One failed stage's listener (see the module doc); ``run`` until ``close``."""

    def __init__(self, options: StageOptions, keyring: SecretStore, message: str) -> None:
        self.options = options
        self.message = message
        self._keyring = keyring
        self._listener: Listener | None = None
        self._closed = False

    async def run(self) -> None:
        if self._closed:
            return
        o = self.options
        me = parse_address(o.address)
        listener = Listener(me.host, me.port, keyring=self._keyring,
                            identity_of_server=o.address, channels={1}, handler=self._answer,
                            name=f"stage {o.node_id} stand-in")
        try:
            await listener.start()
        except OSError as exc:
            log.warning("stage %s failed, and its port %s cannot be bound to say so "
                        "(%s): routers see nothing listening there", o.node_id, o.address,
                        exc.strerror)
            return
        # No await between the bind and this check: a close that came while the address
        # was resolved frees the port here, before anything else runs.
        if self._closed:
            listener.stop_accepting()
            return
        self._listener = listener
        log.info("stage %s failed: its port %s answers that it did, until it starts again",
                 o.node_id, o.address)
        await listener.serve()

    def close(self) -> None:
        """Free the port now (on return); the connections wind down in ``run``."""
        self._closed = True
        if self._listener is not None:
            self._listener.stop_accepting()

    async def _answer(self, stream: MxclStream) -> None:
        with contextlib.suppress(TimeoutError, ConnectionClosed):
            async with asyncio.timeout(ANSWER_S):
                await stream.recv()  # whatever it asks, the answer is the failure
            await stream.send(encode_envelope(CodedError(p.ERR_STAGE_FAILED,
                                                         self.message).to_wire()))
        await stream.close("stage failed")


class StandIns:
    """The daemon's stand-ins, one per failed stage worker, in one task group."""

    def __init__(self, keyring: SecretStore, host_node: str) -> None:
        """``host_node``: this daemon's node id, named in the answers."""
        self._keyring = keyring
        self._host_node = host_node
        self._open: dict[str, StageStandIn] = {}  # worker name -> its stand-in
        self._tg: asyncio.TaskGroup | None = None
        self._stop = asyncio.Event()

    def active(self) -> dict[str, str]:
        """Each stand-in's worker and the message it answers."""
        return {name: s.message for name, s in sorted(self._open.items())}

    async def run(self) -> None:
        """Own the stand-ins' tasks until ``close``."""
        async with asyncio.TaskGroup() as tg:
            self._tg = tg
            await self._stop.wait()
            self._tg = None
            for name in list(self._open):
                self._open.pop(name).close()

    def close(self) -> None:
        self._stop.set()

    def worker_changed(self, spec: WorkerSpec, state: WorkerState | None,
                       reason: str) -> None:
        """The supervisor's ``changed``: a stage worker that enters FAILED gets a stand-in;
        one that leaves it, or is removed, loses it at once."""
        if not isinstance(spec.options, StageOptions):
            return
        old = self._open.pop(spec.name, None)
        if old is not None:
            old.close()
        if state is not WorkerState.FAILED or self._tg is None:
            return
        o = spec.options
        stand_in = StageStandIn(o, self._keyring,
                                failure_message(o.node_id, self._host_node, reason))
        self._open[spec.name] = stand_in
        self._tg.create_task(self._guarded(spec.name, stand_in))

    async def _guarded(self, name: str, stand_in: StageStandIn) -> None:
        """A stand-in's failure is logged and ends only it, never the daemon's tasks."""
        try:
            await stand_in.run()
        except Exception:
            log.exception("the stand-in of failed worker %s ended", name)
        finally:
            if self._open.get(name) is stand_in:
                del self._open[name]
