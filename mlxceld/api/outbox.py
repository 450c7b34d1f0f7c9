"""A stream's outbox: its bytes between the sequence and the client, bounded.

A streamed answer runs as two tasks (``answering.SequenceResponse``): the *pump* takes
the sequence's events as the engine makes them and puts their bytes here, never waiting
for the client; the *writer* sends what is here to the client, waiting on its socket for
as long as the write deadline lets it (``[serve] write_timeout_s``: the guard's
``write_stall_s`` closes a connection whose client takes nothing that long). So the
engine's side of a sequence (its admission slot, the engine's own sequence) never waits
on a client's socket.

A client that reads keeps the outbox near empty (the writer takes all it holds at each
turn). A client that stops reading fills it (``OUTBOX_BYTES``, past what the transport
and the kernel hold for it): ``put`` refuses the next bytes; the pump then gives the writer
``ROOM_WAIT_S`` to take what is held (``room``: a burst of tokens, such as a handover's
or a replay's held ones released at once, fills the outbox faster than the writer's turn
comes, from a client that reads), and otherwise ends the sequence, which frees its slot,
and closes the outbox with an error event (``slow_reader``); what was held is still
written, until the write deadline. A sequence
cut so, or still running when the write deadline closed its connection (the guard says
so in the request's scope: ``stalled``), is counted in ``mlxceld_slow_readers_cut_total``
and logged once per burst (``SlowReaders``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from typing import Final

from prometheus_client import Counter
from starlette.types import Scope

from mlxceld.api.errors import ApiError
from mlxceld.guard.bursts import Burst
from mlxceld.guard.connections import WRITE_STALLED

log = logging.getLogger(__name__)

# Past the connection's own buffers (``guard.connections.SEND_BUFFER_BYTES``, the kernel's
# and the transport's): ~16 events of 20 top logprobs each, ~200 of plain text. A client
# that reads as a stream comes keeps it empty; one that pauses is cut once it lags this and
# those buffers behind (~1 s of a stream with top logprobs, tens of seconds of plain text).
OUTBOX_BYTES: Final = 32 * 1024
# How long a full outbox waits for its writer to take what it holds before the sequence is
# cut: a writer whose client reads takes it at its next turn of the loop; one blocked on
# its connection (the client stopped reading) does not. Short: the slot of a client that
# stopped is held this much longer.
ROOM_WAIT_S: Final = 0.25


class Outbox:
    """The bytes of one stream not yet handed to its client's connection."""

    def __init__(self, limit: int = OUTBOX_BYTES) -> None:
        self.limit = limit
        self.size = 0  # bytes held
        self._held: list[bytes] = []
        self._closed = False
        self._ready = asyncio.Event()
        self._taken = asyncio.Event()  # set each time the writer takes what is held

    def put(self, chunks: Sequence[bytes]) -> bool:
        """Hold ``chunks`` for the writer; False (nothing held) when they would take the
        outbox past its limit: the client lags that far behind. An empty outbox takes
        them whatever their size (a client that has read everything is not behind)."""
        size = sum(len(c) for c in chunks)
        if self._held and self.size + size > self.limit:
            return False
        self._hold(chunks, size)
        return True

    def close(self, last: Sequence[bytes] = ()) -> None:
        """Hold ``last`` whatever the limit (the stream's end: a few small events) and
        end the stream: ``take`` returns None once the writer has taken all."""
        self._hold(last, sum(len(c) for c in last))
        self._closed = True
        self._ready.set()

    def _hold(self, chunks: Sequence[bytes], size: int) -> None:
        if chunks:
            self._held.extend(chunks)
            self.size += size
            self._ready.set()

    async def take(self) -> bytes | None:
        """All the bytes held, at once (waiting for some); None once closed and empty."""
        while not self._held:
            if self._closed:
                return None
            self._ready.clear()
            await self._ready.wait()
        data = b"".join(self._held)
        self._held.clear()
        self.size = 0
        self._taken.set()
        return data

    async def room(self, chunks: Sequence[bytes], within_s: float = ROOM_WAIT_S) -> bool:
        """``put(chunks)``, waiting up to ``within_s`` for the writer to take what is held
        when they do not fit now; False (nothing held) if it took nothing meanwhile."""
        if self.put(chunks):
            return True
        self._taken.clear()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(within_s):
                await self._taken.wait()
        return self._taken.is_set() and self.put(chunks)


def stalled(scope: Scope) -> bool:
    """Whether the guard closed this request's connection at the write deadline."""
    return WRITE_STALLED in scope.get("extensions", {})


def slow_reader_error(limit: int) -> ApiError:
    """What a stream cut for its client's lag ends with (if it is ever read)."""
    return ApiError(408, f"the stream was ended: its client lagged more than {limit} bytes "
                    "behind it, and the sequence was stopped to free its slot for others; read the "
                    "stream as it comes", "invalid_request_error", code="slow_reader")


class SlowReaders:
    """The sequences of one app cut because their client stopped reading: counted in
    ``counter`` and logged, the first of a burst at once and the rest as a count."""

    def __init__(self, counter: Counter) -> None:
        self._counter = counter
        self._burst = Burst(log, logging.WARNING, "sequences cut for a client that stopped "
                            "reading")

    def cut(self, request_id: str, why: str) -> None:
        self._counter.inc()
        self._burst.note("request %s: its client stopped reading its stream (%s): the "
                         "sequence was ended and its slot freed", request_id, why)
