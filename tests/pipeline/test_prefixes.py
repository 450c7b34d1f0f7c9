"""The router's prompt-cache index: what a prompt starts from, what every stage must hold
first, and what is forgotten everywhere (sans-IO: no stage, no model)."""

from __future__ import annotations

from mlxceld.pipeline.prefixes import PrefixIndex, Reuse, common_prefix

RANKS = (0, 1)


def kept_by_all(index: PrefixIndex, tokens: list[int], trimmable: bool = True) -> str:
    entry, gone = index.add(tokens)
    assert gone == []
    for rank in RANKS:
        index.kept(rank, entry, True, trimmable, [])
    return entry


def test_common_prefix() -> None:
    assert common_prefix([1, 2, 3], [1, 2, 3]) == 3
    assert common_prefix([1, 2, 3], [1, 2]) == 2
    assert common_prefix([1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 9, 5, 6, 7]) == 3
    assert common_prefix([9], [1]) == 0
    assert common_prefix((), [1]) == 0
    long = list(range(5000))
    assert common_prefix(long, [*long[:4321], -1, *long[4322:]]) == 4321


def test_an_entry_is_named_only_once_every_stage_kept_it() -> None:
    index = PrefixIndex(RANKS)
    entry, _ = index.add([1, 2, 3, 4])
    assert index.lookup([1, 2, 3, 4, 5, 6]) is None  # nobody holds it yet
    assert index.kept(0, entry, True, True, []) == []
    assert index.lookup([1, 2, 3, 4, 5, 6]) is None  # stage 1 has not said
    index.kept(1, entry, True, True, [])
    assert index.lookup([1, 2, 3, 4, 5, 6]) == Reuse(entry, 4)
    assert index.entries == 1


def test_the_longest_shared_prefix_wins_and_the_last_token_is_always_run() -> None:
    index = PrefixIndex(RANKS)
    short = kept_by_all(index, [1, 2])
    longer = kept_by_all(index, [1, 2, 3, 4, 9, 9], trimmable=False)
    assert index.lookup([1, 2, 3, 4, 5]) == Reuse(short, 2)  # the other needs a trim
    trimmed = kept_by_all(index, [1, 2, 3, 4, 7, 7, 7])
    assert index.lookup([1, 2, 3, 4, 5]) == Reuse(trimmed, 4)
    # The whole prompt kept: all but its last token, which is run to sample from.
    assert index.lookup([1, 2, 3, 4, 7, 7, 7]) == Reuse(trimmed, 6)
    assert index.lookup([8, 1, 2]) is None
    assert index.lookup([1]) is None  # one token: nothing to start from
    assert longer  # kept, but never the answer above


def test_a_kept_entry_that_can_be_trimmed_drops_its_prefixes_everywhere() -> None:
    index = PrefixIndex(RANKS)
    prompt = kept_by_all(index, [1, 2, 3])
    whole, _ = index.add([1, 2, 3, 4, 5])
    index.kept(0, whole, True, True, [])
    assert index.kept(1, whole, True, True, []) == [prompt]
    assert index.lookup([1, 2, 3, 9]) == Reuse(whole, 3)
    # A window's cache that wrapped cannot be trimmed back: its prefixes stay useful.
    other = kept_by_all(index, [7, 7])
    longer, _ = index.add([7, 7, 8, 8])
    index.kept(0, longer, True, False, [])
    assert index.kept(1, longer, True, True, []) == []
    assert index.lookup([7, 7, 5]) == Reuse(other, 2)


def test_a_stage_that_evicts_or_cannot_keep_makes_every_stage_forget() -> None:
    index = PrefixIndex(RANKS)
    a = kept_by_all(index, [1, 1, 1])
    b, _ = index.add([2, 2, 2])
    index.kept(0, b, True, True, [])
    # Stage 1 evicted a for room while keeping b: a goes everywhere.
    assert index.kept(1, b, True, True, [a]) == [a]
    assert index.lookup([1, 1, 1, 1]) is None
    c, _ = index.add([3, 3, 3])
    assert index.kept(0, c, False, False, []) == [c]  # not kept: nobody names it
    assert index.kept(1, c, True, True, []) == [c]  # kept there meanwhile: forgotten
    assert index.stats.dropped == 2


def test_a_prefix_a_stage_lost_drops_the_entry_and_is_counted() -> None:
    index = PrefixIndex(RANKS)
    a = kept_by_all(index, [4, 5, 6])
    reuse = index.lookup([4, 5, 6, 7])
    assert reuse == Reuse(a, 3)
    assert index.lost(reuse) == [a]
    assert index.lookup([4, 5, 6, 7]) is None
    assert (index.stats.lost, index.stats.hits) == (1, 0)
    b = kept_by_all(index, [4, 5, 6])
    reuse = index.lookup([4, 5, 6, 7])
    assert reuse is not None and reuse.entry == b
    index.started(reuse)
    assert (index.stats.hits, index.stats.tokens_reused) == (1, 3)


def test_at_most_max_entries_the_least_recently_used_go() -> None:
    index = PrefixIndex(RANKS, max_entries=2)
    a = kept_by_all(index, [1, 1])
    b = kept_by_all(index, [2, 2])
    assert index.lookup([1, 1, 1]) == Reuse(a, 2)  # a used: b is the oldest now
    c, gone = index.add([3, 3])
    assert gone == [b]
    assert index.clear() == [a, c]
    assert index.entries == 0


def test_an_entry_unknown_here_is_forgotten_by_the_stage_that_kept_it() -> None:
    index = PrefixIndex(RANKS)
    assert index.kept(0, "p99", True, True, []) == ["p99"]
    assert index.kept(0, "p98", False, False, []) == []
    assert index.kept(0, None, False, False, ["p97"]) == []  # a forget's answer


def test_the_same_tokens_kept_twice_leave_one_entry() -> None:
    index = PrefixIndex(RANKS)
    first = kept_by_all(index, [5, 6, 7])  # a prompt kept once prefilled
    second, _ = index.add([5, 6, 7])  # its sequence ended at once (max_tokens 1)
    index.kept(0, second, True, False, [])
    assert index.kept(1, second, True, False, []) == [first]
    assert index.lookup([5, 6, 7, 8]) == Reuse(second, 3) and index.entries == 1
