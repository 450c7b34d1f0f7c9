"""The control socket: bind it safely, serve a starlette app on it, and guard who may talk.

Three fences, each enough on its own for the common case:

1. the socket's directory is 0700 and the socket 0600 (the file system's word); with an
   operator group (``[daemon] socket_group``) the directory is 0750 and the socket 0660,
   both of that group;
2. every connection carries the kernel's peer credentials, and ``peer_guard`` refuses
   any uid but root, our own and the operator group's members (survives a too-wide
   directory or socket mode);
3. ``peer_guard`` refuses requests with ``Origin`` or ``Referer``: a browser tricked
   into talking to the socket through some local proxy always sends one of them.

uvicorn serves our pre-bound socket; it never installs signal handlers (the daemon owns
signals) and never gets ``uds=`` (it would chmod the socket 0666).

Every listener served here (the control socket, and the router's OpenAI port) holds its
connections to a ``ConnectionLimits`` (``connections.py``: a cap kept below the file
limit, a head deadline, a body deadline, a bounded head). The control socket's are
``CONTROL_LIMITS``. An ``accept()`` that fails for want of descriptors is logged once per
burst (``bursts.py``), not once per attempt with its traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import os
import socket
import stat
import sys
from collections.abc import Generator
from pathlib import Path
from typing import Any, Final

import uvicorn
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from mlxceld import failpoints
from mlxceld.control.access import DEFAULT_DENIED_HINT, OperatorGroup, join_hint
from mlxceld.control.peercred import PeerCredentials, is_authorized, peer_credentials
from mlxceld.errors import SocketError
from mlxceld.guard.bursts import Burst
from mlxceld.guard.connections import (
    ACCEPT_BATCH,
    ConnectionLimits,
    Guard,
    Render,
    connection_cap,
)
from mlxceld.guard.guarded import GuardedH11Protocol, json_refusal

logger = logging.getLogger(__name__)

PEER_EXTENSION = "mlxceld.peer"
"""Key in ``scope["extensions"]`` holding the connection's ``PeerCredentials`` (or None)."""

# sun_path is 108 bytes on Linux and 104 on macOS and the BSDs, one kept for the NUL.
SOCKET_PATH_LIMIT = 107 if sys.platform.startswith("linux") else 103
_BACKLOG = 128
_PROBE_TIMEOUT_S = 1.0
# mlxctl sends a request at once and reads its answer; a stream (logs -f) is one request.
# A follower that reads nothing for FOLLOWER_STALL_S (its buffers full) is disconnected.
FOLLOWER_STALL_S: Final = failpoints.FOLLOWER_STALL_S or 30.0
CONTROL_LIMITS: Final = ConnectionLimits(max_connections=128, header_timeout_s=10.0,
                                         body_timeout_s=30.0, write_stall_s=FOLLOWER_STALL_S)
_ACCEPT_FAILED = "socket.accept() out of system resource"  # asyncio's words


def check_socket_path(path: Path) -> None:
    """Refuse a path too long for ``sun_path`` before the kernel says something cryptic."""
    length = len(os.fsencode(path))
    if length > SOCKET_PATH_LIMIT:
        raise SocketError(
            f"control socket path {path} is {length} bytes long; "
            f"the limit on this platform is {SOCKET_PATH_LIMIT} bytes",
            hint="use --socket with a shorter path",
        )


