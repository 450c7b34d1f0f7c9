"""The operator group: who it admits, what a user outside it is told."""

from __future__ import annotations

import grp
import os
import pwd
from pathlib import Path

import pytest

from mlxceld.control.access import (
    DEFAULT_DENIED_HINT,
    OperatorGroup,
    denied_hint,
    join_hint,
    user_groups,
)
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


# The decision as a table, with the group database replaced by our own: the daemon runs as
# uid 1000, the operator group is gid 500, uid 2001's user is a member of it (supplementary),
# uid 2002's user is not, uid 2003 has no user at all.
OWN, OPS, OTHER_GID = 1000, OperatorGroup("ops", 500), 600
DATABASE = {1000: [1000], 2001: [2001, 500], 2002: [2002, 600]}


def groups_of(uid: int) -> list[int]:
    return DATABASE.get(uid, [])


@pytest.mark.parametrize("uid, gid, group, allowed", [
    (0, 0, None, True),                 # root, always
    (0, None, OPS, True),
    (OWN, OTHER_GID, None, True),       # the daemon's own user, whatever its gid
    (OWN, None, OPS, True),
    (2002, OTHER_GID, None, False),     # anyone else without an operator group
    (2001, 500, None, False),           # ... even a member of a group there is not
    (1001, OWN, None, False),           # ... even with the daemon's own gid
    (2003, 500, OPS, True),             # the group's gid as the peer's gid, user or not
    (2001, OTHER_GID, OPS, True),       # a member by the database (supplementary)
    (2001, None, OPS, True),            # ... with no gid from the kernel (macOS, no groups)
    (2002, OTHER_GID, OPS, False),      # not a member
    (2002, None, OPS, False),
    (2003, OTHER_GID, OPS, False),      # a uid without a user has no groups
    (1, 0, OPS, False),                 # gid 0 is no pass: only uid 0 is
])
def test_who_may_use_the_control_socket(uid: int, gid: int | None,
                                        group: OperatorGroup | None, allowed: bool) -> None:
    peer = PeerCredentials(pid=None, uid=uid, gid=gid)
    assert is_authorized(peer, OWN, group, groups_of) is allowed


def test_unknown_credentials_are_refused_whatever_the_group() -> None:
    for group in (None, OPS, OperatorGroup("everyone", 0)):
        assert not is_authorized(None, OWN, group, groups_of)
        assert not is_authorized(None, 0, group, groups_of)


def test_user_groups_reads_the_group_database() -> None:
    assert user_groups(424242) == []  # no such user
    nobody = pwd.getpwuid(NOBODY)
    assert nobody.pw_gid in user_groups(NOBODY)
    assert user_groups(NOBODY) == os.getgrouplist(nobody.pw_name, nobody.pw_gid)


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
