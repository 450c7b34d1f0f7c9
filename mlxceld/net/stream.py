"""One MXCL v1 connection over an asyncio ``StreamReader``/``StreamWriter``.

The sans-IO ``Connection`` does the protocol; this module reads chunks, feeds them
in, writes what it wants sent, and arms the core's handshake deadline at the call
site with ``asyncio.timeout_at``, re-armed as the core moves it (a server's shorter
deadline for the ClientHello, then the 5 s of the whole handshake). ``recv()``
drives the reading: pings are answered with pongs on the way and never reach the
caller. Chunks go to the core as read (it opens a frame where it lies when one chunk
holds it), and sealed frames are written as they are, never joined.

Liveness (``liveness.py`` has the whole story): the stream keeps ``heard_at``, when
the peer last sent anything; ``ping()`` sends a heartbeat ping, whose pong ``recv()``
swallows (a pong to anyone else's ping is delivered) and times: ``rtt_s`` is the round
trip of the latest ping, once answered (our loop's delay included; a pong that comes
after the next ping was sent is not timed); ``silenced(reason)`` ends the
stream for a peer that went quiet. ``send`` has a deadline: a write the peer does not
take within ``write_timeout_s`` (default ``WRITE_TIMEOUT_S``) ends the stream, kind
``"write_timeout"``, instead of blocking the sender for as long as the peer sleeps.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import weakref
from collections.abc import Container
from typing import Final

from mlxceld.net.errors import ConnectionClosed
from mlxceld.wire import (
    Channel,
    Connection,
    EnvelopeError,
    HandshakeComplete,
    HandshakeRefused,
    LocalProtocolError,
    MessageReceived,
    MessageSpec,
    PeerClosed,
    RemoteProtocolError,
    encode_envelope,
    parse_envelope,
)
from mlxceld.wire.crypto import Buffer
from mlxceld.wire.messages import Ping, Pong

log = logging.getLogger(__name__)

READ_CHUNK: Final = 1024 * 1024  # a read takes what is buffered, up to this
FLUSH_TIMEOUT_S: Final = 1.0  # bound on writing a last answer (reject, close) to a peer
_PING_SPECS: Final = {Ping.T: MessageSpec()}
_PING_MAX: Final = 256  # a ping envelope is tiny; larger payloads skip the JSON check
_PONG_SPECS: Final = {Pong.T: MessageSpec()}
WRITE_TIMEOUT_S: Final = 10.0  # a write the peer takes nothing of for this long ends the stream
HEARTBEAT_IDS: Final = 1 << 48  # heartbeat pings count up from here (others stay below)
# Kinds of an end we decided (nothing the peer sends after it is delivered); "rekey": the
# key the stream was made under was removed from the keyring (``retire_streams``).
_OURS: Final = frozenset({"local", "silent", "write_timeout", "rekey"})
# Every open stream of this process, with its loop: what ``retire_streams`` looks through.
_LIVE: Final[weakref.WeakKeyDictionary[MxclStream, asyncio.AbstractEventLoop]] = \
    weakref.WeakKeyDictionary()


def retire_streams(keyring: Container[bytes]) -> int:
    """End every open stream of this process made under a key id ``keyring`` no longer
    holds (a close frame, then the socket): their owners re-dial, under the primary. Safe
    from any thread (a stream of another loop is ended on its loop). The count ended."""
    count = 0
    for stream, loop in list(_LIVE.items()):
        if stream.closed or stream.key_id in keyring:
            continue
        count += 1
        reason = f"key {stream.key_id.hex()} was removed from the keyring; dial again"
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if loop is running:
            stream.retire(reason)
        else:
            loop.call_soon_threadsafe(stream.retire, reason)
    return count


def streams_under(kid: bytes) -> int:
    """How many open streams of this process were made under key id ``kid`` (a stream
    being finished, its close frame sent and the peer's awaited, still counts)."""
    return sum(1 for stream in list(_LIVE) if not stream.closed and stream.key_id == kid)


async def handshake(conn: Connection, reader: asyncio.StreamReader,
                    writer: asyncio.StreamWriter) -> HandshakeComplete | HandshakeRefused:
    """Run the handshake to its end within the core's deadline.

    Raises ``RemoteProtocolError`` on any refusal or failure (``handshake_timeout``
    included) after sending the protocol's answer; the caller closes the writer.
    """
    loop = asyncio.get_running_loop()
    try:
        await _write(conn, writer)
        async with asyncio.timeout_at(conn.next_deadline()) as timer:
            while True:
                event = conn.next_event()
                if isinstance(event, HandshakeComplete | HandshakeRefused):
                    await _write(conn, writer)
                    return event
                data = await read_chunk(reader)
                conn.receive_data(data, loop.time())
                if (deadline := conn.next_deadline()) is not None:
                    timer.reschedule(deadline)  # a server's hello deadline, then the 5 s
                await _write(conn, writer)
    except TimeoutError:
        # The loop may wake a hair before the deadline; the core decides from its own.
        conn.handle_timer(max(loop.time(), conn.next_deadline() or 0.0))
        raise RemoteProtocolError("the handshake did not finish in time",
                                  kind="handshake_timeout") from None
    except RemoteProtocolError:
        await flush_quietly(conn, writer)
        raise


async def read_chunk(reader: asyncio.StreamReader) -> bytes:
    """What ``reader`` holds, up to ``READ_CHUNK`` (``b""``: end of stream).

    Not ``readexactly(body_len)`` for a large frame: ``StreamReader`` would grow its
    buffer to the whole body (copying as it grows) and copy it out again, which
    measured slower than feeding chunks for the core to join once.
    """
    try:
        return await reader.read(READ_CHUNK)
    except OSError:  # a reset is an end of stream without a close frame
        return b""


def write_buffers(writer: asyncio.StreamWriter, buffers: list[bytes | bytearray]) -> None:
    """Hand sealed frames to the transport without joining them. A single frame goes
    as a memoryview, so that what the socket does not take at once is copied only into
    the transport's buffer (Python 3.11 slices a copy of ``bytes``/``bytearray``)."""
    if len(buffers) == 1:
        writer.write(memoryview(buffers[0]))
    elif buffers:
        writer.writelines(buffers)  # small and rare: a handshake flight, a pong and a close


async def _write(conn: Connection, writer: asyncio.StreamWriter) -> None:
    buffers = conn.buffers_to_send()
    if buffers:
        write_buffers(writer, buffers)
        await writer.drain()


async def flush_quietly(conn: Connection, writer: asyncio.StreamWriter) -> None:
    """Send the protocol's last answer if the peer still takes it; never raise OSError."""
    buffers = conn.buffers_to_send()
    if not buffers or writer.is_closing():
        return
    with contextlib.suppress(OSError, TimeoutError):
        async with asyncio.timeout(FLUSH_TIMEOUT_S):
            write_buffers(writer, buffers)
            await writer.drain()


async def close_writer(writer: asyncio.StreamWriter) -> None:
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()


def ping_id(payload: bytes) -> int | None:
    """The ``id`` of a ping envelope, or ``None`` if ``payload`` is anything else."""
    return _small_id(payload, Ping.T, _PING_SPECS)


def pong_id(payload: bytes) -> int | None:
    """The ``id`` of a pong envelope, or ``None`` if ``payload`` is anything else."""
    return _small_id(payload, Pong.T, _PONG_SPECS)


def _small_id(payload: bytes, kind: str, specs: dict[str, MessageSpec]) -> int | None:
    if len(payload) > _PING_MAX or f'"{kind}"'.encode() not in payload:
        return None  # the common case, decided without parsing: not one
    try:
        env = parse_envelope(payload, specs)
    except EnvelopeError:
        return None
    ident = env.header.get("id")
    return ident if type(ident) is int else None


class MxclStream:
    """An established, authenticated connection: ``send``, ``recv``, ``close``."""

    def __init__(self, conn: Connection, reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter, done: HandshakeComplete, *, peer: str,
                 write_timeout_s: float = WRITE_TIMEOUT_S) -> None:
        self._conn = conn
        self._reader = reader
        self._writer = writer
        self.peer_identity = done.peer_identity
        self.key_id = done.key_id
        self.channel = Channel(done.channel)
        self.peer = peer  # "host:port" of the TCP peer, for messages and logs
        self._recv_lock = asyncio.Lock()
        self._ended: ConnectionClosed | None = None
        self.write_timeout_s = write_timeout_s
        self.heard_at = asyncio.get_running_loop().time()  # the peer's last bytes (loop clock)
        self._pings = 0  # heartbeat pings sent: ids HEARTBEAT_IDS + 1 .. + _pings
        self._last_ping: tuple[int, float] | None = None  # the latest one's id and time
        self.rtt_s: float | None = None  # the round trip of the latest ping answered in time
        _LIVE[self] = asyncio.get_running_loop()

    @property
    def closed(self) -> bool:
        return self._ended is not None

    @property
    def local_host(self) -> str | None:
        """The IP this end of the connection is bound to (the interface the peer reached
        us on), or None when the socket says nothing."""
        name = self._writer.get_extra_info("sockname")
        return str(name[0]) if name else None

    async def send(self, payload: Buffer) -> None:
        """Seal and write one message; ``payload`` is read once, by the cipher."""
        if self._ended is not None:
            raise self._ended
        try:
            self._conn.send_message(payload)
        except LocalProtocolError as exc:
            raise ConnectionClosed(str(exc), "local") from exc
        try:
            async with asyncio.timeout(self.write_timeout_s):
                await _write(self._conn, self._writer)
        except TimeoutError:
            reason = (f"the peer took nothing of a write for {self.write_timeout_s:g} s "
                      "(asleep or off the network?)")
            await self._drop(ConnectionClosed(reason, "write_timeout"))
            raise ConnectionClosed(reason, "write_timeout") from None
        except OSError as exc:
            if self._ended is not None and self._ended.kind in _OURS:
                raise self._ended from exc  # we dropped it (silent) while this waited
            await self._end(ConnectionClosed(f"write to {self.peer} failed: {exc}", "abort"))
            raise ConnectionClosed(f"write to {self.peer} failed", "abort") from exc

    def ping(self) -> None:
        """Send a heartbeat ping (``recv`` swallows its pong); nothing on an ended stream.
        Written without waiting for the peer to take it: a ping stuck behind data the peer
        does not read is the silence ``liveness.watch`` is there to notice."""
        if self._ended is not None:
            return
        self._pings += 1
        try:
            self._conn.send_message(encode_envelope(
                Ping(HEARTBEAT_IDS + self._pings).to_wire()))
        except LocalProtocolError:  # closing: the stream ends by itself
            return
        self._last_ping = (HEARTBEAT_IDS + self._pings, asyncio.get_running_loop().time())
        write_buffers(self._writer, self._conn.buffers_to_send())

    async def silenced(self, reason: str) -> None:
        """End the stream for a peer that answers nothing: the socket is aborted (no close
        frame: it would only queue), and ``recv``/``send`` raise ``ConnectionClosed`` kind
        ``"silent"`` with ``reason``."""
        await self._drop(ConnectionClosed(reason, "silent"))

    def finish(self, reason: str) -> None:
        """Send our close frame and send nothing more, but go on reading: every message
        the peer sent before it answers our close is still delivered, then ``recv`` raises
        ``ConnectionClosed`` kind ``"closed"``. What a handover uses (the peer has taken
        all we sent on this stream once its close comes back). ``send`` raises
        ``ConnectionClosed`` kind ``"local"`` from now on."""
        if self._ended is not None or self._conn.our_closed or self._conn.closed:
            return
        with contextlib.suppress(LocalProtocolError):
            self._conn.close(reason)
        with contextlib.suppress(OSError, RuntimeError):
            write_buffers(self._writer, self._conn.buffers_to_send())

    @property
    def finishing(self) -> bool:
        """Our close frame is sent (``finish``), the peer's not received yet."""
        return self._ended is None and self._conn.our_closed

    def retire(self, reason: str) -> None:
        """End the stream now, from its loop, with a close frame naming ``reason``: ``recv``
        and ``send`` raise ``ConnectionClosed`` kind ``"rekey"``."""
        if self._ended is not None:
            return
        self._ended = ConnectionClosed(reason, "rekey")
        if not self._conn.closed and not self._conn.our_closed:
            with contextlib.suppress(LocalProtocolError):
                self._conn.close(reason)
        with contextlib.suppress(OSError, RuntimeError):
            write_buffers(self._writer, self._conn.buffers_to_send())
        self._writer.close()

    async def _drop(self, ended: ConnectionClosed) -> None:
        if self._ended is None:
            self._ended = ended
            self._writer.transport.abort()
            await close_writer(self._writer)

    async def recv(self) -> bytes:
        """The next message's payload; raises ``ConnectionClosed`` once the stream is over."""
        async with self._recv_lock:
            while True:
                if self._ended is not None and self._ended.kind in _OURS:
                    raise self._ended  # we ended it: nothing more for us
                # Messages that authenticated before a broken frame are still delivered;
                # the error comes after them.
                event = self._conn.next_event()
                if isinstance(event, MessageReceived):
                    ident = ping_id(event.payload)
                    if ident is not None:
                        await self._pong(ident)
                    elif not self._our_pong(event.payload):
                        return event.payload
                elif isinstance(event, PeerClosed):
                    await self._answer_close(event.reason)
                elif event is None:
                    if self._ended is not None:
                        raise self._ended
                    await self._read_more()

    async def _pong(self, ident: int) -> None:
        with contextlib.suppress(ConnectionClosed):
            await self.send(encode_envelope(Pong(ident).to_wire()))

    def _our_pong(self, payload: bytes) -> bool:
        ident = pong_id(payload)
        if ident is None or not HEARTBEAT_IDS < ident <= HEARTBEAT_IDS + self._pings:
            return False
        if self._last_ping is not None and self._last_ping[0] == ident:  # not a late one
            self.rtt_s = asyncio.get_running_loop().time() - self._last_ping[1]
        return True

    async def _answer_close(self, reason: str) -> None:
        if not self._conn.our_closed:
            with contextlib.suppress(LocalProtocolError):
                self._conn.close("")
        await self._end(ConnectionClosed(reason, "closed"))

    async def _read_more(self) -> None:
        data = await read_chunk(self._reader)
        if data:
            self.heard_at = asyncio.get_running_loop().time()
        try:
            self._conn.receive_data(data, asyncio.get_running_loop().time())
        except RemoteProtocolError as exc:
            log.info("connection with %s failed: %s (%s)", self.peer, exc.reason, exc.kind)
            await self._end(ConnectionClosed(exc.reason, exc.kind))

    async def close(self, reason: str = "") -> None:
        """Send a close frame (if the stream is still open) and close the socket."""
        if self._ended is None and not self._conn.closed and not self._conn.our_closed:
            with contextlib.suppress(LocalProtocolError):
                self._conn.close(reason)
        await self._end(ConnectionClosed(reason, "local"))

    async def abort(self) -> None:
        """Drop the socket without a close frame; the peer sees an abort."""
        await self._drop(ConnectionClosed("aborted by us", "local"))

    async def _end(self, ended: ConnectionClosed) -> None:
        if self._ended is not None:
            return
        self._ended = ended
        try:
            await flush_quietly(self._conn, self._writer)
        finally:
            await close_writer(self._writer)

    async def __aenter__(self) -> MxclStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
