"""Stop strings over text that arrives in arbitrary pieces."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from mlxceld.api.stops import StopMatcher


def run(stops: list[str], pieces: list[str]) -> tuple[list[str], bool]:
    matcher = StopMatcher(stops)
    out = [matcher.feed(piece) for piece in pieces]
    out.append(matcher.flush())
    return out, matcher.stopped


def cut(stops: list[str], text: str) -> tuple[str, bool]:
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return (text[: min(hits)], True) if hits else (text, False)


def expected(stops: list[str], pieces: list[str]) -> tuple[str, bool]:
    """Generation stops as soon as a stop string is complete: after each piece, the text so
    far is cut before the leftmost stop string it holds. A longer stop string that began
    earlier but would only complete later never gets the chance."""
    text = ""
    for piece in pieces:
        text += piece
        shown, stopped = cut(stops, text)
        if stopped:
            return shown, True
    return text, False


def test_a_stop_string_spanning_pieces_is_cut_and_never_shown_in_part() -> None:
    out, stopped = run(["END"], ["the ", "E", "N", "D", " more"])
    assert stopped and out == ["the ", "", "", "", "", ""]


def test_a_false_start_is_released_when_it_cannot_match() -> None:
    out, stopped = run(["END"], ["a E", "N", "x", "b"])
    assert not stopped and out == ["a ", "", "ENx", "b", ""]


def test_held_text_is_flushed_at_the_end() -> None:
    assert run(["END"], ["abc E", "N"]) == (["abc ", "", "EN"], False)


def test_the_leftmost_of_several_stops_wins() -> None:
    out, _ = run(["world", "o w"], ["hello world"])
    assert "".join(out) == "hell"


def test_the_first_stop_to_complete_wins_over_a_longer_one_begun_earlier() -> None:
    # Found by hypothesis: "ABBB" could start at 0, but "B" completes first.
    assert run(["B", "ABBB"], ["ABB", "B"]) == (["A", "", ""], True)


def test_the_stop_found_is_named() -> None:
    # The leftmost; of two at the same place, the first given (Anthropic's stop_sequence).
    for stops, pieces, matched in ((["world", "o w"], ["hello world"], "o w"),
                                   (["lo", "l"], ["hel", "lo"], "l"),
                                   (["ab", "a"], ["xab"], "ab"),
                                   (["zz"], ["abc"], None)):
        matcher = StopMatcher(stops)
        for piece in pieces:
            matcher.feed(piece)
        assert matcher.matched == matched, stops


def test_without_stops_text_passes_straight_through() -> None:
    assert run([], ["a", "b"]) == (["a", "b", ""], False)


@settings(max_examples=600, deadline=None)
@given(st.lists(st.text("abAB", min_size=1, max_size=4), min_size=1, max_size=16),
       st.lists(st.text("abAB\u00e9", max_size=5), max_size=12))
def test_same_as_cutting_the_whole_text(stops: list[str], pieces: list[str]) -> None:
    out, stopped = run(stops, pieces)
    assert ("".join(out), stopped) == expected(stops, pieces)
    # What was let out is never the start of a stop string that could still complete.
    shown = ""
    matcher = StopMatcher(stops)
    for piece in pieces:
        shown += matcher.feed(piece)
        if matcher.stopped:
            break
        assert cut(stops, shown) == (shown, False)
