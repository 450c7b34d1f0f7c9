"""Which replica takes a request: the router's sans-IO account of its members' work.

No asyncio, no clock: ``pool.py`` tells ``Routing`` what happened (a sequence
dispatched, a token back, a sequence ended) and asks it where the next one goes.

Outstanding work. Per member the router keeps its own account of what it sent and
has not seen finish: for each sequence in flight, the prompt tokens still to
prefill (the prompt less the prefix the member is thought to hold, all of that
until the first token comes back) plus ``max_tokens`` less the tokens generated
so far. It is the router's view, not the member's: a member's queue and its own
speed are not asked, so two routers over one member each see only their share.

Prefix affinity. Each member's engine keeps a prompt cache of the sequences it
finished (mlx-lm's ``LRUPromptCache``: a sequence's prompt and generated tokens), so
a prompt that starts as one of them skips that much prefill there. The router
keeps a shadow of those caches: for each member, the last ``SHADOW_SEQUENCES``
sequences it finished there (fewer when they hold more than ``SHADOW_BLOCKS``
blocks) (a cancelled or failed one is not kept, as the member
does not keep it), each as the chained hashes of its whole ``BLOCK_TOKENS``-token
blocks (block i's hash covers blocks 0..i, so a hit on it means the whole prefix
up to it matches). A new prompt's cached prefix on a member is its number of
leading blocks whose hash the shadow holds, times ``BLOCK_TOKENS``. The shadow is
an estimate: after a member restarts or evicts, or a hash collides, it is wrong,
and that costs only a full prefill there, never a wrong answer.

The choice (``Routing.choose``): among the candidates (members that are up and not
yet tried for this request), the one with the least outstanding work plus this
request's prefill there (its prompt less the cached prefix); a member already
running its ``max_batch`` sequences goes after those that are not; ties by
fewest sequences in flight, then by node id (string order).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

BLOCK_TOKENS = 16  # the shadow's granularity: a prefix counts in whole blocks
SHADOW_SEQUENCES = 256  # sequences remembered per member (its prompt cache holds fewer)
SHADOW_BLOCKS = 1 << 16  # and at most this many blocks (1 Mi tokens), so memory is bounded

Outcome = Literal["completed", "cancelled", "failed", "retried"]


def block_hashes(tokens: Sequence[int], block: int = BLOCK_TOKENS) -> tuple[int, ...]:
    """The chained hash of each whole ``block``-token block of ``tokens``: the i-th
    covers the tokens up to the end of block i (a partial last block has none)."""
    hashes: list[int] = []
    h = 0
    for start in range(0, len(tokens) - block + 1, block):
        h = hash((h, tuple(tokens[start:start + block])))
        hashes.append(h)
    return tuple(hashes)


class PrefixShadow:
    """One member's cache as the router guesses it: the last ``capacity`` sequences
    finished there, as block hashes, ``max_blocks`` blocks in all at most (least
    recently used forgotten first; a sequence longer than that keeps its first
    ``max_blocks`` blocks)."""

    def __init__(self, capacity: int = SHADOW_SEQUENCES, block: int = BLOCK_TOKENS,
                 max_blocks: int = SHADOW_BLOCKS) -> None:
        if capacity < 1 or block < 1 or max_blocks < 1:
            raise ValueError(f"capacity, block and max_blocks must be >= 1, not {capacity}, "
                             f"{block} and {max_blocks}")
        self.capacity = capacity
        self.block = block
        self.max_blocks = max_blocks
        self._blocks = 0
        self._sequences: OrderedDict[int, tuple[int, ...]] = OrderedDict()
        self._held: dict[int, int] = {}  # block hash -> how many sequences hold it

    def __len__(self) -> int:
        return len(self._sequences)

    def remember(self, tokens: Sequence[int]) -> None:
        hashes = block_hashes(tokens, self.block)[:self.max_blocks]
        if not hashes:
            return
        key = hashes[-1]  # names the whole sequence (its blocks, chained)
        if key in self._sequences:
            self._sequences.move_to_end(key)
            return
        self._sequences[key] = hashes
        self._blocks += len(hashes)
        for h in hashes:
            self._held[h] = self._held.get(h, 0) + 1
        while len(self._sequences) > self.capacity or self._blocks > self.max_blocks:
            _, old = self._sequences.popitem(last=False)
            self._blocks -= len(old)
            for h in old:
                left = self._held[h] - 1
                if left:
                    self._held[h] = left
                else:
                    del self._held[h]

    def cached(self, hashes: Sequence[int]) -> int:
        """How many leading tokens of the prompt whose ``block_hashes`` are ``hashes``
        this member is thought to hold."""
        n = 0
        for h in hashes:
            if h not in self._held:
                break
            n += 1
        return n * self.block

    def clear(self) -> None:
        self._sequences.clear()
        self._held.clear()
        self._blocks = 0


@dataclass(frozen=True)
class Choice:
    node_id: str
    cached_tokens: int  # the prompt's prefix the member is thought to hold
    cost: int  # its outstanding work plus this request's prefill there


@dataclass
class NodeAccount:
    """What the router counts for one member."""

    capacity: int  # its max_batch
    shadow: PrefixShadow
    in_flight: int = 0
    outstanding_tokens: int = 0
    dispatched: int = 0
    completed: int = 0
    cancelled: int = 0
    failed: int = 0
    retried: int = 0  # refused before its first token, tried elsewhere
    affinity_hits: int = 0  # dispatched with a cached prefix thought to be there
    affinity_tokens: int = 0  # the prefill those prefixes spared, in tokens
    last_error: str | None = None


@dataclass
class _Flight:
    node_id: str
    prompt: tuple[int, ...]
    prefill_left: int
    decode_left: int
    generated: list[int] = field(default_factory=list)

    @property
    def work(self) -> int:
        return self.prefill_left + self.decode_left


class Routing:
    """The account of every member's work, and the choice of the next one."""

    def __init__(self, capacities: Mapping[str, int], *,
                 shadow_sequences: int = SHADOW_SEQUENCES,
                 block: int = BLOCK_TOKENS) -> None:
        self.block = block
        self._shadow_sequences = shadow_sequences
        self.nodes = {node: NodeAccount(capacity, PrefixShadow(shadow_sequences, block))
                      for node, capacity in capacities.items()}
        self._flights: dict[int, _Flight] = {}

    def add(self, node: str, capacity: int) -> None:
        """A member joins (a new account; one still held for ``node``'s sequences in
        flight is kept, its capacity updated)."""
        account = self.nodes.get(node)
        if account is None:
            self.nodes[node] = NodeAccount(capacity,
                                           PrefixShadow(self._shadow_sequences, self.block))
        else:
            account.capacity = capacity

    def drop(self, node: str) -> None:
        """``node``'s account leaves (its member was retired and has nothing in flight)."""
        account = self.nodes.get(node)
        if account is not None and account.in_flight == 0:
            del self.nodes[node]

    def hashes(self, prompt: Sequence[int]) -> tuple[int, ...]:
        return block_hashes(prompt, self.block)

    def choose(self, prompt: Sequence[int], candidates: Iterable[str],
               hashes: Sequence[int] | None = None) -> Choice | None:
        """Where ``prompt`` goes among ``candidates`` (None: there are none)."""
        if hashes is None:
            hashes = self.hashes(prompt)
        best: tuple[tuple[bool, int, int, str], Choice] | None = None
        for node in candidates:
            account = self.nodes[node]
            cached = min(account.shadow.cached(hashes), len(prompt))
            cost = account.outstanding_tokens + len(prompt) - cached
            key = (account.in_flight >= account.capacity, cost, account.in_flight, node)
            if best is None or key < best[0]:
                best = (key, Choice(node, cached, cost))
        return None if best is None else best[1]

    def dispatch(self, seq: int, choice: Choice, prompt: Sequence[int],
                 max_tokens: int) -> None:
        """Sequence ``seq`` (the caller's unique id) was sent as ``choice`` said."""
        if seq in self._flights:
            raise ValueError(f"sequence {seq} is already in flight")
        account = self.nodes[choice.node_id]
        flight = _Flight(choice.node_id, tuple(prompt), len(prompt) - choice.cached_tokens,
                         max(max_tokens, 0))
        self._flights[seq] = flight
        account.in_flight += 1
        account.outstanding_tokens += flight.work
        account.dispatched += 1
        if choice.cached_tokens:
            account.affinity_hits += 1
            account.affinity_tokens += choice.cached_tokens

    def token(self, seq: int, token: int) -> None:
        """A token of ``seq`` came back: its prefill is done, one less to generate."""
        flight = self._flights[seq]
        before = flight.work
        flight.prefill_left = 0
        flight.decode_left = max(flight.decode_left - 1, 0)
        flight.generated.append(token)
        self.nodes[flight.node_id].outstanding_tokens -= before - flight.work

    def end(self, seq: int, outcome: Outcome, error: str | None = None) -> None:
        """``seq`` ended: its work leaves the account; a completed one is remembered in
        its member's shadow; ``error`` (failed, retried) is its member's last error."""
        flight = self._flights.pop(seq)
        account = self.nodes[flight.node_id]
        account.in_flight -= 1
        account.outstanding_tokens -= flight.work
        if outcome == "completed":
            account.completed += 1
            account.shadow.remember(flight.prompt + tuple(flight.generated))
        elif outcome == "cancelled":
            account.cancelled += 1
        elif outcome == "failed":
            account.failed += 1
        else:
            account.retried += 1
        if error is not None:
            account.last_error = error

    def generated(self, seq: int) -> int:
        return len(self._flights[seq].generated)

    def in_flight(self) -> int:
        return len(self._flights)
