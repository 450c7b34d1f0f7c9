"""The rule of a tensor-parallel group's heartbeats (``engine/heartbeats.py``), fed what
rank 0 heard and the time; and a follower's beat on a real socket pair."""

from __future__ import annotations

import socket
import threading

from mlxceld.engine.heartbeats import BEAT, SILENCE_S, RankSilence, beat


def test_a_rank_heard_from_within_the_bound_is_never_silent() -> None:
    rule = RankSilence([1, 2], now=0.0)
    for t in range(1, 40):
        rule.heard(1, t * 0.25)
        rule.heard(2, t * 0.25)
        assert rule.check(t * 0.25) == ([], [])
    assert not rule.any_silent


def test_a_rank_unheard_for_the_bound_goes_silent_once_and_comes_back_when_heard() -> None:
    rule = RankSilence([1, 2], now=10.0, silence_s=SILENCE_S)
    rule.heard(2, 12.0)
    assert rule.check(10.0 + SILENCE_S - 0.01) == ([], [])
    assert rule.check(10.0 + SILENCE_S) == ([1], [])  # rank 2 was heard at 12
    assert rule.check(14.0) == ([], []) and rule.any_silent  # said once
    assert rule.check(12.0 + SILENCE_S) == ([2], [])
    rule.heard(1, 15.5)
    assert rule.check(15.6) == ([], [1]) and rule.any_silent  # rank 2 still is
    rule.heard(2, 15.7)
    assert rule.check(15.8) == ([], [2]) and not rule.any_silent
    rule.heard(7, 16.0)  # not a rank of the group: ignored
    assert rule.check(16.0) == ([], [])


def test_a_followers_beat_comes_until_its_link_ends() -> None:
    ours, theirs = socket.socketpair()
    beating = threading.Thread(target=beat, args=(theirs, 0.01), daemon=True)
    beating.start()
    ours.settimeout(5.0)
    assert ours.recv(1) == BEAT and ours.recv(1) == BEAT
    ours.close()
    beating.join(5.0)  # its next send fails: it returns
    assert not beating.is_alive()
    theirs.close()
