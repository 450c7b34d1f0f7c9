"""The link test (`mlxctl cluster link-test PEER`): round trips and bandwidth both ways
over the real wire between this daemon's agent and a peer's, on one authenticated,
encrypted MXCL channel-3 stream (the messages: ``wire/link_messages.py``).

The asker (``measure``) dials the peer's agent as its own agent (``connect_as``), then on
that one stream:

1. round trips: ``pings`` envelope pings one after the other (``wire/messages.py``: the
   net shell of every stream answers them, as it answers heartbeats), each timed from
   its send to its pong;
2. upload: ``size`` bytes as ``link_push`` messages of at most ``CHUNK`` (1 MiB; the
   protocol's frames take 256 MiB), sent back to back while the peer's ``link_ack``\\ s
   are read; timed from the first send to the last ack, whose byte counts must add up
   to ``size``;
3. download: one ``link_pull`` for ``size`` bytes; the peer sends them as ``link_data``
   messages of at most ``CHUNK``; timed from the ask to the last byte.

Deadlines: the dial and handshake within ``CONNECT_S`` (3 s, the dialer's retries
included); each answer (a pong, an ack, a chunk) within ``STALL_S`` (5 s) of asking or
of the one before; the three steps together within ``TEST_S`` (60 s: 64 MiB each way
needs a link faster than about 2.3 MB/s; ask a smaller size of a slower one). A write
the peer takes nothing of for ``WRITE_TIMEOUT_S`` (10 s) ends the stream. Every failure
is ``LinkTestFailed`` naming the peer, its ``kind`` the step (``net/errors.py``).

The peer (``serve_link``, on every agent listener): a ``link_push`` is answered with its
``link_ack``; a ``link_pull`` is answered with the bytes it asks for, or refused with
``error`` naming the field when it asks for more than ``MAX_PULL`` (64 MiB) or chunks
larger than ``CHUNK``. The bytes are zeros (the frames are encrypted: what they carry
does not change the cost). The peer keeps nothing between messages: each push is
answered on its own. Its own bounds are the agent listener's (a silent asker is dropped
after ``silence_s``; a write it does not take ends the stream). Nothing is logged of the
bytes; the asker logs one line with the figures.
"""

from __future__ import annotations

import asyncio
import logging
import math
import statistics
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from mlxceld.net.agent import AgentService
from mlxceld.net.dialer import connect_as
from mlxceld.net.errors import ConnectionClosed, HandshakeFailed, LinkTestFailed
from mlxceld.net.stream import MxclStream
from mlxceld.tasks import scoped_group
from mlxceld.types import JSON, MAX_LINK_MIB, MAX_LINK_PINGS
from mlxceld.wire import Envelope, MessageSpec, SecretStore, encode_envelope, parse_envelope
from mlxceld.wire.errors import EnvelopeError
from mlxceld.wire.link_messages import (
    BLOB,
    CHUNK,
    DATA_SPEC,
    PUSH_SPEC,
    LinkAck,
    LinkData,
    LinkPull,
    LinkPush,
)
from mlxceld.wire.messages import Error, MessageError, Ping, Pong
from mlxceld.wire.schedule import Channel

log = logging.getLogger(__name__)

CONNECT_S: Final = 3.0
STALL_S: Final = 5.0
TEST_S: Final = 60.0
MAX_SIZE: Final = MAX_LINK_MIB << 20  # the most bytes asked each way
_PONGS: Final = {Pong.T: MessageSpec(), Error.T: MessageSpec()}
_ACKS: Final = {LinkAck.T: MessageSpec(), Error.T: MessageSpec()}
_DATA: Final = {LinkData.T: DATA_SPEC, Error.T: MessageSpec()}
MB: Final = 1e6  # a rate's MB is 10**6 bytes


# -- the peer's side ---------------------------------------------------------------------------

