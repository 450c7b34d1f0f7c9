"""The router's choice of a replica (``replicas/routing.py``): least outstanding work with
prefix affinity, decided without IO; and the scrubbing of addresses out of its errors."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlxceld.replicas.redaction import scrub
from mlxceld.replicas.routing import (
    BLOCK_TOKENS,
    Choice,
    Outcome,
    PrefixShadow,
    Routing,
    block_hashes,
)

NODES = ["replica-0", "replica-1", "replica-2"]


def routing(capacity: int = 8, **kw: int) -> Routing:
    return Routing(dict.fromkeys(NODES, capacity), **kw)


def long_prompt(seed: int, n: int = 4 * BLOCK_TOKENS) -> list[int]:
    return [(seed * 7919 + i) % 1000 for i in range(n)]


def run(r: Routing, seq: int, prompt: list[int], node: str | None = None,
        max_tokens: int = 8, outcome: Outcome = "completed") -> Choice:
    """Dispatch ``prompt`` (where ``node`` says, else where ``r`` chooses), generate all
    its tokens, end it as ``outcome``."""
    choice = r.choose(prompt, [node] if node else NODES)
    assert choice is not None
    r.dispatch(seq, choice, prompt, max_tokens)
    for t in range(max_tokens):
        r.token(seq, t)
    r.end(seq, outcome)
    return choice


def test_block_hashes_chain_whole_blocks_only() -> None:
    a = long_prompt(1, 2 * BLOCK_TOKENS + 5)
    assert len(block_hashes(a)) == 2
    b = [*a[:BLOCK_TOKENS], a[BLOCK_TOKENS] + 1, *a[BLOCK_TOKENS + 1:]]
    # the second block differs, so does every hash from it on; the first is shared
    assert block_hashes(b)[0] == block_hashes(a)[0]
    assert block_hashes(b)[1] != block_hashes(a)[1]
    # a block that matches at another position does not count: hashes are chained
    shifted = a[BLOCK_TOKENS:2 * BLOCK_TOKENS] + a[:BLOCK_TOKENS]
    assert block_hashes(shifted)[1] != block_hashes(a)[1]


def test_shadow_holds_prefixes_and_forgets_least_recent_first() -> None:
    shadow = PrefixShadow(capacity=2)
    p = [long_prompt(i) for i in range(3)]
    shadow.remember(p[0])
    shadow.remember(p[1])
    assert shadow.cached(block_hashes(p[0] + [1, 2, 3] * 20)) == len(p[0])
    assert shadow.cached(block_hashes(p[0][:BLOCK_TOKENS + 3])) == BLOCK_TOKENS
    shadow.remember(p[0])  # used again: p[1] is now the oldest
    shadow.remember(p[2])
    assert len(shadow) == 2
    assert shadow.cached(block_hashes(p[1])) == 0
    assert shadow.cached(block_hashes(p[0])) == len(p[0])
    with pytest.raises(ValueError, match="capacity"):
        PrefixShadow(capacity=0)


def test_shadow_memory_is_bounded_in_blocks_too() -> None:
    shadow = PrefixShadow(capacity=100, max_blocks=5)
    a, b = long_prompt(1, 3 * BLOCK_TOKENS), long_prompt(2, 3 * BLOCK_TOKENS)
    shadow.remember(a)
    shadow.remember(b)  # 6 blocks: a goes
    assert (len(shadow), shadow.cached(block_hashes(a))) == (1, 0)
    assert shadow.cached(block_hashes(b)) == len(b)
    huge = long_prompt(3, 9 * BLOCK_TOKENS)
    shadow.remember(huge)  # its first 5 blocks only
    assert shadow.cached(block_hashes(huge)) == 5 * BLOCK_TOKENS
    assert shadow.cached(block_hashes(b)) == 0


def test_least_outstanding_work_then_fewest_in_flight_then_node_id() -> None:
    r = routing()
    assert r.choose([1, 2, 3], NODES) == Choice("replica-0", 0, 3)
    r.dispatch(0, Choice("replica-0", 0, 3), [1, 2, 3], max_tokens=10)
    assert r.nodes["replica-0"].outstanding_tokens == 13
    assert r.choose([1, 2, 3], NODES).node_id == "replica-1"  # type: ignore[union-attr]
    # a token back: the prefill is done, one fewer to generate
    r.token(0, 42)
    assert r.nodes["replica-0"].outstanding_tokens == 9
    # equal work (none): the node id decides
    assert r.choose([5], ["replica-2", "replica-1"]).node_id == "replica-1"  # type: ignore[union-attr]
    # equal work, fewer in flight wins: replica-1 runs a sequence with nothing left
    r.dispatch(1, Choice("replica-1", 0, 1), [1], max_tokens=1)
    r.token(1, 7)
    assert r.nodes["replica-1"].outstanding_tokens == 0
    assert r.choose([5], ["replica-2", "replica-1"]).node_id == "replica-2"  # type: ignore[union-attr]
    assert r.choose([5], []) is None


def test_a_member_at_its_max_batch_goes_after_those_below_it() -> None:
    r = Routing({"replica-0": 1, "replica-1": 4})
    r.dispatch(0, Choice("replica-0", 0, 1), [1], max_tokens=1)
    r.dispatch(1, Choice("replica-1", 0, 1), [1], max_tokens=100)
    # replica-0 has far less work, but it is full
    assert r.choose([1], ["replica-0", "replica-1"]).node_id == "replica-1"  # type: ignore[union-attr]


def test_affinity_counts_and_is_kept_only_for_completed_sequences() -> None:
    r = routing()
    prompt = long_prompt(3)
    run(r, 0, prompt, node="replica-2")
    choice = r.choose([*prompt, 9, 9], NODES)
    assert choice == Choice("replica-2", len(prompt), 2)
    r.dispatch(1, choice, [*prompt, 9, 9], max_tokens=4)
    account = r.nodes["replica-2"]
    assert (account.affinity_hits, account.affinity_tokens) == (1, len(prompt))
    r.end(1, "cancelled")
    other = long_prompt(4)
    run(r, 2, other, node="replica-1", outcome="failed")
    assert r.choose(other, NODES).cached_tokens == 0  # type: ignore[union-attr]


loads = st.lists(st.integers(0, 5000), min_size=len(NODES), max_size=len(NODES))


@settings(max_examples=200, deadline=None)
@given(loads=loads, up=st.sets(st.sampled_from(NODES)), n=st.integers(1, 300))
def test_never_a_member_that_is_not_a_candidate(loads: list[int], up: set[str], n: int) -> None:
    r = routing()
    for seq, (node, load) in enumerate(zip(NODES, loads, strict=True)):
        r.dispatch(seq, Choice(node, 0, 0), [1], max_tokens=load)
    choice = r.choose(list(range(n)), sorted(up))
    assert (choice is None) == (not up)
    if choice is not None:
        assert choice.node_id in up
        assert choice.cost == min(r.nodes[u].outstanding_tokens + n for u in up)


@settings(max_examples=100, deadline=None)
@given(load=st.integers(0, 2000), blocks=st.integers(1, 8), holder=st.sampled_from(NODES),
       extra=st.integers(0, BLOCK_TOKENS - 1))
def test_with_equal_loads_the_member_holding_the_prefix_wins(
        load: int, blocks: int, holder: str, extra: int) -> None:
    r = routing(shadow_sequences=4)
    prompt = long_prompt(blocks, blocks * BLOCK_TOKENS)
    run(r, 99, prompt, node=holder, max_tokens=0)
    for seq, node in enumerate(NODES):
        r.dispatch(seq, Choice(node, 0, 0), [1], max_tokens=load)
    choice = r.choose(prompt + [7] * extra, NODES)
    assert choice == Choice(holder, len(prompt), load + 1 + extra)


@settings(max_examples=100, deadline=None)
@given(blocks=st.integers(1, 8), gap=st.integers(1, 3000))
def test_a_big_enough_load_difference_outweighs_affinity(blocks: int, gap: int) -> None:
    r = routing()
    prompt = long_prompt(blocks, blocks * BLOCK_TOKENS)
    run(r, 99, prompt, node="replica-0", max_tokens=0)
    # replica-0 holds the whole prompt but has `gap` more tokens of work than the
    # prompt would cost elsewhere
    r.dispatch(0, Choice("replica-0", 0, 0), [1], max_tokens=len(prompt) + gap - 1)
    choice = r.choose(prompt, NODES)
    assert choice is not None and choice.node_id == "replica-1"
    assert choice.cached_tokens == 0


events = st.lists(st.tuples(st.sampled_from(NODES), st.integers(0, 70), st.integers(0, 40),
                            st.integers(0, 50),
                            st.sampled_from(["completed", "cancelled", "failed", "retried"])),
                  max_size=30)


@settings(max_examples=100, deadline=None)
@given(events=events)
def test_the_account_returns_to_zero_when_every_sequence_ends(
        events: list[tuple[str, int, int, int, Outcome]]) -> None:
    r = routing()
    for seq, (node, prompt_len, max_tokens, tokens, _) in enumerate(events):
        prompt = long_prompt(seq, prompt_len)
        choice = r.choose(prompt, [node])
        assert choice is not None
        r.dispatch(seq, choice, prompt, max_tokens)
        for t in range(min(tokens, max_tokens)):
            r.token(seq, t)
        assert all(a.outstanding_tokens >= 0 for a in r.nodes.values())
    assert r.in_flight() == len(events)
    for seq, (*_, outcome) in enumerate(events):
        r.end(seq, outcome)
    assert r.in_flight() == 0
    for node, account in r.nodes.items():
        assert (account.in_flight, account.outstanding_tokens) == (0, 0), node
        mine = [e[4] for e in events if e[0] == node]
        assert account.dispatched == len(mine)
        assert (account.completed, account.cancelled, account.failed, account.retried) == \
            tuple(mine.count(o) for o in ("completed", "cancelled", "failed", "retried"))


@pytest.mark.parametrize(("text", "addresses", "expected"), [
    ("the link to 10.1.2.3:19100 broke", (), "the link to <address> broke"),
    ("no route to host 10.1.2.3", (), "no route to host <address>"),  # no port, unknown
    ("no answer from [fd00::12]:19000 in 5 s", (), "no answer from <address> in 5 s"),
    ("refused by fd00::12", (), "refused by <address>"),
    ("dial studio.local:19000 failed", (), "dial <address> failed"),
    ("studio.local did not answer", ("studio.local:19000",), "<address> did not answer"),
    ("replica-0 down (silent for 5 s)", (), "replica-0 down (silent for 5 s)"),
])
def test_scrub_removes_every_address(text: str, addresses: tuple[str, ...],
                                     expected: str) -> None:
    assert scrub(text, addresses) == expected
