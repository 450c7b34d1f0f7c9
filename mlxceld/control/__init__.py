"""The control room: the daemon's Unix-socket API, its guard, and the peer check."""

from mlxceld.control.peercred import PeerCredentials, is_authorized, peer_credentials
from mlxceld.control.server import (
    PEER_EXTENSION,
    SOCKET_PATH_LIMIT,
    ControlServer,
    bind_control_socket,
    check_socket_path,
    peer_guard,
    remove_socket_file,
)

__all__ = [
    "PEER_EXTENSION",
    "SOCKET_PATH_LIMIT",
    "ControlServer",
    "PeerCredentials",
    "bind_control_socket",
    "check_socket_path",
    "is_authorized",
    "peer_credentials",
    "peer_guard",
    "remove_socket_file",
]