def serve_link(agent: AgentService) -> None:
    """Answer ``link_push`` and ``link_pull`` on channel 3 (module docstring)."""

    async def pushed(stream: MxclStream, message: Envelope) -> None:
        try:
            push = LinkPush.from_wire(message.header)
        except MessageError as exc:
            await stream.send(encode_envelope(Error(f"link_push refused: {exc}").to_wire()))
            return
        size = len(message.tensors[BLOB].data)
        await stream.send(encode_envelope(LinkAck(push.seq, size).to_wire()))

    async def pull(stream: MxclStream, message: Envelope) -> None:
        try:
            asked = LinkPull.from_wire(message.header)
        except MessageError as exc:
            await stream.send(encode_envelope(Error(f"link_pull refused: {exc}").to_wire()))
            return
        blob = memoryview(bytes(asked.chunk))
        for seq in range(math.ceil(asked.bytes / asked.chunk)):
            n = min(asked.chunk, asked.bytes - seq * asked.chunk)
            await stream.send(encode_envelope(LinkData(seq).to_wire(),
                                              [(BLOB, "u8", (n,), blob[:n])]))

    agent.add_handler(Channel.AGENT, LinkPush.T, pushed, PUSH_SPEC)
    agent.add_handler(Channel.AGENT, LinkPull.T, pull)


# -- the asker's side --------------------------------------------------------------------------

@dataclass(frozen=True)
class Transfer:
    """``bytes`` moved one way in ``seconds``."""

    bytes: int
    seconds: float

    def to_json(self) -> JSON:
        return {"bytes": self.bytes, "seconds": round(self.seconds, 6),
                "mb_per_s": round(self.bytes / MB / max(self.seconds, 1e-9), 3)}


@dataclass(frozen=True)
class LinkReport:
    """What `mlxctl cluster link-test` shows: the peer as asked, the agent address dialled
    and its node id when known, the dial's time, each round trip, and both transfers
    (``sent``: to the peer; ``received``: from it)."""

    peer: str
    address: str
    node_id: str | None
    connect_s: float
    rtts_s: tuple[float, ...]
    sent: Transfer
    received: Transfer
    chunk: int

    def to_json(self) -> JSON:
        ms = sorted(r * 1000 for r in self.rtts_s)
        return {"peer": self.peer, "address": self.address, "node_id": self.node_id,
                "connect_ms": round(self.connect_s * 1000, 3),
                "rtt_ms": {"count": len(ms), "min": round(ms[0], 3),
                           "median": round(statistics.median(ms), 3),
                           "p90": round(ms[math.ceil(0.9 * len(ms)) - 1], 3),
                           "max": round(ms[-1], 3)},
                "sent": self.sent.to_json(), "received": self.received.to_json(),
                "chunk_bytes": self.chunk}


async def measure(origin: str, address: str, *, keyring: SecretStore, pings: int, size: int,
                  peer: str | None = None, node_id: str | None = None, chunk: int = CHUNK,
                  connect_s: float = CONNECT_S, stall_s: float = STALL_S,
                  test_s: float = TEST_S) -> LinkReport:
    """The link test with the agent at ``address`` as the node whose agent is ``origin``:
    ``pings`` round trips, then ``size`` bytes each way (module docstring; at most
    ``connect_s + test_s``). ``peer``: the name the user gave (``address`` if None).
    ``ValueError`` for ``pings``, ``size`` or ``chunk`` out of bounds; ``LinkTestFailed``."""
    if not (1 <= pings <= MAX_LINK_PINGS and 1 <= size <= MAX_SIZE and 1 <= chunk <= CHUNK):
        raise ValueError(f"link test of {pings} pings, {size} bytes in chunks of {chunk}")
    named = peer or address
    began = time.perf_counter()
    try:
        stream = await connect_as(origin, address, keyring=keyring, channel=Channel.AGENT,
                                  budget_s=connect_s)
    except ValueError as exc:
        raise LinkTestFailed("address", f"peer {named!r} {exc}", peer=named,
                             hint="name an agent address host[:port] or a node id of "
                             "mlxctl cluster nodes") from None
    except HandshakeFailed as exc:
        raise LinkTestFailed("connect", f"cannot reach peer {named}: {exc.message}",
                             peer=named, hint=exc.hint or "is its daemon running, with this "
                             "cluster's secret? (mlxctl cluster nodes)") from exc
    connected = time.perf_counter() - began
    test = _Test(stream, named, stall_s)
    try:
        async with asyncio.timeout(test_s):
            rtts = await test.pings(pings)
            sent = await test.push(size, chunk)
            received = await test.pull(size, chunk)
    except TimeoutError:
        raise LinkTestFailed("timeout", f"the link test with peer {named} did not end within "
                             f"{test_s:g} s", peer=named,
                             hint="a slow link: ask less with --size") from None
    except ConnectionClosed as exc:
        raise LinkTestFailed("closed", f"peer {named} ended the link test: {exc}",
                             peer=named) from exc
    except EnvelopeError as exc:
        raise LinkTestFailed("bad_answer", f"peer {named} answered out of bounds: {exc}",
                             peer=named) from exc
    finally:
        await stream.close("link test over")
    report = LinkReport(named, address, node_id, connected, rtts, sent, received, chunk)
    figures = report.to_json()
    log.info("link test with %s (%s): rtt median %.3f ms, sent %.1f MB/s, received %.1f "
             "MB/s", named, address, figures["rtt_ms"]["median"],
             figures["sent"]["mb_per_s"], figures["received"]["mb_per_s"])
    return report


