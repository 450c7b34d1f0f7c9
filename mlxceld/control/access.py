"""Who may use the control socket besides root and the daemon's own user: an operator group.

The daemon's side: ``[daemon] socket_group`` (``--socket-group``) names a group; the
socket is then 0660 and its directory 0750, both of that group, and the peer check
admits a uid whose user is a member of it (``OperatorGroup.admits``).

The client's side: when ``connect()`` is refused, ``denied_hint`` looks at what refused
it (the socket, or the first directory on the way that we cannot pass) and, when that
thing's group would let us in and we are not in that group, says how to join it.

Only the standard library's ``grp``/``pwd``: mlxctl imports this on every command.
"""

from __future__ import annotations

import grp
import os
import pwd
import stat
import sys
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path

DEFAULT_DENIED_HINT = "run mlxctl as the user that runs mlxceld, or as root"


@dataclass(frozen=True)
class OperatorGroup:
    """A group whose members may use the control socket."""

    name: str
    gid: int

    @classmethod
    def named(cls, name: str) -> OperatorGroup:
        """The group called ``name`` on this host; ``KeyError`` when there is none."""
        return cls(name, grp.getgrnam(name).gr_gid)

    def admits(self, uid: int, gid: int | None,
               groups_of: Callable[[int], Collection[int]] | None = None) -> bool:
        """True if the peer's gid is ours, or its uid's user is a member (primary or
        supplementary): ``groups_of(uid)``, by default ``user_groups``, the group database
        now."""
        return gid == self.gid or self.gid in (groups_of or user_groups)(uid)


def user_groups(uid: int) -> list[int]:
    """The gids the group database lists now for ``uid``'s user, primary and supplementary
    (``os.getgrouplist``); none for a uid without a user."""
    try:
        user = pwd.getpwuid(uid)
    except KeyError:
        return []
    return os.getgrouplist(user.pw_name, user.pw_gid)


def join_hint(group: str, platform: str = sys.platform) -> str:
    """What to tell a user who should join ``group``."""
    how = (f"sudo dseditgroup -o edit -a $USER -t user {group}" if platform == "darwin"
           else f"sudo usermod -aG {group} $USER")
    return (f"ask an administrator to add you to group '{group}' (e.g. {how}), "
            "then log in again")


def denied_hint(path: Path) -> str:
    """Why ``connect(path)`` was refused and what to do, as far as this process can see."""
    gid = _refusing_group(path)
    if gid is None or gid in _own_groups():
        return DEFAULT_DENIED_HINT
    name = _group_name(gid)
    if gid in _listed_groups():
        return (f"you are in group '{name}', but this login session is not yet: log in "
                f"again (or run `newgrp {name}`)")
    return join_hint(name)


def _refusing_group(path: Path) -> int | None:
    """The gid whose members the socket (or the directory that hides it) lets in, if any."""
    try:
        st = os.stat(path)
    except PermissionError:
        return _refusing_directory_group(path)
    except OSError:
        return None
    # connect() needs write permission on the socket file.
    return st.st_gid if stat.S_IMODE(st.st_mode) & stat.S_IWGRP else None


def _refusing_directory_group(path: Path) -> int | None:
    for directory in reversed(path.absolute().parents):
        if os.access(directory, os.X_OK):
            continue
        try:
            st = os.stat(directory)
        except OSError:
            return None
        return st.st_gid if stat.S_IMODE(st.st_mode) & stat.S_IXGRP else None
    return None


def _own_groups() -> set[int]:
    """The groups this process has now."""
    return {os.getegid(), *os.getgroups()}


def _listed_groups() -> set[int]:
    """The groups the group database lists for this process's user (a later login's)."""
    try:
        user = pwd.getpwuid(os.geteuid())
        return set(os.getgrouplist(user.pw_name, user.pw_gid))
    except (KeyError, OSError):
        return set()


def _group_name(gid: int) -> str:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)