def bind_control_socket(path: Path, group: OperatorGroup | None = None) -> socket.socket:
    """Bind, chmod 0600 and listen on the Unix socket at ``path``; return it non-blocking.

    The parent directory is created 0700 (or set to 0700 when it is ours). With ``group``
    the socket is 0660 and the directory 0750, both given to that group. A stale socket
    file is replaced; a live one, or anything that is not a socket, is refused.
    """
    check_socket_path(path)
    _prepare_directory(path.parent, group)
    _clear_stale_socket(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        old_umask = os.umask(0o177)
        try:
            sock.bind(os.fspath(path))  # 0600 from the start: only then opened to the group
        finally:
            os.umask(old_umask)
        if group is not None:
            _give_to_group(path, group, "control socket")
        os.chmod(path, 0o600 if group is None else 0o660)
        sock.listen(_BACKLOG)
        sock.setblocking(False)
    except OSError as exc:
        sock.close()
        raise SocketError(
            f"cannot bind control socket {path}: {_strerror(exc)}",
            hint="check the directory's owner and mode, or pick another --socket",
        ) from exc
    except SocketError:
        sock.close()
        raise
    logger.info("control socket bound at %s%s", path,
                f" (group {group.name}, mode 0660)" if group else "")
    return sock


def remove_socket_file(path: Path) -> None:
    """Unlink ``path`` if it is a socket; leave anything else (or nothing) alone."""
    try:
        if stat.S_ISSOCK(os.lstat(path).st_mode):
            os.unlink(path)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise SocketError(f"cannot remove control socket {path}: {_strerror(exc)}") from exc


def _prepare_directory(directory: Path, group: OperatorGroup | None) -> None:
    mode = 0o700 if group is None else 0o750
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = os.stat(directory)
    except OSError as exc:
        raise SocketError(
            f"cannot create control socket directory {directory}: {_strerror(exc)}"
        ) from exc
    if not stat.S_ISDIR(st.st_mode):
        raise SocketError(f"control socket directory {directory} is not a directory")
    if st.st_uid != os.geteuid():
        raise SocketError(
            f"control socket directory {directory} is owned by uid {st.st_uid}, not by us "
            f"(uid {os.geteuid()})",
            hint="use --socket with a path in a directory of your own",
        )
    if st.st_mode & stat.S_ISVTX:
        # A sticky directory is shared by design (/tmp); making it 0700 would break others.
        raise SocketError(
            f"control socket directory {directory} is a shared (sticky) directory",
            hint="use --socket with a path in a directory of your own",
        )
    if group is not None:
        _check_reachable(directory, group)  # before the directory is opened to the group
        if st.st_gid != group.gid:
            _give_to_group(directory, group, "control socket directory")
    if stat.S_IMODE(st.st_mode) != mode:
        try:
            os.chmod(directory, mode)
        except OSError as exc:
            raise SocketError(
                f"cannot chmod control socket directory {directory} to {mode:04o}: "
                f"{_strerror(exc)}"
            ) from exc
        logger.info("control socket directory %s set to %04o", directory, mode)


def _check_reachable(directory: Path, group: OperatorGroup) -> None:
    """Refuse an operator group that could not reach the socket: every directory above
    it must let the group pass (x for others, or for the group when it is theirs)."""
    for parent in directory.absolute().parents:
        try:
            st = os.stat(parent)
        except OSError as exc:
            raise SocketError(f"cannot inspect {parent}: {_strerror(exc)}") from exc
        mode = stat.S_IMODE(st.st_mode)
        if not (mode & stat.S_IXOTH or (mode & stat.S_IXGRP and st.st_gid == group.gid)):
            raise SocketError(
                f"members of group '{group.name}' (socket_group) cannot reach the control "
                f"socket in {directory}: {parent} is mode {mode:04o} (uid {st.st_uid}, "
                f"gid {st.st_gid})",
                hint="put the socket where the group can reach it, e.g. --socket "
                "/run/mlxceld/mlxceld.sock",
            )


def _give_to_group(path: Path, group: OperatorGroup, what: str) -> None:
    try:
        os.chown(path, -1, group.gid)
    except OSError as exc:
        raise SocketError(
            f"cannot give the {what} {path} to group '{group.name}' (socket_group): "
            f"{_strerror(exc)}",
            hint=f"run mlxceld as root or as a member of group '{group.name}'",
        ) from exc


def _clear_stale_socket(path: Path) -> None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise SocketError(f"cannot inspect control socket {path}: {_strerror(exc)}") from exc
    if not stat.S_ISSOCK(st.st_mode):
        raise SocketError(
            f"{path} exists and is not a socket; refusing to replace it",
            hint="remove it yourself if it is not needed, or pick another --socket",
        )
    if is_listening(path):
        raise SocketError(
            f"socket {path} is in use by another mlxceld; stop it first or pick another --socket"
        )
    logger.info("removing stale control socket %s", path)
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        raise SocketError(f"cannot remove stale socket {path}: {_strerror(exc)}") from exc


def is_listening(path: Path) -> bool:
    """Whether something accepts connections on the Unix socket at ``path`` (a probe that
    sends nothing, bounded by ``_PROBE_TIMEOUT_S``)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(_PROBE_TIMEOUT_S)
        try:
            probe.connect(os.fspath(path))
        except (ConnectionRefusedError, FileNotFoundError):
            return False
        except TimeoutError:
            return True  # a listener with a full backlog is still a listener
        except OSError as exc:
            raise SocketError(f"cannot probe socket {path}: {_strerror(exc)}") from exc
    return True


def _strerror(exc: OSError) -> str:
    return exc.strerror or str(exc)


# --- serving ------------------------------------------------------------------------------


def _with_peer(app: ASGIApp, creds: PeerCredentials | None) -> ASGIApp:
    async def with_peer(scope: Scope, receive: Receive, send: Send) -> None:
        extensions = dict(scope.get("extensions") or {})
        extensions[PEER_EXTENSION] = creds
        await app({**scope, "extensions": extensions}, receive, send)

    return with_peer


class _PeerH11Protocol(GuardedH11Protocol):
    """The guarded h11 protocol, with the kernel's peer credentials put into every scope."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if transport.is_closing():  # refused: too many connections
            return
        creds: PeerCredentials | None
        try:
            creds = peer_credentials(transport.get_extra_info("socket"))
        except SocketError as exc:
            logger.warning("control connection without credentials: %s", exc)
            creds = None
        # H11Protocol hands self.app to each request cycle: one wrapper per connection.
        self.app = _with_peer(self.config.loaded_app, creds)


class _QuietServer(uvicorn.Server):
    """A uvicorn server that leaves signals alone and reports when it is accepting."""

    def __init__(self, config: uvicorn.Config, backlog: int) -> None:
        super().__init__(config)
        self.started_future: asyncio.Future[None] | None = None
        self._backlog = backlog

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        for sock in sockets or ():  # asyncio listen()ed with its batch: the kernel's queue
            sock.listen(self._backlog)
        fut = self.started_future
        if self.started and fut is not None and not fut.done():
            fut.set_result(None)

    async def replace_listeners(self, sock: socket.socket) -> None:
        """Accept on ``sock`` from now on, as ``startup`` does, and close the listeners we
        had; the connections they accepted go on."""
        assert self.started, "the server is not serving yet"
        config = self.config

        def create_protocol(_loop: asyncio.AbstractEventLoop | None = None) -> asyncio.Protocol:
            return config.http_protocol_class(  # type: ignore[call-arg]
                config=config, server_state=self.server_state, app_state=self.lifespan.state,
                _loop=_loop)

        server = await asyncio.get_running_loop().create_server(
            create_protocol, sock=sock, backlog=config.backlog)
        sock.listen(self._backlog)  # as in startup: asyncio listen()ed with its batch
        for old in self.servers:
            old.close()
        self.servers = [server]


class SocketServer:
    """Serve ``app`` with uvicorn on the pre-bound socket ``sock`` until asked to stop.

    uvicorn never installs signal handlers here: the process that owns us does. The
    socket is closed when ``serve`` returns; a Unix socket file is left in place (see
    ``remove_socket_file``). ``backlog`` is the kernel's queue of connections not yet
    accepted (128, the control socket's, unless told). asyncio accepts as many as its
    own backlog argument in a turn, and ``listen()``s with it: it is given
    ``ACCEPT_BATCH``, and ``listen()`` is called again with ``backlog`` once serving.
    """

    def __init__(
        self, app: ASGIApp, sock: socket.socket, *, graceful_timeout_s: float = 5.0,
        limits: ConnectionLimits = CONTROL_LIMITS, render: Render = json_refusal,
        what: str = "the control socket",
        protocol: type[GuardedH11Protocol] = GuardedH11Protocol, backlog: int = _BACKLOG,
    ) -> None:
        self._sock = sock
        capped = dataclasses.replace(
            limits, max_connections=connection_cap(limits.max_connections, what, ACCEPT_BATCH))
        self.guard = Guard(capped, render, what)
        self._accept_failures = Burst(logger, logging.ERROR, "failed accepts")
        config = uvicorn.Config(
            app,
            # uvicorn calls this with its config and state: one guard for all connections.
            http=functools.partial(protocol, guard=self.guard),  # type: ignore[arg-type]
            ws="none",  # uvicorn's websocket protocols take config.loaded_app, not ours
            lifespan="off",
            interface="asgi3",
            log_config=None,  # the daemon configures logging, not uvicorn
            log_level="warning",
            access_log=False,
            proxy_headers=False,
            backlog=min(backlog, ACCEPT_BATCH),  # accepts a turn; listen() again after
            # asyncio.wait_for takes a float; uvicorn only annotates int.
            timeout_graceful_shutdown=graceful_timeout_s,  # type: ignore[arg-type]
        )
        self._server = _QuietServer(config, backlog)

    async def serve(self, started: asyncio.Future[None] | None = None) -> None:
        """Serve until ``request_shutdown``; set ``started`` once accepting connections."""
        self._server.started_future = started
        loop = asyncio.get_running_loop()
        previous = loop.get_exception_handler()
        loop.set_exception_handler(functools.partial(self._loop_exception, previous))
        try:
            await self._server.serve(sockets=[self._sock])
        finally:
            loop.set_exception_handler(previous)
            self._close_listeners()
            if started is not None and not started.done():
                started.cancel()

    def request_shutdown(self) -> None:
        """Stop accepting, let requests finish (up to the graceful timeout), return."""
        self._server.should_exit = True

    async def listen_on(self, sock: socket.socket) -> None:
        """Serve on ``sock`` instead of the socket we had (a control socket file bound again:
        ``control/keeper.py``); requests under way on the old one finish as they would."""
        await self._server.replace_listeners(sock)
        old, self._sock = self._sock, sock
        old.close()

    def _loop_exception(self, previous: Any, loop: asyncio.AbstractEventLoop,
                        context: dict[str, Any]) -> None:
        """asyncio retries a failed ``accept()`` a second later, and then once per
        connection still queued: a thousand tracebacks a second. One line per burst."""
        if context.get("message") == _ACCEPT_FAILED:
            where = context.get("socket")
            self._accept_failures.note(
                "cannot accept connections on %s: %s (%s holds %d of its %d)",
                where.getsockname() if where is not None else "a listener",
                context.get("exception"), self.guard.what, self.guard.open,
                self.guard.limits.max_connections)
        elif previous is not None:
            previous(loop, context)
        else:
            loop.default_exception_handler(context)

    def _close_listeners(self) -> None:
        # uvicorn closes them on a clean exit; not when serve() is cancelled or fails.
        servers: list[Any] = getattr(self._server, "servers", [])
        for server in servers:
            server.close()
        self._sock.close()


class ControlServer(SocketServer):
    """The control API's server: every connection's peer credentials reach the app."""

    def __init__(self, app: ASGIApp, sock: socket.socket, *,
                 graceful_timeout_s: float = 5.0) -> None:
        super().__init__(app, sock, graceful_timeout_s=graceful_timeout_s,
                         protocol=_PeerH11Protocol)


def peer_guard(app: ASGIApp, group: OperatorGroup | None = None,
               socket_path: Path | None = None) -> ASGIApp:
    """Refuse requests from uids other than root, ours and ``group``'s members, and any
    browser-originated one. ``socket_path`` is named in the refusal."""
    own_uid = os.getuid()

    async def guard(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await app(scope, receive, send)
            return
        creds = (scope.get("extensions") or {}).get(PEER_EXTENSION)
        if not isinstance(creds, PeerCredentials) or not is_authorized(creds, own_uid, group):
            body = _refusal(creds, own_uid, group, socket_path)
            await _respond(scope, receive, send, body)
            return
        if any(name in (b"origin", b"referer") for name, _ in scope["headers"]):
            logger.warning(
                "refused browser-originated control request from uid %d pid %s",
                creds.uid,
                creds.pid,
            )
            body = _error(
                "cross_origin_refused",
                "browser-originated requests are refused on the control socket",
                "talk to the control socket with mlxctl, not from a web page",
            )
            await _respond(scope, receive, send, body)
            return
        await app(scope, receive, send)

    return guard


def _refusal(creds: object, own_uid: int, group: OperatorGroup | None,
             socket_path: Path | None) -> dict[str, Any]:
    if isinstance(creds, PeerCredentials):
        logger.warning("refused control request from uid %d pid %s", creds.uid, creds.pid)
        who = f"uid {creds.uid}"
    else:
        logger.warning("refused control request from a peer with unknown credentials")
        who = "a peer whose credentials could not be read"
    where = f"the control socket {socket_path}" if socket_path else "this daemon's control socket"
    allowed = (f"only root and uid {own_uid} are" if group is None else
               f"only root, uid {own_uid} and members of group '{group.name}' are")
    return _error("permission_denied", f"{who} is not allowed to use {where} ({allowed})",
                  DEFAULT_DENIED_HINT if group is None else join_hint(group.name))


def _error(code: str, message: str, hint: str) -> dict[str, Any]:
    return {"error": {"code": code, "message": message, "hint": hint}}


async def _respond(scope: Scope, receive: Receive, send: Send, body: dict[str, Any]) -> None:
    if scope["type"] == "websocket":
        # Closing before accept makes the server answer the handshake with 403.
        await send({"type": "websocket.close", "code": 1008})
        return
    await JSONResponse(body, status_code=403)(scope, receive, send)
