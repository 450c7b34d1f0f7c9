"""Polling each candidate's inventory over MXCL channel 3 (agent).

A candidate is polled as soon as the table adds it (``wake``) and then every
``POLL_INTERVAL_S``; the candidates due together are polled concurrently. A
round also drops stale mDNS candidates (``CandidateTable.expire``), so that
happens at least every ``POLL_INTERVAL_S`` whichever discovery runs.

One poll, with its deadlines:

One ``mlxceld.net.agent.ask``:

1. ``mlxceld.net.connect_as`` to the candidate's agent address on channel 3 within
   ``CONNECT_BUDGET_S`` (5 s, the dialer's retries with backoff included). Our
   identity is our own agent address; when that names a specific IP the socket
   is bound to it, so the peer sees the source IP the identity claims (an
   unspecified ``0.0.0.0`` identity is replaced by the source IP on the peer).
2. Send ``InventoryRequest`` (``{"t": "inventory"}``), wait ``ANSWER_TIMEOUT_S`` (5 s)
   for the answer, close the stream, check the answer
   (``mlxceld.discovery.inventory.parse_inventory``).

Outcomes: ``reachable`` with the inventory; ``refused`` when the handshake was
refused (``REFUSED_KINDS``: another secret shows as ``unknown_key_id`` or
``wrong_secret_client``, a version or identity mismatch as its kind); otherwise
``unreachable`` (no connection within the budget, no answer in time, the stream
closed, an error answer or an answer out of bounds). The candidate's ``error``
says ``kind: message``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Final

from mlxceld.discovery.candidates import CandidateTable
from mlxceld.discovery.inventory import (
    AGENT_CHANNEL,
    ANSWER_SPECS,
    InventoryError,
    parse_inventory,
)
from mlxceld.net.agent import ask
from mlxceld.net.errors import AskFailed
from mlxceld.state.peers import PeerState
from mlxceld.wire import SecretStore
from mlxceld.wire.agent_messages import InventoryRequest

log = logging.getLogger(__name__)

POLL_INTERVAL_S: Final = 20.0
CONNECT_BUDGET_S: Final = 5.0
ANSWER_TIMEOUT_S: Final = 5.0
REFUSED_KINDS: Final = frozenset({"version_mismatch", "suite_mismatch", "unknown_key_id",
                                  "identity_not_owned", "rejected", "wrong_secret_client"})


class InventoryPoller:
    def __init__(self, table: CandidateTable, keyring: SecretStore, identity: str, *,
                 interval_s: float = POLL_INTERVAL_S,
                 clock: Callable[[], float] = time.time) -> None:
        self._table = table
        self._keyring = keyring
        self._origin = identity  # our agent listener
        self._interval = interval_s
        self._clock = clock
        self._wake = asyncio.Event()
        self._next: dict[str, float] = {}  # address -> loop time of its next poll

    def wake(self, address: str) -> None:
        """Poll ``address`` at the next chance (the table calls this when it adds one)."""
        self._next.pop(address, None)
        self._wake.set()

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._wake.clear()
            self._table.expire(self._clock())
            now = loop.time()
            due = [a for a in self._table.addresses() if self._next.get(a, 0.0) <= now]
            if due:
                await self.poll_all(due)
            pending = [self._next.get(a, 0.0) for a in self._table.addresses()]
            wait = min(pending, default=loop.time() + self._interval) - loop.time()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(max(wait, 0.0), self._interval)):
                    await self._wake.wait()

    async def poll_all(self, addresses: list[str] | None = None) -> None:
        """Poll ``addresses`` (default: every candidate) now, concurrently; at most
        ``CONNECT_BUDGET_S + ANSWER_TIMEOUT_S`` (10 s). The next regular poll of each
        comes ``POLL_INTERVAL_S`` later."""
        due = self._table.addresses() if addresses is None else addresses
        async with asyncio.TaskGroup() as tg:
            for address in due:
                tg.create_task(self._poll_guarded(address))
        later = asyncio.get_running_loop().time() + self._interval
        for address in due:
            self._next[address] = later

    async def _poll_guarded(self, address: str) -> None:
        try:
            await self.poll(address)
        except Exception as exc:  # a bug must not end the polls of the others
            log.exception("inventory poll of %s failed", address)
            self._table.failed(address, "unreachable", f"internal: {type(exc).__name__}",
                               self._clock())

    async def poll(self, address: str) -> None:
        """Ask ``address`` for its inventory and record the outcome in the table."""
        try:
            answer = await ask(self._origin, address, InventoryRequest(), keyring=self._keyring,
                               channel=AGENT_CHANNEL, answers=ANSWER_SPECS,
                               connect_s=CONNECT_BUDGET_S, answer_s=ANSWER_TIMEOUT_S)
            inventory = parse_inventory(answer.header)
        except AskFailed as exc:
            state, error = _failure(exc)
            self._table.failed(address, state, error, self._clock())
        except InventoryError as exc:
            self._table.failed(address, "unreachable", f"bad_inventory: {exc}", self._clock())
        else:
            self._table.answered(address, inventory.to_wire(), answer.key_id.hex(),
                                 self._clock())


def _failure(exc: AskFailed) -> tuple[PeerState, str]:
    """The candidate's state and ``error`` when its inventory could not be had."""
    if exc.kind == "connect":
        refused = exc.detail in REFUSED_KINDS
        return ("refused" if refused else "unreachable"), f"{exc.detail}: {exc.message}"
    if exc.kind == "timeout":
        return "unreachable", f"no_answer: no inventory answer within {ANSWER_TIMEOUT_S:g} s"
    if exc.kind == "closed":
        return "unreachable", f"closed: {exc.message}"
    if exc.kind == "error":
        return "unreachable", ("bad_inventory: the peer answered with an error: "
                               f"{exc.detail[:200]}")
    if exc.kind == "bad_answer":
        return "unreachable", f"bad_inventory: {exc.message}"
    return "unreachable", f"{exc.kind}: {exc.message}"  # address: not host:port
