"""The operator group: who it admits, what a user outside it is told."""

from __future__ import annotations

import grp
import os
import pwd
from pathlib import Path

import pytest

from mlxceld.control.access import DEFAULT_DENIED_HINT, OperatorGroup, denied_hint, join_hint
from mlxceld.control.peercred import PeerCredentials, is_authorized

NOBODY = 65534


def test_join_hint_names_the_platforms_command() -> None:
    assert join_hint("mlxceld", "linux") == (
        "ask an administrator to add you to group 'mlxceld' (e.g. sudo usermod -aG mlxceld "
        "$USER), then log in again")
    assert "sudo dseditgroup -o edit -a $USER -t user mlxceld" in join_hint("mlxceld", "darwin")


def test_a_group_is_found_by_name_or_not_at_all() -> None:
    root = grp.getgrgid(0).gr_name
    assert OperatorGroup.named(root) == OperatorGroup(root, 0)
    with pytest.raises(KeyError):
        OperatorGroup.named("no-such-group-here")


def test_who_the_group_admits() -> None:
    nobody = pwd.getpwuid(NOBODY)
    others = [g for g in grp.getgrall()
              if g.gr_gid not in os.getgrouplist(nobody.pw_name, nobody.pw_gid)]
    if not others:
        pytest.skip("no group here that uid 65534 is not in")
    outside = OperatorGroup(others[0].gr_name, others[0].gr_gid)
    own = OperatorGroup("own", nobody.pw_gid)
    assert own.admits(NOBODY, None)  # by the group database: the user's primary group
    assert own.admits(424242, nobody.pw_gid)  # by the peer's gid, user or not
    assert not outside.admits(NOBODY, nobody.pw_gid)
    assert not outside.admits(424242, None)  # a uid without a user has no groups


def test_is_authorized_adds_the_group_to_root_and_our_own_uid() -> None:
    peer = PeerCredentials(pid=1, uid=NOBODY, gid=NOBODY)
    assert not is_authorized(peer, own_uid=1000)
    assert not is_authorized(peer, 1000, OperatorGroup("x", 424242))
    assert is_authorized(peer, 1000, OperatorGroup("nogroup", NOBODY))
    assert is_authorized(PeerCredentials(pid=1, uid=0, gid=0), 1000, None)
    assert is_authorized(PeerCredentials(pid=1, uid=1000, gid=5), 1000, None)
    assert not is_authorized(None, 1000, OperatorGroup("nogroup", NOBODY))


def test_a_refusal_no_group_would_lift_gets_the_plain_hint(tmp_path: Path) -> None:
    assert denied_hint(tmp_path / "missing.sock") == DEFAULT_DENIED_HINT
    ours = tmp_path / "ours.sock"
    ours.touch(mode=0o660)  # a group of our own: joining it is not the answer
    assert denied_hint(ours) == DEFAULT_DENIED_HINT
    private = tmp_path / "private.sock"
    private.touch(mode=0o600)
    if os.geteuid() == 0:
        os.chown(private, -1, 424242)
    assert denied_hint(private) == DEFAULT_DENIED_HINT  # the group may not write it either
