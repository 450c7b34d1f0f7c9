"""Who is on the other end of a Unix socket: the kernel's word, not the peer's.

Linux answers ``SO_PEERCRED`` with ``struct ucred {pid_t pid; uid_t uid; gid_t gid;}``.
macOS answers ``LOCAL_PEERCRED`` (level ``SOL_LOCAL``) with ``struct xucred`` and gives
the pid separately through ``LOCAL_PEERPID``. The credentials are those of the process
at ``connect()`` time, which is what we want: a process cannot lend its socket's
identity by changing uid afterwards.
"""

from __future__ import annotations

import socket
import struct
import sys
from asyncio.trsock import TransportSocket
from collections.abc import Callable, Collection
from dataclasses import dataclass

from mlxceld.control.access import OperatorGroup
from mlxceld.errors import SocketError

# <sys/un.h> on macOS; the socket module does not export these.
_SOL_LOCAL = 0
_LOCAL_PEERCRED = 0x001
_LOCAL_PEERPID = 0x002
# struct xucred { u_int cr_version; uid_t cr_uid; short cr_ngroups; gid_t cr_groups[16]; }
_XUCRED = struct.Struct("@IIh16I")
_XUCRED_VERSION = 0
# struct ucred { pid_t pid; uid_t uid; gid_t gid; }
_UCRED = struct.Struct("3i")
_PID = struct.Struct("i")


@dataclass(frozen=True)
class PeerCredentials:
    """The peer's process id (when the platform says), user id and primary group id."""

    pid: int | None
    uid: int
    gid: int | None


def peer_credentials(sock: socket.socket | TransportSocket) -> PeerCredentials:
    """Ask the kernel who is connected to the Unix stream socket ``sock``."""
    try:
        if sys.platform.startswith("linux"):
            return _linux_peer(sock)
        if sys.platform == "darwin":
            return _darwin_peer(sock)
    except OSError as exc:
        raise SocketError(
            f"cannot read the peer credentials of a control connection: {exc.strerror or exc}"
        ) from exc
    raise SocketError(
        f"reading peer credentials is not supported on {sys.platform}",
        hint="run mlxceld on Linux or macOS",
    )


def is_authorized(creds: PeerCredentials | None, own_uid: int,
                  group: OperatorGroup | None = None,
                  groups_of: Callable[[int], Collection[int]] | None = None) -> bool:
    """Root, the daemon's own user, and (when there is one) members of the operator group
    may use the control socket; a peer whose credentials are unknown may not. The
    decision, pure but for ``groups_of`` (``OperatorGroup.admits``: by default the group
    database)."""
    if creds is None:
        return False
    return creds.uid in (0, own_uid) or (group is not None and group.admits(creds.uid,
                                                                            creds.gid,
                                                                            groups_of))


def _linux_peer(sock: socket.socket | TransportSocket) -> PeerCredentials:
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    pid, uid, gid = _UCRED.unpack(raw)
    # The kernel reports pid 0 when the peer's pid is not visible (another pid namespace).
    return PeerCredentials(pid=pid or None, uid=uid, gid=gid)


def _darwin_peer(sock: socket.socket | TransportSocket) -> PeerCredentials:
    raw = sock.getsockopt(_SOL_LOCAL, _LOCAL_PEERCRED, _XUCRED.size)
    version, uid, ngroups, *groups = _XUCRED.unpack(raw.ljust(_XUCRED.size, b"\0"))
    if version != _XUCRED_VERSION:
        raise SocketError(f"unexpected xucred version {version} from LOCAL_PEERCRED")
    gid = groups[0] if ngroups > 0 else None
    try:
        (pid,) = _PID.unpack(sock.getsockopt(_SOL_LOCAL, _LOCAL_PEERPID, _PID.size))
    except OSError:
        pid = 0  # LOCAL_PEERPID is missing before macOS 10.8; the uid is what matters.
    return PeerCredentials(pid=pid or None, uid=uid, gid=gid)