class _Test:
    """The three steps on one stream; each answer read within ``stall_s``."""

    def __init__(self, stream: MxclStream, peer: str, stall_s: float) -> None:
        self._stream, self._peer, self._stall_s = stream, peer, stall_s

    async def _next(self, specs: Mapping[str, MessageSpec], what: str) -> Envelope:
        try:
            async with asyncio.timeout(self._stall_s):
                payload = await self._stream.recv()
        except TimeoutError:
            raise LinkTestFailed("stalled", f"peer {self._peer} sent no {what} within "
                                 f"{self._stall_s:g} s", peer=self._peer,
                                 hint="is it stopped, or the link down?") from None
        got = parse_envelope(payload, specs)
        if got.type == Error.T:
            reason = Error.from_wire(got.header).reason[:500]
            raise LinkTestFailed("refused", f"peer {self._peer} refused the link test: "
                                 f"{reason}", peer=self._peer,
                                 hint="a peer of an older mlxceld has no link test: upgrade "
                                 "it" if "not allowed" in reason else "")
        return got

    async def pings(self, count: int) -> tuple[float, ...]:
        rtts = []
        for ident in range(1, count + 1):
            began = time.perf_counter()
            await self._stream.send(encode_envelope(Ping(ident).to_wire()))
            pong = Pong.from_wire((await self._next(_PONGS, "pong")).header)
            rtts.append(time.perf_counter() - began)
            if pong.id != ident:
                raise EnvelopeError(f"pong {pong.id} answered ping {ident}")
        return tuple(rtts)

    async def push(self, size: int, chunk: int) -> Transfer:
        count = math.ceil(size / chunk)
        blob = memoryview(bytes(chunk))

        async def send_all() -> None:
            for seq in range(count):
                n = min(chunk, size - seq * chunk)
                await self._stream.send(encode_envelope(LinkPush(seq).to_wire(),
                                                        [(BLOB, "u8", (n,), blob[:n])]))

        began = time.perf_counter()
        acked = 0
        async with scoped_group() as tg:
            tg.create_task(send_all())
            for seq in range(count):
                ack = LinkAck.from_wire((await self._next(_ACKS, "link_ack")).header)
                if ack.seq != seq:
                    raise EnvelopeError(f"link_ack {ack.seq} where {seq} was due")
                acked += ack.bytes
        if acked != size:
            raise EnvelopeError(f"the peer acknowledged {acked} bytes of {size}")
        return Transfer(acked, time.perf_counter() - began)

    async def pull(self, size: int, chunk: int) -> Transfer:
        began = time.perf_counter()
        await self._stream.send(encode_envelope(LinkPull(size, chunk).to_wire()))
        got = 0
        for seq in range(math.ceil(size / chunk)):
            message = await self._next(_DATA, "link_data")
            data = LinkData.from_wire(message.header)
            if data.seq != seq:
                raise EnvelopeError(f"link_data {data.seq} where {seq} was due")
            got += len(message.tensors[BLOB].data)
        if got != size:
            raise EnvelopeError(f"the peer sent {got} bytes of the {size} asked")
        return Transfer(got, time.perf_counter() - began)
