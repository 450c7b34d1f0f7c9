"""The daemon's agent listener: MXCL channels 2 (assignment) and 3 (agent).

It runs whenever the daemon holds a cluster secret. Every stream answers
``ping`` with ``pong`` (the net shell does that). Other message types are served
by handlers registered per channel and type with ``add_handler`` before the
listener runs (the daemon registers ``inventory`` on channel 3; assignment adds
its types on channel 2). A handler gets the stream and the parsed envelope and
sends its own answers. A type with no handler on the stream's channel, or a
malformed envelope, gets an ``Error`` (``wire/messages.py``: ``{"t": "error", "reason":
...}``) and the stream stays open.

Liveness: every accepted stream has a heartbeat (``net/liveness.watch``) with the bound
``silence_s`` (the daemon passes ``[daemon] peer_suspect_after_s``, default 3 s): the
listener pings a peer that sends nothing for a third of it, and drops the connection
(logged once, its slot freed) when the peer has sent nothing at all, not even a pong,
for ``silence_s``: a dialer stopped (SIGSTOP) or asleep holds no connection here past
that bound. Every dialer of ours reads its agent streams while it holds them, so its
net shell answers the pings. The stream is read ahead of its handlers (up to
``INBOX`` messages), so that a handler that takes a while (a key op telling the
workers, an offer judged) does not make its peer look silent; a peer that sends more
than ``INBOX`` requests without waiting for the answers is not read meanwhile, and is
dropped as silent if that lasts ``silence_s`` (our own dialers ask one at a time).

Who was heard when (``last_heard``): every accepted stream's bound identity (the agent
address its dialer claimed, checked against its source) and the last time it sent anything
(its ``heard_at``: a message, a ping or a pong), kept past the stream's end (for the
``MAX_HEARD`` identities heard last). A stage host's
lease on its plan's coordinator (``cluster/lease.py``) is read from it: the coordinator's
daemon dials its plan's peers all along (its failure detector's heartbeats,
``discovery/heartbeat.py``), so a coordinator that is alive and reaches its peers is heard
every ``peer_ping_interval_s``.

Refusals go to the security log, rate-limited per class, never one line per socket
(see ``mlxceld.net.listener``).

The asker's side: ``ask`` dials an agent, sends one message, reads one answer and
closes; every daemon part that asks an agent one question (inventory, serving, a key
op, a coordinator's decision, a deactivation) calls it, under that part's own two
deadlines, and handles one failure type (``AskFailed``, its ``kind`` the step).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from mlxceld.net import ConnectionClosed, HandshakeFailed, Listener, MxclStream, SecurityLog
from mlxceld.net.dialer import connect_as
from mlxceld.net.errors import AskFailed
from mlxceld.net.liveness import watch
from mlxceld.tasks import cancelling_group
from mlxceld.types import DEFAULT_SILENCE_S
from mlxceld.wire import Keyring, SecretStore
from mlxceld.wire.address import HostPort, bound_identity, format_address
from mlxceld.wire.envelope import Envelope, MessageSpec, encode_envelope, parse_envelope
from mlxceld.wire.errors import EnvelopeError
from mlxceld.wire.messages import Error, Message

log = logging.getLogger(__name__)

AGENT_CHANNELS = {2, 3}
AgentHandler = Callable[[MxclStream, Envelope], Awaitable[None]]
INBOX: Final = 16  # messages read ahead of their handler on one stream
MAX_HEARD: Final = 1024  # identities whose last message is kept once their stream ended


class AgentService:
    def __init__(self, addr: tuple[str, int], keyring: Keyring,
                 seclog: SecurityLog | None = None, *,
                 silence_s: float = DEFAULT_SILENCE_S) -> None:
        """``silence_s``: how long a connected peer may send nothing before its connection
        is dropped (see the module docstring)."""
        self.silence_s = silence_s
        self._seclog = seclog or SecurityLog()
        self._specs: dict[int, dict[str, MessageSpec]] = {c: {} for c in AGENT_CHANNELS}
        self._handlers: dict[tuple[int, str], AgentHandler] = {}
        self._open: dict[MxclStream, HostPort] = {}  # accepted streams and who dialled them
        self._heard: dict[HostPort, float] = {}  # of streams ended: when last heard (loop)
        self._listener = Listener(addr[0], addr[1], keyring=keyring,
                                  identity_of_server=format_address(*addr),
                                  channels=AGENT_CHANNELS, handler=self._serve_stream,
                                  seclog=self._seclog, name="agent listener")

    @property
    def address(self) -> str:
        """``host:port`` as it listens (IPv6 in brackets), the port resolved if it was 0."""
        host = self._listener.host
        return format_address(host, self._listener.port)

    @property
    def host(self) -> str:
        return self._listener.host

    @property
    def established(self) -> int:
        """Authenticated connections open now."""
        return self._listener.established

    def add_handler(self, channel: int, kind: str, handler: AgentHandler,
                    spec: MessageSpec | None = None) -> None:
        """Serve message type ``kind`` on ``channel`` (2 or 3); ``spec``: its tensors."""
        if channel not in AGENT_CHANNELS or (channel, kind) in self._handlers:
            raise ValueError(f"cannot add a handler for {kind!r} on channel {channel}")
        self._specs[channel][kind] = spec or MessageSpec()
        self._handlers[(channel, kind)] = handler

    async def run(self, started: asyncio.Future[None]) -> None:
        """Serve until ``aclose``; ``started`` resolves once it accepts. ``OSError`` if the
        address cannot be bound."""
        await self._listener.start()
        log.info("agent listener on %s (MXCL channels assignment, agent)", self.address)
        await self._listener.serve(started)

    async def aclose(self) -> None:
        await self._listener.aclose()

    def last_heard(self) -> dict[HostPort, float]:
        """Each identity that dialled us, and when it last sent anything (wall clock)."""
        loop_now, now = asyncio.get_running_loop().time(), time.time()
        heard = dict(self._heard)
        for stream, who in self._open.items():
            heard[who] = max(heard.get(who, 0.0), stream.heard_at)
        return {who: now - max(loop_now - at, 0.0) for who, at in heard.items()}

    async def _serve_stream(self, stream: MxclStream) -> None:
        inbox: asyncio.Queue[bytes | None] = asyncio.Queue(INBOX)
        try:
            who: HostPort | None = bound_identity(stream.peer_identity, stream.peer)
        except ValueError:  # no IP source (a Unix socket in tests): not kept
            who = None
        if who is not None:
            self._open[stream] = who
        try:
            async with cancelling_group() as tg:
                tg.create_task(watch(stream, self.silence_s,
                                     f"agent peer {stream.peer_identity}"))
                tg.create_task(_read_ahead(stream, inbox))
                await self._dispatch(stream, inbox)
        finally:
            if who is not None:
                self._open.pop(stream, None)
                self._heard[who] = max(self._heard.get(who, 0.0), stream.heard_at)
                if len(self._heard) > MAX_HEARD:  # the identity heard longest ago goes
                    del self._heard[min(self._heard, key=self._heard.__getitem__)]

    async def _dispatch(self, stream: MxclStream, inbox: asyncio.Queue[bytes | None]) -> None:
        """Each message read, to its handler in turn, until the stream ends."""
        try:
            while (payload := await inbox.get()) is not None:
                try:
                    message = parse_envelope(payload, self._specs[stream.channel])
                except EnvelopeError as exc:
                    await stream.send(encode_envelope(
                        Error(f"bad envelope: {exc.reason}").to_wire()))
                    continue
                await self._handlers[(stream.channel, message.type)](stream, message)
        except ConnectionClosed:
            return


async def _read_ahead(stream: MxclStream, inbox: asyncio.Queue[bytes | None]) -> None:
    """Read ``stream`` (its pings answered on the way) into ``inbox``; ``None`` at its end."""
    try:
        while True:
            await inbox.put(await stream.recv())
    except ConnectionClosed:
        await inbox.put(None)


@dataclass(frozen=True)
class Answer:
    """What an agent answered ``ask``: the envelope's type and header, and the key id of
    the secret the stream was made under (our primary when we dialled)."""

    type: str
    header: dict[str, Any]
    key_id: bytes


async def ask(origin: str, address: str, question: Message, *,
              keyring: SecretStore, channel: int, answers: Mapping[str, MessageSpec],
              connect_s: float, answer_s: float,
              wanted: Callable[[Envelope], bool] | None = None,
              close_reason: str = "") -> Answer:
    """Ask the agent at ``address`` (``host:port``) one question as the node whose agent is
    ``origin`` (``connect_as``): dial it on ``channel`` within ``connect_s`` (the dialer's
    retries included), send ``question`` (a typed message, ``wire/*messages.py``), read its
    answer within ``answer_s`` (the first one ``wanted`` takes, when given: the others are
    skipped, within the same deadline) and close the stream. At most
    ``connect_s + answer_s``.

    ``answers``: the types the answer may have (an ``error`` answer is ``AskFailed`` of
    kind ``error`` whether listed or not). Any failure is ``AskFailed``; its ``kind``
    says at which step (``mlxceld.net.errors.ASK_KINDS``)."""
    try:
        stream = await connect_as(origin, address, keyring=keyring, channel=channel,
                                  budget_s=connect_s)
    except ValueError as exc:
        raise AskFailed("address", str(exc), peer=address) from None
    except HandshakeFailed as exc:
        raise AskFailed("connect", exc.message, peer=address, detail=exc.kind) from exc
    specs = {Error.T: MessageSpec(), **answers}
    try:
        async with asyncio.timeout(answer_s):
            await stream.send(encode_envelope(question.to_wire()))
            while True:
                got = parse_envelope(await stream.recv(), specs)
                if got.type == Error.T or wanted is None or wanted(got):
                    break
    except TimeoutError:
        raise AskFailed("timeout", f"no answer within {answer_s:g} s", peer=address) from None
    except ConnectionClosed as exc:
        raise AskFailed("closed", exc.message, peer=address, detail=exc.kind) from exc
    except EnvelopeError as exc:
        raise AskFailed("bad_answer", str(exc), peer=address) from exc
    finally:
        await stream.close(close_reason)
    if got.type == Error.T:
        reason = Error.from_wire(got.header).reason[:500]
        raise AskFailed("error", reason, peer=address, detail=reason)
    return Answer(got.type, got.header, stream.key_id)
