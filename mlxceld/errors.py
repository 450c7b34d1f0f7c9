"""The one exception tree of mlxceld.

    MlxceldError                    root: everything we raise on purpose
    ├── ConfigError                 a flag, config file or spec is wrong (the user's to fix)
    │   ├── SecretSourceError       no usable cluster secret where the sources point
    │   └── PlanRefused             no pipeline plan fits the nodes (names each shortfall)
    ├── StateError                  the SQLite state could not be read or written
    ├── KeyringError                a cluster secret cannot be installed, used or removed
    │   ├── UnknownKey              no installed secret has that key id
    │   └── PrimaryKeyRemoval       the primary secret cannot be removed
    ├── DaemonError                 the daemon cannot start or run as asked
    │   ├── AlreadyRunning          another daemon holds the state dir lock
    │   ├── SocketError             the control socket cannot be created
    │   ├── BringUpInProgress       a pipeline bring-up runs already (names its plan)
    │   └── NoActivePlan            `mlxctl cluster deactivate` with no plan to end
    ├── WorkerError                 a worker cannot be spawned, reached or stopped
    │   └── ChannelError            a worker's control channel failed or timed out
    └── ControlError                the control API answered with an error (client side)
        ├── DaemonNotRunning        nothing listens on the control socket
        └── PermissionDenied        the socket or the daemon refused us

Every error carries a message that says what failed, on which object, and a
hint that says what to do next. Foreign exceptions (sqlite3.Error, OSError,
json errors) are translated once, at the seam, with ``raise X(...) from exc``.
"""

from __future__ import annotations


class MlxceldError(Exception):
    """Root of the tree. ``hint`` tells the user what to do next."""

    code = "error"

    def __init__(self, message: str, *, hint: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message


class ConfigError(MlxceldError):
    code = "config"


class SecretSourceError(ConfigError):
    """The cluster secret's sources conflict or point at nothing usable; names every source."""

    code = "secret_source"


class PlanRefused(ConfigError):
    """No split of the model over the candidate nodes fits, or there are too few of them.

    ``shortfalls`` holds, JSON-ready, one entry per stage that does not fit in the
    closest plan: ``stage``, ``node_id``, ``address``, ``needed_bytes``,
    ``usable_bytes``, ``short_bytes``; it is empty when nodes or layers are too few.
    """

    code = "plan_refused"

    def __init__(self, message: str, *, hint: str = "",
                 shortfalls: tuple[dict[str, str | int], ...] = ()) -> None:
        super().__init__(message, hint=hint)
        self.shortfalls = shortfalls


class StateError(MlxceldError):
    code = "state"


class KeyringError(MlxceldError):
    """A cluster secret problem; the message names the key id, never the secret."""

    code = "keyring"


class UnknownKey(KeyringError):
    code = "unknown_key"


class PrimaryKeyRemoval(KeyringError):
    code = "key_is_primary"


class DaemonError(MlxceldError):
    code = "daemon"


class AlreadyRunning(DaemonError):
    code = "already_running"


class SocketError(DaemonError):
    code = "socket"


class BringUpInProgress(DaemonError):
    """A second bring-up was asked for while one plans or pushes."""

    code = "bringup_in_progress"


class NoActivePlan(DaemonError):
    """`mlxctl cluster deactivate` with no plan committed or active (or deactivated) here."""

    code = "nothing_to_end"


class WorkerError(MlxceldError):
    code = "worker"


class ChannelError(WorkerError):
    code = "channel"


class ControlError(MlxceldError):
    """An error answered by the daemon's control API, or reaching it failed."""

    code = "control"

    def __init__(self, message: str, *, hint: str = "", code: str = "", status: int = 0) -> None:
        super().__init__(message, hint=hint)
        if code:
            self.code = code
        self.status = status


class DaemonNotRunning(ControlError):
    code = "not_running"


class PermissionDenied(ControlError):
    code = "permission_denied"
